"""Reliability: threads, page-cache eviction, and the files after long runs.

- 8 threads look up at once for a few seconds; every row of every result is compared with the
  reference (the whole table read once with plain reads): the cpu mode's two host paths (the C
  row copy, and the synchronous one of PLE_UM_ROWCOPY=0) with lookups of up to INLINE_ROWS ids
  and of more (the C copy's inline and pooled sizes, the synchronous path's one chunk and many),
  and the ats mode's kernel under the interpreter.
- The table's pages are dropped from the page cache between lookups (our page-table entries with
  MADV_DONTNEED, then the file's cached pages with fsync + POSIX_FADV_DONTNEED): every lookup
  still returns the file's rows.
- Thousands of lookups in every mode that runs here, raw and dequantized, with prefetch and
  populate, leave every file's bytes (sha256), size and modification time as they were.

The Triton interpreter is not thread-safe (it patches triton.language for the duration of a
launch), so in the ats test launches are serialized by a lock around the real kernel call, as a
GPU stream would run them one after another; everything else in the lookup runs concurrently.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest
import torch
from helpers.machines import GH200
from helpers.reference import bits_differ, reference_rows

import ple_um
import ple_um.lookup.gpu_gather
from ple_um.access.capabilities import triton_interpreter
from ple_um.lookup.rowcopy import INLINE_ROWS
from ple_um.mapping import PAGE
from ple_um.residency import evict_pages

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]


class Reference:
    """The whole table read once with plain reads; the expected result of any lookup."""

    def __init__(self, layout, rows: tuple[int, int] | None = None) -> None:
        self.layout = layout
        self.rows = rows
        self.raw = reference_rows(layout, np.arange(layout.num_rows), rows)

    def expect(self, ids: np.ndarray, out_dtype: torch.dtype | None) -> torch.Tensor:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        inside = (ids >= 0) & (ids < self.layout.num_rows)
        raw = np.zeros((ids.size, self.layout.row_bytes), dtype=np.uint8)
        raw[inside] = self.raw[ids[inside]]
        rows = torch.from_numpy(raw).view(self.layout.dtype)
        if out_dtype is None or out_dtype == self.layout.dtype:
            return rows
        value = rows.float()
        if self.layout.scale is not None:
            value = value * torch.tensor(self.layout.scale, dtype=torch.float32)
        return value.to(out_dtype)

    def same(self, got: torch.Tensor, ids: np.ndarray, out_dtype: torch.dtype | None) -> bool:
        expect = self.expect(ids, out_dtype)
        raw = expect.dtype not in (torch.bfloat16, torch.float16, torch.float32)
        return bits_differ(got.reshape(expect.shape), expect, raw=raw) is None


def hammer(table, ref: Reference, *, threads: int, seconds: float, sizes: tuple[int, int], seed: int):
    """``threads`` threads look up random batches (sizes in ``[lo, hi]``, with duplicates and ids
    outside the table) for ``seconds``, raw and dequantized, allocating or into ``out``; every
    result is checked. Returns (lookups, ids, ids outside the table, mismatches, errors)."""
    n_rows = table.num_rows
    results = [(0, 0, 0, 0) for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def run(k: int) -> None:
        rng = np.random.default_rng(seed + k)
        lookups = ids_seen = outside = bad = 0
        try:
            start.wait()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                n = int(rng.integers(sizes[0], sizes[1] + 1))
                ids = rng.integers(-3, n_rows + 3, n)
                ids[: n // 4] = ids[n // 2 : n // 2 + n // 4]  # duplicates
                out_dtype = (None, torch.bfloat16, torch.float32)[lookups % 3]
                tensor = torch.from_numpy(ids).to(torch.int32 if lookups % 2 else torch.int64)
                if lookups % 4 == 3:
                    out = torch.empty((n, table.row_dim), dtype=out_dtype or table.dtype)
                    got = table.lookup(tensor, out=out)
                else:
                    got = table.lookup(tensor, out_dtype=out_dtype)
                bad += not ref.same(got, ids, out_dtype)
                lookups, ids_seen = lookups + 1, ids_seen + n
                outside += int(((ids < 0) | (ids >= n_rows)).sum())
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        results[k] = (lookups, ids_seen, outside, bad)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=seconds + 300)
    assert not any(w.is_alive() for w in workers), "a lookup thread hangs"
    return tuple(sum(r[i] for r in results) for i in range(4)) + (errors,)


# -- 8 threads at once ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes", [(1, INLINE_ROWS), (INLINE_ROWS + 1, 16 * INLINE_ROWS)], ids=["small", "big"]
)
@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_eight_threads_in_cpu_mode(make_checkpoint, monkeypatch, rowcopy, sizes, rng):
    # The C copy: a pool of 2 threads shared by the 8 callers; the synchronous path: chunks of 2048
    # ids. 3 files, 8 shards.
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "2")
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    monkeypatch.setenv("PLE_UM_CPU_CHUNK", "2048")
    layout = make_checkpoint(
        num_rows=30000, row_dim=12, dtype="fp8", shards=8, seed=int(rng.integers(1 << 30))
    )
    ref = Reference(layout)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        lookups, ids, outside, bad, errors = hammer(
            table, ref, threads=8, seconds=2.5, sizes=sizes, seed=int(rng.integers(1 << 30))
        )
        assert not errors, errors[:3]
        assert bad == 0, f"{bad} of {lookups} concurrent lookups differ from the reference"
        assert lookups >= 8
        # The cpu mode counts on the host: every lookup and every id of every thread, exactly.
        stats = table.stats()
        assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (lookups, ids, outside)
        assert stats["bytes"] == ids * layout.row_bytes
    print(f"cpu {table.row_reads}: {lookups} lookups, {ids} ids, 8 threads")


def test_eight_threads_in_ats_mode(make_checkpoint, monkeypatch, rng):
    layout = make_checkpoint(
        num_rows=3000, row_dim=12, dtype="fp8", shards=6, seed=int(rng.integers(1 << 30))
    )
    ref = Reference(layout)
    launch = threading.Lock()
    gather_rows = ple_um.lookup.gpu_gather.gather_rows

    def serialized(*args, **kwargs):
        with launch:
            return gather_rows(*args, **kwargs)

    monkeypatch.setattr(ple_um.lookup.gpu_gather, "gather_rows", serialized)
    with ple_um.open_table(layout.directory, mode="ats", device="cpu") as table:
        lookups, ids, outside, bad, errors = hammer(
            table, ref, threads=8, seconds=2.5, sizes=(1, 40), seed=int(rng.integers(1 << 30))
        )
        assert not errors, errors[:3]
        assert bad == 0, f"{bad} of {lookups} concurrent lookups differ from the reference"
        assert lookups >= 8
        # The device counters are atomic: every id of every thread is counted.
        stats = table.stats()
        assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (lookups, ids, outside)
    print(f"ats: {lookups} lookups, {ids} ids, 8 threads")


# -- the page cache dropped between lookups -------------------------------------------------------------
def evict(table) -> None:
    """Drop the table's pages: our page-table entries (MADV_DONTNEED on a shared file mapping only
    unmaps; the next read faults the page back in from the cache or the disk), then the file's
    pages in the page cache (written back first)."""
    evict_pages(table.layout.files, table.mapping.regions)


@pytest.mark.parametrize(("mode", "sizes"), [("cpu", (50, 3000)), ("cpu", (16385, 18000)), ("ats", (10, 40))])
def test_lookups_survive_the_page_cache_being_dropped(make_checkpoint, mode, sizes, rng):
    # 4 MiB in 2 files, rows of 512 bytes: 8 rows a page.
    layout = make_checkpoint(
        num_rows=8192, row_dim=512, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )
    ref = Reference(layout, (100, 8000))
    observed = []
    with ple_um.open_table(layout.directory, mode=mode, device="cpu", rows=(100, 8000)) as table:
        for k in range(8):
            evict(table)
            observed.append(sum(r for _, r, _ in table.mapping.residency()))
            n = int(rng.integers(sizes[0], sizes[1] + 1))
            ids = rng.integers(-5, layout.num_rows + 5, n)
            out_dtype = (None, torch.bfloat16)[k % 2]
            got = table.lookup(torch.from_numpy(ids), out_dtype=out_dtype)
            assert ref.same(got, ids, out_dtype), f"lookup {k} after eviction differs from the files"
        if min(observed) > 16 * PAGE:
            print(f"eviction not observable here (resident after eviction: {observed})")
        else:
            assert max(observed) <= table.mapping.mapped_bytes // 2  # the drops did take the pages away


# -- the files after long runs ------------------------------------------------------------------------
def fingerprint(layout) -> dict[str, tuple[str, int, int]]:
    out = {}
    for path in layout.files:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        st = os.stat(path)
        out[path] = (digest, st.st_size, st.st_mtime_ns)
    return out


# mode -> (lookups, largest batch); the interpreter modes are slow, the cpu mode is not.
RUNS = {
    "cpu": (2000, 1000),
    "cpu+prewarm": (100, 30000),
    "ats": (60, 32),
    "ats+populate": (40, 32),
    "device": (60, 32),
    "registered": (60, 32),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_files_unchanged_after_a_long_run(make_checkpoint, monkeypatch, machine, run, rng):
    # A write through the mapping faults and leaves the file as it was:
    # test_mapping.py::test_write_through_the_mapping_faults_and_leaves_the_file.
    layout = make_checkpoint(
        num_rows=5000, row_dim=40, dtype="fp8", shards=6, seed=int(rng.integers(1 << 30))
    )
    mode = run.split("+")[0]
    if run == "cpu+prewarm":
        monkeypatch.setenv("PLE_UM_PREWARM", "1")  # MappedShards.populate at open
    if mode == "registered":
        machine()
    if run == "ats+populate":
        machine(GH200)  # registration populates the mapping
        monkeypatch.setenv("PLE_UM_ATS_POPULATE", "1")
        monkeypatch.setenv("PLE_UM_PREWARM", "1")
    before = fingerprint(layout)
    ref = Reference(layout)
    count, largest = RUNS[run]
    out_dtypes = (None, torch.bfloat16, torch.float16, torch.float32)
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        for k in range(count):
            n = int(rng.integers(1, largest + 1))
            ids = rng.integers(-3, layout.num_rows + 3, n)
            out_dtype = out_dtypes[k % 4]
            if k % 5 == 0:
                table.prefetch(torch.from_numpy(ids)).result(timeout=60)
            got = table.lookup(torch.from_numpy(ids), out_dtype=out_dtype)
            if k % 10 == 0 or k == count - 1:
                assert ref.same(got, ids, out_dtype), f"lookup {k} differs from the files"
        table.mapping.populate(fraction=1.0, workers=2)
        assert table.mapping.changed_files() == []
        assert table.stats()["lookups"] == count
    assert fingerprint(layout) == before
