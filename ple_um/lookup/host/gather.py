"""HostGather: a lookup's rows read on the host, as stream-ordered CUDA work.

A lookup on a CUDA device is queued on the current stream and nothing waits: the ids copied
device-to-host into a pinned buffer; the C row copy (``rowcopy.c``: each id's row read from the
mapped files into pinned staging, zeros for ids not owned, counted in host counters); the staged
rows copied host-to-device into the output (dequantized or decoded there with torch ops when the
output is a float tensor). An eager lookup returns before its rows exist, like any CUDA op. The row
copy runs outside Python (no GIL) and the OS serves any page fault in it, so tables of any size,
resident or not, are served this way.

Who runs the row copy (three strategies, one per case):
- Captured lookups (``torch.cuda.graph``, torch.compile, vLLM's graphs): a host node
  (``cuLaunchHostFunc``) between the two copies, replayed with new ids each time; a big one is cut
  into chunks whose host nodes run in turn on a side stream, each chunk's copy to the device
  waiting only for its own rows (``_chunked``).
- Eager lookups: the dispatcher, one C thread per process (``_dispatched``; ``cuda.py`` says how
  the stream and the dispatcher signal each other). It saves the driver's round trip to its
  callback thread and back that a host node costs (docs/lab/PERF_NOTES.md). Where stream memory
  operations do not work (checked once per device) or ``PLE_UM_DISPATCHER=0``, eager lookups are
  host nodes too.
- No CUDA device: the row copy called directly (``run_here``; ctypes releases the GIL).

Every strategy fills the same job structs (``_fill``). The two on a CUDA device (host nodes, the
dispatcher) queue the same driver copies of the ids and the rows (``_ids_in``, ``_rows_out``) and
differ only in who runs the row copy; the direct call runs it on the calling thread and copies
nothing. What a stream keeps (buffers, the ring of job structs, the signal words): ``cuda.py``.
Bound: per stream that captured lookups, at most twice the largest captured batch of ``8 + row
bytes`` per id (the buffers grow by doubling and earlier ones stay), plus about 100 B per captured
lookup.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import numpy as np
import torch

from ple_um.kernels.launch import current_stream
from ple_um.lookup import rowcopy
from ple_um.lookup.counts import path_counts
from ple_um.lookup.decode import decode_staged
from ple_um.lookup.host import cuda
from ple_um.lookup.host.misses import MissPlan, RowSources
from ple_um.lookup.host.signal_check import prepare_device
from ple_um.lookup.streams import own_stream, relaxed_capture_mode
from ple_um.mapping import MappedShards

# Lookups above this many ids are cut into chunks of it (bigger ones where MAX_CHUNKS would not
# hold them), the last one at most TAIL_ROWS: its copy to the device is the one nothing overlaps.
CHUNK_ROWS = 32768
TAIL_ROWS = 4096
MAX_CHUNKS = 16
assert cuda.RING > MAX_CHUNKS + 1  # a stream's ring holds a whole lookup's job structs
# Bytes of rows a prefetch's thread reads into the row cache at a time (warm_row_cache).
WARM_BYTES = 16 << 20


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


class HostGather:
    """Rows of a mapped table read on the host by the C row copy; see the module docstring.

    ``mapping``: the table's owned rows; ``scale_mapping``: an NVFP4 table's block scales (read
    beside the rows), or None. ``scale``: the dequantization scale on the device (FP8: the global
    scale; NVFP4: ``weight_scale_2``), or None. ``threads``: the threads that read a big lookup."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        mapping: MappedShards,
        device: torch.device,
        *,
        storage: torch.dtype,
        scale: torch.Tensor | None,
        threads: int,
        scale_mapping: MappedShards | None = None,
        built: str = "C row copy",
        misses: MissPlan | None = None,
    ) -> None:
        self.lib = lib
        self.device = device
        self.cuda = device.type == "cuda"
        self.storage = storage
        self.scale = scale
        self.counts, self.warm_counts = rowcopy.Counts(), rowcopy.Counts()  # warm_row_cache's
        self.misses = misses
        self.pool = rowcopy.Pool(lib, threads)
        self.threads = self.pool.threads
        self.enqueue_seconds = 0.0  # host seconds spent queuing lookups (eager calls)
        self._run = rowcopy.function_address(lib, "ple_lookup_run")
        self._wake = rowcopy.function_address(lib, "ple_pool_wake")
        self._driver = None
        self.index = device.index
        self._streams: dict[int, cuda.StreamState] = {}
        self._captured: list[tuple[object, ...]] = []  # job structs and buffers of captured lookups
        self._lock = threading.Lock()
        self.dispatcher = False  # eager lookups through the dispatcher thread (else host nodes)
        if self.cuda:
            self._driver, why = prepare_device(lib, device)
            self.dispatcher = why is None
        # The C code's view of the rows (and block scales), with their row cache and reader: made
        # last, once the driver and the signals check (which may raise) are done, so that a build
        # that fails leaves no descriptor of the files open and no hold on the reader threads.
        self.sources = RowSources(mapping, scale_mapping, misses, self.counts, lib)
        self.rows, self.block_scales = self.sources.rows, self.sources.block_scales
        self.row_bytes = tuple(r.row_bytes for r in (self.rows, self.block_scales) if r is not None)
        way = "as a CUDA host node" if self.cuda else "called directly (no CUDA device)"
        self.row_reads = f"{built}, {way}, {self.threads} threads"
        if misses is not None:
            self.row_reads += f"; {misses.why}"
        if self.cuda:
            eager = "by the dispatcher thread" if self.dispatcher else f"as host nodes ({why})"
            self.row_reads += f"; eager lookups {eager}"

    # -- what a lookup asks ------------------------------------------------------------------
    def gather(
        self, ids: torch.Tensor, *outs: torch.Tensor, raw: bool | None = None, live: np.ndarray | None = None
    ) -> torch.Tensor | None:
        """Rows of flat ``ids`` (on the device, contiguous; any integer dtype) into ``outs``: one
        ``out`` [n, row_dim] (contiguous), raw rows when it has the storage dtype (an NVFP4 table's
        packed bytes: [n, row_bytes]), else dequantized or decoded; an NVFP4 or MXFP8 table's raw
        rows and block scales (``gather_packed``); none for the page touch (``touch``). Queued on
        the current stream, no host sync; without a CUDA device the row copy runs on this thread
        (ctypes releases the GIL), rows straight into ``out`` when raw. ``live``: the page touch's
        word (``touch``). Returns the first output."""
        n, out = ids.numel(), outs[0] if outs else None
        if self.sources.readers:  # an earlier lookup's ring failure, logged once
            self.sources.note_fallback()
        if raw is None:
            raw = out.dtype == self.storage or (self.block_scales is not None and out.dtype == torch.uint8)
        if n == 0:
            return out
        if self.cuda and torch.cuda.current_device() != self.index:  # the driver calls need its context
            with torch.cuda.device(self.index):
                return self.gather(ids, *outs, raw=raw, live=live)
        t0 = time.perf_counter()
        if raw:  # the rows' bytes go straight into the outputs, read only by address
            targets = list(outs)
        else:
            targets = [torch.empty((n, rb), dtype=torch.uint8, device=self.device) for rb in self.row_bytes]
        if self.cuda:
            capturing = self._queue(ids, targets, live)
        elif ids.device.type != "cpu":
            raise ValueError(f"ids are on {ids.device}; a table on the CPU takes host ids")
        else:
            self.run_here(ids.contiguous(), targets, self.counts, live)
        if not raw:
            decode_staged(self.storage, targets, self.scale, out)
        if self.cuda and not capturing and outs:
            with self._lock:
                self.enqueue_seconds += time.perf_counter() - t0
        return out

    def gather_packed(self, ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """NVFP4: the packed rows (uint8 [n, row_bytes]) and block scales (uint8 [n, D/16]) of ``ids``."""
        self.gather(ids, packed, scales, raw=True)

    def touch(self, ids: torch.Tensor, live: np.ndarray | None = None) -> None:
        """Queue a row copy that reads one byte of every page of the rows of ``ids`` (and of their
        block scales) and copies nothing (the ats mode's prefetch: the pages are in memory before
        the kernel queued after it reads them). ``live``: a one-int32 array the caller owns and
        keeps until ``close``; the touch then runs only while it is non-zero when the row copy
        runs (a graph's replays read it then), else every time."""
        self.gather(ids, raw=True, live=live)

    # -- one lookup --------------------------------------------------------------------------
    def _fill(self, job, ids_ptr: int, kind: int, n: int, dst: list[int], live=None, chunk: int = 0) -> None:
        """Point ``job`` at ``n`` ids of kind ``kind`` at ``ids_ptr``, their rows to ``dst`` (no
        destination: the page touch, run while ``live`` is non-zero where given); ``chunk``: its
        number in a lookup cut in chunks (the lookup is counted by chunk 0, the rows by each)."""
        touch = not dst  # the pages of the rows and of their block scales: the kernel reads both
        scales = self.block_scales is not None and (touch or len(dst) > 1)  # else the packed rows alone
        # Each ``job.tables`` / ``job.dst`` read builds a ctypes array object: one read each.
        tables = job.tables
        tables[0] = self.rows.address
        tables[1] = self.block_scales.address if scales else None
        job.ids, job.n = ids_ptr, n
        job.counts = self.counts.address
        job.id_kind = kind
        job.touch = int(touch)
        job.live = live.ctypes.data if touch and live is not None else None
        job.threads = self.threads
        job.inline_rows = rowcopy.INLINE_ROWS
        job.chunk = chunk
        job.dst[: len(dst)] = dst

    def _queue(self, ids: torch.Tensor, targets: list[torch.Tensor], live) -> bool:
        """Fill the lookup's job structs and queue its work on the current stream by the strategy
        that serves it (the module docstring); ``targets`` empty: the page touch, no copy out
        (``live``: its word). Whether the stream is capturing."""
        self._driver.ensure_context(self.index)
        stream = current_stream(self.index)
        capturing = torch.cuda.is_current_stream_capturing()
        state = self._state(stream)
        n = ids.numel()
        kind, size = rowcopy.ID_KINDS[ids.dtype], ids.element_size()
        pieces = chunks(n) if targets else [(0, n)]
        with state.lock:
            bufs = state.buffers_for(n, capturing, self.row_bytes, self._driver)
            slots = [] if capturing else [state.slot(self._driver) for _ in pieces]
            jobs = [rowcopy.LookupStruct() for _ in pieces] if capturing else [state.ring[k] for k in slots]
            for k, (job, (a, b)) in enumerate(zip(jobs, pieces, strict=True)):
                dst = [p + a * rb for p, rb in bufs.staging_ptrs] if targets else []
                self._fill(job, bufs.ids_ptr + a * size, kind, b - a, dst, live, chunk=k)
            if not capturing and self.dispatcher:
                self._dispatched(state, stream, bufs, ids, slots, pieces, targets)
            elif len(pieces) == 1:
                self._ids_in(stream, bufs, ids)
                if not capturing and n > rowcopy.INLINE_ROWS:
                    self.pool.wake()
                self._launch(stream, jobs[0])
                self._rows_out(stream, bufs, targets, 0, n)
            else:
                self._chunked(state, stream, bufs, ids, jobs, pieces, targets, capturing)
            if capturing:  # a graph may replay them at any time: kept as long as this
                with self._lock:
                    self._captured.append((*jobs, bufs, live))
        return capturing

    def _dispatched(self, state, stream, bufs, ids, slots, pieces, targets) -> None:
        """An eager lookup through the dispatcher thread, all on the caller's stream: the ids' copy
        and a write of the lookup's number into its ready word; each piece's job posted; then each
        piece's copy to the device behind a wait for its done word (the pieces' copies overlap the
        reading of the next). ``targets`` empty: no copies (the page touch). Where a job cannot be
        posted (no dispatcher runs: a forked child) it becomes a host node, queued before the
        copies."""
        driver = self._driver
        host, device = state.words(driver)
        offset = device - host
        seq = state.seq = (state.seq + 1) & 0xFFFFFFFF
        ready = host + slots[0] * cuda.SIGNAL_BYTES
        cuda.arm(ready, seq)
        self._ids_in(stream, bufs, ids)
        driver.write_value(stream, ready + offset, seq)
        if ids.numel() > rowcopy.INLINE_ROWS:
            self.pool.wake()
        posted = []
        for slot in slots:
            job = state.ring[slot]
            job.seq, job.ready, job.done = seq, ready, host + slot * cuda.SIGNAL_BYTES + cuda.DONE_AT
            job.busy = 1
            if self.lib.ple_dispatch_post(ctypes.addressof(job)) == 0:
                posted.append(True)
            else:
                self._launch(stream, job)
                posted.append(False)
        for slot, (a, b), waits in zip(slots, pieces, posted, strict=True):
            if waits:
                driver.wait_value(stream, state.ring[slot].done + offset, seq)
            self._rows_out(stream, bufs, targets, a, b)

    def _chunked(self, state, stream, bufs, ids, jobs, pieces, targets, capturing) -> None:
        """A big lookup: the ids in one copy, the chunks' host nodes in turn on the side stream, each
        chunk's copy to the device on the caller's stream once its rows are in."""
        driver = self._driver
        if state.side is None:
            with relaxed_capture_mode() if capturing else contextlib.nullcontext():
                state.side = own_stream(self.device)
        while len(state.events) < len(pieces) + 2:
            state.events.append(driver.event())
        side, events = state.side.cuda_stream, state.events
        if capturing:  # the pool's wake-up overlaps the ids' copy
            driver.record(events[-1], stream)
            driver.wait(side, events[-1])
            driver.launch_host_func(side, self._wake, None)
        else:
            self.pool.wake()
        self._ids_in(stream, bufs, ids)
        driver.record(events[-2], stream)
        driver.wait(side, events[-2])
        for k, job in enumerate(jobs):
            self._launch(side, job)
            driver.record(events[k], side)
        for k, (a, b) in enumerate(pieces):
            driver.wait(stream, events[k])
            self._rows_out(stream, bufs, targets, a, b)

    def _ids_in(self, stream: int, bufs: cuda.PinnedBuffers, ids: torch.Tensor) -> None:
        """Queue the copy of ``ids`` into the pinned ids buffer on ``stream`` (captured like any
        stream operation: a graph replays it with the ids its buffer holds then)."""
        self._driver.d2h(bufs.ids_ptr, ids.data_ptr(), ids.numel() * ids.element_size(), stream)

    def _rows_out(self, stream: int, bufs: cuda.PinnedBuffers, targets, a: int, b: int) -> None:
        """Queue the copies of the staged rows ``[a, b)`` into ``targets`` on ``stream`` (none for
        the page touch)."""
        for target, (staging, rb) in zip(targets, bufs.staging_ptrs, strict=False):
            self._driver.h2d(target.data_ptr() + a * rb, staging + a * rb, (b - a) * rb, stream)

    def _launch(self, stream: int, job) -> None:
        """Queue the host node of ``job`` on ``stream``. Its ``busy`` flag is up only while a host
        node that will clear it is queued (a ring slot is never waited for in vain)."""
        job.busy = 1
        try:
            self._driver.launch_host_func(stream, self._run, ctypes.addressof(job))
        except BaseException:
            job.busy = 0
            raise

    def run_here(
        self, ids: torch.Tensor, staging: list[torch.Tensor], counts: rowcopy.Counts, live=None
    ) -> None:
        """The row copy of host ``ids`` (contiguous) into ``staging`` (contiguous, a row's bytes a
        row, read by address; none for the page touch, with its ``live`` word), run on this
        thread, counted in ``counts``."""
        job, dst = rowcopy.LookupStruct(), [s.data_ptr() for s in staging]
        self._fill(job, ids.data_ptr(), rowcopy.ID_KINDS[ids.dtype], ids.numel(), dst, live)
        job.counts = counts.address
        self.lib.ple_lookup_run(ctypes.addressof(job))

    # -- state, counters and life ------------------------------------------------------------
    def _state(self, stream: int) -> cuda.StreamState:
        state = self._streams.get(stream)
        if state is None:
            with self._lock:
                state = self._streams.setdefault(stream, cuda.StreamState(stream))
        return state

    def read_counts(self) -> dict:
        """The host counters as ``path_counts`` (row copies run, graph replays included; gather =
        the row copies' seconds, stage = the callers' queuing eager lookups). Lookups queued but
        not yet run are not in it (``counts.read()`` has the C counters themselves)."""
        c, warmed = self.counts.read(), self.warm_counts.read()
        return path_counts(
            c["rows"],
            c["out_of_range"],
            c["broken"],
            c["lookups"],
            file_reads=c["file_reads"] + warmed["file_reads"],
            file_read_seconds=(c["read_ns"] + warmed["read_ns"]) * 1e-9,
            gather=c["ns"] * 1e-9,
            stage=self.enqueue_seconds,
        )

    def reset_counts(self) -> None:
        """Zero the counters, keeping the rows a row cache holds (its ``rows``: inserts less
        evictions, so the inserts start again from the rows held)."""
        held = self.counts.held_rows()
        self.counts.array[:] = self.warm_counts.array[:] = 0
        self.counts.array[rowcopy.COUNTS.index("cache_inserts")] = held
        self.enqueue_seconds = 0.0

    def close(self) -> None:
        """Wait for every queued lookup's row copy, then drop the buffers and events (the caller has
        waited for the streams they were queued on: this only checks). Idempotent."""
        for state in self._streams.values():
            state.close(self._driver)
        self._streams = {}
        self._captured = []
        self.sources.close()


def warm_row_cache(host: HostGather, ids) -> int:
    """Read the rows of ``ids`` (host ids: a CPU tensor or an array) that the row cache lacks, many
    in flight, and offer them to it: a table's prefetch where its host path has a row cache. The
    page touch would fault the rows' pages into the page cache, which the lookups' O_DIRECT reads of
    misses pass by, so that every row would be read twice. On the calling thread, WARM_BYTES of
    rows at a time into a scratch buffer (a prefetch of any size, every row of a table over its
    memory included, takes no more); the reads count as file reads, the rows as no lookup's, and
    the cache counts its hits and misses as for any lookup. Returns the number of owned ids."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().to("cpu")
    flat = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    rows = host.rows.struct  # the owned range [lo, hi)
    owned = flat[(flat >= rows.lo) & (flat < rows.hi)].contiguous()
    step = max(1, WARM_BYTES // sum(host.row_bytes))
    scratch = [torch.empty((min(step, owned.numel()), rb), dtype=torch.uint8) for rb in host.row_bytes]
    for a in range(0, owned.numel(), step):
        part = owned[a : a + step]
        host.run_here(part, [s[: part.numel()] for s in scratch], host.warm_counts)
    return owned.numel()
