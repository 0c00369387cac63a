"""The C row copy (ple_um/lookup/native/), compiled on this machine and called through ctypes with a
job struct, as the CUDA driver calls it from a host node: every row against the reference reader,
poisoned staging, shard boundaries, ids outside the owned range and the table, every id dtype, the
block scales of an NVFP4 table beside its rows, a broken shard map, the page touch, lookups from
several threads at once (inline and pooled), a forked child, the counters, and the fallback when no
compiler works.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import pytest
import torch
from helpers.reference import drop_page_cache
from helpers.rowcopy_jobs import boundary_ids, in_forked_child, make_job, rows_in_memory

import ple_um
from ple_um.lookup import rowcopy
from ple_um.lookup.host.gather import HostGather
from ple_um.lookup.sync_gather import SyncGather
from ple_um.mapping import PAGE, MappedShards


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib, why = rowcopy.load(str(tmp_path_factory.mktemp("cache")))
    assert lib is not None, why  # a C compiler is part of the test machine (Triton needs one too)
    return lib


def run(lib, tables, ids, dsts, counts, **kw) -> rowcopy.LookupStruct:
    """One lookup, as the driver runs a host node: a job struct, then ple_lookup_run(&job)."""
    job = make_job(tables, ids, dsts, counts, **kw)
    lib.ple_lookup_run(ctypes.addressof(job))
    return job


@pytest.mark.parametrize(
    "threads,inline_rows,id_dtype",
    [(1, 2048, torch.int64), (3, 0, torch.int64), (4, 16, torch.int32), (2, 0, torch.int16)],
)
def test_lookups_equal_the_reference_rows(
    lib, make_checkpoint, rng, check_rows, poison, threads, inline_rows, id_dtype
):
    layout = make_checkpoint(
        num_rows=3000, row_dim=24, dtype="fp8", shards=7, files=3, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    pool = rowcopy.Pool(lib, threads)
    assert pool.threads >= min(threads, 2)
    for owned in [(0, layout.num_rows), (S + 3, 5 * S - 2), (2 * S, 2 * S)]:
        with MappedShards(layout, owned) as mapping:
            rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
            expect = {"rows": 0, "out_of_range": 0, "lookups": 0}
            for _ in range(4):
                ids_np = boundary_ids(layout, rng, int(rng.integers(1, 4000)), owned)
                if id_dtype == torch.int16:  # the ids this dtype holds (the table has 3000 rows)
                    ids_np = ids_np[(ids_np >= -(1 << 15)) & (ids_np < 1 << 15)]
                ids = torch.from_numpy(ids_np).to(id_dtype)
                out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=layout.dtype))
                job = run(
                    lib,
                    [rows],
                    ids,
                    [out.view(torch.uint8)],
                    counts,
                    threads=pool.threads,
                    inline_rows=inline_rows,
                )
                assert job.busy == 0  # cleared last: a ring slot is free again
                check_rows(out, layout, ids.long(), rows=owned)
                expect["rows"] += ids.numel()
                as_read = ids.long()  # (an int32 id of 2**40 wraps)
                expect["out_of_range"] += int(((as_read < 0) | (as_read >= layout.num_rows)).sum())
                expect["lookups"] += 1
            got = counts.read()
            assert {k: got[k] for k in expect} == expect and got["broken"] == 0 and got["ns"] > 0


def test_nvfp4_rows_and_block_scales_in_one_lookup(lib, make_checkpoint, rng, poison):
    from helpers.reference import reference_rows

    layout = make_checkpoint(
        num_rows=900, row_dim=64, dtype="nvfp4", shards=5, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    owned = (S - 7, 4 * S + 3)
    with MappedShards(layout, owned) as mapping, MappedShards(layout.scale_layout(), owned) as scale_mapping:
        tables = [rowcopy.Rows(mapping), rowcopy.Rows(scale_mapping)]
        counts = rowcopy.Counts()
        ids_np = boundary_ids(layout, rng, 3000, owned)
        ids = torch.from_numpy(ids_np)
        packed = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
        scales = poison(torch.empty((ids.numel(), layout.row_dim // 16), dtype=torch.uint8))
        run(lib, tables, ids, [packed, scales], counts, threads=rowcopy.Pool(lib, 3).threads, inline_rows=0)
        assert np.array_equal(packed.numpy(), reference_rows(layout, ids_np, owned))
        assert np.array_equal(scales.numpy(), reference_rows(layout.scale_layout(), ids_np, owned))
        assert counts.read()["rows"] == ids.numel()  # one lookup, counted once


def test_an_nvfp4_tables_packed_rows_alone_are_read_without_their_block_scales(lib, make_checkpoint, rng):
    """``HostGather.gather`` with one raw output of an NVFP4 table (its packed bytes, [n, row_bytes],
    as its docstring offers) fills it exactly and reads no block scales, which it has nowhere to
    put (in a forked child: a row copy writing them through no pointer would kill it)."""
    from helpers.reference import reference_rows

    layout = make_checkpoint(
        num_rows=900, row_dim=64, dtype="nvfp4", shards=5, seed=int(rng.integers(1 << 30))
    )
    ids_np = boundary_ids(layout, rng, 3000, (0, layout.num_rows))
    with MappedShards(layout) as mapping, MappedShards(layout.scale_layout()) as scale_mapping:
        host = HostGather(
            lib,
            mapping,
            torch.device("cpu"),
            storage=layout.dtype,
            scale=None,
            threads=2,
            scale_mapping=scale_mapping,
        )
        try:

            def packed_alone() -> bool:  # no torch op of its own: OpenMP's threads are the parent's
                packed = np.full((ids_np.size, layout.row_bytes), 0xAB, dtype=np.uint8)
                host.gather(torch.from_numpy(ids_np), torch.from_numpy(packed))
                return np.array_equal(packed, reference_rows(layout, ids_np))

            assert in_forked_child(packed_alone) == 0
        finally:
            host.close()


def test_a_broken_shard_map_zeroes_and_counts_the_rows_it_lacks(lib, make_checkpoint, rng, check_rows):
    layout = make_checkpoint(num_rows=500, row_dim=16, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30)))
    S = layout.rows_per_shard
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        rows.first[2] = rows.end[2] = 0  # shard 2 not mapped
        rows.end[3] = 10  # shard 3: only its first 10 rows
        ids = torch.from_numpy(rng.integers(0, layout.num_rows, 3000))
        ids[:4] = torch.tensor([2 * S, 3 * S + 9, 3 * S + 10, 4 * S])
        lost = ((ids >= 2 * S) & (ids < 3 * S)) | ((ids >= 3 * S + 10) & (ids < 4 * S))
        out = torch.full((ids.numel(), layout.row_bytes), 0xAB, dtype=torch.uint8)
        run(lib, [rows], ids, [out], counts, threads=rowcopy.Pool(lib, 3).threads, inline_rows=0)
        assert counts.read()["broken"] == int(lost.sum()) and counts.read()["out_of_range"] == 0
        assert not out[lost].any()
        check_rows(out[~lost].view(layout.dtype), layout, ids[~lost])


def test_the_touch_of_a_block_scaled_table_brings_in_its_block_scales_too(make_checkpoint, rng):
    """The ats mode's page touch is queued so that the kernel after it takes no page fault: the
    kernel reads an NVFP4 row's block scales (their own tensor, their own mapping) beside its
    bytes, so the touch brings both pages in (the host path's ``touch``, run on this thread)."""
    import ple_um
    from ple_um.residency import evict_pages

    layout = make_checkpoint(num_rows=8192, row_dim=512, dtype="nvfp4", shards=2, files=1)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        mappings = (table.mapping, table.scale_mapping)
        for m in mappings:
            m.advise("random")  # no readahead: only the pages touched come in
            evict_pages(m.layout.files, m.regions)
        ids = rng.choice(layout.num_rows, 40, replace=False)
        table.paths.row_copy.touch(torch.from_numpy(ids))
        for m in mappings:
            (region,) = m.regions
            vec = np.zeros((region.length + PAGE - 1) // PAGE, dtype=np.uint8)
            from ple_um.mapping import _libc

            assert _libc.mincore(region.addr, region.length, vec.ctypes.data) == 0
            rb = m.layout.row_bytes
            for i in ids.tolist():
                shard, local = divmod(i, m.layout.rows_per_shard)
                at = m.shard_base(shard) - region.addr + local * rb
                assert vec[at // PAGE] & 1 and vec[(at + rb - 1) // PAGE] & 1, (m.layout.dtype_name, i)


def test_touch_brings_the_pages_in_and_writes_nothing(lib, make_checkpoint, rng):
    # 4096 rows of 256 B in one file: 16 rows a page.
    layout = make_checkpoint(num_rows=4096, row_dim=256, dtype="fp8", shards=2, files=1)
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        drop_page_cache(layout)
        ((_, before, _),) = mapping.residency()
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        ids = torch.from_numpy(rng.choice(4096, 40, replace=False))
        ids[0] = -1  # outside the table: skipped, and not counted (the kernel counts the lookup)
        run(lib, [rows], ids, [], counts, touch=True)
        ((_, after, _),) = mapping.residency()
        # Each touched row's page is in; at most the pages of the 39 owned rows (readahead off).
        assert after > before
        region = mapping.regions[0]
        vec = np.zeros((region.length + PAGE - 1) // PAGE, dtype=np.uint8)
        from ple_um.mapping import _libc

        assert _libc.mincore(region.addr, region.length, vec.ctypes.data) == 0
        rb, base = layout.row_bytes, mapping.shard_base(0) - region.addr
        for i in ids[1:].tolist():
            shard, local = divmod(i, layout.rows_per_shard)
            addr = mapping.shard_base(shard) - region.addr + local * rb
            assert vec[addr // PAGE] & 1 and vec[(addr + rb - 1) // PAGE] & 1
        got = counts.read()
        assert (got["rows"], got["out_of_range"], got["lookups"]) == (0, 0, 0) and base >= 0


@pytest.mark.parametrize("threads,inline_rows", [(1, 2048), (3, 0)], ids=["inline", "pooled"])
def test_a_live_touch_runs_only_while_its_word_is_set(lib, make_checkpoint, rng, threads, inline_rows):
    """The job of a captured touch is the same job at every replay: it reads its table's word each
    time it runs. Clear: no page comes in and nothing is counted; set: every page of the rows comes
    in and the touch is counted; the word flipped between runs of that one job, the table's pages
    dropped before each (the direct call, as the driver runs a host node)."""
    from ple_um.residency import evict_pages

    # 4096 rows of 256 B in one file: 16 rows a page.
    layout = make_checkpoint(num_rows=4096, row_dim=256, dtype="fp8", shards=2, files=1)
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        mapping.advise("random")  # no readahead: only the pages touched come in
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        ids = torch.from_numpy(rng.choice(4096, 40, replace=False))
        live = np.zeros(1, dtype=np.int32)
        threads = rowcopy.Pool(lib, threads).threads
        job = make_job(
            [rows], ids, [], counts, touch=True, live=live, threads=threads, inline_rows=inline_rows
        )
        touches = 0
        for word in (0, 1, 0, 1, 1, 0):
            evict_pages(layout.files, mapping.regions)
            assert not any(rows_in_memory(mapping, ids)), "the pages were not dropped"
            live[0], job.busy = word, 1
            lib.ple_lookup_run(ctypes.addressof(job))
            assert job.busy == 0  # cleared either way: the ring slot or the graph's node is free
            touches += word
            inside = rows_in_memory(mapping, ids)
            assert all(inside) if word else not any(inside), (word, inside)
            got = counts.read()
            assert got["touches"] == touches and (got["ns"] > 0) == (touches > 0), (word, got)
            assert (got["rows"], got["lookups"]) == (0, 0)
        # The host path's touch (called directly here: no CUDA) takes the same word.
        with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
            host = table.paths.row_copy
            before = host.counts.read()["touches"]
            for word in (0, 1):
                evict_pages(layout.files, [*mapping.regions, *table.mapping.regions])
                live[0] = word
                host.touch(ids, live=live)
                inside = rows_in_memory(mapping, ids)
                assert all(inside) if word else not any(inside), (word, inside)
            assert host.counts.read()["touches"] - before == 1


def test_lookups_from_several_threads_each_get_their_rows(lib, make_checkpoint, rng, check_rows):
    layout = make_checkpoint(
        num_rows=6000, row_dim=24, dtype="fp8", shards=8, files=3, seed=int(rng.integers(1 << 30))
    )
    pool = rowcopy.Pool(lib, 4)
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        sizes = [10, 3000, 9000, 500, 7000, 16, 12000, 2500]  # inline and pooled, mixed
        batches = [
            torch.from_numpy(np.random.default_rng(int(rng.integers(1 << 30))).integers(-5, 6005, n))
            for n in sizes
        ]
        bad: list[int] = []

        def work(k: int) -> None:
            for _ in range(6):
                out = torch.full((sizes[k], layout.row_bytes), 0xAB, dtype=torch.uint8)
                run(lib, [rows], batches[k], [out], counts, threads=pool.threads, inline_rows=1024)
                try:
                    check_rows(out.view(layout.dtype), layout, batches[k])
                except AssertionError:
                    bad.append(k)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(sizes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not bad
        assert counts.read()["rows"] == 6 * sum(sizes) and counts.read()["lookups"] == 6 * len(sizes)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_pooled_lookups_without_the_parents_workers(lib, make_checkpoint, rng):
    from helpers.reference import reference_rows

    layout = make_checkpoint(
        num_rows=6000, row_dim=24, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    pool = rowcopy.Pool(lib, 4)
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        ids_np = rng.integers(0, 6000, 8000)
        ids = torch.from_numpy(ids_np)
        out = torch.full((8000, layout.row_bytes), 0xAB, dtype=torch.uint8)  # before the fork
        run(lib, [rows], ids, [out], counts, threads=pool.threads, inline_rows=0)  # the pool is up
        out.fill_(0xAB)
        want = reference_rows(layout, ids_np)

        def in_child() -> bool:
            run(lib, [rows], ids, [out], counts, threads=pool.threads, inline_rows=0)
            return np.array_equal(out.numpy(), want)

        assert in_forked_child(in_child) == 0


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_the_cpu_mode_is_synchronous(
    tmp_path, monkeypatch, layout, cc, check_rows, rng
):
    import ple_um
    from ple_um.lookup import native_library

    monkeypatch.setattr(native_library, "packaged_library", lambda: None)  # an install without a compiler
    monkeypatch.setenv("CC", cc)
    lib, why = rowcopy.load(str(tmp_path))
    assert lib is None and "compiling" in why and cc in why
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert isinstance(table.paths.host, SyncGather) and not table.capture_safe
        assert cc in table.row_reads and "synchronous" in table.row_reads
        ids = torch.from_numpy(rng.integers(-3, layout.num_rows + 3, 500))
        check_rows(table.lookup(ids), layout, ids)


@pytest.mark.parametrize("knob", ["1", "0"])
def test_the_knob_picks_the_host_path(monkeypatch, layout, rng, check_rows, knob):
    import ple_um

    monkeypatch.setenv("PLE_UM_ROWCOPY", knob)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        if knob == "1":
            assert isinstance(table.paths.host, HostGather) and table.capture_safe
            assert table.row_reads.startswith("C row copy")
        else:
            assert isinstance(table.paths.host, SyncGather) and not table.capture_safe
            assert "PLE_UM_ROWCOPY=0" in table.row_reads
        ids = torch.from_numpy(rng.integers(-3, layout.num_rows + 3, 20000))  # past every inline limit
        check_rows(table.lookup(ids), layout, ids)


def test_a_lookup_cut_in_chunks_counts_its_rows_and_one_lookup(lib, make_checkpoint, rng, check_rows):
    """A lookup a CUDA device's host path cuts in chunks (``gather.chunks``: a job struct each, filled
    by ``HostGather._fill`` as its queue fills them, run here in turn as their host nodes run):
    every row exact and counted, and one host lookup, not one a chunk."""
    from ple_um.lookup.host.gather import CHUNK_ROWS, chunks

    layout = make_checkpoint(
        num_rows=5000, row_dim=24, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout) as mapping:
        host = HostGather(lib, mapping, torch.device("cpu"), storage=layout.dtype, scale=None, threads=2)
        try:
            n = 3 * CHUNK_ROWS + 5
            ids = torch.from_numpy(boundary_ids(layout, rng, n, (0, layout.num_rows)))
            out = torch.full((n, layout.row_dim), 0xAB, dtype=torch.uint8).view(layout.dtype)
            pieces = chunks(n)
            assert len(pieces) > 1
            for k, (a, b) in enumerate(pieces):
                job, dst = rowcopy.LookupStruct(), out.data_ptr() + a * layout.row_bytes
                host._fill(job, ids.data_ptr() + a * ids.element_size(), 0, b - a, [dst], chunk=k)
                job.busy = 1
                lib.ple_lookup_run(ctypes.addressof(job))
                assert job.busy == 0
            check_rows(out, layout, ids)
            got = host.read_counts()
            assert (got["rows"], got["lookups"]) == (n, 1)
        finally:
            host.close()


def test_chunks_cover_the_lookup_and_cut_the_tail():
    from ple_um.lookup.host.cuda import RING
    from ple_um.lookup.host.gather import CHUNK_ROWS, MAX_CHUNKS, TAIL_ROWS, chunks

    for n in (
        1,
        100,
        CHUNK_ROWS,
        CHUNK_ROWS + 1,
        3 * CHUNK_ROWS,
        3 * CHUNK_ROWS + 5,
        131072,
        10**7,
        3 * 10**8,
    ):
        pieces = chunks(n)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(pieces[k][1] == pieces[k + 1][0] for k in range(len(pieces) - 1))
        assert all(a < b for a, b in pieces)
        # A lookup's job structs must fit in its stream's ring at once (one per piece).
        assert len(pieces) <= MAX_CHUNKS + 1 < RING
        if n <= MAX_CHUNKS * CHUNK_ROWS:
            assert all(b - a <= CHUNK_ROWS for a, b in pieces)
        if n > CHUNK_ROWS:
            assert pieces[-1][1] - pieces[-1][0] <= TAIL_ROWS
