"""The dispatcher thread of rowcopy.c (eager lookups on a CUDA device): a posted job waits until its
ready word reaches its number (on a GPU the stream writes it after the ids' copy; here the test
writes it, as the stream would), copies its rows, sets its done word, then clears its busy flag; jobs
run in the order posted; the comparisons are cyclic (CUDA's GEQ); a forked child has no dispatcher
and is told so. Real files, real mmap, the real C thread."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest
import torch
from helpers.reference import reference_rows
from helpers.rowcopy_jobs import boundary_ids, in_forked_child, make_job

from ple_um.lookup import rowcopy
from ple_um.mapping import MappedShards


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib, why = rowcopy.load(str(tmp_path_factory.mktemp("cache")))
    assert lib is not None, why
    assert lib.ple_dispatch_start() == 1
    return lib


class Signals:
    """Ready and done words of a few jobs, 64 bytes apart, as ``host.cuda`` lays them out."""

    def __init__(self, jobs: int) -> None:
        self.words = np.zeros(jobs * 32, dtype=np.uint32)

    def ready(self, k: int) -> int:
        return self.words.ctypes.data + k * 128

    def done(self, k: int) -> int:
        return self.words.ctypes.data + k * 128 + 64

    def set_ready(self, k: int, value: int) -> None:
        self.words[k * 32] = value

    def done_value(self, k: int) -> int:
        return int(self.words[k * 32 + 16])


def job_for(rows, counts, ids, out, *, seq, ready, done, threads=1, inline_rows=2048) -> rowcopy.LookupStruct:
    job = make_job([rows], ids, [out], counts, threads=threads, inline_rows=inline_rows)
    job.seq, job.ready, job.done = seq, ready, done
    return job


def wait_done(signals, k, seq, job=None, timeout=20.0) -> None:
    """Until job k's done word is ``seq`` (and ``job``'s busy flag, cleared after it, is down)."""
    deadline = time.monotonic() + timeout
    while signals.done_value(k) != seq or (job is not None and job.busy):
        assert time.monotonic() < deadline, f"job {k} never signalled done"
        time.sleep(1e-4)


@pytest.mark.parametrize("threads,inline_rows", [(1, 2048), (4, 0)])
def test_a_job_waits_for_its_ready_word_then_copies_and_signals(
    lib, make_checkpoint, rng, poison, threads, inline_rows
):
    layout = make_checkpoint(
        num_rows=5000, row_dim=24, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30))
    )
    pool = rowcopy.Pool(lib, threads)
    owned = (layout.rows_per_shard + 7, layout.num_rows - 3)
    with MappedShards(layout, owned) as mapping:
        rows, counts, signals = rowcopy.Rows(mapping), rowcopy.Counts(), Signals(1)
        ids_np = boundary_ids(layout, rng, 3000, owned)
        ids = torch.from_numpy(ids_np)
        out = poison(torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8))
        before = out.clone()
        signals.set_ready(0, 6)  # the previous lookup's number
        job = job_for(
            rows,
            counts,
            ids,
            out,
            seq=7,
            ready=signals.ready(0),
            done=signals.done(0),
            threads=pool.threads,
            inline_rows=inline_rows,
        )
        assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        time.sleep(0.1)  # the ids have not "arrived": nothing may happen
        assert job.busy == 1 and signals.done_value(0) == 0 and torch.equal(out, before)
        assert counts.read()["lookups"] == 0
        signals.set_ready(0, 7)  # the stream's write after the ids' copy
        wait_done(signals, 0, 7, job)
        want = reference_rows(layout, ids_np, owned)
        assert np.array_equal(out.numpy(), want.reshape(out.shape))
        got = counts.read()
        oob = int(((ids_np < 0) | (ids_np >= layout.num_rows)).sum())
        assert (got["rows"], got["out_of_range"], got["lookups"]) == (ids.numel(), oob, 1)


def test_a_job_whose_ids_are_in_does_not_wait_for_one_posted_before_it(lib, make_checkpoint, rng):
    """Two streams: the first job's stream is behind (its ready word not yet written), the second's
    ids are in. The second runs at once; the first when its word arrives."""
    layout = make_checkpoint(num_rows=800, row_dim=16, dtype="fp8", shards=2, seed=int(rng.integers(1 << 30)))
    with MappedShards(layout) as mapping:
        rows, counts, signals = rowcopy.Rows(mapping), rowcopy.Counts(), Signals(2)
        ids = [torch.from_numpy(rng.integers(0, 800, 50)) for _ in range(2)]
        outs = [torch.zeros((50, layout.row_bytes), dtype=torch.uint8) for _ in range(2)]
        jobs = [
            job_for(rows, counts, ids[k], outs[k], seq=1, ready=signals.ready(k), done=signals.done(k))
            for k in range(2)
        ]
        signals.set_ready(1, 1)
        for job in jobs:
            assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        wait_done(signals, 1, 1, jobs[1])
        assert jobs[0].busy == 1 and signals.done_value(0) == 0
        signals.set_ready(0, 1)
        wait_done(signals, 0, 1, jobs[0])
        for k in range(2):
            assert np.array_equal(outs[k].numpy(), reference_rows(layout, ids[k].numpy()).reshape(50, -1))


def test_the_chunks_of_one_lookup_run_in_order(lib, make_checkpoint, rng):
    """Chunks posted together under one ready word: each chunk's done word is set in turn, never a
    later chunk's before an earlier one's (the stream copies them in that order)."""
    layout = make_checkpoint(
        num_rows=4000, row_dim=16, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout) as mapping:
        rows, counts, signals = rowcopy.Rows(mapping), rowcopy.Counts(), Signals(6)
        ids = torch.from_numpy(rng.integers(0, 4000, 6 * 3000))
        out = torch.zeros((ids.numel(), layout.row_bytes), dtype=torch.uint8)
        jobs = []
        for k in range(6):
            piece = ids[k * 3000 : (k + 1) * 3000]
            jobs.append(
                job_for(
                    rows, counts, piece, out[k * 3000 :], seq=9, ready=signals.ready(0), done=signals.done(k)
                )
            )
        for job in jobs:
            assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        signals.set_ready(0, 9)
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < 6 and time.monotonic() < deadline:
            # Read last chunk first: a chunk seen done must find every earlier one done when it is
            # read after it (read first, an earlier chunk could finish between the reads).
            done = sorted(k for k in reversed(range(6)) if signals.done_value(k) == 9)
            assert done == list(range(len(done))), done  # a prefix, always
            seen = done
        assert len(seen) == 6
        assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy()).reshape(out.shape))


def test_numbers_compare_cyclically_across_the_wrap(lib, make_checkpoint, rng):
    layout = make_checkpoint(num_rows=300, row_dim=16, dtype="fp8", shards=2, seed=int(rng.integers(1 << 30)))
    with MappedShards(layout) as mapping:
        rows, counts, signals = rowcopy.Rows(mapping), rowcopy.Counts(), Signals(1)
        ids = torch.from_numpy(rng.integers(0, 300, 20))
        out = torch.zeros((20, layout.row_bytes), dtype=torch.uint8)
        seq = (1 << 32) - 2
        signals.set_ready(0, (1 << 32) - 3)  # one behind: wait
        job = job_for(rows, counts, ids, out, seq=seq, ready=signals.ready(0), done=signals.done(0))
        assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        time.sleep(0.05)
        assert job.busy == 1
        signals.set_ready(0, 1)  # three past seq, through the wrap: reached
        wait_done(signals, 0, seq, job)
        assert np.array_equal(out.numpy(), reference_rows(layout, ids.numpy()).reshape(20, -1))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_has_no_dispatcher_and_is_told(lib):
    def in_child() -> bool:
        job = rowcopy.LookupStruct()
        return lib.ple_dispatch_post(ctypes.addressof(job)) == -1

    assert in_forked_child(in_child) == 0


def test_a_ready_word_left_from_long_ago_is_armed_before_the_post(lib, make_checkpoint, rng):
    """A slot that has not been the first of a lookup for 2**31 lookups holds a number that
    compares as reached: posted under it unarmed, the job reads the ids before they arrive.
    ``arm`` sets the word one behind first: the job waits for the stream's write."""
    from ple_um.lookup.host.cuda import arm

    layout = make_checkpoint(num_rows=300, row_dim=16, dtype="fp8", shards=2, seed=int(rng.integers(1 << 30)))
    with MappedShards(layout) as mapping:
        rows, counts, signals = rowcopy.Rows(mapping), rowcopy.Counts(), Signals(2)
        ids = torch.from_numpy(rng.integers(0, 300, 20))
        seq = 5
        stale = (seq + (1 << 31) - 1) & 0xFFFFFFFF  # written 2**31 - 1 lookups "later": reached
        outs = [torch.zeros((20, layout.row_bytes), dtype=torch.uint8) for _ in range(2)]
        jobs = [
            job_for(rows, counts, ids, outs[k], seq=seq, ready=signals.ready(k), done=signals.done(k))
            for k in range(2)
        ]
        for k in range(2):
            signals.set_ready(k, stale)
        arm(signals.ready(1), seq)
        for job in jobs:
            assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        wait_done(signals, 0, seq, jobs[0])  # unarmed: ran with no write from the stream
        time.sleep(0.05)
        assert jobs[1].busy == 1 and signals.done_value(1) == 0
        assert not outs[1].any()
        signals.set_ready(1, seq)
        wait_done(signals, 1, seq, jobs[1])
        assert np.array_equal(outs[1].numpy(), reference_rows(layout, ids.numpy()).reshape(20, -1))


@pytest.mark.parametrize("seq", [1, 0, (1 << 32) - 1])
def test_arm_leaves_the_word_one_behind_and_an_earlier_chunk_runnable(seq):
    """Armed, the word is one behind ``seq`` (through the wrap); a job of an earlier lookup that
    waits for a lower number still finds it reached."""
    from ple_um.lookup.host.cuda import arm

    word = np.full(1, 12345, dtype=np.uint32)
    arm(word.ctypes.data, seq)
    assert int(word[0]) == (seq - 1) & 0xFFFFFFFF

    def reached(want: int) -> bool:  # as the C dispatcher compares
        return ((int(word[0]) - want) & 0xFFFFFFFF) < 1 << 31

    assert not reached(seq) and reached((seq - 3) & 0xFFFFFFFF)
