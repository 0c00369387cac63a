"""ple_um.checkpoint.safetensors (with header_json): malformed headers refused with the file and
entry named: lengths, JSON, entries, sizes, overlaps, truncation, metadata, unrelated tensors.

Every malformed file here is written byte by byte into tmp_path (tests/helpers/reference.py).
"""

from __future__ import annotations

import json
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
    ("length_zero", {E: entry()}, b"", 0, r"not valid JSON", None),
    ("invalid_json", b'{"t.weight": {"dtype": ', b"", None, r"header is not valid JSON", None),
    ("not_utf8", b'{"t\xff\xfe": {}}', b"", None, r"header is not valid UTF-8", None),
    ("json_list", [1, 2, 3], b"", None, r"header is a JSON array, expected an object", None),
    ("json_string", '"abc"', b"", None, r"header is a JSON string", None),
    ("json_null", "null", b"", None, r"header is a JSON null", None),
    ("entry_not_object", {E: [1, 2]}, b"", None, r"header entry is a JSON array", E),
    ("no_dtype", {E: {"shape": [2, 4], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"lacks dtype", E),
    ("no_shape", {E: {"dtype": "U8", "data_offsets": [0, 8]}}, b"\0" * 8, None, r"lacks shape", E),
    ("no_offsets", {E: {"dtype": "U8", "shape": [2, 4]}}, b"\0" * 8, None, r"lacks data_offsets", E),
    ("dtype_int", {E: entry(dtype=5)}, b"\0" * 8, None, r"dtype is 5, expected a string", E),
    ("shape_negative", {E: entry(shape=(-2, -4))}, b"\0" * 8, None, r"shape is \[-2, -4\]", E),
    ("shape_float", {E: entry(shape=(2.0, 4))}, b"\0" * 8, None, r"shape is \[2.0, 4\]", E),
    ("shape_bool", {E: entry(shape=(True, 8))}, b"\0" * 8, None, r"shape is \[True, 8\]", E),
    ("shape_str", {E: {**entry(), "shape": "2x4"}}, b"\0" * 8, None, r"shape is '2x4'", E),
    ("shape_nested", {E: entry(shape=([2], 4))}, b"\0" * 8, None, r"shape is \[\[2\], 4\]", E),
    ("offsets_negative", {E: entry(offsets=(-8, 0))}, b"\0" * 8, None, r"data_offsets is \[-8, 0\]", E),
    ("offsets_bool", {E: entry(offsets=(False, 8))}, b"\0" * 8, None, r"data_offsets is \[False, 8\]", E),
    ("offsets_three", {E: entry(offsets=(0, 4, 8))}, b"\0" * 8, None, r"data_offsets is \[0, 4, 8\]", E),
    ("offsets_float", {E: entry(offsets=(0, 8.0))}, b"\0" * 8, None, r"data_offsets is \[0, 8.0\]", E),
    ("offsets_reversed", {E: entry(offsets=(8, 0))}, b"\0" * 8, None, r"end before they start", E),
    ("offsets_past_end", {E: entry(offsets=(0, 8))}, b"\0" * 5, None, r"past the end of the data section", E),
    ("offsets_far_past", {E: entry(offsets=(1 << 62, (1 << 62) + 8))}, b"\0" * 8, None, r"past the end", E),
    (
        "size_mismatch",
        {E: entry(shape=(2, 5))},
        b"\0" * 8,
        None,
        r"hold 8 bytes but shape \[2, 5\] of U8 needs 10",
        E,
    ),
    ("size_mismatch_f4", {E: entry(dtype="F4", shape=(2, 5))}, b"\0" * 8, None, r"needs 5", E),
    (
        "size_astronomic",
        {E: entry(shape=[1 << 62] * 8)},
        b"\0" * 8,
        None,
        r"shape \[4611686018427387904, .* of U8 overflows the 64-bit size safetensors computes",
        E,
    ),
    (
        "huge_number",
        '{"t.weight": {"dtype": "U8", "shape": [' + "9" * 5000 + "]}}",
        b"",
        None,
        "not valid JSON",
        None,
    ),
    ("deeply_nested", "[" * 100_000 + "]" * 100_000, b"", None, r"nested too deeply", None),
    ("deeply_nested_obj", '{"a":' * 100_000 + "1" + "}" * 100_000, b"", None, r"nested too deeply", None),
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
    raises(str(tmp_path), r"data overlaps tensor a", path="x.safetensors", tensor="b")
    # An empty tensor may sit where one tensor ends and the next begins, not inside one (safetensors
    # refuses that too: in offset order, each tensor starts where the one before it ends).
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(offsets=(0, 8)), "e": entry(shape=(0, 4), offsets=(8, 8)), "f": entry(offsets=(8, 16))},
        b"\0" * 16,
    )
    assert read_header(str(tmp_path / "x.safetensors")).problems == ()
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(offsets=(0, 8)), "e": entry(shape=(0, 4), offsets=(4, 4))},
        b"\0" * 8,
    )
    raises(str(tmp_path), r"empty tensor at byte 4 lies inside the data of tensor a", tensor="e")
    write_raw(
        tmp_path / "x.safetensors",
        {"a": entry(shape=(4, 4), offsets=(0, 16)), "b": entry(offsets=(4, 12))},
        b"\0" * 16,
    )
    raises(str(tmp_path), r"data overlaps tensor a", path="x.safetensors", tensor="b")


def test_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    one_file(tmp_path, ple(rows=(3, 3, 3, 0)), order=[scale_name(), shard(0), shard(1), shard(2), shard(3)])
    blob = path.read_bytes()
    path.write_bytes(blob[:-5])
    # shard_3 is empty and lies at the very end: it is past the end too.
    error = raises(str(tmp_path), r"past the end of the data section", path="model.safetensors")
    assert error.tensor in (shard(2), shard(3))
    problems = validate(str(tmp_path))
    assert any(shard(2) in p for p in problems) and any(shard(3) in p for p in problems)


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"format": "pt", "anything": "at all"}, None),
        (None, None),  # null: no metadata, as safetensors reads it
        ({"anything": [1, {"x": None}]}, r"__metadata__ value of 'anything' is a JSON array, not a string"),
        ({"n": 1}, r"__metadata__ value of 'n' is a JSON number, not a string"),
        ([], r"__metadata__ is a JSON array, expected an object of strings"),
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
        str(tmp_path), r"hold 3 bytes but shape \[4\] of U8 needs 4", path="model.safetensors", tensor="junk"
    )


def test_unknown_dtype_of_unrelated_tensor_is_refused(tmp_path):
    """safetensors refuses a header that names a dtype it does not know, whichever tensor has it."""
    tensors = {**ple(), "future": ("F3_E1M1", [3], b"\0\0")}
    raises(
        one_file(tmp_path, tensors),
        r"unknown dtype 'F3_E1M1': safetensors knows only BOOL, ",
        tensor="future",
    )
