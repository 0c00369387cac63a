"""ple_um.checkpoint.safetensors: malformed headers refused with the file and entry named, in the
``safetensors`` package's words: lengths, JSON, entries, sizes, overlaps, truncation, metadata,
unrelated tensors.

Every malformed file here is written byte by byte into tmp_path (tests/helpers/reference.py).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import tempfile

import pytest
from helpers.hand_checkpoints import entry, one_file, ple, raises, scale_name, shard
from helpers.reference import encode_safetensors, write_raw

import ple_um
from ple_um.checkpoint import read_layout, validate
from ple_um.checkpoint import safetensors as st
from ple_um.checkpoint.safetensors import MAX_HEADER_BYTES, read_header
from ple_um.errors import CheckpointError, HostError

E = "t.weight"  # the entry the header cases break


HEADER_CASES = [
    # (id, header or raw bytes, data, length override, match, tensor named)
    ("empty_file", None, b"", None, r"0 bytes, too short", None),
    ("short_file", None, b"\x01\x02\x03", None, r"3 bytes, too short", None),
    ("length_past_file", {E: entry()}, b"\0" * 8, 4096, r"header length 4096 is larger than the file", None),
    (
        "length_over_cap",
        {E: entry()},
        b"\0" * 8,
        MAX_HEADER_BYTES + 1,
        r"exceeds the 100000000 byte limit",
        None,
    ),
    ("length_2_64", {E: entry()}, b"", (1 << 64) - 1, r"exceeds the 100000000 byte limit", None),
    ("length_zero", {E: entry()}, b"", 0, r"invalid JSON in header: EOF while parsing", None),
    # Cut short inside an entry: that entry is named.
    ("invalid_json", b'{"t.weight": {"dtype": ', b"", None, r"invalid JSON in header: EOF while parsing", E),
    ("not_utf8", b'{"t\xff\xfe": {}}', b"", None, r"invalid UTF-8 in header", None),
    ("json_list", [1, 2, 3], b"", None, r"invalid type: sequence, expected struct HashMetadata", None),
    ("json_string", '"abc"', b"", None, r'invalid type: string "abc"', None),
    ("json_null", "null", b"", None, r"invalid type: null", None),
    ("entry_not_object", {E: [1, 2]}, b"", None, r"invalid type: integer `1`", E),
    (
        "no_dtype",
        {E: {"shape": [2, 4], "data_offsets": [0, 8]}},
        b"\0" * 8,
        None,
        r"missing field `dtype`",
        E,
    ),
    ("no_shape", {E: {"dtype": "U8", "data_offsets": [0, 8]}}, b"\0" * 8, None, r"missing field `shape`", E),
    (
        "no_offsets",
        {E: {"dtype": "U8", "shape": [2, 4]}},
        b"\0" * 8,
        None,
        r"missing field `data_offsets`",
        E,
    ),
    ("dtype_int", {E: entry(dtype=5)}, b"\0" * 8, None, r"invalid type: integer `5`", E),
    ("shape_negative", {E: entry(shape=(-2, -4))}, b"\0" * 8, None, r"invalid value: integer `-2`", E),
    ("shape_float", {E: entry(shape=(2.0, 4))}, b"\0" * 8, None, r"floating point `2.0`, expected usize", E),
    ("shape_bool", {E: entry(shape=(True, 8))}, b"\0" * 8, None, r"invalid type: boolean `true`", E),
    ("shape_str", {E: {**entry(), "shape": "2x4"}}, b"\0" * 8, None, r'string "2x4", expected a sequence', E),
    ("shape_nested", {E: entry(shape=([2], 4))}, b"\0" * 8, None, r"sequence, expected usize", E),
    ("offsets_negative", {E: entry(offsets=(-8, 0))}, b"\0" * 8, None, r"invalid value: integer `-8`", E),
    ("offsets_bool", {E: entry(offsets=(False, 8))}, b"\0" * 8, None, r"invalid type: boolean `false`", E),
    ("offsets_three", {E: entry(offsets=(0, 4, 8))}, b"\0" * 8, None, r"invalid length 3, expected 2", E),
    ("offsets_float", {E: entry(offsets=(0, 8.0))}, b"\0" * 8, None, r"floating point `8.0`", E),
    (
        "offsets_reversed",
        {E: entry(offsets=(8, 0))},
        b"\0" * 8,
        None,
        r"invalid offset for tensor `t.weight`",
        E,
    ),
    (
        "offsets_past_end",
        {E: entry(offsets=(0, 8))},
        b"\0" * 5,
        None,
        r"the file ends 3 bytes before the last tensor does; file truncated or offsets wrong",
        E,
    ),
    (
        "offsets_far_past",
        {E: entry(offsets=(1 << 62, (1 << 62) + 8))},
        b"\0" * 8,
        None,
        r"the file ends 4611686018427387904 bytes before the last tensor does",
        E,
    ),
    (
        "size_mismatch",
        {E: entry(shape=(2, 5))},
        b"\0" * 8,
        None,
        r"invalid shape, data type, or offset for tensor; its entry: .*'dtype': 'U8', 'shape': \[2, 5\]",
        E,
    ),
    ("size_mismatch_f4", {E: entry(dtype="F4", shape=(2, 5))}, b"\0" * 8, None, r"'dtype': 'F4'", E),
    (
        "size_astronomic",
        {E: entry(shape=[1 << 62] * 8)},
        b"\0" * 8,
        None,
        r"overflow computing buffer size from shape and/or element type; its entry: .*4611686018427387904",
        E,
    ),
    (
        "huge_number",
        '{"t.weight": {"dtype": "U8", "shape": [' + "9" * 5000 + "]}}",
        b"",
        None,
        "number out of range",
        E,
    ),
    ("deeply_nested", "[" * 100_000 + "]" * 100_000, b"", None, r"expected struct HashMetadata", None),
    (
        "deeply_nested_obj",
        '{"a":' * 100_000 + "1" + "}" * 100_000,
        b"",
        None,
        r"recursion limit exceeded",
        "a",
    ),
]


@pytest.mark.parametrize("case", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_malformed_header(tmp_path, case):
    _, header, data, length, match, tensor = case
    one_file(tmp_path, ple())
    path = tmp_path / "broken.safetensors"
    if header is None:
        path.write_bytes(data)
    else:
        write_raw(path, header, data, length=length)
    raises(str(tmp_path), match, path="broken.safetensors", tensor=tensor)


def test_overlapping_tensors(tmp_path):
    header = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12)), "c": entry(offsets=(12, 20))}
    write_raw(tmp_path / "x.safetensors", header, b"\0" * 20)
    raises(str(tmp_path), r"invalid offset for tensor `b`", path="x.safetensors", tensor="b")
    # An empty tensor may sit where one tensor ends and the next begins, not inside one (safetensors
    # refuses that too: in offset order, each tensor starts where the one before it ends).
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(offsets=(0, 8)), "e": entry(shape=(0, 4), offsets=(8, 8)), "f": entry(offsets=(8, 16))},
        b"\0" * 16,
    )
    assert list(read_header(str(tmp_path / "x.safetensors")).tensors) == ["a", "e", "f"]
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(offsets=(0, 8)), "e": entry(shape=(0, 4), offsets=(4, 4))},
        b"\0" * 8,
    )
    raises(str(tmp_path), r"invalid offset for tensor `e`", tensor="e")
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(shape=(4, 4), offsets=(0, 16)), "b": entry(offsets=(4, 12))},
        b"\0" * 16,
    )
    raises(str(tmp_path), r"invalid offset for tensor `b`", path="x.safetensors", tensor="b")


def test_tensors_at_the_same_offsets_name_one_tensor_every_time(tmp_path):
    """Three entries on the same bytes, none starting at 0: the package names whichever its hash map
    puts first, which changes between calls; ple-um names the first by offset then name, every time."""
    names = ["zeta", "alpha", "mid"]
    write_raw(tmp_path / "x.safetensors", {n: entry(offsets=(8, 16)) for n in names}, b"\0" * 16)
    seen = set()
    for _ in range(40):
        with pytest.raises(CheckpointError) as e:
            read_header(str(tmp_path / "x.safetensors"))
        seen.add((e.value.tensor, str(e.value)))
    assert len(seen) == 1, seen
    tensor, message = seen.pop()
    assert tensor == "alpha" and "invalid offset for tensor `alpha`" in message


@pytest.mark.parametrize("end", [1 << 50, 1 << 63])
def test_tensor_past_the_end_is_refused_before_any_stand_in(tmp_path, end):
    """Tensors claiming data far past the file's end (b, then c of a size the package refuses): refused
    naming the one that ends last, never judged on a stand-in that long (2^50: beyond any mapping;
    2^63: beyond ftruncate)."""
    header = {
        "a": entry(shape=(4,), offsets=(0, 4)),
        "b": entry(shape=(end - 4,), offsets=(4, end)),
        "c": entry(shape=(3,), offsets=(end, end + 4)),
    }
    write_raw(tmp_path / "x.safetensors", header, b"\0" * 12)
    raises(str(tmp_path), rf"the file ends {end + 4 - 12} bytes before the last tensor does", tensor="c")
    assert validate(str(tmp_path))[0].startswith("header places tensor data past the end")


def test_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    one_file(tmp_path, ple(rows=(3, 3, 3, 0)), order=[scale_name(), shard(0), shard(1), shard(2), shard(3)])
    blob = path.read_bytes()
    path.write_bytes(blob[:-5])
    # shard_3 is empty and lies at the very end, where shard_2 ends: the last tensor, the one named.
    error = raises(
        str(tmp_path),
        r"the file ends 5 bytes before the last tensor does; file truncated",
        path="model.safetensors",
        tensor=shard(3),
    )
    assert [p for p in validate(str(tmp_path)) if "model.safetensors" in p] == [str(error)]


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"format": "pt", "anything": "at all"}, None),
        (None, None),  # null: no metadata, as safetensors reads it
        ({"anything": [1, {"x": None}]}, r"invalid type: sequence, expected a string"),
        ({"n": 1}, r"invalid type: integer `1`, expected a string"),
        ([], r"invalid type: sequence, expected a map"),
    ],
)
def test_metadata_maps_strings_to_strings(tmp_path, metadata, match):
    """safetensors reads __metadata__ as an object of strings, and refuses the file otherwise."""
    blob = encode_safetensors(ple())
    length = struct.unpack("<Q", blob[:8])[0]
    header = {"__metadata__": metadata, **json.loads(blob[8 : 8 + length])}
    write_raw(tmp_path / "m.safetensors", header, blob[8 + length :])
    if match is None:
        assert read_layout(str(tmp_path)).num_rows == 9
    else:
        error = raises(str(tmp_path), match, path="m.safetensors")
        assert error.tensor is None


def test_bad_entry_in_unrelated_tensor_is_still_an_error(tmp_path):
    tensors = {**ple(), "junk": ("U8", [3], b"\0\0\0")}
    blob = encode_safetensors(tensors)
    length = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + length])
    header["junk"]["shape"] = [4]
    write_raw(tmp_path / "model.safetensors", header, blob[8 + length :])
    raises(
        str(tmp_path),
        r"invalid shape, data type, or offset for tensor; its entry: .*'shape': \[4\]",
        path="model.safetensors",
        tensor="junk",
    )


def test_unknown_dtype_of_unrelated_tensor_is_refused(tmp_path):
    """safetensors refuses a header that names a dtype it does not know, whichever tensor has it."""
    tensors = {**ple(), "future": ("F3_E1M1", [3], b"\0\0")}
    raises(
        one_file(tmp_path, tensors),
        r"unknown variant `F3_E1M1`, expected one of `BOOL`, ",
        tensor="future",
    )


@pytest.mark.parametrize("fault", ["json", "size", "json_twice", "size_twice"])
def test_the_entry_at_fault_is_named_among_many(tmp_path, fault):
    """The package names no tensor for JSON or a size it refuses (and serde_json places an entry's
    fault at the header's end): ple-um finds the entry, here one of 1000 listed in shuffled order,
    the first at fault (in the text for JSON, by offset for a size) where two are."""
    rng = random.Random(fault)
    count = 1000
    header = {f"t{i}": entry(shape=(2,), offsets=(2 * i, 2 * i + 2)) for i in range(count)}
    at = sorted(rng.sample(range(count), 2 if fault.endswith("twice") else 1))
    for i in at:
        if fault.startswith("json"):
            header[f"t{i}"]["dtype"] = "U9"
        else:
            header[f"t{i}"]["shape"] = [3]
    names = list(header)
    rng.shuffle(names)
    write_raw(tmp_path / "model.safetensors", {n: header[n] for n in names}, b"\0" * (2 * count))
    first = f"t{at[0]}" if fault.startswith("size") else min((f"t{i}" for i in at), key=names.index)
    match = r"unknown variant `U9`" if fault.startswith("json") else r"invalid shape, data type, or offset"
    raises(str(tmp_path), match, path="model.safetensors", tensor=first)


def test_without_memfd_a_temporary_file_stands_in(tmp_path, monkeypatch):
    """A Python without os.memfd_create (built against an old glibc) judges headers exactly as well,
    through a sparse temporary file: a sound table, and an entry at fault found by bisection."""
    monkeypatch.delattr(os, "memfd_create", raising=False)
    made = []

    def temporary(*args, **kw):
        made.append(1)
        return tempfile_file(*args, **kw)

    tempfile_file = tempfile.TemporaryFile
    monkeypatch.setattr(st.tempfile, "TemporaryFile", temporary)
    assert read_layout(one_file(tmp_path, ple())).num_rows == 9
    assert made
    header = {f"t{i}": entry(shape=(2,), offsets=(2 * i, 2 * i + 2)) for i in range(20)}
    header["t13"]["shape"] = [3]
    write_raw(tmp_path / "model.safetensors", header, b"\0" * 40)
    raises(str(tmp_path), r"invalid shape, data type, or offset", path="model.safetensors", tensor="t13")


def test_no_stand_in_is_a_host_error_naming_no_file(tmp_path, monkeypatch):
    """Neither memfd nor a temporary file, or no /proc: a HostError saying so, never a CheckpointError
    that blames the checkpoint; validate does not list it as a problem of each file."""
    directory = one_file(tmp_path, ple())
    monkeypatch.setattr(st, "_PROC_FD", str(tmp_path / "no-proc"))
    with pytest.raises(HostError, match=r"opened through .*no-proc, failed") as info:
        read_layout(directory)
    assert not isinstance(info.value, CheckpointError)
    monkeypatch.undo()

    def refused(*args, **kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(st.tempfile, "TemporaryFile", refused)
    with pytest.raises(HostError, match=r"cannot hand a safetensors header to the package: .*Read-only"):
        validate(directory)


def test_address_space_limit_is_a_host_error(tmp_path):
    """Under a limit on address space (ulimit -v) smaller than a file, the stand-in of its length
    cannot be mapped: a HostError that names the limit, checked in a child that sets it."""
    size = 8 << 30
    path = tmp_path / "big.safetensors"
    write_raw(path, {"t": entry(shape=(size,), offsets=(0, size))})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + size)  # sparse: takes no disk
    child = f"""
import resource
from ple_um.checkpoint.safetensors import read_header
from ple_um.errors import HostError
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    read_header({str(path)!r})
except HostError as e:
    print("HostError:", e)
"""
    root = os.path.dirname(os.path.dirname(ple_um.__file__))  # the tree this ple_um is in
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("HostError: cannot check the safetensors header of "), run.stdout
    assert f"mapping {os.path.getsize(path)} bytes" in run.stdout and "ulimit -v" in run.stdout
