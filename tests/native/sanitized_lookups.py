"""Lookups through a sanitized build of the row copy (run by test_sanitizers.py, in a process whose
sanitizer runtime is preloaded): ``python sanitized_lookups.py LIBRARY CHECKPOINT_DIR [-DNAME ...]``
(the ``-D`` flags the library was built with beyond the shipped ones, for its digest).

What runs in C, on an NVFP4 table (each lookup reads its rows and their block scales): the row
copy (rowcopy.c) over a mapping and through a row cache small enough to evict all the time
(rowcache.c, its slots rewritten while other threads copy them) with the block scales' follower
cache, the reader of misses (reader.c: io_uring where this kernel gives a ring, and its threads;
O_DIRECT where the files take it, plain reads), the page touch, the pool's workers (pool.c)
splitting each lookup, and the dispatcher thread (rowcopy.c) running posted lookups at the same
time as the ones this thread runs. One Python thread: the threads that race are the C
code's own (Python's, not built for the sanitizer, would be reported without the GIL's ordering).
Every row is checked against the reference read from the files; the exit code is 0 only when all
were exact (a sanitizer that finds a fault ends the process first).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.reference import reference_rows  # noqa: E402
from helpers.rowcopy_jobs import boundary_ids, make_job, open_library  # noqa: E402

from ple_um.checkpoint import read_layout  # noqa: E402
from ple_um.lookup import rowcopy  # noqa: E402
from ple_um.lookup.host.file_reads import FileReader, choose_strategy  # noqa: E402
from ple_um.lookup.host.row_cache import WAYS, RowCache  # noqa: E402
from ple_um.mapping import MappedShards  # noqa: E402

# Rounds of lookups (SANITIZED_LOOKUPS: the test that looks for the unannotated race asks for more).
LOOKUPS, BATCH = int(os.environ.get("SANITIZED_LOOKUPS", "8")), 600


def main(library: str, directory: str, *defines: str) -> int:
    lib, why = open_library(library, defines=defines)
    if lib is None:
        print(f"cannot use {library}: {why}", file=sys.stderr)
        return 2
    layout = read_layout(directory, 1)
    layouts = (layout, layout.scale_layout())  # the rows, their block scales
    owned = (layout.rows_per_shard // 2, layout.num_rows - 3)
    pool = rowcopy.Pool(lib, 4)
    bad: list[str] = []
    counts = rowcopy.Counts()
    with contextlib.ExitStack() as stack:
        mappings = [stack.enter_context(MappedShards(part, owned)) for part in layouts]
        strategy, _ = choose_strategy(lib, "auto")
        readers = {
            direct: [
                stack.enter_context(
                    contextlib.closing(FileReader(m, strategy=strategy, direct=direct, depth=8))
                )
                for m in mappings
            ]
            for direct in (False, True)
        }
        # 64 slots for ~2 000 rows, admitting every row: evictions all along, slots rewritten while
        # other threads copy them (the sequence lock's race); the block scales' cache follows.
        cache = stack.enter_context(
            contextlib.closing(RowCache(4 * WAYS, layout.row_bytes, counts, policy="lru"))
        )
        scales = RowCache(4 * WAYS, layouts[1].row_bytes, rowcopy.Counts(), policy="lru", follows=cache)
        stack.enter_context(contextlib.closing(scales))  # closed before the cache it follows
        if lib.ple_dispatch_start() != 1:
            raise SystemExit("the dispatcher did not start")
        tables = {
            "mapped": [rowcopy.Rows(m) for m in mappings],
            "cached": [
                rowcopy.Rows(m, cache=c, reader=r)
                for m, c, r in zip(mappings, (cache, scales), readers[True], strict=True)
            ],
            "read": [rowcopy.Rows(m, reader=r) for m, r in zip(mappings, readers[False], strict=True)],
        }

        rng = np.random.default_rng(1)
        for k in range(LOOKUPS):
            posted = post(lib, tables["cached"], counts, layouts, owned, rng)  # runs meanwhile
            for name, rows in tables.items():
                ids_np = np.concatenate(
                    [
                        boundary_ids(layout, rng, BATCH // 2, owned),
                        rng.integers(owned[0], owned[0] + 200, BATCH // 2),
                    ]
                )  # the hot half: hits, and puts into few sets
                ids = torch.from_numpy(ids_np)
                outs = [
                    torch.full((ids.numel(), part.row_bytes), 0xA5, dtype=torch.uint8) for part in layouts
                ]
                job = make_job(rows, ids, outs, counts, threads=pool.threads, inline_rows=0)
                lib.ple_lookup_run(ctypes.addressof(job))
                if job.busy or not exact(outs, layouts, ids_np, owned):
                    bad.append(f"lookup {k} ({name}): rows differ")
                touch = make_job(rows, ids, [], counts, threads=pool.threads, inline_rows=0, touch=True)
                lib.ple_lookup_run(ctypes.addressof(touch))
            bad += finish(posted, layouts, owned)
    if counts.read()["cache_hits"] == 0 or counts.read()["cache_evictions"] == 0:
        bad.append(f"the row cache was not exercised: {counts.read()}")
    for line in bad:
        print(line, file=sys.stderr)
    print(f"{LOOKUPS * 5} lookups, {len(bad)} wrong; counts {counts.read()}")
    return 1 if bad else 0


def exact(outs, layouts, ids_np, owned) -> bool:
    """Whether the rows and the block scales looked up are the files'."""
    return all(
        np.array_equal(out.numpy(), reference_rows(part, ids_np, owned))
        for out, part in zip(outs, layouts, strict=True)
    )


def post(lib, rows, counts, layouts, owned, rng) -> list:
    """Two lookups posted to the dispatcher thread, ready at once: it runs them while this thread
    runs its own."""
    posted = []
    for _ in range(2):
        ids_np = boundary_ids(layouts[0], rng, BATCH, owned)
        ids = torch.from_numpy(ids_np)
        outs = [torch.full((ids.numel(), part.row_bytes), 0x5A, dtype=torch.uint8) for part in layouts]
        words = np.zeros(32, dtype=np.uint32)
        words[0] = 1  # the ready word, as the stream writes it once the ids are in place
        job = make_job(rows, ids, outs, counts, threads=2, inline_rows=0)
        job.seq, job.ready, job.done = 1, words.ctypes.data, words.ctypes.data + 64
        assert lib.ple_dispatch_post(ctypes.addressof(job)) == 0
        posted.append((job, ids, ids_np, outs, words))
    return posted


def finish(posted, layouts, owned) -> list[str]:
    bad = []
    deadline = time.monotonic() + 120
    for k, (job, _, ids_np, outs, words) in enumerate(posted):
        while job.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        if job.busy or int(words[16]) != 1:
            bad.append(f"dispatched lookup {k} never finished")
        elif not exact(outs, layouts, ids_np, owned):
            bad.append(f"dispatched lookup {k}: rows differ")
    return bad


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
