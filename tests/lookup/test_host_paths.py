"""The cpu access mode end to end through open_table on device cpu, both host paths: the C row copy
(``host.gather.HostGather``, called directly where there is no CUDA) and the synchronous fallback
(``sync_gather.SyncGather``, PLE_UM_ROWCOPY=0). The same bytes as the reference reader for
duplicated, masked and out-of-table ids, dequantized or raw, on the C copy's inline path and its
thread pool's, and in one chunk or many of the synchronous path; NVFP4 and MXFP8 rows and block
scales through both.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers.mxfp8 import reference_mxfp8
from helpers.reference import reference_nvfp4, reference_rows

import ple_um
from ple_um.lookup.host.gather import HostGather
from ple_um.lookup.sync_gather import SyncGather
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
