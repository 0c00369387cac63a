"""ple_um.checkpoint: the layout read from real files, and every way a checkpoint can be refused.

Every malformed checkpoint here is written byte by byte into tmp_path (tests/helpers/reference.py).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from helpers.reference import encode_safetensors, reference_rows, tensor_bytes, write_raw, write_safetensors

from ple_um.checkpoint import find_layers, read_layout, validate
from ple_um.checkpoint.safetensors import MAX_HEADER_BYTES, read_header
from ple_um.errors import CheckpointError

PREFIX = "model.language_model."
INDEX = "model.safetensors.index.json"


def shard(i: int, layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"


def scale_name(layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale"


def scalar(dtype: str, value: float) -> bytes:
    if dtype == "F32":
        return struct.pack("<f", value)
    if dtype == "F16":
        return struct.pack("<e", value)
    if dtype == "BF16":
        return struct.pack("<f", value)[2:]
    if dtype == "F64":
        return struct.pack("<d", value)
    raise AssertionError(dtype)


def ple(
    rows=(3, 3, 3, 0),
    dim: int = 4,
    dtype: str = "F8_E4M3",
    layer: int = 1,
    scale: tuple[str, list[int], float] | None = ("F32", [], 0.0390625),
    prefix: str = PREFIX,
) -> dict[str, tuple[str, list[int], bytes]]:
    """The tensors of one PLE layer: shards with distinct content, and the scale when given."""
    tensors = {
        shard(i, layer, prefix): (dtype, [r, dim], tensor_bytes(dtype, [r, dim], seed=100 * layer + i))
        for i, r in enumerate(rows)
    }
    if scale is not None:
        sdt, shape, value = scale
        tensors[scale_name(layer, prefix)] = (sdt, shape, scalar(sdt, value))
    return tensors


UNRELATED = {"model.language_model.embed_tokens.weight": ("I64", [2, 3], tensor_bytes("I64", [2, 3]))}


def one_file(tmp_path, tensors, name="model.safetensors", **kw) -> str:
    write_safetensors(tmp_path / name, tensors, **kw)
    return str(tmp_path)


def raises(directory, match: str, *, layer=None, path: str | None = None, tensor: str | None = None):
    """read_layout must raise a CheckpointError matching ``match`` that names ``path`` and ``tensor``;
    validate must report the same problem first."""
    with pytest.raises(CheckpointError, match=match) as info:
        read_layout(directory, layer)
    error = info.value
    assert isinstance(error, ValueError)
    if path is not None:
        assert error.path is not None and os.path.basename(error.path) == path, str(error)
        assert path in str(error)
    if tensor is not None:
        assert error.tensor == tensor, str(error)
        assert tensor in str(error)
    problems = validate(directory, layer)
    assert problems and problems[0] == str(error)
    return error


# ---------------------------------------------------------------- sound checkpoints: the layout


def test_layout_fields_and_offsets(tmp_path):
    tensors = {**UNRELATED, **ple()}
    # Scale first, shards out of order: offsets must come from the header, not from any order.
    order = [scale_name(), shard(2), *UNRELATED, shard(0), shard(3), shard(1)]
    directory = one_file(tmp_path, tensors, order=order, metadata={"format": "pt"})
    layout = read_layout(directory)
    assert layout.directory == str(tmp_path)
    assert layout.layer == 1
    assert (layout.dtype_name, layout.dtype) == ("F8_E4M3", torch.float8_e4m3fn)
    assert (layout.row_dim, layout.row_bytes, layout.num_rows, layout.rows_per_shard) == (4, 4, 9, 3)
    assert layout.parts == 4 and layout.nbytes == 36
    assert [s.index for s in layout.shards] == [0, 1, 2, 3]
    assert [s.rows for s in layout.shards] == [3, 3, 3, 0]
    assert [s.tensor for s in layout.shards] == [shard(i) for i in range(4)]
    assert layout.scale == 0.0390625 and layout.scale_tensor == scale_name()
    assert layout.files == (str(tmp_path / "model.safetensors"),)
    with open(tmp_path / "model.safetensors", "rb") as f:
        blob = f.read()
    for s in layout.shards:
        assert s.path == str(tmp_path / "model.safetensors")
        assert blob[s.offset : s.offset + s.rows * 4] == tensors[s.tensor][2]
    assert validate(directory) == []


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_rows_against_bytes_read_directly(tmp_path, dtype):
    tensors = ple(rows=(4, 4, 2), dim=5, dtype=dtype, scale=None)
    write_safetensors(tmp_path / "a.safetensors", {shard(0): tensors[shard(0)], **UNRELATED})
    write_safetensors(tmp_path / "b.safetensors", {shard(2): tensors[shard(2)], shard(1): tensors[shard(1)]})
    layout = read_layout(str(tmp_path))
    assert (layout.num_rows, layout.rows_per_shard, layout.row_bytes) == (10, 4, 10)
    assert layout.scale is None and layout.scale_tensor is None
    table = np.frombuffer(b"".join(tensors[shard(i)][2] for i in range(3)), np.uint8).reshape(10, 10)
    ids = np.array([[0, 3], [4, 9], [7, -1], [10, 5]])
    expected = np.where((ids.reshape(-1, 1) >= 0) & (ids.reshape(-1, 1) < 10), table[ids.reshape(-1) % 10], 0)
    assert np.array_equal(reference_rows(layout, ids), expected)
    owned = reference_rows(layout, np.arange(-2, 12), rows=(3, 8))
    assert np.array_equal(owned[5:10], table[3:8])
    assert not owned[:5].any() and not owned[10:].any()


def test_relative_directory_becomes_absolute(tmp_path, monkeypatch):
    one_file(tmp_path, ple())
    monkeypatch.chdir(tmp_path.parent)
    layout = read_layout(tmp_path.name)
    assert layout.directory == str(tmp_path)
    assert all(os.path.isabs(s.path) for s in layout.shards)


@pytest.mark.parametrize("prefix", ["", "model.", "a.b.c.", "model.language_model."])
def test_any_prefix(tmp_path, prefix):
    layout = read_layout(one_file(tmp_path, ple(prefix=prefix)))
    assert layout.shards[0].tensor == shard(0, prefix=prefix)
    assert layout.scale_tensor == scale_name(prefix=prefix)


def test_similar_names_are_not_ple(tmp_path):
    lookalikes = {
        "model.xlayers.1.ple.ple_embedding.ngram_embedding.shard_0.weight": ("U8", [1, 4], b"\1" * 4),
        shard(0) + ".bias": ("U8", [1, 4], b"\1" * 4),
        shard(0).replace("shard_0", "shard_x"): ("U8", [1, 4], b"\1" * 4),
        "layers.1.ple.ple_embedding.ngram_embedding.shard_٣.weight": ("U8", [1, 4], b"\1" * 4),
    }
    layout = read_layout(one_file(tmp_path, {**lookalikes, **ple()}))
    assert layout.parts == 4


@pytest.mark.parametrize(
    "total, parts, rows",
    [
        (9, 4, (3, 3, 3, 0)),
        (1, 3, (1, 0, 0)),
        (10, 4, (3, 3, 3, 1)),
        (8, 4, (2, 2, 2, 2)),
        (5, 4, (2, 2, 1, 0)),
    ],
)
def test_ceil_layout_with_trailing_empty_shards(tmp_path, total, parts, rows):
    assert sum(rows) == total and len(rows) == parts
    layout = read_layout(one_file(tmp_path, ple(rows=rows)))
    assert layout.num_rows == total
    assert layout.rows_per_shard == -(-total // parts)
    assert tuple(s.rows for s in layout.shards) == rows
    for s in layout.shards:
        assert layout.shard_start(s.index) == s.index * layout.rows_per_shard


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("shape", [[], [1]])
def test_scale_dtypes_and_shapes(tmp_path, dtype, shape):
    layout = read_layout(one_file(tmp_path, ple(scale=(dtype, shape, 0.0390625))))
    assert layout.scale == 0.0390625 and isinstance(layout.scale, float)
    assert layout.scale_tensor == scale_name()


def test_e5m2_table(tmp_path):
    layout = read_layout(one_file(tmp_path, ple(dtype="F8_E5M2", scale=("F32", [1], 0.75))))
    assert (layout.dtype_name, layout.dtype, layout.scale) == ("F8_E5M2", torch.float8_e5m2, 0.75)


@pytest.mark.parametrize("dtype, torch_dtype", [("BF16", torch.bfloat16), ("F16", torch.float16)])
def test_16bit_table_needs_no_scale(tmp_path, dtype, torch_dtype):
    layout = read_layout(one_file(tmp_path, ple(dtype=dtype, scale=None)))
    assert layout.dtype == torch_dtype and layout.row_bytes == 8 and layout.scale is None
    # A scale next to a 16-bit table is not used.
    other = tmp_path / "other"
    other.mkdir()
    assert read_layout(one_file(other, ple(dtype=dtype))).scale is None


def test_reads_only_headers_of_a_huge_sparse_file(tmp_path):
    rows, dim = 1 << 25, 256  # 8 GiB of FP8, sparse on disk: only the header is ever read
    tensors = {scale_name(): ("F32", [], scalar("F32", 0.5))}
    header = {
        scale_name(): {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        shard(0): {"dtype": "F8_E4M3", "shape": [rows, dim], "data_offsets": [4, 4 + rows * dim]},
    }
    path = write_raw(tmp_path / "big.safetensors", header, tensors[scale_name()][2])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + rows * dim)
    layout = read_layout(str(tmp_path))
    assert layout.nbytes == 8 << 30 and layout.scale == 0.5


# ------------------------------------------------------------------- layers


def test_layer_selection(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple(layer=1, rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", ple(layer=3, rows=(2, 2), dim=8))
    # A layer with only a scale has no table.
    write_safetensors(tmp_path / "c.safetensors", {scale_name(7): ("F32", [], scalar("F32", 1.5))})
    directory = str(tmp_path)
    assert find_layers(directory) == [1, 3]
    assert read_layout(directory, 1).num_rows == 4
    three = read_layout(directory, layer=3)
    assert (three.layer, three.num_rows, three.row_dim) == (3, 4, 8)
    error = raises(directory, r"several PLE layers have shards in .*: 1, 3")
    assert error.path is None
    raises(directory, r"no PLE shards of layer 5 .*layers with shards: 1, 3", layer=5)
    raises(directory, r"no PLE shards of layer 7 ", layer=7)
    with pytest.raises(TypeError):
        read_layout(directory, "1")


def test_several_layers_validate_checks_each(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple(layer=1, rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", ple(layer=2, rows=(1, 3)))
    problems = validate(str(tmp_path))
    assert len(problems) == 3
    assert "several PLE layers" in problems[0]
    assert "shard 0 holds 1 rows, expected 2" in problems[1] and "shard 1 holds 3 rows" in problems[2]


def test_no_shards(tmp_path):
    raises(str(tmp_path), r"no PLE shards were found in " + str(tmp_path))
    write_safetensors(tmp_path / "x.safetensors", UNRELATED)
    raises(str(tmp_path), r"no PLE shards were found in ")
    assert find_layers(str(tmp_path)) == []


def test_directory_problems(tmp_path):
    missing = str(tmp_path / "nope")
    raises(missing, r"checkpoint directory .*nope does not exist")
    with pytest.raises(CheckpointError, match="does not exist"):
        find_layers(missing)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    raises(str(a_file), r"is not a directory")


# ------------------------------------------------------------ files that cannot be read


def test_broken_symlink_shard_file(tmp_path):
    one_file(tmp_path, ple())
    os.symlink(tmp_path / "gone.bin", tmp_path / "dangling.safetensors")
    raises(str(tmp_path), r"cannot open: No such file or directory", path="dangling.safetensors")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path):
    path = tmp_path / "model.safetensors"
    one_file(tmp_path, ple())
    path.chmod(0)
    try:
        raises(str(tmp_path), r"cannot open: Permission denied", path="model.safetensors")
    finally:
        path.chmod(0o644)


def test_fifo_and_directory_named_safetensors(tmp_path):
    one_file(tmp_path, ple())
    os.mkfifo(tmp_path / "pipe.safetensors")  # opening it for reading must not wait for a writer
    raises(str(tmp_path), r"not a regular file", path="pipe.safetensors")
    os.unlink(tmp_path / "pipe.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    raises(str(tmp_path), r"not a regular file", path="dir.safetensors")


# ------------------------------------------------------------ malformed headers

E = "t.weight"  # the entry the header cases break


def entry(dtype="U8", shape=(2, 4), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


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


# ------------------------------------------------------------ shard and scale problems


def with_changed(tensors, name, dtype=None, shape=None, data=None):
    old = tensors[name]
    tensors[name] = (
        dtype or old[0],
        shape if shape is not None else old[1],
        data if data is not None else old[2],
    )
    return tensors


SHARD_CASES = [
    (
        "mixed_dtypes",
        lambda: with_changed(ple(dim=4), shard(2), "F16", [3, 2]),
        r"dtype F16 differs from F8_E4M3 of shard tensor " + shard(0).replace(".", r"\."),
        shard(2),
    ),
    (
        "mixed_widths",
        lambda: with_changed(ple(rows=(2, 2, 2)), shard(1), shape=[1, 8]),
        r"row width 8 differs from 4",
        shard(1),
    ),
    ("one_d", lambda: with_changed(ple(), shard(1), shape=[12]), r"shape \[12\], expected 2-D", shard(1)),
    (
        "three_d",
        lambda: with_changed(ple(), shard(0), shape=[3, 2, 2]),
        r"shape \[3, 2, 2\], expected 2-D",
        shard(0),
    ),
    (
        "unsupported_dtype",
        lambda: ple(dtype="F32", scale=None),
        r"unsupported dtype F32 for a PLE shard \(supported: F8_E4M3, F8_E5M2, BF16, F16, U8 \(NVFP4\)\)",
        shard(0),
    ),
    (
        "wrong_rows",
        lambda: ple(rows=(3, 2, 3, 1)),
        r"shard 1 holds 2 rows, expected 3 \(9 rows in 4 parts",
        shard(1),
    ),
    ("empty_in_middle", lambda: ple(rows=(3, 0, 3, 3)), r"shard 1 holds 0 rows, expected 3", shard(1)),
    ("too_many_rows_last", lambda: ple(rows=(2, 2, 3)), r"shard 0 holds 2 rows, expected 3", shard(0)),
    ("zero_rows", lambda: ple(rows=(0, 0)), r"layer 1: the table has 0 rows", shard(0)),
    ("zero_width", lambda: ple(rows=(3, 3), dim=0), r"rows have 0 elements", shard(0)),
    (
        "fp8_without_scale",
        lambda: ple(scale=None),
        r"FP8 table \(F8_E4M3\) without its global scale",
        scale_name(),
    ),
    (
        "e5m2_without_scale",
        lambda: ple(dtype="F8_E5M2", scale=None),
        r"without its global scale",
        scale_name(),
    ),
    (
        "scale_f64",
        lambda: ple(scale=("F64", [], 0.5)),
        r"scale dtype F64 is not one of F32, BF16, F16",
        scale_name(),
    ),
    (
        "scale_shape_2",
        lambda: ple(scale=("F32", [2], 0.5)) | {scale_name(): ("F32", [2], b"\0" * 8)},
        r"scale shape \[2\]",
        scale_name(),
    ),
    (
        "scale_shape_1_1",
        lambda: ple(scale=("F32", [1, 1], 0.5)),
        r"scale shape \[1, 1\] is not \[\] or \[1\]",
        scale_name(),
    ),
    (
        "scale_nan",
        lambda: ple(scale=("F32", [], float("nan"))),
        r"scale is nan, expected a finite non-zero",
        scale_name(),
    ),
    ("scale_inf", lambda: ple(scale=("BF16", [], float("inf"))), r"scale is inf", scale_name()),
    ("scale_neg_inf", lambda: ple(scale=("F16", [1], float("-inf"))), r"scale is -inf", scale_name()),
    ("scale_zero", lambda: ple(scale=("F32", [], 0.0)), r"scale is 0.0", scale_name()),
    ("scale_neg_zero", lambda: ple(scale=("F16", [], -0.0)), r"scale is -0.0", scale_name()),
]


@pytest.mark.parametrize("case", SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
def test_bad_shards_and_scales(tmp_path, case):
    _, build, match, tensor = case
    directory = one_file(tmp_path, {**UNRELATED, **build()})
    raises(directory, match, path="model.safetensors", tensor=tensor)


def test_missing_shard_indices(tmp_path):
    tensors = ple(rows=(2, 2, 2, 2, 2, 2))
    del tensors[shard(2)], tensors[shard(4)]
    error = raises(one_file(tmp_path, tensors), r"layer 1: 2 of shard indices 0\.\.5 missing: 2, 4 \(file ")
    assert error.path is not None


def test_missing_shard_indices_of_a_huge_index_are_listed_briefly(tmp_path):
    tensors = ple(rows=(2,)) | {shard(999_999_999): ("F8_E4M3", [0, 4], b"")}
    error = raises(
        one_file(tmp_path, tensors), r"999999998 of shard indices 0..999999999 missing: 1, 2, .*, 10, \.\.\."
    )
    assert len(str(error)) < 400


def test_duplicate_shard_index(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple(rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", {shard(1): ple(rows=(2, 2))[shard(1)]})
    raises(
        str(tmp_path),
        r"duplicate shard index 1: also tensor .* in .*a\.safetensors",
        path="b.safetensors",
        tensor=shard(1),
    )


def test_duplicate_shard_index_by_spelling(tmp_path):
    tensors = ple(rows=(2, 2)) | {shard(1).replace("shard_1", "shard_01"): ple(rows=(2, 2))[shard(1)]}
    raises(one_file(tmp_path, tensors), r"duplicate shard index 1", tensor=shard(1))


def test_duplicate_scale(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple())
    write_safetensors(tmp_path / "b.safetensors", {scale_name(prefix=""): ("F32", [], scalar("F32", 2.0))})
    raises(str(tmp_path), r"duplicate scale", path="b.safetensors", tensor=scale_name(prefix=""))


def test_validate_lists_every_problem(tmp_path):
    tensors = with_changed(ple(rows=(3, 3, 3, 0)), shard(1), shape=[3, 2], data=b"\0" * 6)
    tensors[scale_name()] = ("F32", [], scalar("F32", float("nan")))
    write_safetensors(tmp_path / "a.safetensors", tensors)
    header = {"x": entry(shape=(3,)), "y": entry(dtype=1, offsets=(8, 16))}
    write_raw(tmp_path / "b.safetensors", header, b"\0" * 16)
    problems = validate(str(tmp_path))
    assert len(problems) == 2, problems  # a broken file counts once, naming its other tensors
    assert "b.safetensors" in problems[0] and "tensor x" in problems[0]
    assert "1 more tensor of this file too: y" in problems[0]
    assert "row width 2 differs" in problems[1]
    with pytest.raises(CheckpointError) as info:
        read_layout(str(tmp_path))
    assert str(info.value) == problems[0]


# ------------------------------------------------------------------- index files


def indexed(tmp_path, files: dict[str, dict], weight_map: dict | None = None, extra=None) -> str:
    """Write ``files`` and an index mapping each of their tensors (or ``weight_map`` as given)."""
    mapping = {}
    for name, tensors in files.items():
        write_safetensors(tmp_path / name, tensors)
        mapping.update({t: name for t in tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": mapping if weight_map is None else weight_map}
    if extra:
        index["weight_map"].update(extra)
    (tmp_path / INDEX).write_text(json.dumps(index))
    return str(tmp_path)


def test_index_picks_the_files(tmp_path):
    tensors = ple(rows=(3, 3, 3, 0))
    files = {
        "model-00001-of-00003.safetensors": {k: tensors[k] for k in (shard(0), shard(1))},
        "model-00002-of-00003.safetensors": {k: tensors[k] for k in (shard(2), shard(3), scale_name())},
        "model-00003-of-00003.safetensors": UNRELATED,
    }
    directory = indexed(tmp_path, files)
    # Garbage that is not in the index, or holds no PLE tensor, is never opened.
    (tmp_path / "stray.safetensors").write_bytes(b"garbage")
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"garbage too")
    layout = read_layout(directory)
    assert [os.path.basename(s.path) for s in layout.shards] == [
        "model-00001-of-00003.safetensors",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
    ]
    assert validate(directory) == []
    os.unlink(tmp_path / INDEX)
    raises(directory, r"exceeds the 100000000 byte limit", path="model-00003-of-00003.safetensors")


def test_index_with_layer_opens_only_that_layers_files(tmp_path):
    files = {"one.safetensors": ple(layer=1), "two.safetensors": ple(layer=2, rows=(2, 2))}
    directory = indexed(tmp_path, files)
    (tmp_path / "one.safetensors").write_bytes(b"broken")
    assert read_layout(directory, layer=2).num_rows == 4
    raises(directory, r"too short", layer=1, path="one.safetensors")
    raises(directory, r"too short", path="one.safetensors")
    raises(directory, r"no PLE shards of layer 3 .*layers with shards: 1, 2", layer=3)


def test_index_in_subfolder_and_symlinked_files(tmp_path, tmp_path_factory):
    (tmp_path / "sub").mkdir()
    blobs = tmp_path_factory.mktemp("blobs")  # the Hugging Face cache: snapshot files link to blobs
    write_safetensors(blobs / "blob1", ple())
    os.symlink(blobs / "blob1", tmp_path / "sub" / "model.safetensors")
    mapping = {name: "sub/model.safetensors" for name in ple()}
    directory = indexed(tmp_path, {}, weight_map=mapping)
    layout = read_layout(directory)
    assert layout.shards[0].path == str(tmp_path / "sub" / "model.safetensors")


@pytest.mark.parametrize(
    "target, match",
    [
        ("/etc/passwd", r"outside the checkpoint directory"),
        ("../model.safetensors", r"outside the checkpoint directory"),
        ("a/../../model.safetensors", r"outside the checkpoint directory"),
        ("..", r"outside the checkpoint directory"),
        ("missing.safetensors", r"'missing.safetensors', a missing file"),
        ("dangling.safetensors", r"'dangling.safetensors', a symlink to a missing file"),
        ("", r"expected a file name"),
        ("a\0b", r"expected a file name"),
        (7, r"names file 7, expected a file name"),
        (None, r"names file None"),
    ],
)
def test_index_entry_problems(tmp_path, target, match):
    tensors = ple()
    os.symlink(tmp_path / "nothing", tmp_path / "dangling.safetensors")
    mapping = {name: "model.safetensors" for name in tensors}
    mapping[shard(1)] = target
    write_safetensors(tmp_path / "model.safetensors", tensors)
    directory = indexed(tmp_path, {}, weight_map=mapping)
    raises(directory, match, path=INDEX, tensor=shard(1))


def test_index_entry_outside_is_an_error_even_for_other_tensors(tmp_path):
    directory = indexed(
        tmp_path, {"model.safetensors": ple()}, extra={"lm_head.weight": "/abs/x.safetensors"}
    )
    raises(directory, r"outside the checkpoint directory", path=INDEX, tensor="lm_head.weight")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", r"index is not valid JSON"),
        (b"\xff\xfe", r"index is not valid UTF-8"),
        (b"[]", r"index has no weight_map object"),
        (b'{"metadata": {}}', r"index has no weight_map object"),
        (b'{"weight_map": []}', r"index has no weight_map object"),
        (b"[" * 100_000, r"index JSON is nested too deeply"),
    ],
)
def test_bad_index_file(tmp_path, content, match):
    write_safetensors(tmp_path / "model.safetensors", ple())
    (tmp_path / INDEX).write_bytes(content)
    raises(str(tmp_path), match, path=INDEX)


def test_index_that_is_a_dangling_symlink(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple())
    os.symlink(tmp_path / "nothing.json", tmp_path / INDEX)
    raises(str(tmp_path), r"cannot open: No such file or directory", path=INDEX)


def test_index_claims_a_tensor_its_file_lacks(tmp_path):
    tensors = ple(rows=(2, 2))
    write_safetensors(
        tmp_path / "a.safetensors", {shard(0): tensors[shard(0)], scale_name(): tensors[scale_name()]}
    )
    write_safetensors(tmp_path / "b.safetensors", {shard(1): tensors[shard(1)]})
    mapping = {shard(0): "a.safetensors", shard(1): "a.safetensors", scale_name(): "a.safetensors"}
    directory = indexed(tmp_path, {}, weight_map=mapping)
    raises(
        directory,
        r"maps this tensor to a\.safetensors, which does not hold it",
        path="a.safetensors",
        tensor=shard(1),
    )


def test_index_without_ple_entries(tmp_path):
    directory = indexed(tmp_path, {"model.safetensors": UNRELATED})
    raises(directory, r"no PLE shards were found in ")
