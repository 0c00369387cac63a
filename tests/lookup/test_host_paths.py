"""The cpu access mode end to end through open_table on device cpu, both host paths: the C row copy
(``host.gather.HostGather``, called directly where there is no CUDA) and the synchronous fallback
(``sync_gather.SyncGather``, PLE_UM_ROWCOPY=0). The same bytes as the reference reader for
duplicated, masked and out-of-table ids, dequantized or raw, on the C copy's inline path and its
thread pool's, and in one chunk or many of the synchronous path; NVFP4 and MXFP8 rows and block
scales through both.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers.mxfp8 import reference_mxfp8
from helpers.reference import reference_nvfp4, reference_rows

import ple_um
from ple_um import envs
from ple_um.lookup import rowcopy
from ple_um.lookup.host.gather import HostGather
from ple_um.lookup.sync_gather import SyncGather
from ple_um.mapping import MappedShards
from ple_um.synthetic import write_checkpoint
from ple_um.synthetic_engram import write_engram_checkpoint

PATHS = {"node": HostGather, "sync": SyncGather}


@pytest.fixture(params=sorted(PATHS))
def host_path(request, monkeypatch):
    """Each test runs through both host paths; returns the class the table must use."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", "1" if request.param == "node" else "0")
    return PATHS[request.param]


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "BF16", "F16"])
def test_random_ids_with_duplicates_masks_and_oob(make_checkpoint, dtype, rng, check_rows, poison, host_path):
    layout = make_checkpoint(num_rows=300, row_dim=9, dtype=dtype, shards=7, seed=int(rng.integers(1 << 30)))
    S = layout.rows_per_shard
    boundaries = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)]  # 24: even
    for rows in [None, (S - 1, 3 * S + 1), (0, 0)]:
        with ple_um.open_table(layout.directory, rows=rows, mode="cpu", device="cpu") as table:
            assert table.mode == "cpu" and isinstance(table.paths.host, host_path) and table.paths.gpu is None
            ids = np.concatenate([boundaries, rng.integers(-20, 320, 500), rng.integers(0, 10, 50)])
            ids = torch.from_numpy(rng.permutation(ids[: ids.size // 2 * 2])).reshape(2, -1)
            assert len(ids.unique()) < ids.numel()  # duplicates
            for out_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
                check_rows(table.lookup(ids, out_dtype=out_dtype), layout, ids, rows=rows)
                out = poison(torch.empty((*ids.shape, layout.row_dim), dtype=out_dtype or layout.dtype))
                assert table.lookup(ids, out=out) is out
                check_rows(out, layout, ids, rows=rows)
            oob = int(((ids < 0) | (ids >= 300)).sum())
            stats = table.stats()
            assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (8, 8 * ids.numel(), 8 * oob)


def test_only_bad_ids_and_empty_ids(make_checkpoint, check_rows, host_path):
    layout = make_checkpoint(num_rows=40, row_dim=4, dtype="bf16", shards=3)
    with ple_um.open_table(layout.directory, rows=(10, 20), mode="cpu", device="cpu") as table:
        for ids in ([-1, 40, 99, -7], [0, 5, 25, 39], []):
            ids = torch.tensor(ids, dtype=torch.int64)
            got = table.lookup(ids, out_dtype=torch.float32)
            check_rows(got, layout, ids, rows=(10, 20))
        assert table.stats()["out_of_range"] == 4
        assert table.lookup(torch.empty((2, 0), dtype=torch.int32)).shape == (2, 0, 4)


def test_thread_pool_paths(make_checkpoint, monkeypatch, rng, check_rows, poison, host_path):
    # Batches with more unique rows than the C copy's inline limit (2048), over 64 shards in 4
    # files; the synchronous path reads them in chunks of 100 ids on the calling thread.
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "4")
    monkeypatch.setenv("PLE_UM_CPU_CHUNK", "100")
    seed = int(rng.integers(1 << 30))
    layout = make_checkpoint(num_rows=9000, row_dim=6, dtype="fp8", shards=64, seed=seed)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert isinstance(table.paths.host, host_path)
        if host_path is SyncGather:
            assert table.paths.host.chunk == 100
        else:
            assert table.paths.host.threads == 4  # the C pool's 3 workers and the calling thread
        rows = 0
        for n in (12000, 20000):
            ids = torch.from_numpy(rng.integers(-50, 9050, n))
            assert len(ids.unique()) > 4096
            for out_dtype in (layout.dtype, torch.float32):
                check_rows(table.lookup(ids, out_dtype=out_dtype), layout, ids)
                out = poison(torch.empty((n, layout.row_dim), dtype=out_dtype))
                check_rows(table.lookup(ids, out=out), layout, ids)
            rows += 4 * n
        # Every row of the table once, in order and reversed.
        ids = torch.arange(9000)
        check_rows(table.lookup(ids), layout, ids)
        check_rows(table.lookup(ids.flip(0)), layout, ids.flip(0))
        assert table.stats()["rows"] == rows + 2 * 9000


def test_one_thread(make_checkpoint, monkeypatch, rng, check_rows, host_path):
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "1")
    layout = make_checkpoint(num_rows=6000, row_dim=3, dtype="bf16", shards=5)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.from_numpy(rng.permutation(6000))
        check_rows(table.lookup(ids, out_dtype=torch.float16), layout, ids)


def test_concurrent_lookups(make_checkpoint, monkeypatch, rng, check_rows, host_path):
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "2")
    layout = make_checkpoint(num_rows=6000, row_dim=4, dtype="fp8", shards=8)
    batches = [torch.from_numpy(rng.integers(-5, 6005, n)) for n in (10, 5000, 300, 4500)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:

        def run(k: int) -> None:
            try:
                for _ in range(3):
                    results[k] = table.lookup(batches[k], out_dtype=torch.bfloat16)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(batches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors
    for k, ids in enumerate(batches):
        check_rows(results[k], layout, ids)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_block_scaled_rows_and_scales(tmp_path, monkeypatch, rng, poison, kind, host_path):
    # The rows and the block scales come from two mappings; decoded on the device, and raw
    # (lookup_packed), in chunks of 64 ids on the synchronous path, an owned range cutting shards.
    monkeypatch.setenv("PLE_UM_CPU_CHUNK", "64")
    seed = int(rng.integers(1 << 30))
    if kind == "nvfp4":
        layout = write_checkpoint(tmp_path, num_rows=700, row_dim=64, dtype="nvfp4", shards=5, seed=seed)
        open_, reference = ple_um.open_table, reference_nvfp4
    else:
        layout = write_engram_checkpoint(tmp_path, tables={7: 700}, head_dim=64, seed=seed)[7]
        open_, reference = ple_um.open_engram_table, reference_mxfp8
    S = layout.rows_per_shard
    rows = (min(S, layout.num_rows // 2) - 3, layout.num_rows - 50)
    edges = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)] + [*rows, rows[1] - 1]
    ids = rng.permutation(np.concatenate([edges, rng.integers(-5, layout.num_rows + 5, 500)]))
    with open_(layout.directory, mode="cpu", rows=rows, device="cpu") as table:
        assert isinstance(table.paths.host, host_path)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            out = poison(torch.empty((ids.size, layout.row_dim), dtype=out_dtype))
            table.lookup(torch.from_numpy(ids), out=out)
            want = reference(layout, ids, rows=rows, out_dtype=out_dtype)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), out_dtype
        packed, scales = table.lookup_packed(torch.from_numpy(ids))
        assert np.array_equal(packed.numpy(), reference_rows(layout, ids, rows=rows))
        assert np.array_equal(
            scales.view(torch.uint8).numpy(), reference_rows(layout.scale_layout(), ids, rows)
        )
        oob = int(((ids < 0) | (ids >= layout.num_rows)).sum())
        stats = table.stats()
        assert (stats["rows"], stats["out_of_range"]) == (4 * ids.size, 4 * oob)


def _break_map(mapping, layout, lost_shard: int, cut_shard: int, late_shard: int) -> None:
    """Make ``mapping``'s shard map lack rows it owns, as both host paths then read it: shard
    ``lost_shard`` not mapped, ``cut_shard`` only its first 10 owned rows, ``late_shard`` all but
    its first 5 owned rows (its address moved with them)."""
    owned = mapping.owned
    del owned[lost_shard]
    owned[cut_shard] = replace(owned[cut_shard], hi=owned[cut_shard].lo + 10)
    late = owned[late_shard]
    owned[late_shard] = replace(late, lo=late.lo + 5, addr=late.addr + 5 * layout.row_bytes)


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_a_broken_shard_map_gives_the_same_zero_rows_and_counts_on_both_paths(
    make_checkpoint, rng, poison, kind
):
    """An owned id whose row lies outside its shard's mapping is a zero row counted as broken: the
    synchronous path gives and counts exactly what the C row copy does (rows and block scales each
    counted), never an IndexError; every other row is the files' bytes. Outputs poisoned first."""
    lib, why = rowcopy.load(envs.PLE_UM_CACHE_DIR)
    assert lib is not None, why
    layout = make_checkpoint(num_rows=500, row_dim=32, dtype=kind, shards=7, seed=int(rng.integers(1 << 30)))
    S = layout.rows_per_shard
    owned = (S - 3, 6 * S + 2)
    edges = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1, 5, 9, 10)]
    ids_np = rng.permutation(np.concatenate([edges, rng.integers(-5, layout.num_rows + 5, 3000)]))
    ids = torch.from_numpy(ids_np)
    local = ids - (ids // S) * S
    lost = (ids >= owned[0]) & (ids < owned[1])
    lost &= (ids // S == 2) | ((ids // S == 3) & (local >= 10)) | ((ids // S == 4) & (local < 5))
    assert lost.any() and not lost.all()
    block_scaled = kind == "nvfp4"
    scale_layout = layout.scale_layout() if block_scaled else None
    with contextlib.ExitStack() as stack:
        mapping = stack.enter_context(MappedShards(layout, owned))
        scale_mapping = stack.enter_context(MappedShards(scale_layout, owned)) if block_scaled else None
        for each in (mapping, scale_mapping):
            if each is not None:
                _break_map(each, each.layout, 2, 3, 4)
        common = {"storage": layout.dtype, "scale": None, "scale_mapping": scale_mapping}
        paths = {
            "C": HostGather(lib, mapping, torch.device("cpu"), threads=3, **common),
            "sync": SyncGather(mapping, torch.device("cpu"), chunk=700, why="the test", **common),
        }
        stack.callback(lambda: [path.close() for path in paths.values()])
        outs, counts = {}, {}
        for name, path in paths.items():
            if block_scaled:
                packed = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
                scales = poison(torch.empty((ids.numel(), scale_layout.row_bytes), dtype=torch.uint8))
                path.gather_packed(ids, packed, scales)
                outs[name] = [packed, scales]
            else:
                raw = poison(torch.empty((ids.numel(), layout.row_dim), dtype=layout.dtype))
                decoded = poison(torch.empty((ids.numel(), layout.row_dim), dtype=torch.float32))
                path.gather(ids, raw)
                path.gather(ids, decoded)
                outs[name] = [raw.view(torch.uint8), decoded]
            read = path.read_counts()
            counts[name] = (read["rows"], read["out_of_range"], read["broken"])
        for c_out, sync_out in zip(outs["C"], outs["sync"], strict=True):
            assert torch.equal(c_out.view(torch.uint8), sync_out.view(torch.uint8))
        outside = int(((ids < 0) | (ids >= layout.num_rows)).sum())
        lookups = 1 if block_scaled else 2
        per_id = 2 if block_scaled else 1  # an NVFP4 id's row and its block scales, each counted
        assert (
            counts["sync"]
            == counts["C"]
            == (
                lookups * ids.numel(),
                lookups * outside,
                lookups * per_id * int(lost.sum()),
            )
        )
        kept = ids_np[~lost.numpy()]
        rows = outs["C"][0]
        assert not rows[lost].any() and np.array_equal(
            rows[~lost].numpy(), reference_rows(layout, kept, owned)
        )
        if block_scaled:
            scales = outs["C"][1]
            assert not scales[lost].any()
            assert np.array_equal(scales[~lost].numpy(), reference_rows(scale_layout, kept, owned))
        else:  # the decoded rows: float32 of the raw ones, zeros where they are lost
            assert torch.equal(outs["C"][1], rows.view(layout.dtype).float())
