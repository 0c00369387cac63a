"""CpuGather: the cpu access mode, the seeds' gather done properly.

Ids come to the host (a sync: the cpu mode is not capture-safe), are deduplicated, rows are read
from the mmap by a thread pool into pinned staging, copied to the device asynchronously and
expanded there. Staging buffers are used in turn and each carries the CUDA event of the copy that
reads it: a buffer is refilled only after its copy finished (the latest seed overwrote its one
buffer while the previous copy could still read it). Without a CUDA device everything stays on the
CPU and the result is a CPU tensor.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ple_um.mapping import MappedShards

# Below this many unique rows, a thread pool's dispatch costs more than the reads.
INLINE_ROWS = 4096


class _Slot:
    """One pinned staging buffer (rows, then the inverse index) and the event of its last copy."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def reserve(self, n_rows: int, row_bytes: int, n_ids: int) -> None:
        if self.event is not None:
            self.event.synchronize()  # the previous copy out of this buffer has finished
        if self.rows is None or self.rows.shape[0] < n_rows:
            self.rows = torch.empty((max(n_rows, 1024), row_bytes), dtype=torch.uint8, pin_memory=True)
        if self.inverse is None or self.inverse.numel() < n_ids:
            self.inverse = torch.empty(max(n_ids, 4096), dtype=torch.int64, pin_memory=True)


class CpuGather:
    """Gathers rows of a MappedShards on the host; returns them on ``device``."""

    def __init__(
        self, mapping: MappedShards, device: torch.device, *, threads: int, chunk: int, slots: int
    ) -> None:
        layout = mapping.layout
        self.mapping = mapping
        self.device = device
        self.row_bytes = layout.row_bytes
        self.rows_per_shard = layout.rows_per_shard
        self.chunk = max(1, chunk)
        self.shards = {i: torch.from_numpy(mapping.shard_rows(i)) for i in mapping.owned}
        self.lo = {i: o.lo for i, o in mapping.owned.items()}
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ple-um-gather")
        self.cuda = device.type == "cuda"
        self._slots = [_Slot() for _ in range(max(1, slots))] if self.cuda else []
        self._next = 0
        self._lock = threading.Lock()  # one gather at a time owns the slot ring
        self.last_phases: dict[str, float] = {}

    def _read(self, uniq: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of the sorted, owned global ids ``uniq`` into ``out`` [len(uniq), row_bytes].

        One index_select per shard segment; big batches are cut into about one task per thread
        (never one task per shard: with 128 shards the dispatch would cost more than the reads)."""
        shard = torch.div(uniq, self.rows_per_shard, rounding_mode="floor")
        present, counts = torch.unique_consecutive(shard, return_counts=True)
        segments = []  # (shard index, start, end) in uniq
        start = 0
        for index, count in zip(present.tolist(), counts.tolist(), strict=True):
            segments.append((index, start, start + count))
            start += count

        def run(group) -> None:
            for index, a, b in group:
                local = uniq[a:b] - (index * self.rows_per_shard + self.lo[index])
                torch.index_select(self.shards[index], 0, local, out=out[a:b])

        n = uniq.numel()
        workers = self.pool._max_workers
        if n <= INLINE_ROWS or workers == 1:
            run(segments)
            return
        per_task = max(self.chunk, -(-n // workers))
        groups, group, filled = [], [], 0
        for index, a, b in segments:
            while a < b:
                take = min(b - a, per_task - filled)
                group.append((index, a, a + take))
                filled += take
                a += take
                if filled == per_task:
                    groups.append(group)
                    group, filled = [], 0
        if group:
            groups.append(group)
        for _ in self.pool.map(run, groups):
            pass

    def gather(self, ids: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
        """Raw rows [n, row_bytes] (uint8, on the device) for flat int64 CPU ``ids``; positions where
        ``owned`` is False get zeros."""
        t0 = time.perf_counter()
        keyed = torch.where(owned, ids, -1)
        uniq, inverse = torch.unique(keyed, sorted=True, return_inverse=True)
        # A -1 key (rows not owned, or not in the table) sorts first and reads as a zero row.
        skip = 1 if uniq.numel() and int(uniq[0]) < 0 else 0
        t1 = time.perf_counter()
        n_uniq = uniq.numel()
        if not self.cuda:
            rows = torch.empty((n_uniq, self.row_bytes), dtype=torch.uint8)
            if skip:
                rows[0].zero_()
            self._read(uniq[skip:], rows[skip:])
            t2 = time.perf_counter()
            out = rows[inverse]
            self.last_phases = {
                "dedup": t1 - t0,
                "gather": t2 - t1,
                "stage": time.perf_counter() - t2,
                "wait": 0.0,
            }
            return out
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            tw = time.perf_counter()
            slot.reserve(n_uniq, self.row_bytes, ids.numel())
            t_wait = time.perf_counter() - tw
            rows = slot.rows[:n_uniq]
            if skip:
                rows[0].zero_()
            self._read(uniq[skip:], rows[skip:])
            t2 = time.perf_counter()
            inv = slot.inverse[: ids.numel()]
            inv.copy_(inverse)
            stream = torch.cuda.current_stream(self.device)
            dev_rows = rows.to(self.device, non_blocking=True)
            dev_inv = inv.to(self.device, non_blocking=True)
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record(stream)
            out = dev_rows[dev_inv]
        self.last_phases = {
            "dedup": t1 - t0,
            "gather": t2 - t1 - t_wait,
            "stage": time.perf_counter() - t2,
            "wait": t_wait,
        }
        return out

    def close(self) -> None:
        """Wait for copies still reading the staging buffers, then stop the threads; idempotent."""
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
        self._slots = []
        self.pool.shutdown(wait=True)
        self.shards.clear()
