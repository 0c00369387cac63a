"""DeepSeek-V4.1 Engram tables read from real safetensors files: the layout, checked against the
safetensors package and the config's geometry; every bad input a typed CheckpointError naming the
file and the tensor."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from engram_config import geometry_from_config
from helpers.reference import reference_rows, safetensors_table, write_raw, write_safetensors

from ple_um.checkpoint.engram import EngramGeometry, read_engram_layout
from ple_um.errors import CheckpointError
from ple_um.synthetic_engram import FILE_NAME, scale_name, weight_name, write_engram_checkpoint

TINY = {
    "engram_layer_ids": [1, 3],
    "engram_num_embeddings": [2700, 3100],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 4,
    "engram_head_dim": 64,
    "engram_vocab_size": 300,
}


def test_layout_of_a_synthetic_table_matches_the_safetensors_package(tmp_path):
    layouts = write_engram_checkpoint(tmp_path, tables={1: 1000, 14: 777}, head_dim=64, seed=3)
    with pytest.raises(CheckpointError, match="Engram tables of layers 1, 14 in "):
        read_engram_layout(tmp_path)  # both layers found: one must be picked
    assert read_engram_layout(tmp_path, 1) == layouts[1]
    layout = read_engram_layout(tmp_path, 14)
    assert layout == layouts[14]
    assert (layout.dtype_name, layout.dtype, layout.row_dim, layout.row_bytes) == (
        "MXFP8",
        torch.float8_e4m3fn,
        64,
        64,
    )
    assert (layout.num_rows, layout.parts, layout.block_size, layout.scale) == (777, 1, 32, None)
    assert layout.shards[0].tensor == weight_name(14) and layout.block_scales[0].tensor == scale_name(14)
    assert layout.nbytes == 777 * (64 + 2)
    table = safetensors_table(layout)
    ids = np.arange(layout.num_rows)
    assert np.array_equal(reference_rows(layout, ids), table["rows"].view(torch.uint8).numpy())
    scales = layout.scale_layout()
    assert (scales.row_dim, scales.dtype) == (2, torch.uint8)
    assert np.array_equal(reference_rows(scales, ids), table["block_scales"].view(torch.uint8).numpy())
    # The two layers' tables differ: each draws from its own generator.
    assert not np.array_equal(reference_rows(layouts[1], ids[:10]), reference_rows(layout, ids[:10]))


def test_u8_scales_are_accepted_as_e8m0_bytes(tmp_path):
    layout = write_engram_checkpoint(tmp_path, tables={2: 50}, head_dim=32, scale_dtype="U8")[2]
    assert read_engram_layout(tmp_path) == layout


def test_geometry_matches_the_tables_and_maps_heads_to_rows(tmp_path):
    geometry = geometry_from_config(TINY)
    sizes = geometry.head_sizes
    assert len(sizes) == 2 and all(len(s) == 8 for s in sizes)
    flat = [p for s in sizes for p in s]
    assert len(set(flat)) == 16 and min(flat) > 299  # distinct primes above engram_vocab_size - 1
    assert all(all(p % d for d in range(2, int(p**0.5) + 1)) for p in flat)
    assert geometry.head_rows(3, 0, 8) == (0, sum(sizes[1]))
    assert geometry.head_rows(3, 2, 4) == (sum(sizes[1][:2]), sum(sizes[1][:4]))
    write_engram_checkpoint(tmp_path, tables={1: 2700, 3: 3100}, head_dim=64)
    assert read_engram_layout(tmp_path, 3, geometry).num_rows == 3100


def test_a_geometry_of_another_type_is_a_type_error_naming_it(tmp_path):
    """read_engram_layout is public: a geometry that is no EngramGeometry (its config dict, a list)
    is a TypeError naming the argument, as open_engram_table's is, not an error from deep inside."""
    write_engram_checkpoint(tmp_path, tables={1: 2700, 3: 3100}, head_dim=64)
    for wrong in (TINY, [2700, 3100], "tiny", 3):
        with pytest.raises(TypeError, match=r"^geometry=.* \(\w+\): expected an EngramGeometry, or None$"):
            read_engram_layout(tmp_path, 3, wrong)
    assert read_engram_layout(tmp_path, 3, None).num_rows == 3100


@pytest.mark.parametrize(
    "change, message",
    [
        ({"engram_num_embeddings": [2700, 3099]}, "3100 rows, but the config gives 3099"),
        ({"engram_head_dim": 128}, "engram_head_dim is 128"),
        ({"engram_layer_ids": [1, 4]}, "engram_layer_ids are \\[1, 4\\]"),
    ],
)
def test_a_table_the_config_does_not_describe_is_refused(tmp_path, change, message):
    write_engram_checkpoint(tmp_path, tables={1: 2700, 3: 3100}, head_dim=64)
    config = dict(TINY, **change)
    with pytest.raises(CheckpointError, match=message) as info:
        read_engram_layout(tmp_path, 3, geometry_from_config(config))
    assert info.value.tensor == weight_name(3) and info.value.path.endswith(".safetensors")


def test_hash_heads_that_need_more_rows_than_the_table_are_refused(tmp_path):
    """A config whose hash heads' ranges (their primes, laid one after the other) end past the
    table's rows would have a rank own rows the table lacks: refused naming the file and the rows
    tensor, not left to the open's row range."""
    write_engram_checkpoint(tmp_path, tables={1: 2700, 3: 3100}, head_dim=64)
    geometry = geometry_from_config(TINY)
    needed = sum(geometry.head_sizes[1])
    assert read_engram_layout(tmp_path, 3, geometry).num_rows == 3100 >= needed
    sizes = (*geometry.head_sizes[1][:-1], geometry.head_sizes[1][-1] + 3101 - needed)
    short = EngramGeometry(
        geometry.layer_ids, geometry.num_rows, geometry.head_dim, (geometry.head_sizes[0], sizes)
    )
    with pytest.raises(CheckpointError, match="layer 3 need 3101 rows .* table has 3100") as info:
        read_engram_layout(tmp_path, 3, short)
    assert info.value.tensor == weight_name(3) and info.value.path.endswith(".safetensors")


def _table(path, *, rows=40, dim=64, dtype="F8_E4M3", scale_dtype="F8_E8M0", scale_shape=None, name=1):
    scale_shape = scale_shape or [rows, dim // 32]
    tensors = {
        weight_name(name): (dtype, [rows, dim], bytes(rows * dim * (2 if dtype == "BF16" else 1))),
        scale_name(name): (
            scale_dtype,
            scale_shape,
            bytes(int(np.prod(scale_shape)) * (4 if scale_dtype == "F32" else 1)),
        ),
    }
    return write_safetensors(os.path.join(path, "model.safetensors"), tensors)


@pytest.mark.parametrize(
    "kw, tensor, message",
    [
        ({"dtype": "BF16"}, "weight", "dtype BF16; only F8_E4M3"),
        ({"dim": 48}, "weight", "multiple of 32"),
        ({"scale_dtype": "F32", "scale_shape": [40, 2]}, "scale", "dtype F32; expected E8M0"),
        ({"scale_shape": [40, 3]}, "scale", "shape \\[40, 3\\], expected \\[40, 2\\]"),
        ({"scale_shape": [39, 2]}, "scale", "expected \\[40, 2\\]"),
    ],
)
def test_bad_tensors_are_refused_naming_file_and_tensor(tmp_path, kw, tensor, message):
    path = _table(tmp_path, **kw)
    with pytest.raises(CheckpointError, match=message) as info:
        read_engram_layout(tmp_path)
    expect = weight_name(1) if tensor == "weight" else scale_name(1)
    assert (info.value.path, info.value.tensor) == (path, expect)


def test_missing_scales_duplicates_and_absent_layers_are_refused(tmp_path):
    path = write_safetensors(
        os.path.join(tmp_path, "a.safetensors"), {weight_name(1): ("F8_E4M3", [4, 32], bytes(128))}
    )
    with pytest.raises(CheckpointError, match="no block-scale tensor") as info:
        read_engram_layout(tmp_path)
    assert (info.value.path, info.value.tensor) == (path, weight_name(1))
    with pytest.raises(CheckpointError, match="no Engram table of layer 2 in .*layers with one: 1"):
        read_engram_layout(tmp_path, 2)
    write_safetensors(
        os.path.join(tmp_path, "b.safetensors"),
        {
            "other." + weight_name(1): ("F8_E4M3", [4, 32], bytes(128)),
            scale_name(1): ("U8", [4, 1], bytes(4)),
        },
    )
    with pytest.raises(CheckpointError, match="a second rows tensor of the same Engram table"):
        read_engram_layout(tmp_path)
    (tmp_path / "two").mkdir()
    _table(tmp_path / "two", name=1)
    write_safetensors(
        os.path.join(tmp_path / "two", "c.safetensors"),
        {weight_name(5): ("F8_E4M3", [4, 32], bytes(128)), scale_name(5): ("U8", [4, 1], bytes(4))},
    )
    with pytest.raises(CheckpointError, match="Engram tables of layers 1, 5 .*pass layer="):
        read_engram_layout(tmp_path / "two")
    assert read_engram_layout(tmp_path / "two", 5).num_rows == 4


def test_scales_whose_rows_are_missing_are_refused_naming_them(tmp_path):
    """A table with its E8M0 scales and no rows tensor is a table missing a tensor, refused naming
    the scales' file and tensor, layer given or not; not a checkpoint without any Engram table."""
    path = write_safetensors(
        os.path.join(tmp_path, "a.safetensors"),
        {scale_name(3): ("F8_E8M0", [4, 1], bytes(4)), "lm_head.weight": ("BF16", [2, 4], bytes(16))},
    )
    for layer in (None, 3):
        with pytest.raises(CheckpointError, match="no rows tensor for this Engram table") as info:
            read_engram_layout(tmp_path, layer)
        assert (info.value.path, info.value.tensor) == (path, scale_name(3))
    # Two such layers: one to pick, then refused as above.
    write_safetensors(os.path.join(tmp_path, "b.safetensors"), {scale_name(5): ("U8", [4, 1], bytes(4))})
    with pytest.raises(CheckpointError, match="Engram tables of layers 3, 5 in .*pass layer="):
        read_engram_layout(tmp_path)


def test_a_checkpoint_without_an_engram_table_says_so(tmp_path):
    """A folder with no Engram table (other tensors, or no file at all) is refused as such, not as
    a choice of layers to make."""
    (tmp_path / "empty").mkdir()
    write_safetensors(tmp_path / "a.safetensors", {"lm_head.weight": ("BF16", [2, 4], bytes(16))})
    for folder in (tmp_path, tmp_path / "empty"):
        with pytest.raises(CheckpointError, match=re.escape(f"no Engram table was found in {folder}") + "$"):
            read_engram_layout(folder)


def test_headers_safetensors_refuses_are_refused(tmp_path):
    _table(tmp_path)
    broken = write_raw(
        tmp_path / "z.safetensors", {"x": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 8]}}
    )
    with pytest.raises(CheckpointError) as info:
        read_engram_layout(tmp_path)
    assert info.value.path == broken
    with pytest.raises(CheckpointError, match="does not exist"):
        read_engram_layout(tmp_path / "nowhere")


def test_index_entries_are_checked(tmp_path):
    write_engram_checkpoint(tmp_path, tables={1: 8}, head_dim=32)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(f'{{"weight_map": {{"{weight_name(1)}": "../elsewhere.safetensors"}}}}')
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        read_engram_layout(tmp_path)
    assert info.value.tensor == weight_name(1)
    # Every entry stays inside the directory, as for a PLE table, not only the Engram table's.
    index.write_text(f'{{"weight_map": {{"{weight_name(1)}": "{FILE_NAME}", "lm_head.weight": "/abs"}}}}')
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        read_engram_layout(tmp_path)
    assert info.value.tensor == "lm_head.weight"
    write_raw(tmp_path / "other.safetensors", {})
    index.write_text(f'{{"weight_map": {{"{weight_name(1)}": "other.safetensors"}}}}')
    with pytest.raises(CheckpointError, match="which does not hold it"):
        read_engram_layout(tmp_path)


def test_released_geometry_layout_only(tmp_path):
    """The released configuration's shapes (two layers of 24 heads, 3 orders x 8, 256 values a row):
    headers written over sparse files of the full size, read and checked against the geometry."""
    released = {
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16_000_000,
    }
    probe = geometry_from_config(dict(released, engram_num_embeddings=[1 << 40, 1 << 40]))
    rows = [sum(s) for s in probe.head_sizes]
    geometry = geometry_from_config(dict(released, engram_num_embeddings=rows))
    assert all(383_000_000 < r < 385_000_000 for r in rows)
    write_engram_checkpoint(tmp_path, tables=dict(zip((1, 14), rows, strict=True)), head_dim=256, sparse=True)
    for layer, count in zip((1, 14), rows, strict=True):
        layout = read_engram_layout(tmp_path, layer, geometry)
        assert (layout.num_rows, layout.row_bytes, layout.scale_layout().row_bytes) == (count, 256, 8)
        assert layout.nbytes == count * 264
    # TP4's rank 2: heads 12..18 of layer 14, one contiguous range of rows.
    start, end = geometry.head_rows(14, 12, 18)
    assert (start, end - start) == (sum(geometry.head_sizes[1][:12]), sum(geometry.head_sizes[1][12:18]))
