"""The C row copy (ple_um/lookup/rowcopy.c), compiled on this machine and run on the row spaces of
a real mapped checkpoint: every row against the file's bytes read with plain reads, poisoned
outputs, jobs over several files, prefix waits, rows out of their space, bad arguments, jobs from
several threads at once, a forked child, and the fallback when no compiler works; jobs by id
against the reference reader, with shard boundaries, ids outside the table and the owned range,
and a broken shard map.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch

from ple_um.lookup import rowcopy
from ple_um.lookup.cpu_gather import CpuGather
from ple_um.mapping import MappedShards


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib, why = rowcopy.load(str(tmp_path_factory.mktemp("cache")))
    assert lib is not None, why  # a C compiler is part of the test machine (Triton needs one too)
    return lib


@pytest.fixture
def spaces(make_checkpoint, rng):
    """The row spaces (one per file) of a real 4-file FP8 checkpoint, and their bytes read from
    the files with plain reads (the reference)."""
    layout = make_checkpoint(
        num_rows=3000, row_dim=24, dtype="fp8", shards=8, files=4, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        gather = CpuGather(mapping, torch.device("cpu"), threads=2, chunk=64, slots=1, row_copy=False)
        try:
            tables = list(gather.space_tensors)
            reference = []
            for space in tables:
                region = next(r for r in mapping.regions if r.addr <= space.data_ptr() < r.addr + r.length)
                with open(region.path, "rb") as f:
                    f.seek(region.file_offset + space.data_ptr() - region.addr)
                    data = f.read(space.numel())
                reference.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(space.shape))
            yield tables, reference
        finally:
            gather.close()


def random_job(tables, reference, rng, n_max=5000):
    """Segments over a random subset of the spaces (some empty), their rows, and the expected output."""
    segments, rows, want, start = [], [], [], 0
    for k in rng.permutation(len(tables)):
        count = int(rng.integers(0, n_max // len(tables)))
        if not count:
            continue
        r = torch.from_numpy(rng.integers(0, tables[k].shape[0], count))
        r[: min(count, 2)] = torch.tensor([0, tables[k].shape[0] - 1])[
            : min(count, 2)
        ]  # both ends of the file
        segments.append((tables[k], start, start + count))
        rows.append(r)
        want.append(reference[k][r])
        start += count
    return segments, torch.cat(rows), torch.cat(want)


@pytest.mark.parametrize("threads,block", [(1, 256), (3, 7), (4, 1)])
def test_jobs_equal_the_files_rows(lib, spaces, rng, threads, block):
    tables, reference = spaces
    copier = rowcopy.RowCopy(lib, threads, block=block)
    for _ in range(20):
        segments, rows, want = random_job(tables, reference, rng)
        if not segments:
            continue
        out = torch.full((rows.numel(), tables[0].shape[1]), 0xAB, dtype=torch.uint8)
        if rng.integers(2):
            copier.wake()  # workers told a job is coming; sometimes none comes before the next wake
        with copier.job(segments, rows, out) as wait:
            upto = int(rng.integers(0, rows.numel() + 1))
            wait(upto)
            assert torch.equal(out[:upto], want[:upto])  # a waited prefix is in, whatever the rest does
        assert torch.equal(out, want)


def test_more_blocks_than_a_job_holds_are_merged(lib, spaces, rng):
    tables, reference = spaces
    n = rowcopy.MAX_BLOCKS + 1000  # with blocks of one row: more than one job holds
    rows = torch.from_numpy(rng.integers(0, tables[0].shape[0], n))
    out = torch.full((n, tables[0].shape[1]), 0xAB, dtype=torch.uint8)
    rowcopy.RowCopy(lib, 3, block=1).copy(tables[0], rows, out)
    assert torch.equal(out, reference[0][rows])


def test_rows_outside_their_space_are_zeroed_and_reported(lib, spaces, rng):
    tables, reference = spaces
    n = 600
    rows = torch.from_numpy(rng.integers(0, tables[1].shape[0], n))
    bad = [3, 100, 599]
    rows[bad] = torch.tensor([-1, tables[1].shape[0], 1 << 40])
    out = torch.full((n, tables[1].shape[1]), 0xAB, dtype=torch.uint8)
    with pytest.raises(rowcopy.RowCopyError, match="3 row numbers outside"):
        rowcopy.RowCopy(lib, 3, block=16).copy(tables[1], rows, out)
    good = np.setdiff1d(np.arange(n), bad)
    assert torch.equal(out[good], reference[1][rows[good]])
    assert not out[bad].any()
    # The job lock was released: the next job runs.
    rows[bad] = 0
    rowcopy.RowCopy(lib, 3).copy(tables[1], rows, out)
    assert torch.equal(out, reference[1][rows])


def test_bad_arguments_are_refused_before_anything_is_read(lib, spaces):
    tables, _ = spaces
    rb = tables[0].shape[1]
    copier = rowcopy.RowCopy(lib, 2)
    rows = torch.zeros(10, dtype=torch.int64)
    out = torch.empty((10, rb), dtype=torch.uint8)
    cases = [
        ([(tables[0], 0, 10)], rows.int(), out, "int64"),
        ([(tables[0], 0, 10)], torch.zeros(20, dtype=torch.int64)[::2], out, "contiguous"),
        ([(tables[0], 0, 10)], rows, torch.empty((10, rb), dtype=torch.float32), "uint8"),
        ([(tables[0], 0, 10)], rows, torch.empty((10, rb + 1), dtype=torch.uint8), "rows"),
        ([(tables[0], 0, 4), (tables[1], 5, 10)], rows, out, "does not follow"),
        ([(tables[0], 0, 9)], rows, out, "cover 9 rows"),
        ([(tables[0][:, :8], 0, 10)], rows, torch.empty((10, 8), dtype=torch.uint8), "contiguous"),
        ([], rows, out, "1 to"),
        ([(tables[0], 0, 10)] * (rowcopy.MAX_SEGMENTS + 1), rows, out, "1 to"),
    ]
    for segments, r, o, match in cases:
        with pytest.raises(ValueError, match=match):
            with copier.job(segments, r, o):
                pass
    copier.copy(tables[0], rows, out)  # and nothing was left locked
    assert torch.equal(out, tables[0][rows])


def test_jobs_from_several_threads_each_get_their_rows(lib, spaces, rng):
    tables, reference = spaces
    jobs = [
        random_job(tables, reference, np.random.default_rng(int(rng.integers(1 << 30)))) for _ in range(8)
    ]
    results: dict[int, bool] = {}

    def run(k):
        segments, rows, want = jobs[k]
        copier = rowcopy.RowCopy(lib, 4, block=32)
        ok = True
        for _ in range(10):
            out = torch.full_like(want, 0xAB)
            with copier.job(segments, rows, out) as wait:
                wait(rows.numel() // 2)
            ok &= bool(torch.equal(out, want))
        results[k] = ok

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs)) if jobs[k][0]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert results and all(results.values())


def boundary_ids(layout, rng, n: int, owned) -> torch.Tensor:
    """Random ids with every shard boundary, ids outside the table and outside ``owned``, shuffled."""
    S, N = layout.rows_per_shard, layout.num_rows
    extra = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)] + [-5, -1, N, N + 3, 1 << 40]
    extra += [owned[0] - 1, owned[0], owned[1] - 1, owned[1]]
    ids = np.concatenate([extra, rng.integers(-10, N + 10, max(0, n - len(extra)))])
    return torch.from_numpy(rng.permutation(ids).astype(np.int64))


@pytest.mark.parametrize("threads,block", [(1, 256), (3, 7), (4, 1)])
def test_jobs_by_id_equal_the_reference_rows(lib, make_checkpoint, rng, check_rows, poison, threads, block):
    layout = make_checkpoint(
        num_rows=3000, row_dim=24, dtype="fp8", shards=7, files=3, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    copier = rowcopy.RowCopy(lib, threads, block=block)
    for owned in [(0, layout.num_rows), (S + 3, 5 * S - 2), (2 * S, 2 * S)]:
        with MappedShards(layout, owned) as mapping:
            gather = CpuGather(mapping, torch.device("cpu"), threads=2, chunk=64, slots=1)
            try:
                assert gather.shard_spaces is not None, gather.row_reads
                for _ in range(4):
                    ids = boundary_ids(layout, rng, int(rng.integers(1, 4000)), owned)
                    out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=layout.dtype))
                    raw = out.view(torch.uint8)
                    with copier.gather(gather.shard_spaces, ids, raw, owned=owned) as wait:
                        upto = int(rng.integers(0, ids.numel() + 1))
                        wait(upto)
                        check_rows(out[:upto], layout, ids[:upto], rows=owned)  # a waited prefix is in
                    check_rows(out, layout, ids, rows=owned)
            finally:
                gather.close()


def test_ids_whose_shard_has_no_rows_mapped_are_zeroed_and_reported(lib, make_checkpoint, rng, check_rows):
    layout = make_checkpoint(num_rows=500, row_dim=16, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30)))
    S, owned = layout.rows_per_shard, (0, layout.num_rows)
    with MappedShards(layout, owned) as mapping:
        gather = CpuGather(mapping, torch.device("cpu"), threads=2, chunk=64, slots=1)
        try:
            full = gather.shard_spaces
            spaces = list(full.spaces)
            spaces[2] = None  # shard 2 not mapped
            spaces[3] = spaces[3][: int(full.row0[3]) + 10]  # shard 3: only its first 10 rows
            broken = rowcopy.ShardSpaces(spaces, full.row0.tolist(), S, layout.row_bytes)
            ids = torch.from_numpy(rng.integers(0, layout.num_rows, 3000))
            ids[:4] = torch.tensor([2 * S, 3 * S + 9, 3 * S + 10, 4 * S])
            lost = ((ids >= 2 * S) & (ids < 3 * S)) | ((ids >= 3 * S + 10) & (ids < 4 * S))
            out = torch.full((ids.numel(), layout.row_bytes), 0xAB, dtype=torch.uint8)
            copier = rowcopy.RowCopy(lib, 3, block=16)
            with pytest.raises(rowcopy.RowCopyError, match=f"{int(lost.sum())} owned ids outside"):
                with copier.gather(broken, ids, out, owned=owned):
                    pass
            assert not out[lost].any()
            check_rows(out[~lost].view(layout.dtype), layout, ids[~lost])
            with copier.gather(full, ids, out, owned=owned):  # nothing was left locked
                pass
            check_rows(out.view(layout.dtype), layout, ids)
        finally:
            gather.close()


def test_bad_arguments_by_id_are_refused_before_anything_is_read(lib, spaces):
    tables, _ = spaces
    rb = tables[0].shape[1]
    shards = rowcopy.ShardSpaces([tables[0], None], [0, 0], 100, rb)
    copier = rowcopy.RowCopy(lib, 2)
    ids = torch.zeros(10, dtype=torch.int64)
    out = torch.empty((10, rb), dtype=torch.uint8)
    cases = [
        (ids.int(), out, (0, 10), "int64"),
        (torch.zeros(20, dtype=torch.int64)[::2], out, (0, 10), "contiguous"),
        (torch.zeros(11, dtype=torch.int64), out, (0, 10), "10 contiguous"),
        (ids, torch.empty((10, rb), dtype=torch.float32), (0, 10), "uint8"),
        (ids, torch.empty((10, rb + 1), dtype=torch.uint8), (0, 10), "B rows"),
        (ids, out, (-1, 10), "owned range"),
        (ids, out, (5, 4), "owned range"),
        (ids, out, (1 << 64, (1 << 64) + 3), "owned range"),  # ctypes would wrap it to [0, 3)
    ]
    for i, o, owned, match in cases:
        with pytest.raises(ValueError, match=match):
            with copier.gather(shards, i, o, owned=owned):
                pass
    layouts = [
        ([], [], 100, rb, "1 to"),
        ([None] * (rowcopy.MAX_SEGMENTS + 1), [0] * (rowcopy.MAX_SEGMENTS + 1), 100, rb, "1 to"),
        ([tables[0]], [0, 0], 100, rb, "1 to"),
        ([tables[0]], [0], 0, rb, "positive"),
        ([tables[0]], [0], 100, rb + 1, "contiguous"),
        ([tables[0][:, :8]], [0], 100, 8, "contiguous"),
        ([tables[0].float()], [0], 100, rb, "uint8"),
        ([tables[0]], [0], 1 << 63, rb, "positive"),
        ([tables[0]], [[0]], 100, rb, "one row per shard"),
    ]
    for spaces_, row0, per_shard, row_bytes, match in layouts:
        with pytest.raises(ValueError, match=match):
            rowcopy.ShardSpaces(spaces_, row0, per_shard, row_bytes)
    with copier.gather(shards, ids, out, owned=(0, 10)):  # and nothing was left locked
        pass
    assert torch.equal(out, tables[0][ids])


def test_shard_spaces_keep_their_own_copies_and_extreme_rows_are_refused(lib, spaces, rng):
    tables, reference = spaces
    rb = tables[0].shape[1]
    per_shard = tables[1].shape[0] - 5
    ids = torch.from_numpy(rng.integers(0, 2 * per_shard, 500))
    ids[:3] = torch.tensor([per_shard - 1, per_shard, 2 * per_shard - 1])
    # row0 given as a strided view ([0, 5]) and the space list changed afterwards: neither reaches C.
    row0 = np.array([0, 99, 5, 99], dtype=np.int64)[::2]
    listed = [tables[1], tables[1]]
    shards = rowcopy.ShardSpaces(listed, row0, per_shard, rb)
    listed.clear()
    out = torch.full((500, rb), 0xAB, dtype=torch.uint8)
    copier = rowcopy.RowCopy(lib, 3, block=16)
    with copier.gather(shards, ids, out, owned=(0, 2 * per_shard)):
        pass
    assert torch.equal(out, reference[1][torch.where(ids < per_shard, ids, ids - per_shard + 5)])
    # A row0 near the int64 limits: every row of that shard outside its space, none read.
    big = rowcopy.ShardSpaces([tables[1], tables[1]], [0, (1 << 63) - 2], per_shard, rb)
    on_second = int((ids >= per_shard).sum())
    with pytest.raises(rowcopy.RowCopyError, match=f"{on_second} owned ids outside"):
        with copier.gather(big, ids, out, owned=(0, 2 * per_shard)):
            pass
    first = ids < per_shard
    assert torch.equal(out[first], reference[1][ids[first]]) and not out[~first].any()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_copies_without_the_parents_workers(lib, spaces, rng):
    tables, reference = spaces
    segments, rows, want = random_job(tables, reference, rng)
    rowcopy.RowCopy(lib, 4).copy(
        segments[0][0], rows[: segments[0][2]], torch.empty_like(want[: segments[0][2]])
    )
    out = torch.full_like(want, 0xAB)  # made before the fork: torch's OpenMP threads do not survive one
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's workers; the pool starts its own
        code = 1
        try:
            with rowcopy.RowCopy(lib, 4).job(segments, rows, out):
                pass
            code = 0 if np.array_equal(out.numpy(), want.numpy()) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_the_gather_keeps_index_select(tmp_path, monkeypatch, layout, cc):
    monkeypatch.setenv("CC", cc)
    lib, why = rowcopy.load(str(tmp_path))
    assert lib is None and "compiling" in why and cc in why
    with MappedShards(layout, (0, layout.num_rows)) as mapping:
        gather = CpuGather(
            mapping, torch.device("cpu"), threads=2, chunk=64, slots=1, cache_dir=str(tmp_path)
        )
        try:
            assert gather.rowcopy is None and gather.row_reads.startswith("torch.index_select (")
        finally:
            gather.close()


@pytest.mark.parametrize("knob", ["1", "0"])
def test_the_knob_picks_the_row_reads_and_big_lookups_match_the_files(
    monkeypatch, layout, rng, check_rows, knob
):
    import ple_um

    monkeypatch.setenv("PLE_UM_ROWCOPY", knob)
    with ple_um.open_table(layout.directory, mode="cpu") as table:
        if knob == "1":
            assert table.cpu.rowcopy is not None and table.cpu.row_reads.startswith("C row copy")
        else:
            assert table.cpu.rowcopy is None and "PLE_UM_ROWCOPY=0" in table.cpu.row_reads
        ids = torch.from_numpy(rng.integers(-3, layout.num_rows + 3, 20000))  # the bulk path's size
        check_rows(table.lookup(ids), layout, ids)


def _child(fn) -> int:
    """Run fn() in a forked child (killed after 20 s, so a hang fails the test); its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)
            code = 0 if fn() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


class _RaisesAsBeginReturns:
    """The library with ple_job_begin raising as it returns (as a signal's handler would, after
    the job lock was taken)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def ple_job_begin(self, *args):
        self._lib.ple_job_begin(*args)
        raise KeyboardInterrupt


def test_an_exception_anywhere_in_a_job_leaves_nothing_locked(lib, spaces, rng):
    tables, reference = spaces
    rows = torch.from_numpy(rng.integers(0, tables[0].shape[0], 3000))
    out = torch.full((3000, tables[0].shape[1]), 0xAB, dtype=torch.uint8)
    copier = rowcopy.RowCopy(lib, 3, block=64)
    with pytest.raises(ZeroDivisionError):
        with copier.job([(tables[0], 0, 3000)], rows, out) as wait:
            wait(100)
            1 / 0  # noqa: B018 - an error in the caller's body
    assert torch.equal(out, reference[0][rows])  # the job still completed
    interrupted = rowcopy.RowCopy(lib, 3)
    interrupted.lib = _RaisesAsBeginReturns(lib)
    with pytest.raises(KeyboardInterrupt):
        with interrupted.job([(tables[0], 0, 3000)], rows, out):
            pass
    done = threading.Event()  # another thread's job runs: the lock was released
    threading.Thread(
        target=lambda: (copier.copy(tables[1], rows % tables[1].shape[0], out), done.set())
    ).start()
    assert done.wait(30)
    assert torch.equal(out, reference[1][rows % tables[1].shape[0]])


def test_jobs_do_not_nest_in_one_thread(lib, spaces, rng):
    tables, reference = spaces
    rows = torch.from_numpy(rng.integers(0, tables[0].shape[0], 500))
    out, inner = (torch.full((500, tables[0].shape[1]), 0xAB, dtype=torch.uint8) for _ in range(2))
    copier = rowcopy.RowCopy(lib, 3, block=16)
    with copier.job([(tables[0], 0, 500)], rows, out):
        with pytest.raises(RuntimeError, match="do not nest"):
            with copier.job([(tables[0], 0, 500)], rows, inner):
                pass
    assert torch.equal(out, reference[0][rows])  # the outer job was not ended by the inner one
    copier.copy(tables[0], rows, inner)
    assert torch.equal(inner, reference[0][rows])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_while_another_thread_is_inside_a_job(lib, spaces, rng):
    """The child has no owner for that job: its own jobs run (the fork hook is in place even when
    no pool was ever started: one thread)."""
    tables, reference = spaces
    rows = torch.from_numpy(rng.integers(0, tables[0].shape[0], 2000))
    want = reference[0][rows]
    held, release = threading.Event(), threading.Event()
    out, child_out = (torch.full_like(want, 0xAB) for _ in range(2))

    def hold():
        with rowcopy.RowCopy(lib, 1).job([(tables[0], 0, 2000)], rows, out):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    try:
        code = _child(
            lambda: (
                rowcopy.RowCopy(lib, 1).copy(tables[0], rows, child_out),
                np.array_equal(child_out.numpy(), want.numpy()),
            )[1]
        )
    finally:
        release.set()
        holder.join(30)
    assert code == 0
    assert torch.equal(out, want)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_inside_a_job_completes_it_in_the_child(lib, spaces, rng):
    tables, reference = spaces
    n = 500000  # 62 500 blocks of 8: the workers are still at it when the fork comes
    rows = torch.from_numpy(rng.integers(0, tables[2].shape[0], n))
    want = reference[2][rows]
    for _ in range(20):  # some of the forks catch a worker inside a block (not every one: timing)
        out = torch.full_like(want, 0xAB)
        with rowcopy.RowCopy(lib, 4, block=8).job([(tables[2], 0, n)], rows, out) as wait:
            wait(1000)

            def finish(out=out, wait=wait):
                wait(n)  # the blocks the parent's workers held are handed out again
                return np.array_equal(out.numpy()[:n], want.numpy())

            assert _child(finish) == 0
        assert torch.equal(out, want)
