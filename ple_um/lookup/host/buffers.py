"""What the host path keeps per stream: pinned buffers for the ids and the staged rows, a ring of
job structs, the dispatcher's signal words, and how a big lookup is cut into chunks.

Eager lookups use one set of pinned buffers per stream (grown, never shrunk): the stream's order
makes reuse safe (the next lookup's ids arrive after the previous lookup's rows left). Each queued
lookup gets its job structs from the stream's ring; a struct is reused once its row copy has
finished (the C code clears its ``busy`` flag last). Lookups captured in a CUDA graph get job
structs of their own and the capture buffers of their stream, shared by the lookups captured on
that stream (replayed one at a time in stream order, as vLLM replays its graphs); a graph may
replay them at any time, so they are kept as long as the host gather.
"""

from __future__ import annotations

import threading
import time

import torch

from ple_um.lookup import rowcopy
from ple_um.lookup.host.driver import CUDA_ERROR_NOT_READY, CUDA_SUCCESS, HostNodeError
from ple_um.lookup.host.signals import SIGNAL_BYTES, signalled
from ple_um.lookup.streams import relaxed_capture_mode

# At most this many ids a lookup's rows are read by the thread that runs its row copy alone: below
# it the pool's hand-off costs more than it saves (docs/lab/PERF_NOTES.md).
INLINE_ROWS = 2048
# Lookups above this many ids are cut into chunks of it (bigger ones where MAX_CHUNKS would not
# hold them), the last one at most TAIL_ROWS: its copy to the device is the one nothing overlaps.
CHUNK_ROWS = 32768
TAIL_ROWS = 4096
MAX_CHUNKS = 16
# Job structs per stream's ring: lookups queued ahead of their row copies before a caller waits.
# A lookup takes one per chunk, so the ring must hold a whole lookup's (MAX_CHUNKS + 1) at once.
RING = 64
assert RING > MAX_CHUNKS + 1


def chunks(n: int) -> list[tuple[int, int]]:
    """[a, b) pieces of a lookup of ``n`` ids: one up to CHUNK_ROWS, else at most MAX_CHUNKS pieces
    of CHUNK_ROWS or more, with the last piece cut to at most TAIL_ROWS (MAX_CHUNKS + 1 in all)."""
    if n <= CHUNK_ROWS:
        return [(0, n)]
    step = max(CHUNK_ROWS, -(-n // MAX_CHUNKS))
    bounds = list(range(0, n, step)) + [n]
    pieces = list(zip(bounds[:-1], bounds[1:], strict=True))
    a, b = pieces[-1]
    if b - a > TAIL_ROWS:
        pieces[-1:] = [(a, b - TAIL_ROWS), (b - TAIL_ROWS, b)]
    return pieces


class PinnedBuffers:
    """Pinned ids and staging (one per table the lookup reads: rows, NVFP4 block scales) for
    lookups of up to ``capacity`` ids."""

    def __init__(self, capacity: int, row_bytes: tuple[int, ...]) -> None:
        self.capacity = capacity
        self.ids = torch.empty(capacity * 8, dtype=torch.uint8, pin_memory=True)
        self.staging = [torch.empty((capacity, rb), dtype=torch.uint8, pin_memory=True) for rb in row_bytes]
        self.ids_ptr = self.ids.data_ptr()
        self.staging_ptrs = [(s.data_ptr(), rb) for s, rb in zip(self.staging, row_bytes, strict=True)]


def check_pending(driver, streams: list[int], job) -> None:
    """Raise HostNodeError when ``job``'s row copy cannot run any more: one of ``streams`` (where it
    was queued) is in error, or they are all idle and its flag is still up (a host node that never
    ran, or a dispatched job whose stream no longer waits for it)."""
    states = [driver.query(stream) for stream in streams]
    failed = [rc for rc in states if rc not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY)]
    if failed:
        why = driver.error_name(failed[0])
        raise HostNodeError(f"a stream with queued lookups failed ({why}): their host nodes will not run")
    if all(rc == CUDA_SUCCESS for rc in states) and job.busy and not signalled(job):
        raise HostNodeError("a queued host node never ran: its stream is idle and its job is still pending")


class StreamState:
    """One stream's eager buffers (and those it outgrew, each kept until an event recorded after
    its last use has completed), the buffers of the lookups captured on it, its ring of job
    structs, its side stream and events for chunked lookups, and the dispatcher's signal words.
    ``lock`` keeps each lookup's operations together on the stream."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.lock = threading.Lock()
        self.buffers: PinnedBuffers | None = None
        self.retired: list[tuple[int, PinnedBuffers]] = []
        self.capture_buffers: PinnedBuffers | None = None
        self.ring = (rowcopy.LookupStruct * RING)()
        self.next = 0
        self.side: torch.cuda.ExternalStream | None = None
        self.events: list[int] = []
        # Per ring slot a ready word (written by the stream) and a done word (by the dispatcher),
        # each on its own 64-byte line; the last lookup's number.
        self.signals: torch.Tensor | None = None
        self.signals_device = 0
        self.seq = 0

    def words(self, driver) -> tuple[int, int]:
        """The host and device addresses of the signal words (made on first use)."""
        if self.signals is None:
            self.signals = torch.zeros(RING * SIGNAL_BYTES // 4, dtype=torch.int32, pin_memory=True)
            self.signals_device = driver.device_pointer(self.signals.data_ptr())
        return self.signals.data_ptr(), self.signals_device

    def slot(self, driver) -> int:
        """The index of the next job struct of the ring, once its previous lookup has finished.
        While it waits, the streams its work runs on are asked every ~0.1 s: a stream in error
        never runs it (HostNodeError names the error instead of waiting for ever)."""
        index = self.next
        job = self.ring[index]
        spins = 0
        while job.busy:  # RING lookups queued ahead of their row copies: back-pressure
            spins += 1
            time.sleep(0 if spins < 1000 else 1e-4)
            if spins % 1000 == 0:
                streams = [self.handle] + ([self.side.cuda_stream] if self.side is not None else [])
                check_pending(driver, streams, job)
        self.next = (self.next + 1) % RING
        return index

    def buffers_for(self, n: int, capturing: bool, row_bytes: tuple[int, ...], driver) -> PinnedBuffers:
        """Buffers for ``n`` ids: the stream's eager ones, or its capture ones; grown by doubling.
        Outgrown eager buffers are kept until an event recorded now (after every operation queued
        on the stream that may read them) has completed."""
        if capturing:
            bufs = self.capture_buffers
            if bufs is None or bufs.capacity < n:
                with relaxed_capture_mode():
                    bufs = PinnedBuffers(max(n, 2 * (bufs.capacity if bufs else 0)), row_bytes)
                self.capture_buffers = bufs
            return bufs
        if self.buffers is None or self.buffers.capacity < n:
            self.retired = [(ev, b) for ev, b in self.retired if not _freed(driver, ev)]
            old = self.buffers
            if old is not None:
                event = driver.event()
                driver.record(event, self.handle)
                self.retired.append((event, old))
            self.buffers = PinnedBuffers(max(n, 2 * (old.capacity if old else 0), 1024), row_bytes)
        return self.buffers

    def close(self, driver) -> None:
        """Wait for every job of the ring (the caller has synchronized the device: this only
        checks), then destroy the events."""
        for job in self.ring:
            while job.busy:
                time.sleep(1e-4)
        for event, _ in self.retired:
            driver.destroy(event)
        for event in self.events:
            driver.destroy(event)
        self.retired, self.events = [], []


def _freed(driver, event: int) -> bool:
    if not driver.done(event):
        return False
    driver.destroy(event)
    return True
