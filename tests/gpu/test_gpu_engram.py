"""DeepSeek-V4.1 Engram (MXFP8) tables on a real GPU: ple-um's kernel and host decode against vLLM
0.33's own compiled ``_engram_lookup_kernel`` on every code and exponent, bit for bit; an
Engram-shaped table (256 values + 8 E8M0 bytes a row, a rank's heads) in every mode the machine
allows, eager and in a CUDA graph replayed with new ids, and with its rows not in memory (the row
cache and the reader); the vLLM plugin's table against stock ``ParallelEngramEmbedding`` with its
pinned host copy, on the GPU. Outputs poisoned first."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.mxfp8 import reference_mxfp8
from helpers.reference import reference_rows

import ple_um
from ple_um.checkpoint import EngramGeometry
from ple_um.kernels.gather_mxfp8 import gather_mxfp8
from ple_um.lookup.mxfp8 import decode_mxfp8
from ple_um.residency import evict_pages
from ple_um.synthetic_engram import write_engram_checkpoint

MODES = [("registered", "1"), ("device", "1"), ("cpu", "1"), ("cpu", "node"), ("cpu", "0"), ("ats", "1")]
CONFIG = {
    "engram_layer_ids": [1],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 20_000,
}


@pytest.fixture(scope="module")
def engram(tmp_path_factory):
    """One Engram layer of 24 prime-sized heads (about 480 000 rows, 127 MB), and its geometry."""
    probe = EngramGeometry.from_config(dict(CONFIG, engram_num_embeddings=[1 << 40]))
    rows = sum(probe.head_sizes[0])
    geometry = EngramGeometry.from_config(dict(CONFIG, engram_num_embeddings=[rows]))
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"Engram table seed {seed}")
    path = tmp_path_factory.mktemp("engram")
    return write_engram_checkpoint(path, tables={1: rows}, head_dim=256, seed=seed)[1], geometry


def _vllm_kernel():
    engram = pytest.importorskip("vllm.models.deepseek_v41.common.engram")
    return engram._engram_lookup_kernel


def vllm_rows(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """BF16 rows through vLLM's compiled kernel (one head owning the whole table)."""
    index = ids.reshape(-1, 1).to(torch.int32)
    n, dim = index.shape[0], weight.shape[1]
    out = torch.full((n, dim), float("nan"), dtype=torch.bfloat16, device=weight.device)
    _vllm_kernel()[(16,)](
        weight, scales, index, index, out, 0, weight.shape[0], n, 1, 1,
        HEAD_START=0, LOCAL_HEADS=1, TOTAL_HEADS=1, DIM=dim, QUANT_BLOCK=32, BLOCK_R=16, GRID=16,
        SORTED=False, PACKED=False, OUT_STRIDE=dim, PEER_ROWS=0,
    )  # fmt: skip
    return out


def test_every_code_and_exponent_equals_vllms_compiled_kernel(device):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.repeat(255 * 32 // codes.numel() + 1)[: 255 * 32].view(255, 32)
    weight = torch.cat([values.roll(k, 1) for k in range(8)]).to(device)
    scales = torch.arange(255, dtype=torch.uint8).repeat(8).view(-1, 1).to(device)
    ids = torch.arange(weight.shape[0], device=device)
    want = vllm_rows(weight.view(torch.float8_e4m3fn), scales, ids).view(torch.int16)
    host = torch.full_like(want, -1).view(torch.bfloat16)
    decode_mxfp8(weight, scales, host)
    assert torch.equal(host.view(torch.int16), want)
    out = torch.full_like(host, float("nan"))
    counters = torch.zeros(2, dtype=torch.int64, device=device)
    bases = (
        torch.tensor([weight.data_ptr()], device=device),
        torch.tensor([scales.data_ptr()], device=device),
    )
    rows = weight.shape[0]
    gather_mxfp8(
        *bases, ids, out, counters, row_start=0, row_end=rows, num_rows=rows, rows_per_shard=rows, row_dim=32
    )
    assert torch.equal(out.view(torch.int16), want)
    assert counters.tolist() == [rows, 0]


def _open(monkeypatch, layout, geometry, mode, rowcopy, rows, device, **env):
    from ple_um.access.capabilities import read_capabilities

    if mode == "ats" and not read_capabilities(device).pageable_memory_access_uses_host_page_tables:
        pytest.skip("no ATS on this machine")
    monkeypatch.setenv("PLE_UM_ROWCOPY", "0" if rowcopy == "0" else "1")
    monkeypatch.setenv("PLE_UM_DISPATCHER", "0" if rowcopy == "node" else "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return ple_um.open_engram_table(layout.directory, rows=rows, geometry=geometry, mode=mode, device=device)


def _ids(layout, rows, n, rng):
    extra = [rows[0] - 1, rows[0], rows[1] - 1, rows[1], -1, layout.num_rows, 0, layout.num_rows - 1]
    ids = np.concatenate([extra, rng.integers(0, layout.num_rows, n)]).astype(np.int64)
    rng.shuffle(ids)
    return ids


@pytest.mark.parametrize("mode,rowcopy", MODES)
def test_a_ranks_heads_in_every_mode_eager_and_in_a_graph(engram, mode, rowcopy, monkeypatch, rng, device):
    layout, geometry = engram
    rows = geometry.head_rows(1, 6, 12)  # TP4's rank 1
    with _open(monkeypatch, layout, geometry, mode, rowcopy, rows, device) as table:
        for n in (1, 24 * 64, 40_000):
            ids_np = _ids(layout, rows, n, rng)
            out = torch.full((ids_np.size, 256), float("nan"), dtype=torch.bfloat16, device=device)
            table.lookup(torch.from_numpy(ids_np).to(device), out=out)
            want = reference_mxfp8(layout, ids_np, rows, torch.bfloat16)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), (mode, n)
        values, scales = table.lookup_packed(torch.from_numpy(ids_np).to(device))
        assert np.array_equal(values.cpu().numpy(), reference_rows(layout, ids_np, rows))
        assert np.array_equal(scales.cpu().numpy(), reference_rows(layout.scale_layout(), ids_np, rows))
        if not table.capture_safe:
            return
        ids = torch.zeros(24 * 64, dtype=torch.int64, device=device)
        out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16, device=device)
        table.lookup(ids, out=out)  # warm-up outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(ids, out=out)
        for _ in range(3):
            ids_np = _ids(layout, rows, ids.numel() - 8, rng)
            ids.copy_(torch.from_numpy(ids_np))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            want = reference_mxfp8(layout, ids_np, rows, torch.bfloat16)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), mode


def _drop_pages(table) -> None:
    for mapping in (table.mapping, table.scale_mapping):
        evict_pages(mapping.layout.files, mapping.regions)


@pytest.mark.parametrize("reads", ["uring", "threads"])
def test_rows_not_in_memory_through_the_row_cache_and_the_reader(engram, reads, monkeypatch, rng, device):
    layout, geometry = engram
    rows = geometry.head_rows(1, 0, 24)
    env = {"PLE_UM_FILE_READS": reads, "PLE_UM_ROW_CACHE": "4MiB"}
    with _open(monkeypatch, layout, geometry, "cpu", "1", rows, device, **env) as table:
        assert table.paths.host.rows.reader is not None, table.row_reads
        for n in (24, 24 * 256, 40_000):
            for _ in range(2):
                _drop_pages(table)
                ids_np = _ids(layout, rows, n, rng)
                out = torch.full((ids_np.size, 256), float("nan"), dtype=torch.bfloat16, device=device)
                table.lookup(torch.from_numpy(ids_np).to(device), out=out)
                want = reference_mxfp8(layout, ids_np, rows, torch.bfloat16)
                assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), (reads, n)
        assert table.stats()["file_reads"] > 0 and table.stats()["row_cache"]["hits"] > 0


def test_the_plugin_table_equals_stock_with_its_pinned_copy(engram, monkeypatch, rng, device, tmp_path):
    """vLLM's real ParallelEngramEmbedding with cpu_offload (its pinned host copy, read through UVA
    by its compiled kernel) against ple-um's, from the same file, on the GPU."""
    engram_module = pytest.importorskip("vllm.models.deepseek_v41.common.engram")
    from safetensors import safe_open
    from vllm.config import DeviceConfig, EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from ple_um.vllm.engram import MappedEngramEmbedding

    layout, geometry = engram
    monkeypatch.setenv("PLE_UM_DIR", layout.directory)
    config = VllmConfig(device_config=DeviceConfig(device="cuda"))
    object.__setattr__(config, "engram_config", EngramConfig(cpu_offload=True))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp_path}/dist",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        try:
            sizes = geometry.head_sizes[0]
            stock = engram_module.ParallelEngramEmbedding(layout.num_rows, 256, sizes, cpu_offload=True)
            with safe_open(layout.shards[0].path, framework="pt") as f:
                for param, spec in (
                    (stock.weight, layout.shards[0]),
                    (stock.weight_scale_inv, layout.block_scales[0]),
                ):
                    param.weight_loader(param, f.get_tensor(spec.tensor))
            ours = MappedEngramEmbedding(geometry, 1, cpu_offload=True, dp_shared_memory=False)
            for param, spec in (
                (ours.weight, layout.shards[0]),
                (ours.weight_scale_inv, layout.block_scales[0]),
            ):
                shape = (layout.num_rows, 256 if spec is layout.shards[0] else 8)
                dtype = torch.float8_e4m3fn if spec is layout.shards[0] else torch.uint8
                param.weight_loader(param, torch.empty(shape, dtype=dtype, device="meta"))
            starts = np.cumsum([0, *sizes[:-1]])
            hashes = np.stack([rng.integers(0, s, 500) for s in sizes], axis=1) + starts
            hashes = torch.from_numpy(hashes.astype(np.int32)).to(device)
            want = stock(hashes)
            got = ours(hashes)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            ours.served.close()
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
