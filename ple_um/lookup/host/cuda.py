"""The host path's side of CUDA: libcuda's calls, what a lookup keeps per stream, and the words
through which a stream and ple-um's dispatcher thread hand an eager lookup to each other.

The calls (``CudaDriver``, one per process: ``CudaDriver.get()``) are bound through ctypes on
libcuda: each is a stream operation (captured like any other) or a query, and none takes the GIL
back while it runs. A copy, launch, wait, event creation or context call that fails raises
``HostNodeError`` naming the call and the driver's error; ``query`` and ``done`` hand the stream's
or event's state back.

Per stream (``StreamState``): pinned buffers for the ids and the staged rows, and a ring of job
structs. Eager lookups use one set of buffers per stream (grown, never shrunk): the stream's order
makes reuse safe (the next lookup's ids arrive after the previous lookup's rows left). Each queued
lookup gets its job structs from the stream's ring; a struct is reused once its row copy has
finished (the C code clears its ``busy`` flag last). Lookups captured in a CUDA graph get job
structs of their own and the capture buffers of their stream, shared by the lookups captured on
that stream (replayed one at a time in stream order, as vLLM replays its graphs); a graph may
replay them at any time, so they are kept as long as the host gather.

The signals: each ring slot has two 32-bit words of pinned memory, a cache line apart: its ready
word, written by the stream (``cuStreamWriteValue32``) once the lookup's ids are in pinned memory,
and its done word, written by the dispatcher once the rows are staged; the stream's copy of the
rows waits for it (``cuStreamWaitValue32``, greater-or-equal, compared cyclically as CUDA does). A
lookup's number (``seq``) is what both words carry. Whether a device's streams see the host's
writes is checked once per device at open (``signal_check.py``).

The stream a lookup is queued on is torch's current one (``kernels.launch.current_stream``, which the
kernel's launcher reads too); every call on it goes through ``CudaDriver``, the host path's one
binding to the driver. ple-um's own streams (a chunked lookup's side stream) and the relaxed capture
mode are made through the CUDA runtime in ``lookup/streams.py``, shared with code outside the host
path (the stats reporter, the prefetch stream, the release of a dropped table); the pinned buffers
and words are torch tensors.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from ple_um.errors import PleUmError
from ple_um.lookup import rowcopy
from ple_um.lookup.streams import relaxed_capture_mode

_PTR, _I32, _U32, _U64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint64
_SIGNATURES = {
    "cuMemcpyDtoHAsync_v2": [_PTR, _U64, ctypes.c_size_t, _PTR],
    "cuMemcpyHtoDAsync_v2": [_U64, _PTR, ctypes.c_size_t, _PTR],
    "cuLaunchHostFunc": [_PTR, _PTR, _PTR],
    "cuEventCreate": [ctypes.POINTER(_PTR), ctypes.c_uint],
    "cuEventRecord": [_PTR, _PTR],
    "cuEventQuery": [_PTR],
    "cuEventDestroy_v2": [_PTR],
    "cuStreamWaitEvent": [_PTR, _PTR, ctypes.c_uint],
    "cuGetErrorName": [_I32, ctypes.POINTER(ctypes.c_char_p)],
    "cuStreamQuery": [_PTR],
    "cuCtxGetCurrent": [ctypes.POINTER(_PTR)],
    "cuCtxSetCurrent": [_PTR],
    "cuDeviceGet": [ctypes.POINTER(_I32), _I32],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_PTR), _I32],
}
# Stream memory operations: the dispatcher's signals (CUDA 11.7+ drivers have the _v2 calls).
_MEM_OPS = {
    "cuStreamWriteValue32_v2": [_PTR, _U64, _U32, _U32],
    "cuStreamWaitValue32_v2": [_PTR, _U64, _U32, _U32],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_U64), _PTR, _U32],
}
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600


class HostNodeError(PleUmError, RuntimeError):
    """The CUDA driver refused a call of the host path (the message names the call and the error)."""


class StreamBlockedError(HostNodeError):
    """A stream of this device waits for ever (the signals' check at open): nothing may synchronize
    the device after it, so the open gives up without releasing through the device."""


class CudaDriver:
    """libcuda's calls of the host path: copies, host functions, events, stream memory operations."""

    _instance: CudaDriver | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        lib = self.lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _I32
        self.mem_ops = all(hasattr(lib, name) for name in _MEM_OPS)
        if self.mem_ops:
            for name, argtypes in _MEM_OPS.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, _I32
            self.write_value = self._checked(
                lambda stream, address, value: lib.cuStreamWriteValue32_v2(stream, address, value, 0),
                "cuStreamWriteValue32",
            )
            self.wait_value = self._checked(  # flags 0: CU_STREAM_WAIT_VALUE_GEQ (cyclic)
                lambda stream, address, value: lib.cuStreamWaitValue32_v2(stream, address, value, 0),
                "cuStreamWaitValue32",
            )
        self._thread = threading.local()
        self.d2h = self._checked(lib.cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync")
        self.h2d = self._checked(lib.cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync")
        self.launch_host_func = self._checked(lib.cuLaunchHostFunc, "cuLaunchHostFunc")
        self.record = self._checked(lib.cuEventRecord, "cuEventRecord")
        self.wait = self._checked(
            lambda stream, event: lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent"
        )

    @classmethod
    def get(cls) -> CudaDriver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _ok(self, rc: int, name: str) -> None:
        if rc != CUDA_SUCCESS:
            raise HostNodeError(f"{name} failed: {self.error_name(rc)}")

    def _checked(self, fn, name: str):
        def call(*args) -> None:  # checked in its one frame: an eager lookup makes four such calls
            if (rc := fn(*args)) != CUDA_SUCCESS:
                self._ok(rc, name)

        return call

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        return f"{(name.value or b'?').decode()} ({rc})"

    def query(self, stream: int) -> int:
        """cuStreamQuery's code: CUDA_SUCCESS (idle), CUDA_ERROR_NOT_READY (busy), or an error."""
        return self.lib.cuStreamQuery(stream)

    def ensure_context(self, index: int) -> None:
        """Make device ``index``'s primary context current in this thread where none is (a thread
        that has made no CUDA call yet: the calls here need one). Once per thread. The caller has
        made ``index`` torch's current device (whose context is then current)."""
        if getattr(self._thread, "index", None) == index:
            return
        current = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and not current.value:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            for call in (  # in turn, each checked before the next uses what it made
                lambda: self.lib.cuDeviceGet(ctypes.byref(device), index),
                lambda: self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                lambda: self.lib.cuCtxSetCurrent(context),
            ):
                if (rc := call()) != CUDA_SUCCESS:
                    raise HostNodeError(
                        f"making device {index}'s context current failed: {self.error_name(rc)}"
                    )
        self._thread.index = index

    def device_pointer(self, host: int) -> int:
        """The device address of pinned host memory at ``host`` (the same address under UVA)."""
        address = ctypes.c_uint64()
        self._ok(
            self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(address), host, 0), "cuMemHostGetDevicePointer"
        )
        return address.value

    def event(self) -> int:
        """A new event without timing (destroy with ``destroy``)."""
        handle = ctypes.c_void_p()
        self._ok(self.lib.cuEventCreate(ctypes.byref(handle), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return handle.value

    def done(self, event: int) -> bool:
        return self.lib.cuEventQuery(event) == CUDA_SUCCESS

    def destroy(self, event: int) -> None:
        self.lib.cuEventDestroy_v2(event)


# A ring slot's words: its ready word at the slot's start, its done word a cache line further (the
# stream writes one, the dispatcher the other).
SIGNAL_BYTES, DONE_AT = 128, 64


def arm(ready: int, seq: int) -> None:
    """Set the ready word at ``ready`` one behind ``seq`` before the lookup numbered ``seq`` is
    posted under it. A ring slot's word is written by its stream only when the slot is a lookup's
    first: a slot that has not been first for about 2**31 lookups holds a number that compares as
    reached, and the dispatcher would read the ids before they arrive. Safe to store: the slot is
    free, so the stream's last write of this word has landed (the job that waited for it has run),
    and a later chunk of that lookup, still waiting on it, waits for that number or a lower one
    (at or below ``seq - 1``: still reached)."""
    ctypes.c_uint32.from_address(ready).value = (seq - 1) & 0xFFFFFFFF


def signalled(job) -> bool:
    """Whether the dispatcher has set ``job``'s done word (its stream's wait is over, and the job's
    busy flag is about to clear): a job of the dispatcher whose stream is idle."""
    if not job.done:
        return False
    done = ctypes.c_uint32.from_address(job.done).value
    return ((done - job.seq) & 0xFFFFFFFF) < 1 << 31


# Job structs per stream's ring: lookups queued ahead of their row copies before a caller waits.
# A lookup takes one per chunk: the ring holds a whole lookup's (``gather.MAX_CHUNKS`` + 1) at once.
RING = 64


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
        if job.busy:  # RING lookups queued ahead of their row copies: back-pressure
            self._wait_free(job, driver)
        self.next = (self.next + 1) % RING
        return index

    def _wait_free(self, job, driver) -> None:
        """Wait until ``job``'s row copy has run, asking the streams its work runs on every ~0.1 s:
        HostNodeError where it cannot run any more (``check_pending``) instead of a wait for ever."""
        spins = 0
        while job.busy:
            spins += 1
            time.sleep(0 if spins < 1000 else 1e-4)
            if spins % 1000 == 0:
                streams = [self.handle] + ([self.side.cuda_stream] if self.side is not None else [])
                check_pending(driver, streams, job)

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
            # Made before the old ones retire: where the pinned allocation (or the event) fails,
            # the old buffers stay the stream's, and only the stream's (never retired as well).
            new = PinnedBuffers(max(n, 2 * (old.capacity if old else 0), 1024), row_bytes)
            if old is not None:
                self.retired.append((self._recorded(driver), old))
            self.buffers = new
        return self.buffers

    def _recorded(self, driver) -> int:
        """A new event recorded on the stream now (destroyed where the record fails)."""
        event = driver.event()
        try:
            driver.record(event, self.handle)
        except BaseException:
            driver.destroy(event)
            raise
        return event

    def close(self, driver) -> None:
        """Wait for every job of the ring (the caller has waited for the streams its lookups
        were queued on: this only checks; a job that cannot run any more raises HostNodeError, as
        in ``slot``, rather than hang the release), then destroy the events."""
        for job in self.ring:
            if job.busy:
                self._wait_free(job, driver)
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
