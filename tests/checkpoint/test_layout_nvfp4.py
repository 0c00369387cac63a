"""NVFP4 tables in ple_um.checkpoint.layout: the layout of sound checkpoints and the block scales'
own layout.

NVFP4 (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``): U8 shards ``[rows_i, D/2]`` of packed E2M1
pairs, F8_E4M3 block scales ``shard_<i>.weight_scale`` ``[rows_i, D/16]``, and one global
``weight_scale_2``. Every checkpoint is written byte by byte into tmp_path.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import (
    GLOBAL,
    INDEX,
    UNRELATED,
    block,
    global_name,
    nvfp4,
    one_file,
    raises,
    scalar,
    scale_name,
    shard,
    without,
)
from helpers.reference import reference_rows, tensor_bytes, write_raw, write_safetensors

from ple_um.checkpoint import find_layers, read_layout, validate


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
    with pytest.raises(ValueError, match="only NVFP4 and MXFP8 tables have block scales"):
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
    """weight_scale_2 and block scales next to an FP8 or 16-bit table are not used."""
    rows = {shard(i): ("F8_E4M3", [2, 4], tensor_bytes("F8_E4M3", [2, 4], seed=i)) for i in range(2)}
    extra = {k: v for k, v in nvfp4(rows=(2, 2)).items() if k not in (shard(0), shard(1))}
    fp8 = {**rows, **extra, scale_name(): ("F32", [], scalar("F32", 0.5))}
    layout = read_layout(one_file(tmp_path, fp8))
    assert (layout.dtype_name, layout.scale, layout.scale_tensor) == ("F8_E4M3", 0.5, scale_name())
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
