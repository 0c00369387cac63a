"""DeepSeek-V4.1 Engram (MXFP8) tables on a real GPU: ple-um's kernel and host decode against vLLM
0.33's own compiled ``_engram_lookup_kernel`` on every code and exponent, bit for bit; an
Engram-shaped table (256 values + 8 E8M0 bytes a row, a rank's heads) in every mode the machine
allows, eager and in a CUDA graph replayed with new ids, with its rows not in memory (the row
cache and the reader), and larger than the memory cgroup of the process that serves it (the modes
that read it where it lies); the vLLM plugin's table against stock ``ParallelEngramEmbedding`` with
its pinned host copy, on the GPU. Outputs poisoned first."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
import torch
from engram_config import geometry_from_config
from helpers.cgroup import run_limited
from helpers.mxfp8 import engram_ids, graph_replays_differ, reference_mxfp8
from helpers.reference import reference_rows

import ple_um
from ple_um.kernels.gather_block_scaled import gather_block_scaled
from ple_um.lookup.decode import decode_mxfp8
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
    probe = geometry_from_config(dict(CONFIG, engram_num_embeddings=[1 << 40]))
    rows = sum(probe.head_sizes[0])
    geometry = geometry_from_config(dict(CONFIG, engram_num_embeddings=[rows]))
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
    geometry = dict(row_start=0, row_end=rows, num_rows=rows, rows_per_shard=rows, row_dim=32)
    gather_block_scaled(*bases, ids, out, counters, fmt="MXFP8", **geometry)
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
    return engram_ids(layout.num_rows, rows, n, rng)


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
        if table.capture_safe:
            assert graph_replays_differ(table, rows, lambda n: _ids(layout, rows, n, rng), device) == [], mode


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


@pytest.mark.parametrize("contender", ["torch", "vllm", "stand-in"])
def test_the_benchs_contenders_equal_the_files(engram, contender, rng, device):
    """``ple-um bench --model deepseek-v41``'s torch anchor (the table in GPU memory) and vLLM's
    stock pinned copy, read by vLLM's compiled kernel or by the stand-in, on the GPU."""
    from ple_um.bench.contenders import TorchResident, VllmEngramPinned

    layout, _ = engram
    if contender == "torch":
        impl = TorchResident(layout, device)
    else:
        if contender == "vllm":
            _vllm_kernel()  # skipped without vLLM
        impl = VllmEngramPinned(layout, device, use_vllm=contender == "vllm")
        assert impl.kernel == contender
    try:
        for n in (1, 24 * 64, 40_000):
            ids_np = rng.integers(0, layout.num_rows, n)
            ids_np[: min(n, 2)] = [layout.num_rows - 1, 0][: min(n, 2)]
            out = torch.full((n, 256), float("nan"), dtype=torch.bfloat16, device=device)
            impl.lookup(torch.from_numpy(ids_np).to(device), out=out)
            torch.cuda.synchronize(device)
            want = reference_mxfp8(layout, ids_np, None, torch.bfloat16)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), (contender, n)
    finally:
        impl.close()


# The child under the memory limit: its CUDA context, imports and the host path's kernels (compiled
# by a first open in the cpu mode: Triton's compiler alone would not fit the limit) held first, then
# the limit set to what it holds and 48 MiB more (the table is 127 MB), the table's pages dropped,
# eager lookups and graph replays with new ids, each compared with the rows decoded from the files.
CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import numpy as np, torch
    import ple_um
    from helpers.mxfp8 import engram_ids, graph_replays_differ, reference_mxfp8
    from ple_um.access.capabilities import read_capabilities
    from ple_um.checkpoint import EngramGeometry
    group, mode, device = {group!r}, {mode!r}, torch.device("cuda")
    torch.zeros(1, device=device)
    if mode == "ats" and not read_capabilities(device).pageable_memory_access_uses_host_page_tables:
        print(json.dumps(dict(skipped="no ATS on this machine")))
        sys.exit(0)
    def read(name):
        with open(os.path.join(group, name)) as f:
            return int(f.read())
    def drop_pages():
        fd = os.open({path!r}, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    geometry = {geometry!r}
    rows = geometry.head_rows(1, 0, 24)  # every head: the whole table, 127 MB
    rng = np.random.default_rng({seed})
    ids_for = lambda n: engram_ids({num_rows}, rows, n, rng)
    warm = ple_um.open_engram_table({directory!r}, rows=rows, geometry=geometry, mode="cpu", device=device)
    with warm as t:
        for n in (24, 24 * 64):
            t.lookup(torch.from_numpy(ids_for(n)).to(device), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    drop_pages()
    limit = (read("memory.current") if {v2} else read("memory.usage_in_bytes")) + (48 << 20)
    with open(os.path.join(group, "memory.max" if {v2} else "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    drop_pages()
    bad = []
    opened = ple_um.open_engram_table({directory!r}, rows=rows, geometry=geometry, mode=mode, device=device)
    with opened as table:
        serving = table.stats()["serving"]
        for n in (24, 24 * 64, 40_000):
            for k in range(3):
                ids_np = ids_for(n)
                out = torch.full((ids_np.size, 256), float("nan"), dtype=torch.bfloat16, device=device)
                table.lookup(torch.from_numpy(ids_np).to(device), out=out)
                for a in range(0, ids_np.size, 2048):  # the reference in pieces: it must fit the limit too
                    want = reference_mxfp8(table.layout, ids_np[a : a + 2048], rows, torch.bfloat16)
                    if not torch.equal(out[a : a + 2048].cpu().view(torch.int16), want.view(torch.int16)):
                        bad.append(("eager", n, k, a))
        bad += [("graph", k) for k in graph_replays_differ(table, rows, ids_for, device, replays=4)]
        stats = table.stats()
    print(json.dumps(dict(serving=serving, bad=bad, reads=stats["file_reads"], row_cache=stats["row_cache"])))
    """
)


@pytest.mark.parametrize("mode", ["cpu", "ats"])
def test_a_table_larger_than_its_memory_cgroup(engram, mode, rng, device):
    """The Engram table (127 MB) served by a process whose memory cgroup (page cache included, no
    swap) holds 48 MiB more than its CUDA context and imports: on the host path (the table does not
    fit), its rows through the row cache and the reader of misses, eager and in graph replays with
    new ids, every element equal to the files'."""
    layout, geometry = engram
    seed, tests = int(rng.integers(1 << 30)), os.path.dirname(os.path.dirname(__file__))
    result = run_limited(
        "ple-um-engram",
        lambda group, v2: CHILD.format(
            tests=tests,
            group=group,
            mode=mode,
            v2=v2,
            path=layout.shards[0].path,
            geometry=geometry,
            seed=seed,
            num_rows=layout.num_rows,
            directory=layout.directory,
        ),
    )
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["bad"] == []
    serving = result["serving"]
    assert serving["path"] == "host" and "cgroup" in serving["why"], serving
    assert result["reads"] > 0 and result["row_cache"]["hits"] > 0, result


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
