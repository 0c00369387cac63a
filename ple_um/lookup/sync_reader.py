"""RowReader: the synchronous host path's reading of rows (``sync_gather.SyncGather`` uses one for
the rows and one for an NVFP4 table's block scales).

Ids come to the host (the caller waits for the device), are deduplicated (small batches) and
grouped by file; a thread pool reads the rows from the mmap into pinned staging, which is copied to
the device asynchronously, in chunks, and expanded there. Staging buffers are used in turn and each
carries the CUDA event of the copy that reads it: a buffer is refilled only after its copy finished.
Big batches are not deduplicated: their ids are grouped by file where they are (on the GPU with
torch ops, on the host with a radix sort of the space numbers), read file after file with one
``torch.index_select`` per chunk and put in place on the device. Without a CUDA device everything
stays on the CPU and the result is a CPU tensor.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ple_um.mapping import MappedShards

# Below this many unique rows, a thread pool's dispatch costs more than the reads.
INLINE_ROWS = 4096
# Up to this many ids a lookup is deduplicated; above it rows are only grouped by file (row space).
DEDUP_ROWS = 16384
# Rows per host-to-device copy when a big gather is pipelined: the smallest chunk whose per-copy
# overhead does not show (docs/lab/PERF_NOTES.md). The last chunk is cut to TAIL_ROWS: its copy is
# the one nothing overlaps.
PIPELINE_ROWS = 32768
TAIL_ROWS = 4096


class _Slot:
    """One pinned staging buffer (rows; and int64s: a deduplicated gather's inverse index or a big
    gather's plan) and the event of its last copy."""

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

    def copied(self, device: torch.device) -> None:
        """Mark the copies just queued out of this slot: it is refilled only after they ran."""
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))


def _phases(t0: float, t1: float, t_read: float, t_wait: float) -> dict[str, float]:
    """Seconds of a staged gather: planning on the host (dedup, until ``t1``), then reading rows,
    staging and copying, and waiting (for a staging slot, or for the plan the device made)."""
    return {
        "dedup": t1 - t0,
        "gather": t_read,
        "stage": time.perf_counter() - t1 - t_read - t_wait,
        "wait": t_wait,
    }


def _segments(counts: list[int]) -> list[tuple[int, int, int]]:
    """(space, start, end) of each row space's run in rows grouped by space, from the per-space
    counts whose first entry is the number of ids not owned (grouped first, and not read)."""
    segments, start = [], 0
    for k, count in enumerate(counts[1:]):
        if count:
            segments.append((k, start, start + count))
            start += count
    return segments


def _chunks(segments: list[tuple[int, int, int]], step: int, tail: int) -> list[tuple[int, int, int]]:
    """(space, start, end) pieces of at most ``step`` rows of each segment, the very last piece
    at most ``tail`` rows."""
    chunks = [(k, a, min(a + step, b)) for k, a0, b in segments for a in range(a0, b, step)]
    if chunks and chunks[-1][2] - chunks[-1][1] > tail:
        k, a, b = chunks.pop()
        chunks += [(k, a, b - tail), (k, b - tail, b)]
    return chunks


class RowReader:
    """Gathers rows of a MappedShards on the host; returns them on ``device``.

    Rows are read from "row spaces": 2-D views of a mapped file in which a row's position is its
    index. The shards of one file normally lie back to back, so one file is one row space and a
    batch needs one indexing call per file, not one per shard."""

    def __init__(
        self,
        mapping: MappedShards,
        device: torch.device,
        *,
        threads: int,
        chunk: int,
        slots: int,
    ) -> None:
        layout = mapping.layout
        self.mapping = mapping
        self.device = device
        self.row_bytes = rb = layout.row_bytes
        self.rows_per_shard = layout.rows_per_shard
        self.chunk = max(1, chunk)
        self.spaces: list[np.ndarray] = []
        self.space_of_shard = np.full(layout.parts, -1, dtype=np.int32)
        self.row0_of_shard = np.zeros(layout.parts, dtype=np.int64)
        where: dict[tuple[int, int], int] = {}
        for index, owned in sorted(mapping.owned.items()):
            region = mapping.regions[owned.region]
            rel = owned.addr - region.addr
            residue = rel % rb
            key = (owned.region, residue)
            if key not in where:
                where[key] = len(self.spaces)
                count = (region.length - residue) // rb
                self.spaces.append(region.array()[residue : residue + count * rb].reshape(count, rb))
            self.space_of_shard[index] = where[key]
            self.row0_of_shard[index] = (rel - residue) // rb - owned.lo
        self.space_dtype = np.int16 if len(self.spaces) < 1 << 15 else np.int32
        self.space_tensors = [torch.from_numpy(a) for a in self.spaces]
        self.space_of_shard_t = torch.from_numpy(self.space_of_shard.astype(np.int64))
        self.row0_of_shard_t = torch.from_numpy(self.row0_of_shard)
        self._device_maps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ple-um-gather")
        self.cuda = device.type == "cuda"
        self.slots = max(1, slots)
        self._slots = [_Slot() for _ in range(self.slots)] if self.cuda else []
        self._next = 0
        self._lock = threading.Lock()  # one gather at a time owns the slot ring
        self.last_phases: dict[str, float] = {}

    def _plan(self, ids: np.ndarray, owned: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(space, row, inverse, skip): the rows to read, grouped by row space (the first ``skip``
        are zero rows, for ids not owned), and for each id its position in that list.

        Small batches are deduplicated (np.unique: repeated n-grams are common and each saved row
        is a saved page fault); big ones are not. Grouping is a stable radix sort of the 16-bit
        space numbers, far cheaper than a sort of the ids."""
        if ids.size <= DEDUP_ROWS:
            keys, inverse = np.unique(np.where(owned, ids, -1), return_inverse=True)
            inverse = inverse.reshape(-1)
            valid = keys >= 0
        else:
            keys, inverse, valid = ids, None, owned
        shard = np.where(valid, keys // self.rows_per_shard, 0)
        space = np.where(valid, self.space_of_shard[shard], -1).astype(self.space_dtype)
        row = self.row0_of_shard[shard] + (keys - shard * self.rows_per_shard)
        order = np.argsort(space, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        inverse = rank if inverse is None else rank[inverse]
        skip = int(np.count_nonzero(~valid))
        return space[order], row[order], inverse, skip

    def _read(self, space: np.ndarray, row: np.ndarray, out: np.ndarray) -> None:
        """Rows ``row`` of row spaces ``space`` (grouped by space) into ``out`` [n, row_bytes]."""
        n = space.size
        if n == 0:
            return
        bounds = np.flatnonzero(np.diff(space)) + 1
        starts = [0, *bounds.tolist()]
        ends = [*bounds.tolist(), n]
        step = n if n <= INLINE_ROWS else max(self.chunk, -(-n // self.threads))
        tasks = [
            (int(space[a]), c, min(c + step, b))
            for a, b in zip(starts, ends, strict=True)
            for c in range(a, b, step)
        ]

        def run(task) -> None:
            k, a, b = task
            # np.take releases the GIL for the copy, so tasks overlap across threads; mode="clip"
            # skips the bounds pass (every row is in range by construction).
            np.take(self.spaces[k], row[a:b], axis=0, out=out[a:b], mode="clip")

        if len(tasks) == 1:
            run(tasks[0])
        else:
            for _ in self.pool.map(run, tasks):
                pass

    def gather(self, ids: torch.Tensor, owned: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Raw rows [n, row_bytes] (uint8, on the device) for flat int64 ``ids`` (on the host or the
        device), into ``out`` when given; positions where ``owned`` is False get zeros."""
        if out is None:
            out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8, device=self.device)
        if ids.numel() > DEDUP_ROWS:
            return self._gather_big(ids, owned, out)
        ids, owned = ids.cpu(), owned.cpu()
        t0 = time.perf_counter()
        space, row, inverse, skip = self._plan(ids.numpy(), owned.numpy())
        n_keys, n = space.size, ids.numel()
        t1 = time.perf_counter()
        if not self.cuda:
            rows = torch.empty((n_keys, self.row_bytes), dtype=torch.uint8)
            rows[:skip].zero_()
            self._read(space[skip:], row[skip:], rows.numpy()[skip:])
            t2 = time.perf_counter()
            np.take(rows.numpy(), inverse, axis=0, out=out.numpy(), mode="clip")
            t3 = time.perf_counter()
            self.last_phases = {"dedup": t1 - t0, "gather": t2 - t1, "stage": t3 - t2, "wait": 0.0}
            return out
        with self._lock:
            slot, t_wait = self._take_slot(n_keys, n)
            rows = slot.rows[:n_keys]
            rows_np = rows.numpy()
            rows[:skip].zero_()
            dev_rows = torch.empty((n_keys, self.row_bytes), dtype=torch.uint8, device=self.device)
            # Chunks: the copy of one chunk runs while the threads read the next.
            step = max(PIPELINE_ROWS, -(-n_keys // 8))
            t_read = 0.0
            for a in range(0, n_keys, step):
                b = min(a + step, n_keys)
                tr = time.perf_counter()
                lo = max(a, skip)
                if b > lo:
                    self._read(space[lo:b], row[lo:b], rows_np[lo:b])
                t_read += time.perf_counter() - tr
                dev_rows[a:b].copy_(rows[a:b], non_blocking=True)
            inv = slot.inverse[:n]
            inv.copy_(torch.from_numpy(inverse))
            dev_inv = inv.to(self.device, non_blocking=True)
            slot.copied(self.device)
            torch.index_select(dev_rows, 0, dev_inv, out=out)
        self.last_phases = _phases(t0, t1, t_read, t_wait)
        return out

    def _take_slot(self, n_rows: int, n_ids: int) -> tuple[_Slot, float]:
        """The next staging slot, grown to size once the copies out of it finished (the seconds
        waited for them). Called with the lock held."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        t0 = time.perf_counter()
        slot.reserve(n_rows, self.row_bytes, n_ids)
        return slot, time.perf_counter() - t0

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(space of each shard, row of each shard's local row 0 in its space) on ``device``."""
        if device.type == "cpu":
            return self.space_of_shard_t, self.row0_of_shard_t
        if self._device_maps is None:
            self._device_maps = (self.space_of_shard_t.to(device), self.row0_of_shard_t.to(device))
        return self._device_maps

    def _gather_big(self, ids: torch.Tensor, owned: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A big batch: no dedup. Ids still on the GPU are grouped there with torch ops (a sort of
        the space numbers; this path runs no Triton kernel, so that it works where the GPU modes'
        kernels do not), ids on the host with a radix sort of the 16-bit space numbers, then as
        ``_read_planned``."""
        t0 = time.perf_counter()
        S = self.rows_per_shard
        space_of_shard, row0 = self._maps(ids.device)
        shard = torch.where(owned, ids // S, 0)
        space = torch.where(owned, space_of_shard[shard], -1)
        row = row0[shard] + (ids - shard * S)
        n_counts = len(self.spaces) + 1
        if ids.is_cuda:
            # Narrow keys: a radix sort of 16 (or 32) bits takes fewer passes than of 64.
            key = space.to(torch.int16 if self.space_dtype == np.int16 else torch.int32)
            order = torch.sort(key, stable=True).indices
            counts = torch.zeros(n_counts, dtype=torch.int64, device=ids.device)
            counts.index_add_(0, space + 1, torch.ones_like(space))  # bincount would sync
        else:
            order = torch.from_numpy(np.argsort(space.numpy().astype(self.space_dtype), kind="stable"))
            counts = torch.from_numpy(np.bincount(space.numpy() + 1, minlength=n_counts))
        plan = torch.cat((counts, row[order]))
        return self._read_planned(plan, order, ids.numel(), n_counts, out, t0)

    def _read_planned(
        self, plan: torch.Tensor, order: torch.Tensor, n: int, n_counts: int, out: torch.Tensor, t0: float
    ) -> torch.Tensor:
        """Read the rows a plan lists into ``out``: ``plan[:n_counts]`` ids per bin (bin 0: not
        owned, not read; bin 1 + s: row space s), then the row numbers grouped by bin; ``order``
        the batch position of each. Rows are read with one torch.index_select per chunk (on torch's
        own threads) into pinned staging, copied to the device chunk by chunk while the next is
        read, and put in place there with index_copy_."""
        if not self.cuda:
            counts = plan[:n_counts].tolist()
            skip = counts[0]
            rows, order = plan[n_counts + skip :], order[skip:]
            if skip:
                out.zero_()
            t1 = time.perf_counter()
            for k, a, b in _segments(counts):
                out.index_copy_(0, order[a:b], torch.index_select(self.space_tensors[k], 0, rows[a:b]))
            t2 = time.perf_counter()
            self.last_phases = {"dedup": t1 - t0, "gather": t2 - t1, "stage": 0.0, "wait": 0.0}
            return out
        on_device = plan.is_cuda
        t1 = time.perf_counter()
        with self._lock:
            slot, t_wait = self._take_slot(n, n + n_counts)
            host_plan = slot.inverse[: n + n_counts]
            host_plan.copy_(plan, non_blocking=on_device)
            if on_device:
                tw = time.perf_counter()
                torch.cuda.current_stream(self.device).synchronize()  # the plan has arrived
                t_wait += time.perf_counter() - tw
            counts = host_plan[:n_counts].tolist()
            skip = counts[0]
            rows_of = host_plan[n_counts + skip :]
            order = order[skip:].to(self.device, non_blocking=True)
            if skip:
                out.zero_()
            n_valid = n - skip
            staged = slot.rows[:n_valid]
            dev_rows = torch.empty((n_valid, self.row_bytes), dtype=torch.uint8, device=self.device)
            t_read = 0.0
            try:
                for k, a, b in _chunks(_segments(counts), PIPELINE_ROWS, TAIL_ROWS):
                    tr = time.perf_counter()
                    torch.index_select(self.space_tensors[k], 0, rows_of[a:b], out=staged[a:b])
                    t_read += time.perf_counter() - tr
                    dev_rows[a:b].copy_(staged[a:b], non_blocking=True)
            finally:
                slot.copied(self.device)  # copies queued before an error still read the slot
            out.index_copy_(0, order, dev_rows)
        self.last_phases = _phases(t0, t1, t_read, t_wait)
        return out

    def close(self) -> None:
        """Wait for copies still reading the staging buffers, then stop the threads; idempotent."""
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
        self._slots = []
        self.pool.shutdown(wait=True)
        self.spaces = []
