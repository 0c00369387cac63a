"""NVFP4 tables in the checkpoint layer: the layout, every way such a checkpoint can be refused, the
synthetic writer, and the reference decoder the lookup paths are checked against.

NVFP4 (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``): U8 shards ``[rows_i, D/2]`` of packed E2M1
pairs, F8_E4M3 block scales ``shard_<i>.weight_scale`` ``[rows_i, D/16]``, and one global
``weight_scale_2``. Every malformed checkpoint is written byte by byte into tmp_path.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import torch
from helpers.reference import (
    decode_e2m1,
    decode_e4m3,
    encode_safetensors,
    reference_nvfp4,
    reference_rows,
    tensor_bytes,
    write_raw,
    write_safetensors,
)
from safetensors import safe_open

from ple_um.checkpoint import find_layers, read_layout, validate
from ple_um.errors import CheckpointError
from ple_um.synthetic import write_checkpoint

PREFIX = "model.language_model."
INDEX = "model.safetensors.index.json"
UNRELATED = {"model.language_model.embed_tokens.weight": ("I64", [2, 3], tensor_bytes("I64", [2, 3]))}


def _ple(layer: int, prefix: str) -> str:
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding."


def shard(i: int, layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{_ple(layer, prefix)}shard_{i}.weight"


def block(i: int, layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{_ple(layer, prefix)}shard_{i}.weight_scale"


def global_name(layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{_ple(layer, prefix)}weight_scale_2"


def fp8_scale_name(layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{_ple(layer, prefix)}weight_scale"


def scalar(dtype: str, value: float) -> bytes:
    return {
        "F32": lambda: struct.pack("<f", value),
        "F16": lambda: struct.pack("<e", value),
        "BF16": lambda: struct.pack("<f", value)[2:],
        "F64": lambda: struct.pack("<d", value),
    }[dtype]()


GLOBAL = 0.0390625


def nvfp4(
    rows=(3, 3, 3, 0),
    dim: int = 32,
    layer: int = 1,
    prefix: str = PREFIX,
    global_scale: tuple[str, list[int], float] | None = ("F32", [], GLOBAL),
) -> dict[str, tuple[str, list[int], bytes]]:
    """One NVFP4 layer: ``dim`` values a row; shards and block scales with distinct content."""
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for i, r in enumerate(rows):
        tensors[shard(i, layer, prefix)] = ("U8", [r, dim // 2], tensor_bytes("U8", [r, dim // 2], seed=i))
        shape = [r, dim // 16]
        tensors[block(i, layer, prefix)] = ("F8_E4M3", shape, tensor_bytes("F8_E4M3", shape, seed=50 + i))
    if global_scale is not None:
        dtype, shape, value = global_scale
        tensors[global_name(layer, prefix)] = (dtype, shape, scalar(dtype, value))
    return tensors


def one_file(tmp_path, tensors, name="model.safetensors", **kw) -> str:
    write_safetensors(tmp_path / name, tensors, **kw)
    return str(tmp_path)


def raises(directory, match: str, *, layer=None, path: str | None = None, tensor: str | None = None):
    """read_layout raises a CheckpointError matching ``match`` naming ``path`` and ``tensor``, and
    validate lists the same problem first."""
    with pytest.raises(CheckpointError, match=match) as info:
        read_layout(directory, layer)
    error = info.value
    if path is not None:
        assert error.path is not None and os.path.basename(error.path) == path, str(error)
    if tensor is not None:
        assert error.tensor == tensor, str(error)
        assert tensor in str(error)
    problems = validate(directory, layer)
    assert problems and problems[0] == str(error)
    return error


def changed(tensors, name, dtype=None, shape=None, data=None):
    old = tensors[name]
    tensors[name] = (
        dtype or old[0],
        shape if shape is not None else old[1],
        data if data is not None else old[2],
    )
    return tensors


def without(tensors, *names):
    for name in names:
        del tensors[name]
    return tensors


# ---------------------------------------------------------------- sound checkpoints: the layout


def test_layout_fields_and_offsets(tmp_path):
    tensors = {**UNRELATED, **nvfp4()}
    # Global scale first, shards and block scales interleaved out of order: offsets from the header.
    order = [global_name(), block(2), shard(2), *UNRELATED, block(0), shard(3), shard(0), block(3)]
    order += [block(1), shard(1)]
    directory = one_file(tmp_path, tensors, order=order, metadata={"format": "pt"})
    layout = read_layout(directory)
    assert layout.directory == str(tmp_path) and layout.layer == 1
    assert (layout.dtype_name, layout.dtype) == ("NVFP4", torch.uint8)
    assert layout.is_nvfp4 and layout.block_size == 16
    assert (layout.row_dim, layout.row_bytes, layout.num_rows, layout.rows_per_shard) == (32, 16, 9, 3)
    assert layout.parts == 4
    assert layout.nbytes == 9 * 16 + 9 * 2
    assert [s.tensor for s in layout.shards] == [shard(i) for i in range(4)]
    assert [s.tensor for s in layout.block_scales] == [block(i) for i in range(4)]
    assert [s.index for s in layout.block_scales] == [0, 1, 2, 3]
    assert [s.rows for s in layout.shards] == [s.rows for s in layout.block_scales] == [3, 3, 3, 0]
    assert layout.scale == GLOBAL and isinstance(layout.scale, float)
    assert layout.scale_tensor == global_name()
    assert layout.files == (str(tmp_path / "model.safetensors"),)
    blob = (tmp_path / "model.safetensors").read_bytes()
    for s in layout.shards:
        assert blob[s.offset : s.offset + s.rows * 16] == tensors[s.tensor][2]
    for s in layout.block_scales:
        assert s.path == str(tmp_path / "model.safetensors")
        assert blob[s.offset : s.offset + s.rows * 2] == tensors[s.tensor][2]
    assert validate(directory) == []
    assert find_layers(directory) == [1]


def test_scale_layout(tmp_path):
    tensors = nvfp4(rows=(4, 4, 2), dim=64)
    layout = read_layout(one_file(tmp_path, tensors))
    scales = layout.scale_layout()
    assert (scales.dtype_name, scales.dtype) == ("F8_E4M3", torch.float8_e4m3fn)
    assert (scales.row_dim, scales.row_bytes) == (4, 4)
    assert (scales.num_rows, scales.rows_per_shard, scales.parts) == (10, 4, 3)
    assert (scales.directory, scales.layer) == (layout.directory, layout.layer)
    assert scales.shards == layout.block_scales
    assert (scales.scale, scales.scale_tensor, scales.block_scales, scales.block_size) == (None, None, (), 0)
    assert not scales.is_nvfp4 and scales.nbytes == 40
    with pytest.raises(ValueError, match="only NVFP4 tables have block scales"):
        scales.scale_layout()
    # Mapped like any table: its rows are the block-scale bytes.
    expected = np.frombuffer(b"".join(tensors[block(i)][2] for i in range(3)), np.uint8).reshape(10, 4)
    assert np.array_equal(reference_rows(scales, np.arange(10)), expected)
    packed = np.frombuffer(b"".join(tensors[shard(i)][2] for i in range(3)), np.uint8).reshape(10, 32)
    assert np.array_equal(reference_rows(layout, np.arange(10)), packed)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "BF16", "F16"])
def test_scale_layout_refused_for_other_dtypes(make_checkpoint, dtype):
    layout = make_checkpoint(dtype=dtype, num_rows=5, row_dim=16, shards=2)
    assert not layout.is_nvfp4 and layout.block_scales == () and layout.block_size == 0
    assert layout.nbytes == 5 * layout.row_bytes
    with pytest.raises(ValueError, match=f"this table is {dtype}"):
        layout.scale_layout()


def test_files_include_the_block_scale_files(tmp_path):
    tensors = nvfp4(rows=(2, 2))
    files = {
        "rows.safetensors": {k: tensors[k] for k in (shard(0), shard(1))},
        "blocks.safetensors": {k: tensors[k] for k in (block(0), block(1))},
        "global.safetensors": {global_name(): tensors[global_name()], **UNRELATED},
    }
    for name, content in files.items():
        write_safetensors(tmp_path / name, content)
    layout = read_layout(str(tmp_path))
    assert layout.files == (str(tmp_path / "blocks.safetensors"), str(tmp_path / "rows.safetensors"))
    assert {s.path for s in layout.block_scales} == {str(tmp_path / "blocks.safetensors")}
    # The same through an index, which alone picks the files to read.
    weight_map = {t: name for name, content in files.items() for t in content}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "stray.safetensors").write_bytes(b"garbage")
    assert read_layout(str(tmp_path)) == layout


def test_index_claims_block_scales_their_file_lacks(tmp_path):
    tensors = nvfp4(rows=(2, 2))
    write_safetensors(tmp_path / "a.safetensors", without(dict(tensors), block(1)))
    write_safetensors(tmp_path / "b.safetensors", {block(1): tensors[block(1)]})
    weight_map = {t: "a.safetensors" for t in tensors}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    raises(str(tmp_path), r"maps this tensor to a\.safetensors, which does not hold it", tensor=block(1))


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("shape", [[], [1]])
def test_global_scale_dtypes_and_shapes(tmp_path, dtype, shape):
    layout = read_layout(one_file(tmp_path, nvfp4(global_scale=(dtype, shape, 0.75))))
    assert layout.scale == 0.75 and layout.scale_tensor == global_name()


@pytest.mark.parametrize("prefix", ["", "model.", "a.b.c."])
def test_any_prefix(tmp_path, prefix):
    layout = read_layout(one_file(tmp_path, nvfp4(prefix=prefix, layer=7)))
    assert layout.layer == 7
    assert layout.block_scales[0].tensor == block(0, 7, prefix)
    assert layout.scale_tensor == global_name(7, prefix)


@pytest.mark.parametrize("dim", [16, 48, 2048])
def test_row_widths(tmp_path, dim):
    layout = read_layout(one_file(tmp_path, nvfp4(rows=(1, 1), dim=dim)))
    assert (layout.row_dim, layout.row_bytes, layout.scale_layout().row_bytes) == (dim, dim // 2, dim // 16)


def test_nvfp4_names_do_not_matter_to_other_tables(tmp_path):
    """weight_scale_2 and block scales next to an FP8 or 16-bit table are not used (as before)."""
    rows = {shard(i): ("F8_E4M3", [2, 4], tensor_bytes("F8_E4M3", [2, 4], seed=i)) for i in range(2)}
    extra = {k: v for k, v in nvfp4(rows=(2, 2)).items() if k not in (shard(0), shard(1))}
    fp8 = {**rows, **extra, fp8_scale_name(): ("F32", [], scalar("F32", 0.5))}
    layout = read_layout(one_file(tmp_path, fp8))
    assert (layout.dtype_name, layout.scale, layout.scale_tensor) == ("F8_E4M3", 0.5, fp8_scale_name())
    assert layout.block_scales == () and layout.block_size == 0
    other = tmp_path / "bf16"
    other.mkdir()
    rows = {shard(i): ("BF16", [2, 4], tensor_bytes("BF16", [2, 4], seed=i)) for i in range(2)}
    layout = read_layout(one_file(other, {**rows, **extra}))
    assert layout.scale is None and layout.block_scales == ()


def test_a_layer_with_only_block_scales_is_no_table(tmp_path):
    tensors = {**nvfp4(layer=1), block(0, layer=4): ("F8_E4M3", [1, 2], b"\0\0")}
    assert find_layers(one_file(tmp_path, tensors)) == [1]
    assert read_layout(str(tmp_path)).layer == 1


def test_reads_only_headers_of_a_huge_sparse_file(tmp_path):
    rows, dim = 1 << 24, 512  # 4 GiB of packed rows and 512 MiB of block scales, sparse on disk
    header = {
        global_name(): {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        shard(0): {"dtype": "U8", "shape": [rows, dim // 2], "data_offsets": [4, 4 + rows * dim // 2]},
        block(0): {
            "dtype": "F8_E4M3",
            "shape": [rows, dim // 16],
            "data_offsets": [4 + rows * dim // 2, 4 + rows * dim // 2 + rows * dim // 16],
        },
    }
    path = write_raw(tmp_path / "big.safetensors", header, scalar("F32", 0.5))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + rows * dim // 2 + rows * dim // 16)
    layout = read_layout(str(tmp_path))
    assert layout.nbytes == (4 << 30) + (512 << 20) and layout.scale == 0.5


# ------------------------------------------------------------ malformed NVFP4 checkpoints

CASES = [
    # (id, tensors, match, tensor named)
    (
        "block_scales_missing",
        lambda: without(nvfp4(), block(1)),
        r"NVFP4 shard 1 without its block scales; no such tensor in any file",
        block(1),
    ),
    (
        "block_scales_missing_for_empty_shard",
        lambda: without(nvfp4(), block(3)),
        r"NVFP4 shard 3 without its block scales",
        block(3),
    ),
    (
        "block_scales_without_rows",
        lambda: nvfp4() | {block(4): ("F8_E4M3", [0, 2], b"")},
        r"block scales of shard 4 without its rows: no tensor " + shard(4).replace(".", r"\."),
        block(4),
    ),
    (
        "block_rows",
        lambda: changed(nvfp4(), block(1), shape=[2, 2], data=b"\0" * 4),
        r"block scales of shard 1 have 2 rows, its row shard " + shard(1).replace(".", r"\.") + " has 3",
        block(1),
    ),
    (
        "block_width",
        lambda: changed(nvfp4(), block(0), shape=[3, 4], data=b"\0" * 12),
        r"block-scale width 4, expected 2: one scale per 16 of the 32 values of a row \(16 packed bytes\)",
        block(0),
    ),
    (
        "block_width_one_scale_per_byte",
        lambda: changed(nvfp4(rows=(2, 2)), block(1), shape=[2, 16], data=b"\0" * 32),
        r"block-scale width 16, expected 2",
        block(1),
    ),
    (
        "block_dtype_e5m2",
        lambda: changed(nvfp4(), block(2), dtype="F8_E5M2"),
        r"block-scale dtype F8_E5M2, expected F8_E4M3",
        block(2),
    ),
    (
        "block_dtype_u8",
        lambda: changed(nvfp4(), block(0), dtype="U8"),
        r"block-scale dtype U8, expected F8_E4M3",
        block(0),
    ),
    (
        "block_dtype_bf16",
        lambda: changed(nvfp4(), block(0), dtype="BF16", shape=[3, 1]),
        r"block-scale dtype BF16, expected F8_E4M3",
        block(0),
    ),
    (
        "block_one_d",
        lambda: changed(nvfp4(), block(1), shape=[6]),
        r"block-scale tensor has shape \[6\], expected 2-D",
        block(1),
    ),
    (
        "width_not_a_multiple_of_16",
        lambda: changed(
            changed(nvfp4(rows=(2, 2), dim=16), shard(0), shape=[2, 12], data=b"\0" * 24),
            shard(1),
            shape=[2, 12],
            data=b"\1" * 24,
        ),
        r"NVFP4 rows of 24 values \(12 packed bytes\) do not split into blocks of 16: the packed "
        r"width must be a multiple of 8",
        shard(0),
    ),
    (
        "width_odd",
        lambda: changed(
            changed(nvfp4(rows=(1, 1), dim=16), shard(0), shape=[1, 3], data=b"\0" * 3),
            shard(1),
            shape=[1, 3],
            data=b"\1" * 3,
        ),
        r"NVFP4 rows of 6 values \(3 packed bytes\)",
        shard(0),
    ),
    ("zero_width", lambda: nvfp4(rows=(2, 2), dim=0), r"rows have 0 elements", shard(0)),
    ("zero_rows", lambda: nvfp4(rows=(0, 0)), r"layer 1: the table has 0 rows", shard(0)),
    (
        "global_missing",
        lambda: nvfp4(global_scale=None),
        r"NVFP4 table without its global scale weight_scale_2; no such tensor in any file",
        global_name(),
    ),
    (
        "global_missing_fp8_scale_present",
        lambda: nvfp4(global_scale=None) | {fp8_scale_name(): ("F32", [], scalar("F32", 0.5))},
        r"unsharded weight_scale next to an NVFP4 table: its block scales must be stored per shard",
        fp8_scale_name(),
    ),
    (
        "unsharded_weight_scale",
        lambda: nvfp4() | {fp8_scale_name(): ("F8_E4M3", [9, 2], b"\0" * 18)},
        r"unsharded weight_scale next to an NVFP4 table",
        fp8_scale_name(),
    ),
    (
        "global_f64",
        lambda: nvfp4(global_scale=("F64", [], 0.5)),
        r"global scale dtype F64 is not one of F32, BF16, F16",
        global_name(),
    ),
    (
        "global_e4m3",
        lambda: nvfp4() | {global_name(): ("F8_E4M3", [], b"\x38")},
        r"global scale dtype F8_E4M3 is not one of",
        global_name(),
    ),
    (
        "global_shape_2",
        lambda: nvfp4() | {global_name(): ("F32", [2], b"\0" * 8)},
        r"global scale shape \[2\] is not \[\] or \[1\]",
        global_name(),
    ),
    (
        "global_shape_1_1",
        lambda: nvfp4(global_scale=("F32", [1, 1], 0.5)),
        r"global scale shape \[1, 1\]",
        global_name(),
    ),
    (
        "global_nan",
        lambda: nvfp4(global_scale=("F32", [], float("nan"))),
        r"global scale is nan, expected a finite non-zero number",
        global_name(),
    ),
    (
        "global_inf",
        lambda: nvfp4(global_scale=("BF16", [], float("inf"))),
        r"global scale is inf",
        global_name(),
    ),
    (
        "global_neg_inf",
        lambda: nvfp4(global_scale=("F16", [1], float("-inf"))),
        r"global scale is -inf",
        global_name(),
    ),
    ("global_zero", lambda: nvfp4(global_scale=("F32", [], 0.0)), r"global scale is 0.0", global_name()),
    (
        "global_neg_zero",
        lambda: nvfp4(global_scale=("F16", [], -0.0)),
        r"global scale is -0.0",
        global_name(),
    ),
    # The row shards' own checks, as for any table.
    (
        "ceil_layout",
        lambda: nvfp4(rows=(3, 2, 3, 1)),
        r"shard 1 holds 2 rows, expected 3 \(9 rows in 4 parts: ceil\(9/4\) = 3 rows per shard\)",
        shard(1),
    ),
    ("empty_in_middle", lambda: nvfp4(rows=(3, 0, 3, 3)), r"shard 1 holds 0 rows, expected 3", shard(1)),
    (
        "mixed_dtypes",
        lambda: changed(nvfp4(), shard(2), dtype="F8_E4M3", shape=[3, 16]),
        r"dtype F8_E4M3 differs from U8 of shard tensor " + shard(0).replace(".", r"\."),
        shard(2),
    ),
    (
        "mixed_widths",
        lambda: changed(nvfp4(rows=(2, 2)), shard(1), shape=[1, 32]),
        r"row width 32 differs from 16",
        shard(1),
    ),
    ("rows_one_d", lambda: changed(nvfp4(), shard(0), shape=[48]), r"shape \[48\], expected 2-D", shard(0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed(tmp_path, case):
    _, build, match, tensor = case
    directory = one_file(tmp_path, {**UNRELATED, **build()})
    raises(directory, match, path="model.safetensors", tensor=tensor)


def test_missing_row_shard_index(tmp_path):
    tensors = without(nvfp4(rows=(2, 2, 2, 2)), shard(2), block(2))
    raises(one_file(tmp_path, tensors), r"layer 1: 1 of shard indices 0\.\.3 missing: 2 \(file ")
    # With its block scales left behind, they are reported too.
    tensors = without(nvfp4(rows=(2, 2, 2, 2)), shard(2))
    problems = validate(one_file(tmp_path, tensors))
    assert len(problems) == 2, problems
    assert "missing: 2" in problems[0]
    assert "block scales of shard 2 without its rows" in problems[1] and block(2) in problems[1]


def test_duplicate_block_scales(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", nvfp4(rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", {block(1, prefix=""): nvfp4(rows=(2, 2))[block(1)]})
    raises(
        str(tmp_path),
        r"duplicate block scales of shard index 1: also tensor .* in .*a\.safetensors",
        path="b.safetensors",
        tensor=block(1, prefix=""),
    )


def test_duplicate_global_scale(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", nvfp4())
    write_safetensors(tmp_path / "b.safetensors", {global_name(prefix=""): ("F32", [], scalar("F32", 2.0))})
    raises(str(tmp_path), r"duplicate global scale", path="b.safetensors", tensor=global_name(prefix=""))


def test_truncated_block_scales(tmp_path):
    path = tmp_path / "model.safetensors"
    order = [global_name(), *(shard(i) for i in range(4)), *(block(i) for i in range(4))]
    one_file(tmp_path, nvfp4(rows=(3, 3, 3, 1)), order=order)
    path.write_bytes(path.read_bytes()[:-1])
    error = raises(str(tmp_path), r"past the end of the data section", path="model.safetensors")
    assert error.tensor == block(3)


def test_block_scale_size_that_does_not_match_its_shape(tmp_path):
    tensors = nvfp4(rows=(2, 2))
    blob = encode_safetensors(tensors)
    length = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + length])
    header[block(1)]["shape"] = [2, 3]
    write_raw(tmp_path / "model.safetensors", header, blob[8 + length :])
    raises(str(tmp_path), r"hold 4 bytes but shape \[2, 3\] of F8_E4M3 needs 6", tensor=block(1))


def test_validate_lists_every_problem(tmp_path):
    tensors = nvfp4(rows=(3, 3, 2, 1), global_scale=("F32", [], float("nan")))
    tensors[fp8_scale_name()] = ("F32", [], scalar("F32", 0.5))
    without(tensors, block(1))
    changed(tensors, block(2), shape=[3, 4], data=b"\0" * 12)  # 3 rows for 2, and 4 wide for 2
    tensors[block(5)] = ("F8_E4M3", [0, 2], b"")
    changed(tensors, block(0), dtype="F8_E5M2")
    write_safetensors(tmp_path / "a.safetensors", tensors)
    problems = validate(str(tmp_path))
    expected = [
        ("shard 2 holds 2 rows, expected 3", shard(2)),
        ("shard 3 holds 1 rows, expected 0", shard(3)),
        ("unsharded weight_scale next to an NVFP4 table", fp8_scale_name()),
        ("block-scale dtype F8_E5M2", block(0)),
        ("NVFP4 shard 1 without its block scales", block(1)),
        (f"block scales of shard 2 have 3 rows, its row shard {shard(2)} has 2", block(2)),
        ("block-scale width 4, expected 2", block(2)),
        ("block scales of shard 5 without its rows", block(5)),
        ("global scale is nan", global_name()),
    ]
    assert len(problems) == len(expected), problems
    for problem, (text, tensor) in zip(problems, expected, strict=True):
        assert text in problem and f"tensor {tensor})" in problem, (problem, text)
        assert str(tmp_path / "a.safetensors") in problem
    with pytest.raises(CheckpointError) as info:
        read_layout(str(tmp_path))
    assert str(info.value) == problems[0]


def test_validate_goes_on_to_the_block_scales_when_the_rows_are_unsound(tmp_path):
    tensors = changed(nvfp4(rows=(2, 2, 2)), shard(1), dtype="F16", shape=[2, 8])
    without(tensors, block(2), global_name())
    problems = validate(one_file(tmp_path, tensors))
    assert len(problems) == 3, problems
    assert "dtype F16 differs from U8" in problems[0]
    assert "NVFP4 shard 2 without its block scales" in problems[1]
    assert "without its global scale weight_scale_2" in problems[2]


# ------------------------------------------------------------------- the synthetic writer


def load_all(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def test_writer_layout_and_tensors(make_checkpoint):
    layout = make_checkpoint(dtype="nvfp4", num_rows=37, row_dim=64, shards=4, files=3, layer=2, seed=5)
    assert (layout.dtype_name, layout.dtype, layout.layer) == ("NVFP4", torch.uint8, 2)
    assert (layout.row_dim, layout.row_bytes, layout.num_rows, layout.block_size) == (64, 32, 37, 16)
    assert [s.rows for s in layout.shards] == [s.rows for s in layout.block_scales] == [10, 10, 10, 7]
    assert [s.tensor for s in layout.block_scales] == [block(i, layer=2) for i in range(4)]
    assert layout.scale_tensor == global_name(layer=2)
    # Each shard's block scales lie in its file.
    assert [s.path for s in layout.shards] == [s.path for s in layout.block_scales]
    assert validate(layout.directory) == []
    tensors = load_all(layout.directory)  # the safetensors package agrees with the names and offsets
    for s, b in zip(layout.shards, layout.block_scales, strict=True):
        rows, scales = tensors[s.tensor], tensors[b.tensor]
        assert rows.dtype == torch.uint8 and list(rows.shape) == [s.rows, 32]
        assert scales.dtype == torch.float8_e4m3fn and list(scales.shape) == [s.rows, 4]
        with open(s.path, "rb") as f:
            f.seek(s.offset)
            assert f.read(s.rows * 32) == rows.numpy().tobytes()
            f.seek(b.offset)
            assert f.read(b.rows * 4) == scales.view(torch.uint8).numpy().tobytes()
    global_scale = tensors[global_name(layer=2)]
    assert global_scale.dtype == torch.float32 and global_scale.shape == ()
    assert global_scale.item() == layout.scale
    assert math.frexp(layout.scale)[0] != 0.5  # not a power of two
    assert fp8_scale_name(layer=2) not in tensors  # vLLM refuses it next to NVFP4
    with open(os.path.join(layout.directory, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map) == set(tensors)


@pytest.mark.parametrize("spelling", ["nvfp4", "NVFP4", "NvFp4"])
def test_writer_spellings(make_checkpoint, spelling):
    assert make_checkpoint(dtype=spelling, row_dim=16, num_rows=3, shards=1).dtype_name == "NVFP4"


@pytest.mark.parametrize("row_dim", [8, 24, 33, 1])
def test_writer_refuses_a_width_not_a_multiple_of_16(tmp_path, row_dim):
    with pytest.raises(
        ValueError, match=f"row_dim of an NVFP4 table must be a multiple of 16, got {row_dim}"
    ):
        write_checkpoint(tmp_path / "c", num_rows=8, row_dim=row_dim, dtype="nvfp4", shards=2)
    assert not (tmp_path / "c").exists()


def _content(layout) -> tuple[np.ndarray, np.ndarray]:
    """Packed rows [num_rows, row_bytes] and block scales [num_rows, row_dim // 16], as uint8."""
    rows = reference_rows(layout, np.arange(layout.num_rows))
    return rows, reference_rows(layout.scale_layout(), np.arange(layout.num_rows))


def test_writer_determinism(make_checkpoint):
    args = dict(dtype="nvfp4", num_rows=33, row_dim=32, shards=3)
    a, b = make_checkpoint(**args, seed=7), make_checkpoint(**args, seed=7)
    for name in os.listdir(a.directory):
        with (
            open(os.path.join(a.directory, name), "rb") as fa,
            open(os.path.join(b.directory, name), "rb") as fb,
        ):
            assert fa.read() == fb.read(), name
    c = make_checkpoint(**args, seed=8)
    (ra, sa), (rc, sc) = _content(a), _content(c)
    assert (ra != rc).mean() > 0.5 and (sa != sc).mean() > 0.5 and a.scale != c.scale
    # Rows and their block scales draw from different streams.
    assert not np.array_equal(ra[:, : sa.shape[1]], sa)
    # The file split does not change the content.
    d = make_checkpoint(**args, seed=7, files=1)
    rd, sd = _content(d)
    assert np.array_equal(rd, ra) and np.array_equal(sd, sa) and d.scale == a.scale


def test_writer_many_chunks(make_checkpoint, monkeypatch):
    from ple_um import synthetic

    monkeypatch.setattr(synthetic, "CHUNK_BYTES", 50)  # 2 rows of 24 bytes; 16 rows of 3 scales
    layout = make_checkpoint(dtype="nvfp4", num_rows=31, row_dim=48, shards=2)
    assert validate(layout.directory) == []
    rows, scales = _content(layout)
    assert rows.shape == (31, 24) and scales.shape == (31, 3)
    assert not np.isin(scales, [0x7F, 0xFF]).any() and len(np.unique(scales)) > 40


def test_writer_codes_cover_everything_finite(tmp_path):
    """Enough values that every byte and every scale code would show up if it could."""
    layout = write_checkpoint(tmp_path, num_rows=4096, row_dim=64, dtype="nvfp4", shards=2, seed=11)
    rows, scales = _content(layout)
    assert len(np.unique(rows)) == 256  # any byte is two valid E2M1 codes
    codes = np.unique(scales)
    assert len(codes) == 254 and not np.isin(codes, [0x7F, 0xFF]).any()  # every code but the NaNs
    values = decode_e4m3(scales)
    assert np.isfinite(values).all()
    assert (values < 0).any() and (values == 0).any() and np.signbit(values[values == 0]).any()
    assert ((np.abs(values) > 0) & (np.abs(values) < 2.0**-6)).any()  # subnormals
    decoded = reference_nvfp4(layout, np.arange(layout.num_rows), out_dtype=torch.float32)
    assert torch.isfinite(decoded).all()
    assert torch.isfinite(reference_nvfp4(layout, np.arange(layout.num_rows), out_dtype=torch.float16)).all()


def test_writer_global_scale_per_seed(make_checkpoint):
    values = set()
    for seed in range(8):
        layout = make_checkpoint(dtype="nvfp4", num_rows=4, row_dim=16, shards=1, seed=seed)
        assert 0.01 <= layout.scale < 0.05 * 1.25 and math.frexp(layout.scale)[0] != 0.5
        values.add(layout.scale)
    assert len(values) == 8


# ------------------------------------------------------------------- the reference decoder


def test_e2m1_codes():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    values = decode_e2m1(np.arange(16))
    assert values.dtype == np.float32 and values.tolist() == expected
    assert np.signbit(values[8]) and not np.signbit(values[0])


def test_e4m3_codes():
    values = decode_e4m3(np.arange(256))
    assert values.dtype == np.float32
    hand = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x38: 1.0, 0x3C: 1.5, 0x40: 2.0}
    hand |= {0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x81: -(2.0**-9), 0x30: 0.5, 0x47: 3.75}
    for code, value in hand.items():
        assert values[code] == value, hex(code)
    assert np.signbit(values[0x80]) and values[0x80] == 0
    assert np.isnan(values[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(values, [0x7F, 0xFF])).all()
    # torch's float8_e4m3fn agrees, bit for bit but for the NaNs' sign and payload.
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = np.isfinite(values)
    assert np.array_equal(np.isnan(theirs), ~finite)
    assert np.array_equal(values[finite].view(np.uint32), theirs[finite].view(np.uint32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (so -0.0 differs from 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def hand_table(tmp_path, packed: bytes, scales: bytes, global_scale: float):
    """One row of ``2 * len(packed)`` values in one shard."""
    tensors = {
        shard(0): ("U8", [1, len(packed)], packed),
        block(0): ("F8_E4M3", [1, len(scales)], scales),
        global_name(): ("F32", [], scalar("F32", global_scale)),
    }
    return read_layout(one_file(tmp_path, tensors))


def test_reference_decoder_by_hand(tmp_path):
    # 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) element 1; 0x80: +0, -0;
    # 0xF7: 6, -6; 0x9B: -1.5, -0.5; then zeros.
    packed = bytes([0x21, 0x80, 0xF7, 0x9B]) + bytes(4) + bytes([0x44, 0x0F]) + bytes(6)
    layout = hand_table(tmp_path, packed, scales=bytes([0x38, 0x3C]), global_scale=1.0)
    got = reference_nvfp4(layout, [0], out_dtype=torch.float32)
    assert got.shape == (1, 32) and got.dtype == torch.float32
    assert got[0, :8].tolist() == [0.5, 1.0, 0.0, -0.0, 6.0, -6.0, -1.5, -0.5]
    assert torch.signbit(got[0, 3]) and not torch.signbit(got[0, 2])
    assert not got[0, 8:16].any()
    # Block 1 has scale 1.5: 0x44 -> 2, 2; 0x0F -> -6, 0.
    assert got[0, 16:20].tolist() == [3.0, 3.0, -9.0, 0.0]
    # The global scale multiplies too; ids out of range give zeros.
    other = tmp_path / "other"
    other.mkdir()
    layout = hand_table(other, packed, scales=bytes([0x40, 0x01]), global_scale=0.25)  # 2.0, 2**-9
    got = reference_nvfp4(layout, [[0, 1], [-1, 0]], out_dtype=torch.float32)
    assert got.shape == (2, 2, 32)
    assert got[0, 0, :6].tolist() == [0.25, 0.5, 0.0, -0.0, 3.0, -3.0]
    assert got[0, 0, 16:19].tolist() == [2.0**-10, 2.0**-10, -6 * 2.0**-11]
    assert not got[0, 1].any() and not got[1, 0].any()
    assert torch.equal(got[1, 1], got[0, 0])
    assert not reference_nvfp4(layout, [0], rows=(1, 5)).any()
    assert reference_nvfp4(layout, [0]).dtype == torch.bfloat16


def test_reference_decoder_rounds_once_in_the_output_dtype(tmp_path):
    # 1.5 * (1.5 * 0.3) in float32, then to bfloat16: the scales' product first.
    layout = hand_table(tmp_path, bytes([0x33]) + bytes(7), bytes([0x3C]), global_scale=0.3)
    scale = np.float32(1.5) * np.float32(0.3)
    f32 = np.float32(1.5) * scale
    got = reference_nvfp4(layout, [0], out_dtype=torch.float32)
    assert got[0, 0].item() == float(f32) == got[0, 1].item()
    assert reference_nvfp4(layout, [0])[0, 0] == torch.tensor(float(f32)).to(torch.bfloat16)


def test_reference_decoder_against_torch(make_checkpoint):
    """The same computation with torch's own float8 decoder and vLLM's nibble order."""
    layout = make_checkpoint(dtype="nvfp4", num_rows=40, row_dim=64, shards=3, seed=2)
    ids = np.array([0, 39, 13, 14, -1, 40, 26, 5])
    packed = torch.from_numpy(reference_rows(layout, ids))
    scales = torch.from_numpy(reference_rows(layout.scale_layout(), ids)).view(torch.float8_e4m3fn)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(len(ids), 64).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    product = scales.float() * torch.tensor(layout.scale, dtype=torch.float32)
    expect = (values.reshape(len(ids), 4, 16) * product.unsqueeze(-1)).reshape(len(ids), 64)
    valid = torch.from_numpy((ids >= 0) & (ids < 40))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = reference_nvfp4(layout, ids, out_dtype=dtype)
        assert same_bits(got[valid], expect[valid].to(dtype)), dtype
        assert same_bits(got[~valid], torch.zeros_like(got[~valid]))


@pytest.mark.vllm
def test_reference_decoder_against_vllm_cpu_path(make_checkpoint):
    """vLLM's own CPU dequantization (what Qwen4ExpPLENvFp4EmbeddingMethod.embedding runs on the
    CPU) gives the same bits."""
    emulation = pytest.importorskip("vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils")
    layout = make_checkpoint(dtype="nvfp4", num_rows=300, row_dim=128, shards=4, seed=9)
    ids = np.arange(layout.num_rows)
    packed = torch.from_numpy(reference_rows(layout, ids))
    scales = torch.from_numpy(reference_rows(layout.scale_layout(), ids)).view(torch.float8_e4m3fn)
    global_scale = torch.tensor([layout.scale], dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        theirs = emulation.dequantize_to_dtype(packed, scales, global_scale, dtype, swizzle=False)
        ours = reference_nvfp4(layout, ids, out_dtype=dtype)
        assert theirs.dtype == ours.dtype and theirs.shape == ours.shape
        assert same_bits(theirs, ours), dtype
