"""Rows not in memory: the reader of misses (``native/reader.c``, ``host/file_reads.py``) and the row
cache (``native/rowcache.c``, ``host/row_cache.py``), driven through ctypes as a host node runs them
and through open_table, on real files: every row against the reference reader on fresh random data,
poisoned outputs, shard edges, ids outside the owned range and the table, NVFP4, concurrent lookups
with evictions, a cache smaller than one lookup, a file truncated under the reader, a filesystem
without O_DIRECT, the publishing order of a cache slot, a slot's tag, the bytes a cache takes per
row, and cached rows served with no page of the files read.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import sparse_table
from helpers.reference import drop_page_cache, reference_rows
from helpers.rowcopy_jobs import boundary_ids, make_job, open_library

import ple_um
from ple_um import envs, residency
from ple_um.access import memory
from ple_um.errors import KnobError
from ple_um.lookup import native_build, rowcopy
from ple_um.lookup.host import misses, row_cache
from ple_um.lookup.host.file_reads import FileReader, choose_strategy
from ple_um.lookup.host.misses import plan
from ple_um.lookup.host.row_cache import SLOT_OVERHEAD, WAYS, RowCache, slots_for
from ple_um.mapping import PAGE, MappedShards, _libc
from ple_um.residency import evict_file_pages, evict_pages

STRATEGIES = ["uring", "threads"]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib, why = rowcopy.load(str(tmp_path_factory.mktemp("cache")))
    assert lib is not None, why
    return lib


@pytest.fixture(scope="module")
def publish_first_lib(tmp_path_factory):
    """The row copy built as a wrong cache (``-DPLE_TEST_PUBLISH_FIRST``: a slot's tag published
    before its bytes), which only this test builds: the shipped library has no such switch, and the
    define is in the build's digest, so that the check a shipped library passes refuses it."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the wrong cache with")
    out = str(tmp_path_factory.mktemp("publish-first") / "rowcopy-publish-first.so")
    defines = ("-DPLE_TEST_PUBLISH_FIRST",)
    command = native_build.command(cc, out, werror=False, extra=defines)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lib, why = open_library(out)
    assert lib is None and "built from other source" in why, why
    lib, why = open_library(out, defines=defines)
    assert lib is not None, why
    return lib


def run(lib, tables, ids, dsts, counts, **kw):
    job = make_job(tables, ids, dsts, counts, **kw)
    lib.ple_lookup_run(ctypes.addressof(job))
    assert job.busy == 0
    return counts.read()


def evict(mapping: MappedShards, layout) -> None:
    """Every page of the table out of this process and the page cache (``evict_pages``)."""
    evict_pages(layout.files, mapping.regions)


def resident_pages(mapping: MappedShards) -> int:
    return sum(int(residency.resident_pages(r).sum()) for r in mapping.regions)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_every_missing_row_read_from_the_files_is_exact(lib, make_checkpoint, rng, poison, strategy, direct):
    layout = make_checkpoint(
        num_rows=3001, row_dim=40, dtype="fp8", shards=7, files=3, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    owned = (S - 5, 5 * S + 3)
    with MappedShards(layout, owned) as mapping:
        reader = FileReader(mapping, strategy=strategy, direct=direct, depth=16)
        try:
            assert reader.direct == direct  # this machine's files take O_DIRECT
            rows, counts = rowcopy.Rows(mapping, reader=reader), rowcopy.Counts()
            for threads, inline in ((1, 2048), (rowcopy.Pool(lib, 3).threads, 0)):
                evict(mapping, layout)
                ids_np = rng.permutation(np.unique(boundary_ids(layout, rng, 2500, owned)))  # each id once
                ids = torch.from_numpy(ids_np)
                out = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
                before = counts.read()["file_reads"]
                got = run(lib, [rows], ids, [out], counts, threads=threads, inline_rows=inline)
                assert np.array_equal(out.numpy(), reference_rows(layout, ids_np, owned))
                in_owned = int(((ids_np >= owned[0]) & (ids_np < owned[1])).sum())
                assert got["file_reads"] - before == in_owned  # no cache: every owned row is read
                assert got["broken"] == 0
            # An id that comes again in a window is read once.
            evict(mapping, layout)
            ids = torch.from_numpy(np.repeat(rng.integers(owned[0], owned[1], 50), 6))
            out = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
            before = counts.read()["file_reads"]
            got = run(lib, [rows], ids, [out], counts)
            assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy()))
            assert got["file_reads"] - before == len(np.unique(ids.numpy()))
        finally:
            reader.close()


def test_a_forked_child_reads_through_a_ring_of_its_own(lib, make_checkpoint, rng):
    """The parent's reading thread has an io_uring ring; a child forked from it gets a ring of its
    own for its reads (sharing the parent's would mix their queues), and both read exact rows."""
    from helpers.rowcopy_jobs import in_forked_child

    layout = make_checkpoint(
        num_rows=2000, row_dim=32, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout) as mapping:
        reader = FileReader(mapping, strategy="uring", direct=True, depth=16)
        try:
            rows = rowcopy.Rows(mapping, reader=reader)
            ids = torch.from_numpy(rng.integers(0, 2000, 500))
            expect = reference_rows(layout, ids.numpy())

            def look() -> bool:
                evict(mapping, layout)
                out = torch.full((500, layout.row_bytes), 0xAB, dtype=torch.uint8)
                counts = rowcopy.Counts()
                got = run(lib, [rows], ids, [out], counts)
                return np.array_equal(out.numpy(), expect) and got["file_reads"] > 0

            assert look()  # the parent's ring is made
            assert in_forked_child(look) == 0
            assert look()  # and still works after the child's
        finally:
            reader.close()


def test_files_that_refuse_o_direct_get_plain_reads(lib, make_checkpoint, rng, monkeypatch):
    """Where a file does not read back through O_DIRECT (a filesystem without it; injected here by
    the reader's own probe answering so for every file but the first), every file of the table is
    read through the page cache, and the rows are the same. The reader keeps one descriptor a
    file, the one it reads through: none of those it opened to try O_DIRECT stays open."""
    from ple_um.lookup.host import file_reads

    layout = make_checkpoint(
        num_rows=500, row_dim=24, dtype="bf16", shards=3, files=2, seed=int(rng.integers(1 << 30))
    )
    probed = []

    def refused_but_the_first(fd: int, size: int) -> int | None:
        probed.append(fd)
        return 4096 if len(probed) == 1 else None

    monkeypatch.setattr(file_reads, "_direct_alignment", refused_but_the_first)
    with MappedShards(layout) as mapping:
        fds = len(os.listdir("/proc/self/fd"))
        reader = FileReader(mapping, strategy="uring", direct=True, depth=8)
        try:
            assert not reader.direct and reader.align == 0
            flags = {fd: _flags(fd) for fd in set(reader.fds.tolist()) if fd >= 0}
            assert flags and not any(f & os.O_DIRECT for f in flags.values())
            assert len(flags) == len(layout.files) == len(os.listdir("/proc/self/fd")) - fds
            ids = torch.from_numpy(rng.integers(-3, 503, 700))
            out = torch.full((700, layout.row_bytes), 0xAB, dtype=torch.uint8)
            run(lib, [rowcopy.Rows(mapping, reader=reader)], ids, [out], rowcopy.Counts())
            assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy()))
        finally:
            reader.close()


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_file_truncated_under_the_reader_gives_counted_zero_rows(lib, make_checkpoint, rng, strategy):
    """A read past the end of a truncated file returns fewer bytes: a zero row, counted as broken
    and never cached (through the mapping the same read would kill the process with SIGBUS)."""
    layout = make_checkpoint(
        num_rows=2000, row_dim=64, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )
    victim = layout.files[-1]
    with MappedShards(layout) as mapping:
        reader = FileReader(mapping, strategy=strategy, direct=True, depth=8)
        counts = rowcopy.Counts()
        cache = RowCache(slots_for(1 << 20, layout.row_bytes), layout.row_bytes, counts, policy="lru")
        try:
            rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
            lost_from = next(s for s in layout.shards if s.path == victim)
            os.truncate(victim, lost_from.offset)  # every row of the last file's shards gone
            evict(mapping, layout)
            ids = torch.from_numpy(rng.integers(0, layout.num_rows, 800))
            lost = np.isin(
                ids.numpy() // layout.rows_per_shard, [s.index for s in layout.shards if s.path == victim]
            )
            out = torch.full((800, layout.row_bytes), 0xAB, dtype=torch.uint8)
            got = run(lib, [rows], ids, [out], counts)
            assert lost.any() and got["broken"] == int(lost.sum())
            assert not out[torch.from_numpy(lost)].any()
            kept = ~lost
            assert np.array_equal(out.numpy()[kept], reference_rows(layout, ids.numpy()[kept]))
            # The zero rows were not cached: the same ids again are misses, zeros again.
            hits = counts.read()["cache_hits"]
            again = torch.full((800, layout.row_bytes), 0xAB, dtype=torch.uint8)
            run(lib, [rows], ids, [again], counts)
            assert (
                counts.read()["cache_hits"] - hits == int(kept.sum())
                and not again[torch.from_numpy(lost)].any()
            )
        finally:
            cache.close()
            reader.close()


@pytest.mark.parametrize("policy", ["tinylfu", "lru", "clock"])
def test_a_cache_smaller_than_one_lookup_stays_exact(lib, make_checkpoint, rng, poison, policy):
    layout = make_checkpoint(
        num_rows=5000, row_dim=32, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30))
    )
    owned = (100, 4900)
    with MappedShards(layout, owned) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(2 * WAYS, layout.row_bytes, counts, policy=policy)  # two sets
        reader = FileReader(mapping, strategy="uring", direct=True, depth=32)
        try:
            rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
            hot = rng.integers(owned[0], owned[1], 4)
            looked_up = 0
            for _ in range(6):
                ids_np = np.concatenate([boundary_ids(layout, rng, 1500, owned), np.repeat(hot, 50)])
                ids = torch.from_numpy(rng.permutation(ids_np))
                out = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
                run(lib, [rows], ids, [out], counts)
                assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy(), owned))
                looked_up += int(((ids_np >= owned[0]) & (ids_np < owned[1])).sum())
            stats = cache.stats()
            assert stats["hits"] > 0 and stats["evictions"] > 0 and 0 < stats["rows"] <= 2 * WAYS
            assert stats["hits"] + stats["misses"] == looked_up  # owned ids only
        finally:
            cache.close()
            reader.close()


def test_every_place_of_a_held_row_is_a_hit_and_reads_nothing(lib, make_checkpoint, rng, poison):
    """Rows the cache holds, each asked for several times in one window among ids outside the owned
    range: every place is a hit of its own (the policy sees each), none is read from the files, and
    every row is exact; a window's new rows that come again are one miss a place and one read."""
    layout = make_checkpoint(
        num_rows=6000, row_dim=160, dtype="fp8", shards=6, seed=int(rng.integers(1 << 30))
    )
    owned = (500, 5500)
    with MappedShards(layout, owned) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(slots_for(4 << 20, layout.row_bytes), layout.row_bytes, counts)
        reader = FileReader(mapping, strategy="uring", direct=True, depth=16)
        try:
            rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
            held = rng.choice(np.arange(*owned), 300, replace=False)
            run(
                lib,
                [rows],
                torch.from_numpy(held),
                [torch.empty((300, layout.row_bytes), dtype=torch.uint8)],
                counts,
            )
            assert cache.stats()["rows"] == 300  # a cache with room keeps every row it read
            evict(mapping, layout)
            fresh = rng.choice(np.setdiff1d(np.arange(*owned), held), 20, replace=False)
            outside = np.array([-3, 0, owned[1], layout.num_rows + 9])
            ids_np = rng.permutation(np.concatenate([np.repeat(held[:100], 4), np.repeat(fresh, 3), outside]))
            before = counts.read()
            out = poison(torch.empty((ids_np.size, layout.row_bytes), dtype=torch.uint8))
            got = run(lib, [rows], torch.from_numpy(ids_np), [out], counts)
            assert np.array_equal(out.numpy(), reference_rows(layout, ids_np, owned))
            assert got["cache_hits"] - before["cache_hits"] == 400
            assert got["cache_misses"] - before["cache_misses"] == 60
            assert got["file_reads"] - before["file_reads"] == 20
        finally:
            cache.close()
            reader.close()


def test_concurrent_lookups_with_evictions_get_their_rows(lib, make_checkpoint, rng):
    """Eight threads, a cache of one set (every insertion evicts a row another thread may be
    copying): every row of every lookup is exact."""
    layout = make_checkpoint(
        num_rows=4000, row_dim=48, dtype="bf16", shards=6, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(WAYS, layout.row_bytes, counts, policy="lru")
        reader = FileReader(mapping, strategy="uring", direct=True, depth=16)
        rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
        expect_all = reference_rows(layout, np.arange(layout.num_rows))
        bad: list[str] = []
        seeds = rng.integers(1 << 30, size=8)

        def work(seed):
            local = np.random.default_rng(seed)
            for _ in range(40):
                ids_np = local.choice(np.arange(WAYS + WAYS // 2), 300)  # more ids than slots: evictions
                out = torch.full((300, layout.row_bytes), 0xAB, dtype=torch.uint8)
                job = make_job([rows], torch.from_numpy(ids_np), [out], counts)
                lib.ple_lookup_run(ctypes.addressof(job))
                if not np.array_equal(out.numpy(), expect_all[ids_np]):
                    bad.append(f"seed {seed}")

        try:
            threads = [threading.Thread(target=work, args=(int(s),)) for s in seeds]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert bad == [] and cache.stats()["evictions"] > 0
        finally:
            cache.close()
            reader.close()


def test_block_scales_follow_their_rows_under_evictions(lib, make_checkpoint, rng):
    """An NVFP4 table's block scales in a follower cache of one set (the rows' tags and policy):
    eight threads whose ids outnumber the slots (every insertion evicts a row, and with it the
    scales written for it) each get every packed row and every block scale exact, and the scales
    are served from the cache (the test fails when a follower's slot is taken before its scales
    are written for the id the rows' slot holds)."""
    layout = make_checkpoint(
        num_rows=3000, row_dim=64, dtype="nvfp4", shards=4, seed=int(rng.integers(1 << 30))
    )
    scale_layout = layout.scale_layout()
    with MappedShards(layout) as mapping, MappedShards(scale_layout) as scale_mapping:
        counts, scale_counts = rowcopy.Counts(), rowcopy.Counts()
        cache = RowCache(WAYS, layout.row_bytes, counts, policy="lru")
        scale_cache = RowCache(WAYS, scale_layout.row_bytes, scale_counts, policy="lru", follows=cache)
        readers = [FileReader(m, strategy="threads", direct=False, depth=8) for m in (mapping, scale_mapping)]
        tables = [
            rowcopy.Rows(mapping, cache=cache, reader=readers[0]),
            rowcopy.Rows(scale_mapping, cache=scale_cache, reader=readers[1]),
        ]
        expect = reference_rows(layout, np.arange(layout.num_rows))
        expect_scales = reference_rows(scale_layout, np.arange(layout.num_rows))
        bad: list[str] = []

        def work(seed):
            local = np.random.default_rng(seed)
            for _ in range(40):
                ids_np = local.choice(np.arange(WAYS + WAYS // 2), 300)  # more ids than slots: evictions
                out = torch.full((300, layout.row_bytes), 0xAB, dtype=torch.uint8)
                scales = torch.full((300, scale_layout.row_bytes), 0xAB, dtype=torch.uint8)
                job = make_job(tables, torch.from_numpy(ids_np), [out, scales], counts)
                lib.ple_lookup_run(ctypes.addressof(job))
                if not np.array_equal(out.numpy(), expect[ids_np]):
                    bad.append(f"rows, seed {seed}")
                if not np.array_equal(scales.numpy(), expect_scales[ids_np]):
                    bad.append(f"block scales, seed {seed}")

        try:
            threads = [threading.Thread(target=work, args=(int(s),)) for s in rng.integers(1 << 30, size=8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert bad == [] and cache.stats()["evictions"] > 0
            assert scale_counts.read()["cache_hits"] > 0
        finally:
            scale_cache.close()
            cache.close()
            for reader in readers:
                reader.close()


def _race(lib, layout, mapping, seconds: float) -> int:
    """Readers and one writer on a cache of one set, through ``lib`` (the shipped build or the wrong
    cache's), until a row comes back wrong or ``seconds`` pass: how many rows came back wrong."""
    counts = rowcopy.Counts()
    cache = RowCache(WAYS, layout.row_bytes, counts, policy="lru")
    reader = FileReader(mapping, strategy="threads", direct=False, depth=4, lib=lib)
    rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
    expect_all = reference_rows(layout, np.arange(layout.num_rows))
    wrong = [0]
    stop = time.monotonic() + seconds

    def look(seed):
        local = np.random.default_rng(seed)
        while time.monotonic() < stop and not wrong[0]:
            ids_np = local.integers(0, 2 * WAYS, 64)
            out = torch.full((64, layout.row_bytes), 0xAB, dtype=torch.uint8)
            job = make_job([rows], torch.from_numpy(ids_np), [out], counts)  # held while it runs
            lib.ple_lookup_run(ctypes.addressof(job))
            wrong[0] += int((out.numpy() != expect_all[ids_np]).any(axis=1).sum())

    try:
        threads = [threading.Thread(target=look, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cache.close()
        reader.close()
    return wrong[0]


def test_a_row_is_in_place_before_anything_can_find_it(lib, publish_first_lib, make_checkpoint, rng):
    """The check can fail: a cache that publishes a slot's tag before its bytes (a build of the
    library for this test) hands out rows that are not theirs; the real order never does."""
    layout = make_checkpoint(num_rows=64, row_dim=256, dtype="fp8", shards=2, seed=int(rng.integers(1 << 30)))
    with MappedShards(layout) as mapping:
        assert _race(publish_first_lib, layout, mapping, seconds=30.0) > 0
        assert _race(lib, layout, mapping, seconds=3.0) == 0


def test_cached_rows_are_served_with_no_page_of_the_files_read(make_checkpoint, rng, monkeypatch):
    """A row copy whose set is locked by another thread's insert drops its row (the cache is only
    a cache), so the lookup after the first may still miss a few of its rows; once one is all hits,
    serving the same ids reads nothing from the files. The table is large enough that the 8 MiB
    cache is not capped at it: capped, it has about seven times as many slots as the lookup has rows,
    and a set that more of them hash to than it has ways keeps one missing for good (equally hot
    rows do not evict each other)."""
    layout = make_checkpoint(
        num_rows=200_000, row_dim=160, dtype="fp8", shards=8, files=2, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "8MiB")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 3000))
        expect = reference_rows(layout, ids.numpy())  # read now: the reference's reads would count
        missed = []
        while not missed or missed[-1]:
            first = table.stats()["row_cache"]
            assert np.array_equal(table.lookup(ids).view(torch.uint8).numpy(), expect)
            missed.append(table.stats()["row_cache"]["misses"] - first["misses"])
            assert len(missed) <= 4, f"misses per lookup of the same ids: {missed}"
        assert len(missed) >= 2 and all(m <= 30 for m in missed[1:]), missed  # dropped: 1 % at most
        evict(table.mapping, layout)
        first, before_io = table.stats()["row_cache"], _read_bytes()
        got = table.lookup(ids).view(torch.uint8).numpy()
        stats, after_io = table.stats()["row_cache"], _read_bytes()
        assert resident_pages(table.mapping) == 0  # no page of the files came in
        assert after_io == before_io  # nothing read from the storage
        assert np.array_equal(got, expect)
        assert (stats["hits"] - first["hits"], stats["misses"] - first["misses"]) == (3000, 0)


def test_the_rows_held_survive_a_reset_of_the_counters(make_checkpoint, rng, monkeypatch):
    """The open zeroes the counters after its checks; the rows the cache holds stay counted, and the
    next lookup of them is all hits. One thread reads the rows: with several, a row whose set
    another thread's insert holds is dropped, and the rows held would not be known. The table is
    large enough that the cache is not capped at it (a capped cache's sets can fill: above)."""
    layout = make_checkpoint(
        num_rows=50_000, row_dim=64, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "4MiB")
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "1")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 800))
        opened = table.stats()["row_cache"]["rows"]  # the rows the open's checks read
        table.lookup(ids)
        held = table.stats()["row_cache"]["rows"]
        assert len(np.unique(ids.numpy())) <= held <= opened + len(np.unique(ids.numpy()))
        table.paths.reset_counts()
        after = table.stats()["row_cache"]
        assert (after["rows"], after["hits"], after["misses"], after["evictions"]) == (held, 0, 0, 0)
        got = table.lookup(ids).view(torch.uint8).numpy()
        assert np.array_equal(got, reference_rows(layout, ids.numpy()))
        stats = table.stats()["row_cache"]
        assert (stats["rows"], stats["hits"], stats["misses"]) == (held, 800, 0)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def test_the_table_caches_only_its_own_rows_and_never_ids_outside_it(
    make_checkpoint, rng, monkeypatch, check_rows
):
    layout = make_checkpoint(
        num_rows=3000, row_dim=32, dtype="fp8", shards=6, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1MiB")
    owned = (700, 2100)  # a tensor-parallel rank's rows
    with ple_um.open_table(layout.directory, rows=owned, mode="cpu", device="cpu") as table:
        opened = table.stats()["row_cache"]["rows"]  # the rows the open's checks read
        ids = torch.from_numpy(np.concatenate([rng.integers(-50, 3050, 4000), [-1, 3000, 1 << 40]]))
        for _ in range(2):
            check_rows(table.lookup(ids), layout, ids, rows=owned)
        stats = table.stats()
        inside = (ids >= owned[0]) & (ids < owned[1])
        cache = stats["row_cache"]
        assert cache["hits"] + cache["misses"] == 2 * int(inside.sum())  # only owned ids are looked up
        assert cache["rows"] <= opened + len(np.unique(ids[inside].numpy()))
        assert stats["out_of_range"] == 2 * int(((ids < 0) | (ids >= 3000)).sum())


def test_nvfp4_rows_and_block_scales_through_the_cache(make_checkpoint, rng, monkeypatch, assert_same_bits):
    from helpers.reference import reference_nvfp4

    layout = make_checkpoint(
        num_rows=2000, row_dim=64, dtype="nvfp4", shards=4, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "256KiB")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert table.stats()["row_cache"] is not None
        for _ in range(3):
            ids = torch.from_numpy(rng.integers(-5, 2005, 900))
            packed, scales = table.lookup_packed(ids)
            assert np.array_equal(packed.numpy(), reference_rows(layout, ids.numpy()))
            assert np.array_equal(
                scales.view(torch.uint8).numpy(), reference_rows(layout.scale_layout(), ids.numpy())
            )
            got = table.lookup(ids, out_dtype=torch.float32)
            assert_same_bits(got, reference_nvfp4(layout, ids.numpy(), out_dtype=torch.float32), raw=False)
        assert table.stats()["row_cache"]["hits"] > 0


def _cache_calls(lib):
    lib.ple_cache_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_uint64,
        ctypes.c_uint32,
        ctypes.c_void_p,
    ]
    lib.ple_cache_get.restype = ctypes.c_int
    lib.ple_cache_put.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.ple_cache_put.restype = None
    return lib.ple_cache_get, lib.ple_cache_put


def _cache_hash(id_: int) -> int:
    """rowcopy.h's ple_cache_hash: splitmix64's finalizer."""
    m = (1 << 64) - 1
    x = id_ & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_a_slot_s_tag_is_its_whole_id(lib, make_checkpoint, rng, poison):
    """A set's tags are 32 bits: a full set of 16 rows is served exactly, as hits, with nothing read
    from the files; an id that agrees with a held one in its low 32 bits (as a tag cut to 32 bits
    would) is not served that row, and ids no tag can hold (negative, 2^32 - 1 and past) are never
    put (their rows are read each time)."""
    layout = make_checkpoint(
        num_rows=40000, row_dim=160, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    held = rng.choice(layout.num_rows, WAYS, replace=False)
    with MappedShards(layout) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(WAYS, layout.row_bytes, counts, policy="lru")  # one set: every id maps to it
        reader = FileReader(mapping, strategy="uring", direct=True, depth=16)
        try:
            rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
            run(
                lib,
                [rows],
                torch.from_numpy(held),
                [torch.empty((WAYS, layout.row_bytes), dtype=torch.uint8)],
                counts,
            )
            tags = np.ctypeslib.as_array((ctypes.c_uint32 * WAYS).from_address(cache.struct.tags))
            assert tags.tolist() == (held + 1).tolist()  # way k took held[k]: the empty ways fill in order
            evict(mapping, layout)
            ids_np = rng.permutation(np.repeat(held, 4))
            out = poison(torch.empty((ids_np.size, layout.row_bytes), dtype=torch.uint8))
            before = counts.read()
            got = run(lib, [rows], torch.from_numpy(ids_np), [out], counts)
            assert np.array_equal(out.numpy(), reference_rows(layout, ids_np))
            assert got["cache_hits"] - before["cache_hits"] == ids_np.size
            assert got["file_reads"] == before["file_reads"]
            get, put = _cache_calls(lib)
            dst = poison(torch.empty(layout.row_bytes, dtype=torch.uint8))
            for id_ in held.tolist():
                assert get(cache.address, id_, _cache_hash(id_), (1 << WAYS) - 1, dst.data_ptr()) == 1
                alias = id_ + (1 << 32)
                assert get(cache.address, alias, _cache_hash(alias), (1 << WAYS) - 1, dst.data_ptr()) == 0
            inserts = counts.read()["cache_inserts"]
            row = torch.zeros(layout.row_bytes, dtype=torch.uint8)
            for id_ in (-1, -(1 << 40), (1 << 32) - 1, (1 << 32) + 7, (1 << 62)):
                put(cache.address, id_, row.data_ptr())
            assert counts.read()["cache_inserts"] == inserts and tags.tolist() == (held + 1).tolist()
        finally:
            cache.close()
            reader.close()


def test_a_plan_sizes_an_nvfp4_tables_two_caches_together(lib, make_checkpoint, monkeypatch):
    """The plan's slots are those of the rows' cache and the block scales' follower together, and
    what the row sources build: a size that holds one set of rows alone but not with their block
    scales is no row cache, said so in the plan."""
    monkeypatch.setenv("PLE_UM_FILE_READS", "threads")  # misses read, even from a resident table
    layout = make_checkpoint(num_rows=5000, row_dim=160, dtype="nvfp4", shards=4)
    scales = layout.scale_layout()
    one_set = row_cache.nbytes_for(WAYS, layout.row_bytes)
    assert slots_for(one_set, layout.row_bytes) == WAYS  # the rows alone would have a cache
    assert slots_for(one_set, layout.row_bytes, block_scales=scales.row_bytes) == 0
    with MappedShards(layout) as mapping, MappedShards(scales) as scale_mapping:
        for size, cached in ((1 << 20, True), (one_set, False)):
            monkeypatch.setenv("PLE_UM_ROW_CACHE", str(size))
            planned = plan(lib, mapping, scale_mapping, spills=True)
            sources = misses.RowSources(mapping, scale_mapping, planned, rowcopy.Counts())
            try:
                caches = [sources.rows.cache, sources.block_scales.cache]
                if cached:
                    assert {c.slots for c in caches} == {planned.slots} and planned.slots > 0
                    assert sum(len(c._memory) for c in caches) <= planned.cache_bytes
                else:
                    assert caches == [None, None] and planned.slots == planned.cache_bytes == 0
                    assert "holds not one set of rows" in planned.why
            finally:
                sources.close()


@pytest.mark.parametrize("capacity", [1 << 20, 64 << 20])
def test_a_cache_takes_at_most_eight_bytes_beside_each_row(make_checkpoint, capacity):
    """Issue 43's bound, from the memory the caches really map (not from SLOT_OVERHEAD): the bytes
    a cache takes for each row it can hold are at most 1.05 x the row's bytes + 8, for 160-byte FP8
    rows and for the NVFP4 table of the same 160 values (80 bytes of rows and 10 of block scales in
    two caches of as many slots, the scales' following the rows' admission); the budget is kept."""
    fp8 = make_checkpoint(num_rows=5000, row_dim=160, dtype="fp8", shards=4)  # the plan sizes the cache
    nvfp4 = make_checkpoint(num_rows=5000, row_dim=160, dtype="nvfp4", shards=4)
    for layout in (fp8, nvfp4):
        scales = layout.scale_layout() if layout.is_nvfp4 else None
        plan = misses.MissPlan(
            cache_bytes=capacity,
            slots=slots_for(capacity, layout.row_bytes, block_scales=scales.row_bytes if scales else 0),
            policy="tinylfu",
            strategy="mmap",
            direct=False,
            depth=1,
            resident_check=False,
            why="a test's",
        )
        with (
            MappedShards(layout) as mapping,
            MappedShards(scales) if scales else contextlib.nullcontext() as scale_mapping,
        ):
            sources = misses.RowSources(mapping, scale_mapping, plan, rowcopy.Counts())
            try:
                caches = [sources.rows.cache] + ([sources.block_scales.cache] if scales else [])
                mapped = sum(len(c._memory) for c in caches)  # the anonymous mappings themselves
                held = min(c.slots for c in caches)
                row_bytes = layout.row_bytes + (scales.row_bytes if scales else 0)
                assert {c.slots for c in caches} == {held} and held > 0.9 * capacity / (row_bytes + 16)
                assert mapped <= capacity and sources.stats()["bytes"] == mapped
                assert mapped / held <= 1.05 * row_bytes + 8, (layout.dtype_name, mapped / held)
            finally:
                sources.close()


def test_one_off_rows_do_not_flush_hot_ones_under_tinylfu(lib, make_checkpoint, rng):
    """Rounds of the same 200 hot rows among 1 000 rows seen once each, into a cache of 512: TinyLFU
    keeps the hot rows (wanted more often than any one-off), LRU lets the one-offs flush them
    before they come again."""
    layout = make_checkpoint(
        num_rows=60000, row_dim=16, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    hit_rate = {}
    hot = rng.choice(layout.num_rows, 200, replace=False)
    cold = rng.permutation(np.setdiff1d(np.arange(layout.num_rows), hot))
    with MappedShards(layout) as mapping:
        reader = FileReader(mapping, strategy="uring", direct=False, depth=32)
        try:
            for policy in ("tinylfu", "lru"):
                counts = rowcopy.Counts()
                cache = RowCache(512, layout.row_bytes, counts, policy=policy)
                rows = rowcopy.Rows(mapping, cache=cache, reader=reader)
                for k in range(30):
                    ids = torch.from_numpy(
                        rng.permutation(np.concatenate([hot, cold[k * 1000 : (k + 1) * 1000]]))
                    )
                    before = counts.read()["cache_hits"]
                    run(lib, [rows], ids, [torch.empty((1200, layout.row_bytes), dtype=torch.uint8)], counts)
                hit_rate[policy] = (counts.read()["cache_hits"] - before) / len(hot)  # the last round
                cache.close()
        finally:
            reader.close()
    assert hit_rate["tinylfu"] >= 0.8 and hit_rate["lru"] <= 0.3, hit_rate


def test_the_page_touch_asks_for_the_missing_pages_at_once(lib, make_checkpoint, rng):
    layout = make_checkpoint(num_rows=4096, row_dim=256, dtype="fp8", shards=2, files=1)
    with MappedShards(layout) as mapping:
        reader = FileReader(mapping, strategy="uring", direct=False, depth=16)
        try:
            evict(mapping, layout)
            ids = torch.from_numpy(rng.choice(4096, 60, replace=False))
            run(lib, [rowcopy.Rows(mapping, reader=reader)], ids, [], rowcopy.Counts(), touch=True)
            region = mapping.regions[0]
            pages = residency.resident_pages(region)
            base = mapping.shard_base(0) - region.addr
            for i in ids.tolist():
                assert pages[(base + i * layout.row_bytes) // PAGE], i
        finally:
            reader.close()


def test_auto_keeps_a_row_cache_only_for_a_table_that_does_not_fit(lib, make_checkpoint, monkeypatch):
    """The fit decides the cache (``lookup.fit``), the residency only whether misses are read: a
    table that fits gets no cache, in the page cache or not; one that does not gets one."""
    layout = make_checkpoint(num_rows=10000, row_dim=160, dtype="fp8", shards=4)
    with MappedShards(layout) as mapping:
        mapping.populate()
        assert plan(lib, mapping, None, spills=False) is None  # resident, fits: rows copied as they are
        evict(mapping, layout)
        fits = plan(lib, mapping, None, spills=False)  # not resident, fits: no cache, misses read
        assert fits.cache_bytes == 0 and fits.resident_check and not fits.direct, fits
        assert "fit" in fits.why and fits.strategy in ("uring", "threads")
        cold = plan(lib, mapping, None, spills=True)
        assert cold is not None and cold.direct and cold.strategy in ("uring", "threads")
        assert "do not fit" in cold.why
        assert (
            0
            < cold.cache_bytes
            <= mapping.owned_bytes // layout.row_bytes * (layout.row_bytes + SLOT_OVERHEAD)
        )
        monkeypatch.setenv("PLE_UM_ROW_CACHE_FRACTION", "0.000000001")
        assert plan(lib, mapping, None, spills=True).cache_bytes == 0  # no room: no cache, misses read
        monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
        monkeypatch.setenv("PLE_UM_FILE_READS", "mmap")
        cold = plan(lib, mapping, None, spills=True)
        assert cold.cache_bytes == 0 and not cold.reads


def test_a_table_a_page_short_of_resident_is_copied_from_the_mapping(lib, make_checkpoint, monkeypatch):
    """One page the kernel reclaimed must not send a table that fits to the reader of misses (its
    rows are copied from the mapping, the page faulted back in); one mostly out of memory is read."""
    monkeypatch.delenv("PLE_UM_ROW_CACHE", raising=False)
    monkeypatch.delenv("PLE_UM_FILE_READS", raising=False)
    layout = make_checkpoint(num_rows=40000, row_dim=160, dtype="fp8", shards=4)
    with MappedShards(layout) as mapping:
        mapping.populate()
        first = mapping.regions[0]  # then one page out of this process and the page cache
        assert first.length > 2 * PAGE and first.file_offset % PAGE == 0
        assert _libc.madvise(first.addr + PAGE, PAGE, mmap.MADV_DONTNEED) == 0
        evict_file_pages(first.path, first.file_offset + PAGE, PAGE)
        resident = sum(r for _, r, _ in mapping.residency())
        mapped = sum(m for _, _, m in mapping.residency())
        if resident == mapped:
            pytest.skip("the page was not dropped (a file system whose files are their page cache)")
        assert mapped - resident <= PAGE * 2 and resident < mapped
        assert mapping.resident() and not mapping.resident(slack=0)
        assert plan(lib, mapping, None, spills=False) is None  # served as resident: from the mapping
        evict(mapping, layout)
        assert not mapping.resident()
        cold_plan = plan(lib, mapping, None, spills=False)
        assert cold_plan is not None and cold_plan.reads and cold_plan.cache_bytes == 0


def test_a_row_over_two_pages_with_a_page_out_is_read_not_faulted(lib, make_checkpoint, rng):
    """Without a row cache, a miss whose pages are all resident is copied from the mapping and the
    others are read: a row of 8 KiB at an unaligned offset lies on three pages, and one whose last
    page alone is out is read from the file (one read counted), exact, not faulted in."""
    layout = make_checkpoint(
        num_rows=64, row_dim=4096, dtype="bf16", shards=1, seed=int(rng.integers(1 << 30))
    )
    rb = layout.row_bytes
    with MappedShards(layout) as mapping:
        r = int(rng.integers(1, 63))
        at = mapping.shard_base(0) + r * rb
        first, last = at // PAGE, (at + rb - 1) // PAGE
        if last - first != 2:
            pytest.skip("the rows start on a page boundary here: none lies on three pages")
        evict(mapping, layout)
        mapping.advise("random")  # a fault reads its page alone: the row's first two pages in, not the last
        for page in (first, first + 1):
            ctypes.c_uint8.from_address(page * PAGE).value  # noqa: B018 - the read faults the page in
        vec = np.zeros(3, dtype=np.uint8)
        assert _libc.mincore(first * PAGE, 3 * PAGE, vec.ctypes.data) == 0
        if vec.tolist() != [1, 1, 0]:
            pytest.skip(f"the pages could not be set up so ({vec.tolist()}): a file system that keeps them")
        reader = FileReader(mapping, strategy="threads", direct=False, depth=4, resident_check=True, lib=lib)
        try:
            rows, counts = rowcopy.Rows(mapping, reader=reader), rowcopy.Counts()
            ids = torch.tensor([r], dtype=torch.int64)
            out = torch.full((1, rb), 0xAB, dtype=torch.uint8)
            got = run(lib, [rows], ids, [out], counts)
            assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy()))
            assert got["file_reads"] == 1 and got["broken"] == 0, got
        finally:
            reader.close()


FSTAT_CHILD = """
import os, sys
import numpy as np, torch
import ple_um
from helpers.reference import reference_rows

directory, lookups = sys.argv[1], int(sys.argv[2])
with ple_um.open_table(directory, mode="cpu", device="cpu") as table:
    table.mapping.populate()
    plan = table.paths.host.misses
    assert plan.resident_check and plan.cache_bytes == 0 and plan.strategy == "threads", plan
    layout, rng = table.layout, np.random.default_rng(3)
    per = layout.rows_per_shard
    planned = [
        np.concatenate([rng.integers(s * per, (s + 1) * per, 30) for s in range(len(layout.shards))])
        for _ in range(lookups)
    ]
    expected = [reference_rows(layout, ids) for ids in planned]
    with open(os.path.join(directory, "lookups-begin"), "w"):
        pass
    outs = [table.lookup(torch.from_numpy(ids)) for ids in planned]
    with open(os.path.join(directory, "lookups-end"), "w"):
        pass
    for out, want in zip(outs, expected):
        assert np.array_equal(out.view(torch.uint8).numpy(), want)
print("exact")
"""


def test_a_resident_copy_asks_each_file_its_size_once_a_chunk(make_checkpoint, tmp_path):
    """Without a row cache, a resident row is copied only where its file holds it just before and
    just after (reader.c): each file's size is asked (an fstat) once before a chunk's copies and
    once after, for a table of 12 files as for one of 2. Counted from outside by strace, in a child
    whose lookups of 360 ids (30 a file, one chunk each) are every one exact."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace to count the fstat calls with")
    layout = make_checkpoint(num_rows=12 * 200, row_dim=64, dtype="fp8", shards=12, files=12, seed=11)
    assert len(set(layout.files)) == 12
    lookups, trace = 3, tmp_path / "trace"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests]),
        "PLE_UM_ROW_CACHE": "0",
        "PLE_UM_FILE_READS": "threads",
        "PLE_UM_CPU_THREADS": "1",
        "PLE_UM_FIT_CHECK_SEC": "3600",
    }
    command = [strace, "-f", "-y", "-qq", "-o", str(trace), "-e", "trace=fstat,newfstatat,openat"]
    done = subprocess.run(
        [*command, sys.executable, "-c", FSTAT_CHILD, str(layout.directory), str(lookups)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0 and "exact" in done.stdout, done.stderr[-3000:]
    lines = trace.read_text().splitlines()
    begin = next(k for k, line in enumerate(lines) if "lookups-begin" in line)
    end = next(k for k, line in enumerate(lines) if "lookups-end" in line)
    asked = {os.path.realpath(path): 0 for path in layout.files}
    for line in lines[begin:end]:
        if "fstat" in line and "resumed>" not in line:
            for path in asked:
                if f"<{path}>" in line:
                    asked[path] += 1
    assert asked == {path: 2 * lookups for path in asked}, asked


def test_uring_asked_where_no_ring_can_be_made_takes_threads():
    class NoRing:
        def ple_uring_works(self):
            return 0

    assert choose_strategy(NoRing(), "auto")[0] == "threads"
    assert choose_strategy(NoRing(), "uring")[0] == "threads"
    assert choose_strategy(NoRing(), "mmap")[0] == "mmap"


def test_the_cgroup_room_is_the_tightest_of_the_groups_above(tmp_path):
    groups = tmp_path / "cgroup"
    (groups / "outer" / "inner").mkdir(parents=True)
    (groups / "outer" / "memory.max").write_text(str(6 << 30))
    (groups / "outer" / "memory.current").write_text(str(1 << 30))
    (groups / "outer" / "inner" / "memory.max").write_text("max")
    (groups / "outer" / "inner" / "memory.current").write_text(str(1 << 30))
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/outer/inner\n")
    assert memory.cgroup_headroom(str(proc), root=str(groups)) == 5 << 30
    (groups / "outer" / "memory.max").write_text("max")
    assert memory.cgroup_headroom(str(proc), root=str(groups)) is None


def test_file_reads_are_counted_without_a_row_cache(make_checkpoint, rng, monkeypatch):
    """PLE_UM_ROW_CACHE=0 on a table not in the page cache at open: the misses are still read many
    at a time and counted in stats(); a second lookup of the same ids finds their pages resident
    and reads nothing."""
    layout = make_checkpoint(
        num_rows=20000, row_dim=160, dtype="fp8", shards=8, files=2, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    drop_page_cache(layout)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 2000))
        expect = reference_rows(layout, ids.numpy())
        evict(table.mapping, layout)
        before = table.stats()
        assert before["row_cache"] is None
        assert np.array_equal(table.lookup(ids).view(torch.uint8).numpy(), expect)
        first = table.stats()
        read = first["file_reads"] - before["file_reads"]
        assert 0 < read <= len(np.unique(ids.numpy()))
        assert first["file_read_seconds"] > before["file_read_seconds"]
        assert np.array_equal(table.lookup(ids).view(torch.uint8).numpy(), expect)
        assert table.stats()["file_reads"] == first["file_reads"]  # resident now: nothing read
        assert first["file_reader"] in ("uring", "threads")


@pytest.mark.parametrize("strategy", ["threads", "mmap"])
def test_stats_say_how_misses_are_read(make_checkpoint, rng, monkeypatch, strategy):
    """stats()["file_reader"]: the reader's strategy, or None where misses are faulted in through
    the mapping (then no read of the files is counted)."""
    layout = make_checkpoint(
        num_rows=5000, row_dim=160, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    monkeypatch.setenv("PLE_UM_FILE_READS", strategy)
    drop_page_cache(layout)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 500))
        evict(table.mapping, layout)
        assert np.array_equal(
            table.lookup(ids).view(torch.uint8).numpy(), reference_rows(layout, ids.numpy())
        )
        stats = table.stats()
        assert stats["file_reader"] == (None if strategy == "mmap" else strategy)
        assert (stats["file_reads"] > 0) == (strategy != "mmap")


def test_an_explicit_row_cache_is_capped_at_the_table_and_refused_past_memory(
    lib, make_checkpoint, monkeypatch
):
    """A size larger than the owned rows need takes what they need; one that does not fit the
    memory left is a KnobError naming the variable, at open, before anything is faulted in."""
    layout = make_checkpoint(num_rows=10000, row_dim=160, dtype="fp8", shards=4)
    need = 10000 * (160 + SLOT_OVERHEAD)
    with MappedShards(layout) as mapping:
        monkeypatch.setenv("PLE_UM_ROW_CACHE", "1GiB")
        assert plan(lib, mapping, None, spills=False).cache_bytes == need
        monkeypatch.setattr(memory, "available", lambda: need - 1)
        with pytest.raises(KnobError, match=r"PLE_UM_ROW_CACHE='1GiB'.* does not fit"):
            plan(lib, mapping, None, spills=False)
        monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
        cold = plan(lib, mapping, None, spills=True)  # none asked: nothing to fit
        assert cold is None or cold.cache_bytes == 0
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1GiB")  # memory.available still says need - 1
    with pytest.raises(KnobError, match="PLE_UM_ROW_CACHE='1GiB'"):  # as it is, not a rejected mode
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    monkeypatch.undo()
    nvfp4 = make_checkpoint(num_rows=10000, row_dim=160, dtype="nvfp4", shards=4)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1GiB")
    with MappedShards(nvfp4) as mapping, MappedShards(nvfp4.scale_layout()) as scales:
        # the block scales follow the rows' slots: their bytes alone beside the rows' slots
        assert plan(lib, mapping, scales, spills=False).cache_bytes == 10000 * (80 + 10 + SLOT_OVERHEAD)


def _hold_sizing_lock() -> int:
    fd = os.open(os.path.join(envs.PLE_UM_CACHE_DIR, "row-cache.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_row_caches_are_sized_one_open_at_a_time(make_checkpoint, monkeypatch):
    """An open sizes and faults in its row cache only while no other process (or thread) does:
    one held here keeps it waiting until it is let go."""
    layout = make_checkpoint(num_rows=5000, row_dim=64, dtype="fp8", shards=4)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1MiB")
    opened: list[float] = []

    def open_one():
        with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
            opened.append(time.monotonic())
            assert table.stats()["row_cache"]["bytes"] > 0

    fd = _hold_sizing_lock()
    try:
        worker = threading.Thread(target=open_one)
        worker.start()
        time.sleep(2.0)
        released = time.monotonic()
    finally:
        os.close(fd)
    worker.join(60)
    assert not worker.is_alive() and len(opened) == 1
    assert opened[0] > released  # it waited for the lock


def test_sizing_goes_on_without_the_lock_where_it_cannot_be_had(tmp_path, monkeypatch, caplog):
    """Past the wait, or where the lock file cannot be made, the cache is sized without it, and a
    warning says so."""
    fd = _hold_sizing_lock()
    try:
        t0 = time.monotonic()
        with misses.one_sizing_at_a_time(wait_s=0.2):
            assert 0.2 <= time.monotonic() - t0 < 10
    finally:
        os.close(fd)
    assert "still held by another process after 0 s" in caplog.text
    cache = tmp_path / "cache"
    (cache / "row-cache.lock").mkdir(parents=True)  # a folder where the lock file should be
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(cache))
    with misses.one_sizing_at_a_time():
        pass
    assert "row cache sized without" in caplog.text and "row-cache.lock: Is a directory" in caplog.text


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_a_prefetch_reads_the_rows_into_the_row_cache(make_checkpoint, rng, monkeypatch, dtype):
    """The cpu mode's prefetch with a row cache: the rows the cache lacks read into it (an NVFP4
    table's block scales into theirs), no page of the files faulted in, no lookup counted; the
    lookup after it is served from the cache (but the few rows a locked set dropped) and exact."""
    layout = make_checkpoint(
        num_rows=200000,
        row_dim=160 if dtype == "fp8" else 64,
        dtype=dtype,
        shards=8,
        files=2,
        seed=int(rng.integers(1 << 30)),
    )
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "8MiB")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        mappings = [m for m in (table.mapping, table.scale_mapping) if m is not None]
        for m in mappings:
            evict(m, m.layout)
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 3000))
        asked = torch.cat([ids, torch.tensor([-1, layout.num_rows, 5])])
        before = table.stats()
        unique, tables = len(np.unique(ids.numpy())), len(mappings)
        distinct = len(np.unique(np.append(ids.numpy(), 5)))  # the owned ids, each once
        assert table.prefetch(asked).result(timeout=60) == distinct
        warmed = table.stats()
        assert sum(resident_pages(m) for m in mappings) == 0  # read past the page cache
        assert (warmed["rows"], warmed["host_lookups"]) == (before["rows"], before["host_lookups"])
        # Each distinct owned id asked of the cache once (the open's self-test left a few rows in
        # it), and each row it lacked read once, by one of the prefetch's threads.
        hits = warmed["row_cache"]["hits"] - before["row_cache"]["hits"]
        misses = warmed["row_cache"]["misses"] - before["row_cache"]["misses"]
        assert hits + misses == distinct and misses >= unique - before["row_cache"]["rows"]
        assert warmed["file_reads"] - before["file_reads"] == misses * tables
        if dtype == "fp8":
            got = table.lookup(ids).view(torch.uint8).numpy()
        else:
            packed, scales = table.lookup_packed(ids)
            assert np.array_equal(
                scales.view(torch.uint8).numpy(), reference_rows(layout.scale_layout(), ids.numpy())
            )
            got = packed.numpy()
        assert np.array_equal(got, reference_rows(layout, ids.numpy()))
        after = table.stats()
        hits = after["row_cache"]["hits"] - warmed["row_cache"]["hits"]
        assert hits >= 0.99 * 3000 and after["file_reads"] - warmed["file_reads"] <= 0.02 * unique


# A child that prefetches every row of a table over its row cache and says how much its peak
# memory grew (the table sparse: its rows are holes, read as zeros without touching the disk). The
# peak is reset first (clear_refs 5), so that the open's own peak does not hide the prefetch's.
_PREFETCH_CHILD = """
import sys, torch, ple_um

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))

with ple_um.open_table(sys.argv[1], mode="cpu", device="cpu") as table:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    rows = table.prefetch(torch.arange(table.num_rows)).result(timeout=240)
    grown = status("VmHWM") - before
    print(rows, grown, table.stats()["file_reads"], table.stats()["row_cache"]["bytes"])
"""


def test_a_prefetch_larger_than_memory_reads_in_bounded_memory(tmp_path):
    """A prefetch of every row of a 1 GiB table with a 16 MiB row cache (the host path of a table
    over its memory) reads each row past the cache, and its peak memory grows by far less than the
    rows asked: each prefetch thread's scratch rows are bounded (``gather.WARM_BYTES``) whatever
    the number of ids (a prefetch as large as the table must not end the process)."""
    rows, dim = 1 << 16, 8192  # 2 shards of 2**16 rows of 8 KiB (FP8): 1 GiB, sparse on disk
    sparse_table(tmp_path, rows, dim)
    env = {**os.environ, "PLE_UM_ROW_CACHE": "16MiB", "PLE_UM_SELF_TEST_ROWS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _PREFETCH_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read, grown, file_reads, cache_bytes = map(int, done.stdout.split())
    assert read == file_reads == 2 * rows and cache_bytes <= 16 << 20
    grew = f"peak memory grew by {grown >> 20} MiB for a prefetch of {2 * rows * dim >> 20} MiB of rows"
    assert grown < 160 << 20, grew


def _rings() -> int:
    """The io_uring instances this process holds open (its fds that are rings)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return found


def test_a_thread_lets_go_of_its_ring_when_it_ends(make_checkpoint, rng, monkeypatch):
    """Each thread that reads misses through io_uring makes a ring of its own; when the thread ends
    the ring goes with it, so threads that come and go (a prefetch's pool, a caller's workers)
    leave no fd behind."""
    if choose_strategy(rowcopy.load(envs.PLE_UM_CACHE_DIR)[0], "uring")[0] != "uring":
        pytest.skip("no io_uring ring can be made here")
    layout = make_checkpoint(num_rows=20000, row_dim=160, dtype="fp8", shards=4, files=2)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    monkeypatch.setenv("PLE_UM_FILE_READS", "uring")
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "1")  # the calling thread reads its own misses
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        before, seen = _rings(), []

        def look():
            evict(table.mapping, layout)
            ids = torch.from_numpy(rng.integers(0, layout.num_rows, 500))
            assert np.array_equal(
                table.lookup(ids).view(torch.uint8).numpy(), reference_rows(layout, ids.numpy())
            )
            seen.append(_rings())

        for k in range(5):
            worker = threading.Thread(target=look)
            worker.start()
            worker.join(60)
            deadline = time.monotonic() + 10  # join returns before the thread's C destructors run
            while _rings() != before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _rings() == before, f"thread {k} left its ring"
        assert seen == [before + 1] * 5  # a ring while the thread lived
        assert table.stats()["file_reads"] > 0
