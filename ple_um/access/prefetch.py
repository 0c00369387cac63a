"""PagePrefetcher: CPU threads that fault in the pages a coming lookup will read.

Under ATS the GPU's faults on file pages that are not resident are served one page at a time by
the OS, which is slow; touching the rows from CPU threads first (in parallel, many faults in
flight) makes the GPU's reads hit resident pages. A hint only: lookups are correct without it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ple_um.mapping import MappedShards


class PagePrefetcher:
    """Touches rows of a MappedShards from a small thread pool; owns the threads."""

    def __init__(self, mapping: MappedShards, threads: int = 4) -> None:
        self.mapping = mapping
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ple-um-prefetch")

    def submit(self, ids, touch=None) -> Future:
        """Start touching the rows of ``ids`` (CPU tensor or array of global ids); returns a Future
        of the number of distinct rows touched. Each id goes to one thread once (an id asked for
        twice would otherwise be read twice, by two threads at once). ``touch(ids) -> rows``: what a
        thread does with its part of them (default: fault in their pages, ``MappedShards.touch_rows``)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().to("cpu").numpy()
        flat = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        parts = np.array_split(flat, min(self.threads, max(1, flat.size // 256)))
        futures = [self.pool.submit(touch or self.mapping.touch_rows, p) for p in parts]
        done: Future = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def finish(_f) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result(sum(f.result() for f in futures))

        for f in futures:
            f.add_done_callback(finish)
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=True)
