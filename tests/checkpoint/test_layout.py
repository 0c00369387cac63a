"""ple_um.checkpoint.layout: the layout read from real files (fields, offsets, rows, the ceil
layout, scales per dtype), and the layer picked by read_layout, find_layers and validate.

Every checkpoint here is written byte by byte into tmp_path (tests/helpers/hand_checkpoints.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import UNRELATED, one_file, ple, raises, scalar, scale_name, shard
from helpers.reference import reference_rows, write_raw, write_safetensors

from ple_um.checkpoint import find_layers, read_engram_layout, read_layout, validate


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


@pytest.mark.parametrize("layer", [True, False, 1.0, "1"])
def test_a_layer_that_is_no_int_is_refused(tmp_path, layer):
    """A bool is no layer (True would read layer 1, False layer 0): refused as the openers refuse it,
    by read_layout, validate and read_engram_layout alike."""
    write_safetensors(tmp_path / "a.safetensors", ple(layer=1, rows=(2, 2)))
    directory = str(tmp_path)
    for read in (read_layout, validate, read_engram_layout):
        with pytest.raises(TypeError, match="layer"):
            read(directory, layer)


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
