"""ple_um.checkpoint.safetensors: malformed headers refused with the file and entry named, in the
``safetensors`` package's words: lengths, JSON, entries, sizes, overlaps, truncation, metadata,
unrelated tensors.

Every malformed file here is written byte by byte into tmp_path (tests/helpers/reference.py).
"""

from __future__ import annotations

import json
import random
import struct

import pytest
from helpers.hand_checkpoints import entry, one_file, ple, raises, scale_name, shard
from helpers.reference import encode_safetensors, write_raw

from ple_um.checkpoint import read_layout, validate
from ple_um.checkpoint.safetensors import MAX_HEADER_BYTES, read_header

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
    ("offsets_far_past", {E: entry(offsets=(1 << 62, (1 << 62) + 8))}, b"\0" * 8, None, r"invalid offset", E),
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
