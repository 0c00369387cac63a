"""MXFP8 (DeepSeek-V4.1 Engram) tables end to end: the decode kernel under the Triton interpreter
(ats and device modes on the CPU) and the cpu mode's torch decoder, bit for bit against vLLM 0.33's
own Engram lookup kernel (run under the interpreter) and against a NumPy decoder written from the
format, on real files; raw rows and E8M0 scales against the bytes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.mxfp8 import reference_mxfp8
from helpers.reference import maps_of, reference_rows
from helpers.vllm_engram import engram_module

import ple_um
from ple_um import operating
from ple_um.kernels.gather_block_scaled import gather_block_scaled
from ple_um.lookup import fit
from ple_um.lookup.decode import decode_mxfp8
from ple_um.mapping import MappedShards
from ple_um.synthetic_engram import write_engram_checkpoint
from ple_um.units import format_bytes

MODES = ("ats", "device", "cpu")
OUT = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(scope="module")
def engram(tmp_path_factory):
    # 1 500 rows of 64 values: every E4M3 code and (with the scales' wide quarter) most exponents.
    return write_engram_checkpoint(tmp_path_factory.mktemp("engram"), tables={7: 1500}, head_dim=64, seed=5)[
        7
    ]


def vllm_lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """bf16 rows of ``ids`` through vLLM 0.33's ``_engram_lookup_kernel`` (one head, the whole
    table owned), under the Triton interpreter."""
    engram = engram_module()
    index = ids.reshape(-1, 1).to(torch.int32)
    n, dim = index.shape[0], weight.shape[1]
    out = torch.full((n, dim), float("nan"), dtype=torch.bfloat16)
    engram._engram_lookup_kernel[(4,)](
        weight, scales, index, index, out, 0, weight.shape[0], n, 1, 1,
        HEAD_START=0, LOCAL_HEADS=1, TOTAL_HEADS=1, DIM=dim, QUANT_BLOCK=32, BLOCK_R=16, GRID=4,
        SORTED=False, PACKED=False, OUT_STRIDE=dim, PEER_ROWS=0,
    )  # fmt: skip
    return out


def _ids(layout, rng, n, rows=None):
    extra = [0, 1, layout.num_rows - 1, -7, -1, layout.num_rows, layout.num_rows + 3]
    if rows is not None:
        extra += [rows[0] - 1, rows[0], rows[1] - 1, rows[1]]
    ids = np.concatenate([extra, rng.integers(0, layout.num_rows, n)]).astype(np.int64)
    rng.shuffle(ids)
    return ids


def test_every_code_and_exponent_decodes_as_vllm_decodes():
    """All 254 finite E4M3 codes times all 255 E8M0 exponents vLLM's kernel takes (zero scale,
    subnormal and overflowing products included): our kernel and our torch decoder give vLLM's bits.

    Under the interpreter vLLM's ``.to(tl.bfloat16)`` truncates and mangles float32 subnormals (the
    interpreter's own conversion; a GPU rounds to nearest even, tests/gpu/test_gpu_engram.py compares
    there), so products that are float32 subnormals are held to round-to-nearest-even instead."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    exponents = torch.arange(255, dtype=torch.uint8)
    values = codes.repeat(255 * 32 // codes.numel() + 1)[: 255 * 32].view(255, 32)
    weight = torch.cat([values.roll(k, 1) for k in range(8)]).view(torch.float8_e4m3fn)
    scales = exponents.repeat(8).view(-1, 1)
    ids = torch.arange(weight.shape[0])
    exact = weight.float() * (scales.to(torch.int32) << 23).view(torch.float32)
    subnormal = (exact != 0) & (exact.abs() < 2.0**-126)
    assert 0 < int(subnormal.sum()) < exact.numel() // 10
    want = vllm_lookup(weight, scales, ids).view(torch.int16)
    want = torch.where(subnormal, exact.to(torch.bfloat16).view(torch.int16), want)
    got = torch.full_like(exact, float("nan"), dtype=torch.bfloat16)
    decode_mxfp8(weight.view(torch.uint8), scales, got)
    assert torch.equal(got.view(torch.int16), want)
    out = torch.full_like(got, float("nan"))
    bases = (torch.tensor([weight.data_ptr()]), torch.tensor([scales.data_ptr()]))
    counters = torch.zeros(2, dtype=torch.int64)
    n = rows = weight.shape[0]
    geometry = dict(row_start=0, row_end=rows, num_rows=rows, rows_per_shard=rows, row_dim=32)
    gather_block_scaled(*bases, ids, out, counters, fmt="MXFP8", **geometry)
    assert torch.equal(out.view(torch.int16), want)
    assert counters.tolist() == [n, 0]


def test_table_rows_equal_vllms_kernel_on_the_same_file(engram, rng):
    from safetensors import safe_open

    with safe_open(engram.shards[0].path, framework="pt") as f:
        weight = f.get_tensor(engram.shards[0].tensor)
        scales = f.get_tensor(engram.block_scales[0].tensor).view(torch.uint8)
    ids = torch.from_numpy(rng.integers(0, engram.num_rows, 400))
    exact = reference_mxfp8(engram, ids.numpy())
    subnormal = (exact != 0) & (exact.abs() < 2.0**-126)  # see the test above
    want = vllm_lookup(weight, scales, ids).view(torch.int16)
    want = torch.where(subnormal, exact.to(torch.bfloat16).view(torch.int16), want)
    for mode in MODES:
        with ple_um.open_engram_table(engram.directory, mode=mode, device="cpu") as table:
            got = table.lookup(ids, out_dtype=torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want), mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [None, (150, 1003)])
def test_decoded_rows_equal_the_numpy_decoder(engram, mode, rows, rng):
    ids = _ids(engram, rng, 300, rows)
    with ple_um.open_engram_table(engram.directory, layer=7, mode=mode, rows=rows, device="cpu") as table:
        assert table.mode == mode and table.dtype == torch.float8_e4m3fn and table.row_dim == 64
        for out_dtype in OUT:
            got = table.lookup(torch.from_numpy(ids), out_dtype=out_dtype)
            want = reference_mxfp8(engram, ids, rows=rows, out_dtype=out_dtype)
            assert got.shape == (ids.size, 64) and got.dtype == out_dtype
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (mode, rows, out_dtype)
        oob = int(((ids < 0) | (ids >= engram.num_rows)).sum())
        stats = table.stats()
        assert stats["rows"] == 3 * ids.size and stats["out_of_range"] == 3 * oob


@pytest.mark.parametrize("mode", MODES)
def test_out_buffer_2d_int32_ids_and_poison(engram, mode, rng):
    ids = rng.integers(-3, engram.num_rows + 3, size=(5, 40)).astype(np.int32)
    with ple_um.open_engram_table(engram.directory, mode=mode, device="cpu") as table:
        out = torch.full((5, 40, 64), float("nan"), dtype=torch.bfloat16)
        assert table.lookup(torch.from_numpy(ids), out=out) is out
        want = reference_mxfp8(engram, ids.reshape(-1), out_dtype=torch.bfloat16).view(5, 40, 64)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("mode", MODES)
def test_lookup_packed_gives_the_file_bytes(engram, mode, rng):
    rows = (100, 1100)
    ids = _ids(engram, rng, 200, rows)
    with ple_um.open_engram_table(engram.directory, mode=mode, rows=rows, device="cpu") as table:
        values, scales = table.lookup_packed(torch.from_numpy(ids))
        assert values.dtype == torch.uint8 and values.shape == (ids.size, 64)
        assert scales.dtype == torch.uint8 and scales.shape == (ids.size, 2)
        assert np.array_equal(values.numpy(), reference_rows(engram, ids, rows=rows))
        assert np.array_equal(scales.numpy(), reference_rows(engram.scale_layout(), ids, rows=rows))


def test_raw_lookup_of_an_mxfp8_table_is_refused(engram):
    with ple_um.open_engram_table(engram.directory, mode="cpu", device="cpu") as table:
        with pytest.raises(TypeError, match="MXFP8 table decodes its rows"):
            table.lookup(torch.arange(4))
        with pytest.raises(TypeError, match="MXFP8"):
            table.lookup(torch.arange(4), out_dtype=torch.float8_e4m3fn)


def test_bulk_sized_cpu_lookup(engram, rng, monkeypatch):
    """20 000 ids: a big lookup of the cpu mode's host path feeds the decoder."""
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "2")
    ids = rng.integers(-5, engram.num_rows + 5, 20000)
    with ple_um.open_engram_table(engram.directory, mode="cpu", device="cpu") as table:
        got = table.lookup(torch.from_numpy(ids), out_dtype=torch.float32)
    assert torch.equal(got, reference_mxfp8(engram, ids, out_dtype=torch.float32))


def test_self_test_covers_both_tensors(engram):
    with ple_um.open_engram_table(engram.directory, mode="device", device="cpu") as table:
        assert table.self_test(64) is None
        assert table.stats()["mapped_bytes"] > table.mapping.mapped_bytes  # the block scales too
        for copy in table.access.device_copies:  # the rows, then the block scales
            copy[0] ^= 0x10
            why = table.self_test(64)
            assert why is not None and re.fullmatch(r"self-test: 1 of \d+ sample rows differ .*", why), why
            copy[0] ^= 0x10


def test_a_ranks_heads_through_the_row_cache_and_the_reader(tmp_path, rng, monkeypatch):
    """TP2's rank 1 of a layer whose 8 heads own prime ranges: only its heads' rows are mapped, and
    the cpu mode's row cache (rows of 64 B with 2 B of scales beside them) and reader of misses
    give the files' rows and nothing outside them."""
    from engram_config import geometry_from_config

    config = {
        "engram_layer_ids": [3],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 4,
        "engram_head_dim": 64,
        "engram_vocab_size": 300,
        "engram_num_embeddings": [2700],
    }
    geometry = geometry_from_config(config)
    layout = write_engram_checkpoint(
        tmp_path, tables={3: 2700}, head_dim=64, seed=int(rng.integers(1 << 30))
    )[3]
    rows = geometry.head_rows(3, 4, 8)
    assert 0 < rows[0] < rows[1] < layout.num_rows
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "64KiB")
    with ple_um.open_engram_table(tmp_path, rows=rows, geometry=geometry, mode="cpu", device="cpu") as table:
        assert table.rows == rows and table.stats()["row_cache"] is not None
        assert table.mapping.mapped_bytes < layout.num_rows * 64  # only this rank's heads
        for _ in range(3):
            ids = _ids(layout, rng, 900, rows)
            values, scales = table.lookup_packed(torch.from_numpy(ids))
            assert np.array_equal(values.numpy(), reference_rows(layout, ids, rows=rows))
            assert np.array_equal(scales.numpy(), reference_rows(layout.scale_layout(), ids, rows=rows))
            got = table.lookup(torch.from_numpy(ids), out_dtype=torch.bfloat16)
            want = reference_mxfp8(layout, ids, rows=rows, out_dtype=torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        stats = table.stats()
        assert stats["row_cache"]["hits"] > 0 and stats["file_reads"] > 0


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("layer", "7", "layer='7' (str): expected a layer number (an int), or None for the only layer"),
        ("geometry", {"rows": 1500}, "geometry={'rows': 1500} (dict): expected an EngramGeometry, or None"),
        ("device", 1.5, "device=1.5 (float): expected a torch.device, a str (cpu, cuda, cuda:N)"),
        ("strict", "yes", "strict='yes' (str): expected a bool, or None for PLE_UM_STRICT"),
    ],
)
def test_an_engram_open_names_an_argument_of_a_wrong_type(engram, name, value, expected):
    """open_engram_table checks its arguments' types before anything is read, as open_table does."""
    given = {"mode": "cpu", "device": "cpu", name: value}
    with pytest.raises(TypeError, match=re.escape(expected)):
        ple_um.open_engram_table(engram.directory, **given)
    assert not maps_of(engram.files)


def test_the_files_alone_count_an_engram_tables_block_scales(engram):
    """The table ``ple-um inspect`` describes and the fit ``ple-um probe`` measures at open hold the
    E8M0 block scales beside the E4M3 rows (every lookup reads both)."""
    both = engram.num_rows * (engram.row_bytes + engram.row_dim // engram.block_size)
    described = operating.describe_layout(engram)
    assert sum(f["bytes"] for f in described["files"]) == both == engram.nbytes
    with MappedShards(engram) as rows, MappedShards(engram.scale_layout()) as scales:
        mapped = sum(r.length for m in (rows, scales) for r in m.regions)
    serving = fit.at_open(engram, "cpu", cuda=False)
    assert f"the owned rows ({format_bytes(mapped)}," in serving.why, serving.why
