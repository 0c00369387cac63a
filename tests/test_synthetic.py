"""ple_um.synthetic: real, deterministic, finite checkpoints (NVFP4 included) that the safetensors
package agrees with."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import block, global_name, scale_name
from helpers.reference import decode_e4m3, reference_nvfp4, reference_rows
from safetensors import safe_open

from ple_um import synthetic
from ple_um.checkpoint import read_layout, validate
from ple_um.synthetic import write_checkpoint

INDEX = "model.safetensors.index.json"


def files_of(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


def load_all(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, as the safetensors package loads it."""
    tensors = {}
    for name in files_of(directory):
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def table_bytes(directory, layout) -> np.ndarray:
    """uint8 [num_rows, row_bytes]: the shards as the safetensors package loads them, concatenated."""
    tensors = load_all(directory)
    parts = [tensors[s.tensor].contiguous().view(torch.uint8).numpy().reshape(-1) for s in layout.shards]
    return np.concatenate(parts).reshape(layout.num_rows, layout.row_bytes)


def test_layout_and_names(make_checkpoint):
    layout = make_checkpoint(num_rows=37, row_dim=24, dtype="fp8", shards=4, layer=5)
    directory = layout.directory
    assert files_of(directory) == [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    assert (layout.layer, layout.num_rows, layout.row_dim, layout.row_bytes) == (5, 37, 24, 24)
    assert [s.rows for s in layout.shards] == [10, 10, 10, 7]
    assert [s.tensor for s in layout.shards] == [
        f"model.language_model.layers.5.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(4)
    ]
    assert (
        layout.scale_tensor == "model.language_model.layers.5.ple.ple_embedding.ngram_embedding.weight_scale"
    )
    assert validate(directory) == []


@pytest.mark.parametrize(
    "num_rows, shards, rows",
    [(9, 4, [3, 3, 3, 0]), (2, 5, [1, 1, 0, 0, 0]), (1, 1, [1]), (100, 7, [15] * 6 + [10])],
)
def test_trailing_empty_shards(make_checkpoint, num_rows, shards, rows):
    layout = make_checkpoint(num_rows=num_rows, shards=shards, row_dim=3, dtype="bf16")
    assert [s.rows for s in layout.shards] == rows
    assert layout.rows_per_shard == math.ceil(num_rows / shards)
    shapes = {k: list(v.shape) for k, v in load_all(layout.directory).items()}
    for s in layout.shards:
        assert shapes[s.tensor] == [s.rows, 3]


@pytest.mark.parametrize("dtype", ["F8_E5M2", "F16", "nvfp4"])
@pytest.mark.parametrize("files, expected", [(None, 4), (1, 1), (2, 2), (6, 6)])
def test_file_split_and_index(make_checkpoint, files, expected, dtype):
    layout = make_checkpoint(num_rows=50, row_dim=16, dtype=dtype, shards=6, files=files)
    directory = layout.directory
    names = files_of(directory)
    assert names == [f"model-{k:05d}-of-{expected:05d}.safetensors" for k in range(1, expected + 1)]
    with open(os.path.join(directory, INDEX)) as f:
        index = json.load(f)
    held = {}
    total = 0
    for name in names:
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            for key in f.keys():
                held[key] = name
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == total
    assert "model.language_model.embed_tokens.weight" in held  # the tensor readers must skip
    # Shards (and NVFP4 block scales), the unrelated tensor, the scale (none for F16).
    assert len(held) == {"F8_E5M2": 6 + 2, "F16": 6 + 1, "nvfp4": 2 * 6 + 2}[dtype]
    # Shards split in contiguous runs, in index order; block scales in their shard's file.
    order = [names.index(held[s.tensor]) for s in layout.shards]
    assert order == sorted(order)
    assert [held[s.tensor] for s in layout.block_scales] == (
        [held[s.tensor] for s in layout.shards] if dtype == "nvfp4" else []
    )


def test_files_must_not_exceed_shards(tmp_path):
    with pytest.raises(ValueError, match=r"files \(5\) must not exceed shards \(4\)"):
        write_checkpoint(tmp_path, num_rows=10, row_dim=4, dtype="fp8", shards=4, files=5)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "fp8", "F8_E5M2", "nvfp4"])
def test_determinism(make_checkpoint, dtype):
    def content(layout):
        return {
            name: open(os.path.join(layout.directory, name), "rb").read()  # noqa: SIM115
            for name in (*files_of(layout.directory), INDEX)
        }

    a = make_checkpoint(num_rows=33, row_dim=16, dtype=dtype, shards=3, seed=7)
    b = make_checkpoint(num_rows=33, row_dim=16, dtype=dtype, shards=3, seed=7)
    c = make_checkpoint(num_rows=33, row_dim=16, dtype=dtype, shards=3, seed=8)
    assert content(a) == content(b)
    assert np.array_equal(table_bytes(a.directory, a), table_bytes(b.directory, b))
    ta, tc = table_bytes(a.directory, a), table_bytes(c.directory, c)
    assert (ta != tc).mean() > 0.5
    # Content depends on the shard index, not on how shards are split over files.
    d = make_checkpoint(num_rows=33, row_dim=16, dtype=dtype, shards=3, seed=7, files=1)
    assert np.array_equal(table_bytes(d.directory, d), ta)


def test_shards_differ_from_each_other(make_checkpoint):
    layout = make_checkpoint(num_rows=40, row_dim=32, dtype="fp8", shards=4)
    table = table_bytes(layout.directory, layout)
    for i in range(1, 4):
        assert (table[:10] != table[10 * i : 10 * i + 10]).mean() > 0.5


def test_contents_finite_and_random_looking(any_dtype_layout):
    layout = any_dtype_layout
    tensors = load_all(layout.directory)
    for s in layout.shards:
        t = tensors[s.tensor]
        assert t.dtype == layout.dtype and list(t.shape) == [s.rows, layout.row_dim]
        assert torch.isfinite(t.float()).all()
    raw = table_bytes(layout.directory, layout).reshape(-1)
    if layout.dtype_name == "F8_E4M3":
        assert not np.isin(raw, [0x7F, 0xFF]).any()
    if layout.dtype_name == "F8_E5M2":
        assert not ((raw & 0x7C) == 0x7C).any()
    assert len(np.unique(raw)) > 10
    assert torch.isfinite(tensors["model.language_model.embed_tokens.weight"].float()).all()


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "BF16", "F16"])
def test_finite_over_many_values(tmp_path, dtype):
    """Enough values that every byte / exponent code would show up if it could."""
    layout = write_checkpoint(tmp_path, num_rows=4096, row_dim=64, dtype=dtype, shards=2, seed=11)
    tensors = load_all(layout.directory)
    values = torch.cat([tensors[s.tensor].float().reshape(-1) for s in layout.shards])
    assert torch.isfinite(values).all()
    if layout.dtype_name in ("BF16", "F16"):
        magnitude = values.abs()
        assert magnitude.min() >= 2**-4 and magnitude.max() < 2**4
        assert (values < 0).float().mean().item() == pytest.approx(0.5, abs=0.02)
    else:
        # Every code but the excluded ones appears.
        raw = table_bytes(layout.directory, layout).reshape(-1)
        assert len(np.unique(raw)) == (254 if dtype == "F8_E4M3" else 256 - 8)


def test_safetensors_package_agrees_with_our_offsets(any_dtype_layout):
    layout = any_dtype_layout
    tensors = load_all(layout.directory)
    for s in layout.shards:
        with open(s.path, "rb") as f:
            f.seek(s.offset)
            ours = f.read(s.rows * layout.row_bytes)
        assert ours == tensors[s.tensor].contiguous().view(torch.uint8).numpy().tobytes()
    table = table_bytes(layout.directory, layout)
    assert np.array_equal(reference_rows(layout, np.arange(layout.num_rows)), table)


def test_scale(make_checkpoint):
    values = set()
    for seed in range(20):
        layout = make_checkpoint(num_rows=4, row_dim=2, shards=1, seed=seed)
        assert 0.01 <= layout.scale < 0.05 * 1.25
        assert math.frexp(layout.scale)[0] != 0.5  # not a power of two
        loaded = load_all(layout.directory)[layout.scale_tensor]
        assert loaded.dtype == torch.float32 and loaded.shape == ()
        assert loaded.item() == layout.scale
        # A pure function of the seed: computed again, the value written.
        assert synthetic.scale_value(seed) == layout.scale
        values.add(layout.scale)
    assert len(values) == 20


@pytest.mark.parametrize("dtype", ["bf16", "F16", "f16", "fp16", "float16"])
def test_16bit_has_no_scale_tensor(make_checkpoint, dtype):
    layout = make_checkpoint(dtype=dtype)
    assert layout.scale is None
    assert not any(k.endswith("weight_scale") for k in load_all(layout.directory))


@pytest.mark.parametrize(
    "dtype, row_dim", [("fp8", 5), ("F8_E5M2", 5), ("bf16", 5), ("f16", 5), ("nvfp4", 16)]
)
def test_header_padded_and_data_aligned(make_checkpoint, dtype, row_dim):
    layout = make_checkpoint(num_rows=13, row_dim=row_dim, dtype=dtype, shards=3, files=3)
    for name in files_of(layout.directory):
        with open(os.path.join(layout.directory, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = f.read(length)
        assert length % 8 == 0  # the data section starts 8-aligned
        parsed = json.loads(header)
        assert parsed["__metadata__"] == {"format": "pt"}
        # Every tensor aligned to its element size, as the safetensors package lays files out.
        for key, meta in parsed.items():
            if key != "__metadata__":
                size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}[meta["dtype"]]
                assert meta["data_offsets"][0] % size == 0


@pytest.mark.parametrize(
    "spelling, name",
    [
        (torch.float8_e4m3fn, "F8_E4M3"),
        (torch.float8_e5m2, "F8_E5M2"),
        (torch.bfloat16, "BF16"),
        (torch.float16, "F16"),
        ("F8_E4M3", "F8_E4M3"),
        ("fp8", "F8_E4M3"),
        ("fp8_e4m3", "F8_E4M3"),
        ("F8_E5M2", "F8_E5M2"),
        ("bf16", "BF16"),
        ("BF16", "BF16"),
        ("f16", "F16"),
        ("F16", "F16"),
        ("fp16", "F16"),
        ("float16", "F16"),
        (" Float16 ", "F16"),
        ("bfloat16", "BF16"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("nvfp4", "NVFP4"),
        ("NVFP4", "NVFP4"),
    ],
)
def test_dtype_spellings(make_checkpoint, spelling, name):
    layout = make_checkpoint(dtype=spelling, num_rows=3, row_dim=16, shards=1)
    assert layout.dtype_name == name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_rows=0), r"num_rows must be at least 1, got 0"),
        (dict(row_dim=0), r"row_dim must be at least 1"),
        (dict(shards=0), r"shards must be at least 1"),
        (dict(num_rows=-5), r"num_rows must be at least 1"),
        (dict(num_rows=2.5), r"num_rows must be an integer"),
        (dict(shards=True), r"shards must be an integer"),
        (dict(seed=-1), r"seed must be at least 0"),
        (dict(layer=-1), r"layer must be at least 0"),
        (dict(files=0), r"files must be at least 1"),
        (dict(workers=0), r"workers must be at least 1"),
        (dict(dtype="fp32"), r"unsupported table dtype 'fp32'"),
        (dict(dtype=torch.float32), r"unsupported table dtype torch.float32"),
        (dict(dtype=None), r"unsupported table dtype None"),
        (dict(dtype=torch.uint8), r"unsupported table dtype torch.uint8"),
        (dict(dtype="fp4"), r"unsupported table dtype 'fp4'"),
        (dict(dtype="nvfp4", row_dim=8), r"row_dim of an NVFP4 table must be a multiple of 16, got 8"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    args = dict(num_rows=8, row_dim=4, dtype="fp8", shards=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        write_checkpoint(tmp_path / "c", **args)
    assert not (tmp_path / "c").exists()


def test_more_shards_than_rows(make_checkpoint):
    layout = make_checkpoint(num_rows=3, shards=8, row_dim=4)
    assert [s.rows for s in layout.shards] == [1, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_many_chunks(make_checkpoint, monkeypatch, dtype):
    monkeypatch.setattr(synthetic, "CHUNK_BYTES", 100)  # a row of 48 bytes: 2 rows per chunk
    layout = make_checkpoint(num_rows=31, row_dim=24, dtype=dtype, shards=2)
    tensors = load_all(layout.directory)
    for s in layout.shards:
        assert torch.isfinite(tensors[s.tensor].float()).all()
    assert validate(layout.directory) == []


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_writer_threads_write_the_same_bytes(make_checkpoint, monkeypatch, dtype):
    monkeypatch.setattr(synthetic, "CHUNK_BYTES", 200)  # several chunks a shard, written at offsets
    args = dict(num_rows=301, row_dim=32, dtype=dtype, shards=7, files=3, seed=5)
    one, many = make_checkpoint(**args), make_checkpoint(**args, workers=4)
    for name in (*files_of(one.directory), INDEX):
        paths = (os.path.join(one.directory, name), os.path.join(many.directory, name))
        with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
            assert a.read() == b.read(), name
    assert validate(many.directory) == []
    assert not [f for f in os.listdir(many.directory) if f.endswith(".partial")]


def test_progress_bar(make_checkpoint, capsys):
    make_checkpoint(progress=True)
    assert "write" in capsys.readouterr().err


def test_write_back_syncs_every_file_once_its_data_is_in(tmp_path, monkeypatch):
    """write_back: each safetensors file is fsynced once, holding all its bytes, before it is renamed
    into place; without it nothing is synced."""
    synced = {}
    real_fsync = os.fsync

    def fsync(fd):
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            synced[os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))] = f.read()
        real_fsync(fd)

    monkeypatch.setattr(synthetic.os, "fsync", fsync)
    args = dict(num_rows=40, row_dim=16, dtype="fp8", shards=3, files=2)
    write_checkpoint(tmp_path / "plain", **args)
    assert synced == {}
    layout = write_checkpoint(tmp_path / "synced", **args, write_back=True)
    assert len(synced) == len(layout.files) == 2
    for path in layout.files:
        with open(path, "rb") as f:
            assert synced[os.path.basename(path) + ".partial"] == f.read(), path


def test_rewrite_in_place(tmp_path):
    write_checkpoint(tmp_path, num_rows=8, row_dim=4, dtype="fp8", shards=2, seed=1)
    layout = write_checkpoint(tmp_path, num_rows=8, row_dim=4, dtype="fp8", shards=2, seed=2)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    assert read_layout(str(tmp_path)) == layout


def test_reference_rows_importable_both_ways():
    from tests.helpers.reference import reference_rows as from_package

    assert from_package.__code__.co_code == reference_rows.__code__.co_code


# -- NVFP4 tables -------------------------------------------------------------------------------
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
    assert scale_name(layer=2) not in tensors  # vLLM refuses it next to NVFP4
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
