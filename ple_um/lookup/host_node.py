"""HostGather: a lookup's rows read on the host, as stream-ordered CUDA work.

A lookup on a CUDA device is queued on the current stream and nothing waits: the ids copied
device-to-host into a pinned buffer; the C row copy (``rowcopy.c``: each id's row read from the
mapped files into pinned staging, zeros for ids not owned, counted in host counters); the staged
rows copied host-to-device into the output (dequantized or decoded there with torch ops when the
output is a float tensor). An eager lookup returns before its rows exist, like any CUDA op. The row
copy runs outside Python (no GIL) and the OS serves any page fault in it, so tables of any size,
resident or not, are served this way (docs/FACTS.md section 7).

Who runs the row copy:
- Captured lookups (``torch.cuda.graph``, torch.compile, vLLM's graphs): a host node
  (``cuLaunchHostFunc``) between the two copies, replayed with new ids each time.
- Eager lookups: the dispatcher, one C thread per process (``rowcopy.c``). The stream writes the
  lookup's number into a ready word of pinned memory after the ids' copy (``cuStreamWriteValue32``);
  the dispatcher copies the rows once it sees it and writes a done word; the stream's copy of the
  rows waits for that (``cuStreamWaitValue32``). Against a host node per lookup (and per chunk) it
  saves the driver's round trip to its callback thread and back: faster at every size measured on
  the H200 (docs/PERF_NOTES.md row 18). Where stream memory operations do not work (checked once
  per device) or ``PLE_UM_DISPATCHER=0``, eager lookups are host nodes too.

Big lookups are cut into chunks, each chunk's copy to the device waiting only for its own rows: the
copies overlap the reading of the next chunk (eager: the dispatcher runs the chunks in turn;
captured: their host nodes run in turn on a side stream).

Buffers. Eager lookups use one set of pinned buffers per stream (grown, never shrunk): the stream's
order makes reuse safe (the next lookup's ids arrive after the previous lookup's rows left). Each
queued lookup gets its own job structs from the stream's ring; a struct is reused once its row copy
has finished (it clears its ``busy`` flag). A captured lookup gets job structs of its own and the
capture buffers of its stream, shared by the lookups captured on that stream (replayed one at a
time in stream order, as vLLM replays its graphs; graphs captured on different streams have their
own); they are kept as long as the gather, since a graph may replay them at any time. Bound: per
stream that captured lookups, at most twice the largest captured batch of ``8 + row bytes`` per id
(the buffers grow by doubling and earlier ones stay), plus about 100 B per captured lookup.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time

import torch

from ple_um import envs
from ple_um.lookup import rowcopy
from ple_um.lookup.nvfp4 import decode_nvfp4, dequantize, e2m1_values
from ple_um.lookup.streams import own_stream, relaxed_capture_mode
from ple_um.mapping import MappedShards

log = logging.getLogger(__name__)

# At most this many ids a lookup's rows are read by the thread that runs its host node alone (the
# pool's hand-off costs more below; docs/PERF_NOTES.md).
INLINE_ROWS = 2048
# Lookups above this many ids are cut into chunks of it (bigger ones where MAX_CHUNKS would not
# hold them), the last one at most TAIL_ROWS (its copy to the device is the one nothing overlaps).
CHUNK_ROWS = 32768
TAIL_ROWS = 4096
MAX_CHUNKS = 16
# Job structs per stream's ring: lookups queued ahead of their host nodes before a caller waits.
# A lookup takes one per chunk, so the ring must hold a whole lookup's (MAX_CHUNKS + 1) at once.
RING = 64
assert RING > MAX_CHUNKS + 1
# The dispatcher's words of a ring slot: its ready word at the slot's start, its done word a cache
# line further (the stream writes one, the dispatcher the other).
SIGNAL_BYTES, DONE_AT = 128, 64
# Seconds the open-time check of the dispatcher's signals waits for a stream to see a write.
SIGNAL_TIMEOUT = 5.0


class HostNodeError(RuntimeError):
    """The CUDA driver refused to queue a host node (the message names the call and the error)."""


class StreamBlockedError(HostNodeError):
    """A stream of this device waits for ever (the dispatcher's check at open): nothing may
    synchronize the device after it, so the open gives up without releasing through the device."""


class _Driver:
    """The few CUDA driver calls of the host path, through ctypes on libcuda: queue a host function,
    and events. Each is a stream operation (captured like any other); none
    takes the GIL back while it runs, and every return code is checked."""

    _instance: _Driver | None = None
    _lock = threading.Lock()
    _stranded: list[torch.Tensor] = []  # pinned words a blocked stream may still wait on: never freed

    def __init__(self) -> None:
        lib = self.lib = ctypes.CDLL("libcuda.so.1")
        ptr, i32, u32, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint64
        signatures = {
            "cuMemcpyDtoHAsync_v2": [ptr, u64, ctypes.c_size_t, ptr],
            "cuMemcpyHtoDAsync_v2": [u64, ptr, ctypes.c_size_t, ptr],
            "cuLaunchHostFunc": [ptr, ptr, ptr],
            "cuEventCreate": [ctypes.POINTER(ptr), ctypes.c_uint],
            "cuEventRecord": [ptr, ptr],
            "cuEventQuery": [ptr],
            "cuEventDestroy_v2": [ptr],
            "cuStreamWaitEvent": [ptr, ptr, ctypes.c_uint],
            "cuGetErrorName": [i32, ctypes.POINTER(ctypes.c_char_p)],
            "cuStreamQuery": [ptr],
            "cuCtxGetCurrent": [ctypes.POINTER(ptr)],
            "cuCtxSetCurrent": [ptr],
            "cuDeviceGet": [ctypes.POINTER(i32), i32],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ptr), i32],
        }
        # Stream memory operations (the dispatcher's signals; CUDA 11.7+ drivers have the _v2 calls).
        mem_ops = {
            "cuStreamWriteValue32_v2": [ptr, u64, u32, u32],
            "cuStreamWaitValue32_v2": [ptr, u64, u32, u32],
            "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(u64), ptr, u32],
        }
        self._thread = threading.local()
        self._signals_checked: dict[int, str | StreamBlockedError] = {}
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i32
        self.mem_ops = all(hasattr(lib, name) for name in mem_ops)
        if self.mem_ops:
            for name, argtypes in mem_ops.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, i32
            self.write_value = self._checked(
                lambda stream, address, value: lib.cuStreamWriteValue32_v2(stream, address, value, 0),
                "cuStreamWriteValue32",
            )
            self.wait_value = self._checked(  # flags 0: CU_STREAM_WAIT_VALUE_GEQ (cyclic)
                lambda stream, address, value: lib.cuStreamWaitValue32_v2(stream, address, value, 0),
                "cuStreamWaitValue32",
            )
        self.d2h = self._checked(lib.cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync")
        self.h2d = self._checked(lib.cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync")
        self.launch_host_func = self._checked(lib.cuLaunchHostFunc, "cuLaunchHostFunc")
        self.record = self._checked(lib.cuEventRecord, "cuEventRecord")
        self.wait = self._checked(
            lambda stream, event: lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent"
        )

    @classmethod
    def get(cls) -> _Driver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _checked(self, fn, name: str):
        def call(*args) -> None:
            rc = fn(*args)
            if rc != 0:
                raise HostNodeError(f"{name} failed: {self.error_name(rc)}")

        return call

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        return f"{(name.value or b'?').decode()} ({rc})"

    def ensure_context(self, index: int) -> None:
        """Make device ``index``'s primary context current in this thread where none is (a thread
        that has made no CUDA call yet: the driver calls below need one). Once per thread. The
        caller has made ``index`` torch's current device (whose context is then current)."""
        if getattr(self._thread, "index", None) == index:
            return
        current = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and not current.value:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            for rc in (
                self.lib.cuDeviceGet(ctypes.byref(device), index),
                self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                self.lib.cuCtxSetCurrent(context),
            ):
                if rc != 0:
                    raise HostNodeError(
                        f"making device {index}'s context current failed: {self.error_name(rc)}"
                    )
        self._thread.index = index

    def check_pending(self, streams: list[int], job) -> None:
        """Raise HostNodeError when ``job``'s host node cannot run any more: one of ``streams`` (where
        it was queued) is in error, or they are all idle and its flag is still up."""
        states = [self.lib.cuStreamQuery(stream) for stream in streams]
        failed = [rc for rc in states if rc not in (0, 600)]  # CUDA_SUCCESS, CUDA_ERROR_NOT_READY
        if failed:
            why = self.error_name(failed[0])
            raise HostNodeError(f"a stream with queued lookups failed ({why}): their host nodes will not run")
        if all(rc == 0 for rc in states) and job.busy and not _signalled(job):
            raise HostNodeError(
                "a queued host node never ran: its stream is idle and its job is still pending"
            )

    def device_pointer(self, host: int) -> int:
        """The device address of pinned host memory at ``host`` (the same address under UVA)."""
        address = ctypes.c_uint64()
        rc = self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(address), host, 0)
        if rc != 0:
            raise HostNodeError(f"cuMemHostGetDevicePointer failed: {self.error_name(rc)}")
        return address.value

    def signals_work(self, device: torch.device) -> str | None:
        """None when stream memory operations work on ``device`` as the dispatcher uses them
        (checked once per device), else why not: a stream writes a word of pinned memory, then
        waits for a word that this thread writes after the wait was queued."""
        known = self._signals_checked.get(device.index)
        if known is None:
            try:
                known = self._check_signals(device)
            except StreamBlockedError as exc:  # a stream left blocked: said again at every open
                known = exc
            self._signals_checked[device.index] = known
        if isinstance(known, StreamBlockedError):
            raise known
        return known or None

    def _check_signals(self, device: torch.device) -> str:
        if not self.mem_ops:
            return "this driver has no cuStreamWriteValue32_v2 / cuStreamWaitValue32_v2"
        try:
            self.ensure_context(device.index)
            word = torch.zeros(SIGNAL_BYTES // 4, dtype=torch.int32, pin_memory=True)  # one slot's words
            stream = own_stream(device).cuda_stream
        except Exception as exc:  # noqa: BLE001 - any failure means: use host nodes
            return f"stream memory operations failed: {exc}"
        return self._round_trip(stream, word, lambda: own_stream(device).cuda_stream)

    def _round_trip(self, stream: int, word: torch.Tensor, other_stream) -> str:
        """The check itself, on ``stream`` with one slot's words in ``word`` (pinned): the stream
        writes the ready word, then waits for the done word, which this thread sets. A stream that
        never sees the write still waits: the word is kept for the life of the process (freed, its
        memory could be handed out and written again), and the same write is made from the device
        on ``other_stream()`` to release it (else every later synchronize of the device would hang).
        Where even that does not release it, StreamBlockedError (logged first)."""
        done = DONE_AT // 4
        try:
            address = self.device_pointer(word.data_ptr())
            self.write_value(stream, address, 7)
            self.wait_value(stream, address + DONE_AT, 1)
            time.sleep(1e-3)
            word[done] = 1  # as the dispatcher signals a lookup done
            rc = self._settle(stream)
            if rc == 600:
                _Driver._stranded.append(word)
                self.write_value(other_stream(), address + DONE_AT, 1)
                released = self._settle(stream) == 0
        except Exception as exc:  # noqa: BLE001 - any failure means: use host nodes
            return f"stream memory operations failed: {exc}"
        if rc == 600 and not released:
            why = (
                "a stream waiting on pinned memory saw neither this thread's write nor the device's "
                f"own within {2 * SIGNAL_TIMEOUT:g} s: it stays blocked, so any synchronize of this "
                "device will hang. Run with PLE_UM_DISPATCHER=0 (eager lookups as host nodes; this "
                "check is then not made)"
            )
            log.error("ple-um: %s", why)
            raise StreamBlockedError(why)
        if rc == 600:
            return "a stream waiting on pinned memory never saw this thread's write"
        if rc != 0:
            return f"a stream waiting on pinned memory: {self.error_name(rc)} after this thread's write"
        if int(word[0]) != 7:
            return f"a stream's write of pinned memory did not arrive (read {int(word[0])})"
        return ""

    def _settle(self, stream: int) -> int:
        """cuStreamQuery's answer once ``stream`` is no longer busy, or 600 (not ready) after
        SIGNAL_TIMEOUT seconds."""
        deadline = time.monotonic() + SIGNAL_TIMEOUT
        while (rc := self.lib.cuStreamQuery(stream)) == 600 and time.monotonic() < deadline:
            time.sleep(1e-4)
        return rc

    def event(self) -> int:
        """A new event without timing (destroy with ``destroy``)."""
        handle = ctypes.c_void_p()
        rc = self.lib.cuEventCreate(ctypes.byref(handle), 2)  # CU_EVENT_DISABLE_TIMING
        if rc != 0:
            raise HostNodeError(f"cuEventCreate failed: {self.error_name(rc)}")
        return handle.value

    def done(self, event: int) -> bool:
        return self.lib.cuEventQuery(event) == 0

    def destroy(self, event: int) -> None:
        self.lib.cuEventDestroy_v2(event)


def arm(ready: int, seq: int) -> None:
    """Set the ready word at ``ready`` one behind ``seq`` before the lookup numbered ``seq`` is
    posted under it. A ring slot's word is written by its stream only when the slot is a lookup's
    first: a slot that has not been first for about 2**31 lookups holds a number that compares as
    reached, and the dispatcher would read the ids before they arrive. Safe to store: the slot is
    free, so the stream's last write of this word has landed (the job that waited for it has run),
    and a later chunk of that lookup, still waiting on it, waits for that number or a lower one
    (at or below ``seq - 1``: still reached)."""
    ctypes.c_uint32.from_address(ready).value = (seq - 1) & 0xFFFFFFFF


def _signalled(job) -> bool:
    """Whether the dispatcher has set ``job``'s done word (its stream's wait is over, and the job's
    busy flag is about to clear): a job of the dispatcher whose stream is idle."""
    if not job.done:
        return False
    done = ctypes.c_uint32.from_address(job.done).value
    return ((done - job.seq) & 0xFFFFFFFF) < 1 << 31


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


class _Buffers:
    """Pinned ids and staging for lookups of up to ``capacity`` ids."""

    def __init__(self, capacity: int, row_bytes: tuple[int, ...]) -> None:
        self.capacity = capacity
        self.ids = torch.empty(capacity * 8, dtype=torch.uint8, pin_memory=True)
        self.staging = [torch.empty((capacity, rb), dtype=torch.uint8, pin_memory=True) for rb in row_bytes]
        self.ids_ptr = self.ids.data_ptr()
        self.staging_ptrs = [(s.data_ptr(), rb) for s, rb in zip(self.staging, row_bytes, strict=True)]


class _Stream:
    """One stream's eager buffers (and those it outgrew, each kept until an event recorded after
    its last use has completed), the buffers of the lookups captured on it, its ring of job
    structs, and its side stream and events for chunked lookups. ``lock`` keeps each lookup's
    operations together on the stream."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.lock = threading.Lock()
        self.buffers: _Buffers | None = None
        self.retired: list[tuple[int, _Buffers]] = []
        self.capture_buffers: _Buffers | None = None
        self.ring = (rowcopy.LookupStruct * RING)()
        self.next = 0
        self.side: torch.cuda.ExternalStream | None = None
        self.events: list[int] = []
        # The dispatcher's signals: per ring slot a ready word (written by the stream) and a done
        # word (written by the dispatcher), each on its own 64-byte line; the lookup's number.
        self.signals: torch.Tensor | None = None
        self.signals_device = 0
        self.seq = 0

    def words(self, driver: _Driver) -> tuple[int, int]:
        """The host and device addresses of the signal words (made on first use)."""
        if self.signals is None:
            self.signals = torch.zeros(RING * SIGNAL_BYTES // 4, dtype=torch.int32, pin_memory=True)
            self.signals_device = driver.device_pointer(self.signals.data_ptr())
        return self.signals.data_ptr(), self.signals_device

    def slot(self, driver: _Driver) -> int:
        """The index of the next job struct of the ring, once its previous lookup has finished.
        While it waits, the streams its work runs on are asked every ~0.1 s: a stream in error
        never runs it (HostNodeError names the error instead of waiting for ever)."""
        index = self.next
        job = self.ring[index]
        spins = 0
        while job.busy:  # RING lookups queued ahead of their host nodes: back-pressure
            spins += 1
            time.sleep(0 if spins < 1000 else 1e-4)
            if spins % 1000 == 0:
                streams = [self.handle] + ([self.side.cuda_stream] if self.side is not None else [])
                driver.check_pending(streams, job)
        self.next = (self.next + 1) % RING
        return index


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
    ) -> None:
        self.lib = lib
        self.device = device
        self.cuda = device.type == "cuda"
        self.storage = storage
        self.scale = scale
        self.rows = rowcopy.Rows(mapping)
        self.block_scales = rowcopy.Rows(scale_mapping) if scale_mapping is not None else None
        self.row_bytes = tuple(r.row_bytes for r in (self.rows, self.block_scales) if r is not None)
        self.counts = rowcopy.Counts()
        self.pool = rowcopy.Pool(lib, threads)
        self.threads = self.pool.threads
        way = "as a CUDA host node" if self.cuda else "called directly (no CUDA device)"
        self.row_reads = f"{built}, {way}, {self.threads} threads"
        self.enqueue_seconds = 0.0  # host seconds spent queuing lookups (eager calls)
        self._run = rowcopy.function_address(lib, "ple_lookup_run")
        self._wake = rowcopy.function_address(lib, "ple_pool_wake")
        self._driver = _Driver.get() if self.cuda else None
        self.index = device.index
        self._streams: dict[int, _Stream] = {}
        self._captured: list[tuple[object, ...]] = []  # job structs and buffers of captured lookups
        self._lock = threading.Lock()
        self.dispatcher = False  # eager lookups through the dispatcher thread (else host nodes)
        if self.cuda:
            e2m1_values(device)  # on the device before any capture needs it
            if not envs.PLE_UM_DISPATCHER:
                why = "PLE_UM_DISPATCHER=0"
            elif not lib.ple_dispatch_start():
                why = "the dispatcher thread could not be started"
            else:
                why = self._driver.signals_work(device)
            self.dispatcher = why is None
            eager = "by the dispatcher thread" if self.dispatcher else f"as host nodes ({why})"
            self.row_reads += f"; eager lookups {eager}"

    # -- one lookup --------------------------------------------------------------------------
    def _fill(self, job, ids_ptr: int, kind: int, n: int, dst: list[int], touch: bool = False) -> None:
        """Point ``job`` at ``n`` ids of kind ``kind`` at ``ids_ptr``, their rows to ``dst``."""
        job.tables[0] = self.rows.address
        job.tables[1] = self.block_scales.address if self.block_scales is not None and not touch else None
        job.ids, job.n = ids_ptr, n
        job.counts = self.counts.address
        job.id_kind = kind
        job.touch = int(touch)
        job.threads = self.threads
        job.inline_rows = INLINE_ROWS
        for k, address in enumerate(dst):
            job.dst[k] = address

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of flat ``ids`` (on the device, contiguous; any integer dtype) into ``out`` [n,
        row_dim] (contiguous): raw rows when out has the storage dtype (an NVFP4 table's packed
        bytes: [n, row_bytes]), else dequantized or decoded. Queued on the current stream; no
        host sync."""
        return self._lookup(ids, [out])

    def gather_packed(self, ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """NVFP4: the packed rows (uint8 [n, row_bytes]) and block scales (uint8 [n, D/16]) of ``ids``."""
        self._lookup(ids, [packed, scales], raw=True)

    def touch(self, ids: torch.Tensor) -> None:
        """Queue a host node that reads one byte of every page of the rows of ``ids`` (the ats mode's
        prefetch: the pages are in memory before the kernel queued after it reads them)."""
        n = ids.numel()
        if n == 0:
            return
        kind = rowcopy.ID_KINDS[ids.dtype]
        if not self.cuda:
            job = rowcopy.LookupStruct()
            self._fill(job, ids.data_ptr(), kind, n, [], touch=True)
            self.lib.ple_lookup_run(ctypes.addressof(job))
            return
        if torch.cuda.current_device() != self.index:
            with torch.cuda.device(self.index):
                return self.touch(ids)
        self._driver.ensure_context(self.index)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        capturing = torch.cuda.is_current_stream_capturing()
        state = self._state(stream)
        with state.lock:
            bufs = self._buffers(state, n, capturing)
            if not capturing and self.dispatcher:
                slot = state.slot(self._driver)
                self._fill(state.ring[slot], bufs.ids_ptr, kind, n, [], touch=True)
                self._dispatched(state, stream, bufs, ids, [slot], [(0, n)], None)
                return
            job = rowcopy.LookupStruct() if capturing else state.ring[state.slot(self._driver)]
            self._fill(job, bufs.ids_ptr, kind, n, [], touch=True)
            self._ids_in(bufs, ids)
            self._launch(stream, job)
            if capturing:
                self._keep((job, bufs))

    def _lookup(self, ids: torch.Tensor, outs: list[torch.Tensor], raw: bool | None = None) -> torch.Tensor:
        out = outs[0]
        n = ids.numel()
        if raw is None:
            raw = out.dtype == self.storage or (self.block_scales is not None and out.dtype == torch.uint8)
        if n == 0:
            return out
        if not self.cuda:
            return self._lookup_here(ids, outs, raw)
        if torch.cuda.current_device() != self.index:  # the driver calls need its context current
            with torch.cuda.device(self.index):
                return self._lookup(ids, outs, raw)
        t0 = time.perf_counter()
        self._driver.ensure_context(self.index)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        capturing = torch.cuda.is_current_stream_capturing()
        state = self._state(stream)
        kind, size = rowcopy.ID_KINDS[ids.dtype], ids.element_size()
        if raw:
            targets = [o.view(torch.uint8).view(n, o.shape[-1] * o.element_size()) for o in outs]
        else:
            targets = raws = [
                torch.empty((n, rb), dtype=torch.uint8, device=self.device) for rb in self.row_bytes
            ]
        pieces = chunks(n)
        with state.lock:
            bufs = self._buffers(state, n, capturing)
            slots = [] if capturing else [state.slot(self._driver) for _ in pieces]
            jobs = [rowcopy.LookupStruct() for _ in pieces] if capturing else [state.ring[k] for k in slots]
            for job, (a, b) in zip(jobs, pieces, strict=True):
                self._fill(
                    job, bufs.ids_ptr + a * size, kind, b - a, [p + a * rb for p, rb in bufs.staging_ptrs]
                )
            if not capturing and self.dispatcher:
                self._dispatched(state, stream, bufs, ids, slots, pieces, targets)
            elif len(pieces) == 1:
                self._ids_in(bufs, ids)
                if not capturing and n > INLINE_ROWS:
                    self.pool.wake()
                self._launch(stream, jobs[0])
                for target, staging in zip(targets, bufs.staging, strict=True):
                    target.copy_(staging[:n], non_blocking=True)
            else:
                self._chunked(state, stream, bufs, ids, jobs, pieces, targets, capturing)
            if capturing:
                self._keep((*jobs, bufs))
        if not raw:
            self._decode(raws, out)
        if not capturing:
            with self._lock:
                self.enqueue_seconds += time.perf_counter() - t0
        return out

    def _dispatched(self, state, stream, bufs, ids, slots, pieces, targets) -> None:
        """An eager lookup through the dispatcher thread, all on the caller's stream: the ids' copy
        and a write of the lookup's number into its ready word; each piece's job posted; then each
        piece's copy to the device behind a wait for its done word (the pieces' copies overlap the
        reading of the next). ``targets`` None: no copies (the page touch). Where a job cannot be
        posted (no dispatcher runs: a forked child) it becomes a host node, queued before the
        copies."""
        driver = self._driver
        host, device = state.words(driver)
        offset = device - host
        seq = state.seq = (state.seq + 1) & 0xFFFFFFFF
        ready = host + slots[0] * SIGNAL_BYTES
        arm(ready, seq)
        driver.d2h(bufs.ids_ptr, ids.data_ptr(), ids.numel() * ids.element_size(), stream)
        driver.write_value(stream, ready + offset, seq)
        if ids.numel() > INLINE_ROWS:
            self.pool.wake()
        posted = []
        for slot in slots:
            job = state.ring[slot]
            job.seq, job.ready, job.done = seq, ready, host + slot * SIGNAL_BYTES + DONE_AT
            job.busy = 1
            if self.lib.ple_dispatch_post(ctypes.addressof(job)) == 0:
                posted.append(True)
            else:
                self._launch(stream, job)
                posted.append(False)
        for slot, (a, b), waits in zip(slots, pieces, posted, strict=True):
            if waits:
                driver.wait_value(stream, state.ring[slot].done + offset, seq)
            if targets is None:
                continue
            for target, (staging, rb) in zip(targets, bufs.staging_ptrs, strict=True):
                driver.h2d(target.data_ptr() + a * rb, staging + a * rb, (b - a) * rb, stream)

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
        self._ids_in(bufs, ids)
        driver.record(events[-2], stream)
        driver.wait(side, events[-2])
        for k, job in enumerate(jobs):
            self._launch(side, job)
            driver.record(events[k], side)
        for k, (a, b) in enumerate(pieces):
            driver.wait(stream, events[k])
            for target, staging in zip(targets, bufs.staging, strict=True):
                target[a:b].copy_(staging[a:b], non_blocking=True)

    def _ids_in(self, bufs: _Buffers, ids: torch.Tensor) -> None:
        """The ids' copy into the pinned buffer for a host node, through torch, as the host-node
        path was measured and checked (the driver's copy calls it once tried ran as copies of
        pageable memory there, PERF_NOTES row 16; the dispatcher's path makes them since, row 18,
        asynchronous on the H200: unifying the two is left for a GPU run)."""
        n = ids.numel()
        bufs.ids[: n * ids.element_size()].view(ids.dtype).copy_(ids, non_blocking=True)

    def _launch(self, stream: int, job) -> None:
        """Queue the host node of ``job`` on ``stream``. Its ``busy`` flag is up only while a host
        node that will clear it is queued (a ring slot is never waited for in vain)."""
        job.busy = 1
        try:
            self._driver.launch_host_func(stream, self._run, ctypes.addressof(job))
        except BaseException:
            job.busy = 0
            raise

    def _decode(self, raws: list[torch.Tensor], out: torch.Tensor) -> None:
        if self.block_scales is not None:
            decode_nvfp4(raws[0], raws[1], self.scale, out)
        else:
            dequantize(raws[0], self.storage, self.scale, out)

    def _lookup_here(self, ids: torch.Tensor, outs: list[torch.Tensor], raw: bool) -> torch.Tensor:
        """No CUDA: the host function called directly (ctypes releases the GIL), rows straight into
        ``out`` when raw."""
        n = ids.numel()
        if ids.device.type != "cpu":
            raise ValueError(f"ids are on {ids.device}; a table on the CPU takes host ids")
        ids = ids.contiguous()
        if raw:
            staging = [o.view(torch.uint8).view(n, o.shape[-1] * o.element_size()) for o in outs]
        else:
            staging = [torch.empty((n, rb), dtype=torch.uint8) for rb in self.row_bytes]
        job = rowcopy.LookupStruct()
        self._fill(job, ids.data_ptr(), rowcopy.ID_KINDS[ids.dtype], n, [s.data_ptr() for s in staging])
        self.lib.ple_lookup_run(ctypes.addressof(job))
        if not raw:
            self._decode(staging, outs[0])
        return outs[0]

    # -- buffers -----------------------------------------------------------------------------
    def _state(self, stream: int) -> _Stream:
        state = self._streams.get(stream)
        if state is None:
            with self._lock:
                state = self._streams.setdefault(stream, _Stream(stream))
        return state

    def _buffers(self, state: _Stream, n: int, capturing: bool) -> _Buffers:
        """Buffers for ``n`` ids: the stream's eager ones, or its capture ones; grown by doubling.
        Outgrown eager buffers are kept until an event recorded now (after every operation queued
        on the stream that may read them) has completed."""
        if capturing:
            bufs = state.capture_buffers
            if bufs is None or bufs.capacity < n:
                with relaxed_capture_mode():
                    bufs = _Buffers(max(n, 2 * (bufs.capacity if bufs else 0)), self.row_bytes)
                state.capture_buffers = bufs
            return bufs
        if state.buffers is None or state.buffers.capacity < n:
            state.retired = [(ev, b) for ev, b in state.retired if not self._freed(ev)]
            old = state.buffers
            if old is not None:
                event = self._driver.event()
                self._driver.record(event, state.handle)
                state.retired.append((event, old))
            state.buffers = _Buffers(max(n, 2 * (old.capacity if old else 0), 1024), self.row_bytes)
        return state.buffers

    def _freed(self, event: int) -> bool:
        if not self._driver.done(event):
            return False
        self._driver.destroy(event)
        return True

    def _keep(self, items: tuple[object, ...]) -> None:
        with self._lock:
            self._captured.append(items)

    # -- counters and life -------------------------------------------------------------------
    def read_counts(self) -> dict[str, int]:
        """The host counters: rows, out_of_range (ids outside the table), broken (owned ids whose
        row was outside its shard's mapping: zeroed), ns (nanoseconds in host nodes), lookups
        (host nodes run, graph replays included). Lookups queued but not yet run are not in it."""
        return self.counts.read()

    def reset_counts(self) -> None:
        self.counts.array[:] = 0

    def close(self) -> None:
        """Wait for every queued lookup's host node, then drop the buffers and events (the caller has
        synchronized the device: this only checks). Idempotent."""
        for state in self._streams.values():
            for job in state.ring:
                while job.busy:
                    time.sleep(1e-4)
            for event, _ in state.retired:
                self._driver.destroy(event)
            for event in state.events:
                self._driver.destroy(event)
        self._streams = {}
        self._captured = []
