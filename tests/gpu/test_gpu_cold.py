"""Rows not in memory on a real GPU: the cpu mode's host path with its row cache and its reader of
misses (io_uring and reader threads, O_DIRECT), run as the dispatcher's eager lookups, as host
nodes, and in CUDA graphs replayed with new ids, every page of the table dropped before each call;
small caches (evictions between replays), NVFP4, two streams at once. Every output poisoned first
and compared with the rows read from the files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.reference import bits_differ, reference_nvfp4, reference_rows

import ple_um
from ple_um.lookup.host.gather import HostGather
from ple_um.residency import evict_pages

READERS = ["uring", "threads"]


def drop_pages(table) -> None:
    """Every page of the table out of this process and the page cache."""
    for mapping in (table.mapping, table.scale_mapping):
        if mapping is not None:
            evict_pages(mapping.layout.files, mapping.regions)


def want(layout, ids_np: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if layout.is_nvfp4:
        return reference_nvfp4(layout, ids_np, out_dtype=dtype)
    raw = torch.from_numpy(reference_rows(layout, ids_np)).view(layout.dtype)
    if dtype == layout.dtype:
        return raw
    value = raw.float() * (layout.scale if layout.scale is not None else 1.0)
    return value.to(dtype)


def same(got: torch.Tensor, expect: torch.Tensor) -> bool:
    return bits_differ(got.cpu(), expect, raw=not got.is_floating_point() or got.element_size() == 1) is None


@pytest.fixture
def cold_table(monkeypatch, device):
    def open_(layout, reads: str, cache: str, dispatcher: bool = True):
        monkeypatch.setenv("PLE_UM_FILE_READS", reads)
        monkeypatch.setenv("PLE_UM_ROW_CACHE", cache)
        monkeypatch.setenv("PLE_UM_DISPATCHER", "1" if dispatcher else "0")
        table = ple_um.open_table(layout.directory, mode="cpu", device=device)
        host = table.paths.host
        assert isinstance(host, HostGather) and host.rows.reader is not None, table.row_reads
        assert table.capture_safe and host.dispatcher == dispatcher, table.row_reads
        return table

    return open_


@pytest.mark.parametrize("reads", READERS)
@pytest.mark.parametrize("dispatcher", [True, False], ids=["dispatcher", "host-nodes"])
@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_eager_cold_lookups_equal_the_files(
    tables, name, reads, dispatcher, cold_table, ids_for, rng, device
):
    layout = tables[name]
    dtype = torch.bfloat16 if layout.is_nvfp4 else layout.dtype
    with cold_table(layout, reads, "4MiB", dispatcher) as table:
        for n in (16, 1000, 40_000):  # 40 000: chunked
            for _ in range(2):  # the second time part of it from the cache
                drop_pages(table)
                ids_np = ids_for(layout, n, rng)
                out = torch.empty((n, layout.row_dim), dtype=dtype, device=device)
                out.view(torch.uint8).fill_(0xAB)
                table.lookup(torch.from_numpy(ids_np).to(device), out=out)
                assert same(out, want(layout, ids_np, dtype)), (n, reads)
        stats = table.stats()
        assert stats["broken_rows"] == 0 and stats["file_reads"] > 0


@pytest.mark.parametrize("reads", READERS)
@pytest.mark.parametrize("cache", ["256KiB", "64MiB"], ids=["evicting", "holding"])
def test_graphs_replay_cold_with_new_ids(tables, reads, cache, cold_table, ids_for, rng, device):
    """A captured lookup's host node reads its misses and fills the cache at every replay; the
    number of hits changes each time, nothing on the host needs it."""
    layout = tables["fp8"]
    with cold_table(layout, reads, cache) as table:
        for n in (1024, 40_000):
            ids = torch.zeros(n, dtype=torch.int64, device=device)
            out = torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device=device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                table.lookup(ids, out=out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                table.lookup(ids, out=out)
            hot = ids_for(layout, n // 2, rng)
            for k in range(4):
                ids_np = rng.permutation(np.concatenate([hot, ids_for(layout, n - n // 2, rng)]))
                ids.copy_(torch.from_numpy(ids_np))
                out.view(torch.uint8).fill_(0xAB)
                if k % 2 == 0:
                    drop_pages(table)
                graph.replay()
                torch.cuda.synchronize()
                assert same(out, want(layout, ids_np, torch.bfloat16)), (n, k)
        cached = table.stats()["row_cache"]
        assert cached["hits"] > 0
        if cache == "256KiB":
            assert cached["evictions"] > 0
        else:  # room for every row: only a set that happens to fill evicts (a few)
            assert cached["evictions"] < cached["rows"] // 100


def test_two_streams_share_one_cache(tables, cold_table, ids_for, rng, device):
    layout = tables["bf16"]
    with cold_table(layout, "uring", "1MiB") as table:
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        outs, expects = [], []
        drop_pages(table)
        for _ in range(6):
            for stream in streams:
                ids_np = ids_for(layout, 3000, rng)
                with torch.cuda.stream(stream):
                    out = torch.empty((3000, layout.row_dim), dtype=layout.dtype, device=device)
                    out.view(torch.uint8).fill_(0xAB)
                    table.lookup(torch.from_numpy(ids_np).to(device), out=out)
                outs.append(out)
                expects.append(want(layout, ids_np, layout.dtype))
        torch.cuda.synchronize()
        for k, (got, expect) in enumerate(zip(outs, expects, strict=True)):
            assert same(got, expect), k


def test_host_nodes_read_their_misses_on_the_drivers_thread(tables, cold_table, rng, device):
    """Host nodes run on CUDA's callback thread: its reads (its own io_uring ring) are exact and
    counted, every missing row read once."""
    layout = tables["f16"]
    with cold_table(layout, "uring", "1MiB", dispatcher=False) as table:
        drop_pages(table)
        ids_np = rng.integers(0, layout.num_rows, 5000)
        got = table.lookup(torch.from_numpy(ids_np).to(device))
        assert same(got, want(layout, ids_np, layout.dtype))
        assert table.stats()["file_reads"] >= len(np.unique(ids_np))
