"""MappedTable and open_table: one PLE table served from its checkpoint files.

The table owns, in the order it builds them and releases them in reverse: the mapping
(fds + mmaps), the access mode's resources (CUDA registration, device copy, the lookup paths with
their buffers and threads), and the prefetch threads. Under torch.compile lookups go through the
torch ops in ``ple_um.ops``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import torch

from ple_um import envs, metrics, ops
from ple_um.access import first_read
from ple_um.access.capabilities import read_capabilities, resolve_device
from ple_um.access.prefetch import PagePrefetcher
from ple_um.access.probe import CAPTURE_SAFE, ProbeReport, decide, pin_budget, requested_mode
from ple_um.access.registration import RegisteredMapping
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.errors import CheckpointError, ModeUnavailableError, TableClosedError
from ple_um.lookup import rowcopy
from ple_um.lookup.cpu_gather import SyncGather
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.lookup.host_node import HostGather, StreamBlockedError
from ple_um.lookup.nvfp4 import BLOCK
from ple_um.mapping import MappedShards

logger = logging.getLogger(__name__)

# What a table whose close failed still holds: never freed (see MappedTable.close).
_KEPT_AFTER_FAILED_CLOSE: list[tuple[object, ...]] = []

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _alignment(layout: ShardLayout) -> int:
    """Widest power-of-two byte alignment (<= 8) of every shard's row 0 and of the row stride."""
    align = 8
    for spec in layout.shards:
        while spec.rows and (spec.offset % align or layout.row_bytes % align):
            align //= 2
    return align


def _sample_ids(mapping: MappedShards, count: int, seed: int = 0) -> np.ndarray:
    """Owned ids for the self-test: both ends of every owned shard, then random ones."""
    S = mapping.layout.rows_per_shard
    ends = []
    for index, owned in sorted(mapping.owned.items()):
        ends += [index * S + owned.lo, index * S + owned.hi - 1]
    rng = np.random.default_rng(seed)
    rand = rng.integers(mapping.row_start, mapping.row_end, size=max(0, count - len(ends)))
    return np.unique(np.concatenate([np.array(ends[:count], dtype=np.int64), rand]))


def _file_rows(layout: ShardLayout, ids: np.ndarray) -> np.ndarray:
    """Rows read with pread through fresh descriptors: the self-test's reference."""
    out = np.empty((ids.size, layout.row_bytes), dtype=np.uint8)
    S = layout.rows_per_shard
    fds: dict[str, int] = {}
    try:
        for k, i in enumerate(ids.tolist()):
            spec = layout.shards[i // S]
            fd = fds.get(spec.path)
            if fd is None:
                fd = fds[spec.path] = os.open(spec.path, os.O_RDONLY | os.O_NONBLOCK)
            data = os.pread(fd, layout.row_bytes, spec.offset + (i - i // S * S) * layout.row_bytes)
            if len(data) != layout.row_bytes:
                raise CheckpointError(f"short read of row {i}", path=spec.path, tensor=spec.tensor)
            out[k] = np.frombuffer(data, dtype=np.uint8)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


_ID_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8))


class MappedTable:
    """A PLE table served from its mapped checkpoint files through one access mode.

    It opens the table, owns the mode's resources, and picks a lookup path per call: the kernel
    over per-shard bases (``GpuGather``: the ats, registered and device modes) or the host path
    (``HostGather``: the C row copy run as a CUDA host node; the cpu mode, and the GPU modes'
    lookups of at least ``bulk_rows`` ids). Each path owns its buffers, its dequantization and its
    counting. Where the C row copy cannot be built, the cpu mode's host path is ``SyncGather``,
    which is not capture-safe."""

    def __init__(
        self,
        layout: ShardLayout,
        *,
        rows: tuple[int, int],
        device: torch.device,
        mapping: MappedShards,
        report: ProbeReport,
        strict: bool,
        scale_mapping: MappedShards | None = None,
    ) -> None:
        self.layout = layout
        # NVFP4: the block scales, mapped like the rows and reached through their own bases.
        self.scale_mapping = scale_mapping
        self.scale_registration: RegisteredMapping | None = None
        self.scale_device_copy: torch.Tensor | None = None
        self.rows = rows
        self.device = device
        self.mapping = mapping
        self.report = report
        self.mode = report.mode
        self.strict = strict
        self.num_rows = layout.num_rows
        self.row_dim = layout.row_dim
        self.dtype = layout.dtype
        self.scale = layout.scale
        self.capture_safe = CAPTURE_SAFE[self.mode]
        self.registration: RegisteredMapping | None = None
        self.device_copy: torch.Tensor | None = None
        self.gpu: GpuGather | None = None
        self.host: HostGather | SyncGather | None = None
        self.row_reads = "the GPU kernel only"
        self.bulk_rows: int | None = None  # GPU-mode lookups this big take the host path
        self.touch_pages = False  # a host node touches a lookup's pages before the kernel (ats)
        self.prefetcher: PagePrefetcher | None = None
        self.open_seconds = 0.0
        self.bulk_calibration: dict = {}
        self.mapped_resident = 0  # bytes of page-table entries made at open (PLE_UM_MAP_RESIDENT)
        self._scale_dev = (
            torch.tensor([layout.scale], dtype=torch.float32, device=device)
            if layout.scale is not None
            else None
        )
        nvfp4 = scale_mapping is not None
        self._float_only = nvfp4
        self._out_dtypes = frozenset(FLOAT_OUT if nvfp4 else (layout.dtype, *FLOAT_OUT))
        self._lookups = 0  # eager lookup() calls
        self.metrics: metrics.LookupMetrics | None = None  # set by open_table once the table serves
        self.watch: metrics.Watch | None = None
        self._closed = False
        # Calls in flight (one entry each; list.append and .pop are atomic under the GIL, the
        # cheapest guard there is): close() waits until it is empty before it unmaps anything.
        self._inflight: list[None] = []
        self._close_lock = threading.Lock()
        self._closing = False
        self._released = threading.Event()
        self.handle = ops.register_table(self)

    # -- building the access mode ---------------------------------------------------------
    def _build(self, caps_cuda: bool, host_node: bool = True) -> None:
        """Create the resources of ``self.mode``; on error the caller closes them. ``host_node``
        False: the cpu mode's synchronous host path even where the C row copy builds."""
        mode, layout, m, sm = self.mode, self.layout, self.mapping, self.scale_mapping
        advice = envs.PLE_UM_MADVISE
        if advice == "auto":
            advice = "random" if mode in ("cpu", "ats") else "normal"
        if advice != "none":
            for mapping in (m, sm):
                if mapping is not None:
                    mapping.advise(advice)
        lib, why = rowcopy.load(envs.PLE_UM_CACHE_DIR) if envs.PLE_UM_ROWCOPY else (None, "PLE_UM_ROWCOPY=0")
        if not host_node and lib is not None:
            lib, why = None, "the host node's self-test failed"
        if mode == "cpu":
            if lib is not None:
                self.host = self._host_gather(lib, why)
            else:
                self.host = SyncGather(
                    m,
                    self.device,
                    storage=layout.dtype,
                    scale=self._scale_dev,
                    threads=envs.PLE_UM_CPU_THREADS,
                    chunk=envs.PLE_UM_CPU_CHUNK,
                    slots=envs.PLE_UM_STAGING_SLOTS,
                    why=why,
                    scale_mapping=sm,
                )
                self.capture_safe = False
            self.row_reads = self.host.row_reads
        else:
            bases = self._device_bases(m, caps_cuda)
            scale_bases = self._device_bases(sm, caps_cuda, scales=True) if sm is not None else None
            base_align = _alignment(layout)
            if mode == "device":
                # The allocation is 256-byte aligned and every shard's rows start at a multiple of row_bytes.
                base_align = _alignment_rows(layout)
            self.gpu = GpuGather(
                layout,
                bases,
                device=self.device,
                row_start=self.rows[0],
                row_end=self.rows[1],
                base_align=base_align,
                scale=self._scale_dev,
                scale_bases=scale_bases,
            )
            knob = envs.PLE_UM_ATS_PREFETCH
            touch = knob == "on" or (knob == "auto" and mode == "ats" and not m.fully_resident())
            touch = touch and mode != "device" and self.device.type == "cuda"
            bulk = mode in ("ats", "registered") and self.device.type == "cuda" and envs.PLE_UM_BULK_ROWS != 0
            if lib is not None and (bulk or touch):
                self.host = self._host_gather(lib, why)
                self.touch_pages = touch
                self.row_reads = f"the GPU kernel; big lookups: {self.host.row_reads}"
            elif bulk or touch:
                self.row_reads = f"the GPU kernel only (no host path: {why})"
        if mode in ("ats", "cpu"):
            self.prefetcher = PagePrefetcher(m)
        if isinstance(self.host, HostGather) and mode in ("ats", "cpu") and envs.PLE_UM_MAP_RESIDENT:
            self.mapped_resident = sum(mp.map_resident() for mp in (m, sm) if mp is not None)

    def _host_gather(self, lib, built: str) -> HostGather:
        return HostGather(
            lib,
            self.mapping,
            self.device,
            storage=self.dtype,
            scale=self._scale_dev,
            threads=envs.PLE_UM_CPU_THREADS,
            scale_mapping=self.scale_mapping,
            built=built,
        )

    def _device_bases(self, mapping: MappedShards, caps_cuda: bool, scales: bool = False) -> list[int]:
        """Per-shard addresses the kernel reads ``mapping`` through in this GPU mode; the
        registration or device copy made for it is kept (the rows' or the block scales')."""
        mode = self.mode
        registration, copy = None, None
        if mode == "ats":
            if caps_cuda and envs.PLE_UM_ATS_POPULATE:
                with metrics.progress(mapping.mapped_bytes, "ple-um register") as advance:
                    registration = RegisteredMapping(mapping, self.device, progress=advance)
            bases = mapping.host_bases()
        elif mode == "registered":
            with metrics.progress(mapping.mapped_bytes, "ple-um register") as advance:
                registration = RegisteredMapping(mapping, self.device, progress=advance)
            bases = registration.device_bases()
        else:  # device
            copy, bases = _copy_to_device(mapping, self.device)
        if scales:
            self.scale_registration, self.scale_device_copy = registration, copy
        else:
            self.registration, self.device_copy = registration, copy
        return bases

    def _release_access(self) -> None:
        """Wait for the device, then release the mode's resources. Where that fails (a CUDA error)
        the device is not known to be idle: a host thread (the dispatcher, a host node, the pool)
        may still read the mappings or a job struct, so they are kept for the life of the process
        (``mappings_kept``: the caller leaves them mapped) and the error is raised."""
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every queued kernel and host node has run
            for res in (self.prefetcher, self.host, self.scale_registration, self.registration):
                if res is not None:
                    res.close()
        except BaseException:
            _KEPT_AFTER_FAILED_CLOSE.append((self.host, self.mapping, self.scale_mapping))
            logger.error("ple-um: releasing %s failed; its mappings stay until exit", self.layout.directory)
            raise
        self.prefetcher = self.host = None
        self.scale_registration = self.registration = None
        self.bulk_rows = None
        self.touch_pages = False
        self.gpu = None
        self.device_copy = self.scale_device_copy = None

    @property
    def mappings_kept(self) -> bool:
        """Whether a failed release left this table's mappings to the process's end."""
        return any(kept[1] is self.mapping for kept in _KEPT_AFTER_FAILED_CLOSE)

    def self_test(self, count: int) -> str | None:
        """Gather sample rows through this mode's lookup path and compare them with the bytes read
        from the files; None when equal, else what differed. The rows it reads count like a
        lookup's (``open_table`` zeroes the counters after its own self-test)."""
        if count <= 0 or not self.mapping.owned:
            return None  # self-test disabled (PLE_UM_SELF_TEST_ROWS=0) or nothing owned
        ids_np = _sample_ids(self.mapping, count)
        expect = _file_rows(self.layout, ids_np)
        ids = torch.from_numpy(ids_np).to(self.device)
        if self.scale_mapping is None:
            got = self._gather_flat(ids, None, None).view(torch.uint8).reshape(ids_np.size, -1)
        else:  # NVFP4: the packed rows and the block scales, side by side
            got = torch.cat(self._packed_flat(ids), dim=1)
            expect = np.concatenate([expect, _file_rows(self.layout.scale_layout(), ids_np)], axis=1)
        got = got.cpu().numpy()
        if not np.array_equal(got, expect):
            bad = np.flatnonzero((got != expect).any(axis=1))
            first = ids_np[bad[0]]
            return f"self-test: {bad.size} of {ids_np.size} sample rows differ from the file (first: {first})"
        return None

    def calibrate_bulk(self, sizes=(262144, 131072, 65536, 32768, 16384, 4096), repeats: int = 3) -> dict:
        """Time the GPU gather and the host path on random owned ids, largest batch first, and set
        ``bulk_rows`` to the smallest size from which the host path wins at every size measured
        (None when it does not win at the largest). Returns the medians measured, in seconds."""
        rng = np.random.default_rng(1)
        start, end = self.rows
        self.bulk_rows = None
        measured = {}

        def batches(n: int, count: int) -> list[torch.Tensor]:
            return [torch.from_numpy(rng.integers(start, end, size=n)).to(self.device) for _ in range(count)]

        dtype = torch.bfloat16 if self._float_only else self.dtype  # NVFP4: decoded rows
        out = torch.empty((max(sizes), self.row_dim), dtype=dtype, device=self.device)
        for batch in batches(max(sizes), 2):  # buffers allocated and the pool started before timing
            self.host.gather(batch, out[: batch.numel()])
        for n in sorted(sizes, reverse=True):
            times = {"gpu": [], "bulk": []}
            for path in ("gpu", "bulk"):
                for k, batch in enumerate(batches(n, repeats + 1)):
                    torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    (self.gpu if path == "gpu" else self.host).gather(batch, out[:n])
                    torch.cuda.synchronize(self.device)
                    if k:  # the first call of each is a warm-up
                        times[path].append(time.perf_counter() - t0)
            measured[n] = {path: float(np.median(t)) for path, t in times.items()}
            if measured[n]["bulk"] >= measured[n]["gpu"]:
                break
            self.bulk_rows = n
        self._reset_counts()
        return measured

    # -- lookups --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TableClosedError("the table is closed")

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Hold the table open for the work inside: close() waits until no one holds it."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _enter(self) -> None:
        self._inflight.append(None)
        if self._closed:  # checked after the entry is in: close() either sees it or we see closed
            self._inflight.pop()
            raise TableClosedError("the table is closed")

    def _leave(self) -> None:
        self._inflight.pop()

    def _lookup_flat(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype=None) -> torch.Tensor:
        """Body of a lookup: flat ids on the table's device -> out [n, row_dim] (the ops' body)."""
        self._enter()
        try:
            return self._gather_flat(ids, out, out_dtype)
        finally:
            self._leave()

    def _gather_flat(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype) -> torch.Tensor:
        if out is None:
            dtype = out_dtype or self.dtype
            width = self.layout.row_bytes if self._float_only and dtype == self.dtype else self.row_dim
            out = torch.empty((ids.numel(), width), dtype=dtype, device=self.device)
        gpu = self.gpu
        if gpu is None:
            return self.host.gather(ids, out)
        bulk = self.bulk_rows
        if bulk is not None and ids.numel() >= bulk:
            return self.host.gather(ids, out)
        if self.touch_pages:
            self.host.touch(ids)
        return gpu.gather(ids, out)

    def lookup(
        self,
        ids: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        strict: bool | None = None,
    ) -> torch.Tensor:
        """Rows of the global ``ids`` (any shape): ``ids.shape + (row_dim,)``.

        Storage dtype by default; ``out_dtype`` (bf16/f16/f32) dequantizes: ``float32(row) * scale``
        cast to it. ``out`` receives the result without allocating (CUDA graphs); its dtype picks raw
        or dequantized (an ``out_dtype`` given with it must agree). Ids outside the owned range give
        zero rows; ids outside the table give zero rows and are counted, or raise IndexError when
        strict (which synchronizes). Queued on the current stream: no host sync, in every mode
        whose table is ``capture_safe``."""
        if self._closed:
            raise TableClosedError("the table is closed")
        out_dtype = self._check_args(ids, out, out_dtype)
        if ids.device != self.device:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    f"ids are on {ids.device} but the table is on {self.device} (cannot copy during capture)"
                )
            ids = ids.to(self.device)
        if strict if strict is not None else self.strict:
            bad = ((ids < 0) | (ids >= self.num_rows)).sum().item()
            if bad:
                raise IndexError(f"{bad} ids outside [0, {self.num_rows}) (strict lookup)")
        self._lookups += 1  # eager calls; rows are counted by the paths (graph replays too)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        # Eager calls skip the op's dispatch (tens of microseconds of Python); torch.compile traces
        # the op, which it sees as one opaque call with a known output.
        if torch.compiler.is_compiling():
            flat = ids.view(-1)
            if out is not None:
                ops.lookup_out(flat, out.view(-1, self.row_dim), self.handle)
                return out
            return ops.lookup(flat, self.handle, out_dtype or self.dtype).view(*ids.shape, self.row_dim)
        gpu = self.gpu
        if out is not None and gpu is not None and not self.touch_pages:
            bulk = self.bulk_rows
            if bulk is None or ids.numel() < bulk:
                # The kernel path of an eager call with its out: the kernel reads the contiguous ids
                # and writes the contiguous out by address, whatever their shapes (no flat views).
                self._enter()
                try:
                    return gpu.gather(ids, out)
                finally:
                    self._leave()
        flat = ids.view(-1)
        if out is not None:
            self._lookup_flat(flat, out.view(-1, self.row_dim))
            return out
        return self._lookup_flat(flat, None, out_dtype).view(*ids.shape, self.row_dim)

    @staticmethod
    def _check_ids(ids) -> None:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, not {type(ids).__name__}")
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")

    def _check_args(self, ids, out: torch.Tensor | None, out_dtype) -> torch.dtype | None:
        """The argument checks of every lookup (``lookup`` and the torch ops); the out dtype."""
        self._check_ids(ids)
        if out is not None:
            if out_dtype is not None and out_dtype != out.dtype:
                raise TypeError(f"out is {out.dtype} but out_dtype is {out_dtype}: pass one of them")
            out_dtype = out.dtype
            if out_dtype not in self._out_dtypes:
                self._refuse_dtype(out_dtype)
            if out.shape != (*ids.shape, self.row_dim):
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*ids.shape, self.row_dim)}")
            if out.device != self.device:
                raise ValueError(f"out is on {out.device}, the table on {self.device}")
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        elif (
            out_dtype is not None
            and out_dtype not in self._out_dtypes
            or out_dtype is None
            and self._float_only
        ):
            self._refuse_dtype(out_dtype)
        return out_dtype

    def _op_lookup(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype=None) -> torch.Tensor:
        """The body of the torch ops (``ple_um::lookup`` / ``lookup_out``): flat ids on the table's
        device, checked as ``lookup`` checks its arguments (the ops are public)."""
        self._check_open()
        self._check_args(ids, out, out_dtype)
        if ids.dim() != 1:
            raise ValueError(f"the ple_um ops take flat ids (1-D), got shape {tuple(ids.shape)}")
        if ids.device != self.device:
            raise ValueError(f"ids are on {ids.device}, the table on {self.device}")
        return self._lookup_flat(ids.contiguous(), out, out_dtype)

    def _refuse_dtype(self, out_dtype) -> None:
        if self._float_only:
            raise TypeError(
                "an NVFP4 table decodes its rows: pass out_dtype (bf16, f16 or f32) or a float out=, "
                "or use lookup_packed() for the packed bytes and block scales"
            )
        raise TypeError(f"out_dtype must be {self.dtype} (raw) or one of bf16, f16, f32; got {out_dtype}")

    def lookup_packed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NVFP4: the raw rows of ``ids`` for callers that decode themselves: packed bytes
        ``ids.shape + (row_dim // 2,)`` (uint8) and block scales ``ids.shape + (row_dim // 16,)``
        (float8_e4m3fn); zeros outside the owned range and the table."""
        self._check_open()
        if self.scale_mapping is None:
            raise TypeError("lookup_packed() is for NVFP4 tables; use lookup()")
        self._check_ids(ids)
        flat = ids.to(self.device).reshape(-1).contiguous()
        with self._in_use():
            packed, scales = self._packed_flat(flat)
        return (
            packed.view(*ids.shape, packed.shape[1]),
            scales.view(torch.float8_e4m3fn).view(*ids.shape, scales.shape[1]),
        )

    def _packed_flat(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = ids.numel()
        packed = torch.empty((n, self.layout.row_bytes), dtype=torch.uint8, device=self.device)
        scales = torch.empty((n, self.row_dim // BLOCK), dtype=torch.uint8, device=self.device)
        (self.gpu or self.host).gather_packed(ids, packed, scales)
        return packed, scales

    def prefetch(self, ids) -> Future:
        """Start bringing the pages of ``ids``' rows into memory from CPU threads (a hint; modes
        whose pages are resident need none). Returns a Future of the number of rows touched."""
        with self._in_use():
            if self.prefetcher is None:
                done: Future = Future()
                done.set_result(0)
                return done
            return self.prefetcher.submit(ids)

    def _reset_counts(self) -> None:
        for path in (self.gpu, self.host):
            if path is not None:
                path.reset_counts()

    def stats(self, *, sync: bool = True) -> dict:
        """Counters: lookups (eager calls), rows and ids outside the table (counted by the paths:
        graph replays too), bytes, phase seconds of the host path, memory. ``sync`` waits for the
        device first, so that every lookup queued before is in the figures (the stats reporter
        reads without it, on a stream of its own)."""
        with self._in_use():
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return self._stats()

    def _stats(self) -> dict:
        rows = oob = broken = host_lookups = 0
        phases = {"dedup": 0.0, "gather": 0.0, "stage": 0.0, "wait": 0.0}
        if self.gpu is not None:
            counts = self.gpu.read_counts()
            rows, oob = counts["rows"], counts["out_of_range"]
        if isinstance(self.host, HostGather):
            counts = self.host.read_counts()
            rows += counts["rows"]
            oob += counts["out_of_range"]
            broken, host_lookups = counts["broken"], counts["lookups"]
            phases["gather"] = counts["ns"] * 1e-9
            phases["stage"] = self.host.enqueue_seconds
        elif isinstance(self.host, SyncGather):
            counts = self.host.read_counts()
            rows, oob, host_lookups = counts["rows"], counts["out_of_range"], counts["lookups"]
            phases.update(self.host.phases)
        return {
            "mode": self.mode,
            "lookups": self._lookups,
            "rows": rows,
            "bytes": rows * self.layout.row_bytes,
            "out_of_range": oob,
            "host_lookups": host_lookups,
            "broken_rows": broken,
            "phase_seconds": phases,
            "mapped_bytes": self.mapping.mapped_bytes
            + (self.scale_mapping.mapped_bytes if self.scale_mapping else 0),
            "pinned_bytes": sum(
                r.registered_bytes for r in (self.registration, self.scale_registration) if r is not None
            )
            if self.mode == "registered"
            else 0,
            "device_bytes": sum(
                c.numel() for c in (self.device_copy, self.scale_device_copy) if c is not None
            ),
            "open_seconds": self.open_seconds,
        }

    # -- life -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for lookups in flight and for the device, then release prefetch, access resources
        and mappings. Idempotent; a second caller returns once the first has released everything.
        Where that wait or a release fails (a CUDA error), the error is raised and the mappings are
        kept until the process exits: host threads may still read them."""
        with self._close_lock:
            closing, self._closing = self._closing, True
        if closing:
            self._released.wait()
            return
        try:
            if self.watch is not None:
                self.watch.close()  # its last stats() read, while the table is still open
            self._closed = True
            while self._inflight:
                time.sleep(1e-3)
            ops.unregister_table(self.handle)
            self._release_access()  # where it fails, the mappings stay mapped (and it raises)
            if self.scale_mapping is not None:
                self.scale_mapping.close()
            self.mapping.close()
        finally:
            self._released.set()

    def __enter__(self) -> MappedTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.mode
        return (
            f"MappedTable({self.layout.directory!r}, layer={self.layout.layer}, rows={self.rows}, "
            f"{self.num_rows}x{self.row_dim} {self.dtype}, {state})"
        )


def _copy_to_device(mapping: MappedShards, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The owned rows of ``mapping`` copied into one device allocation, and each shard's base in it."""
    layout = mapping.layout
    copy = torch.empty(mapping.owned_bytes, dtype=torch.uint8, device=device)
    bases = [0] * layout.parts
    pos = 0
    for index, owned in sorted(mapping.owned.items()):
        n = owned.rows * layout.row_bytes
        copy[pos : pos + n].copy_(torch.from_numpy(mapping.shard_rows(index).reshape(-1)))
        bases[index] = copy.data_ptr() + pos - owned.lo * layout.row_bytes
        pos += n
    return copy, bases


def _alignment_rows(layout: ShardLayout) -> int:
    align = 8
    while layout.row_bytes % align:
        align //= 2
    return align


def open_table(
    path: str | os.PathLike,
    *,
    layer: int | None = None,
    rows: tuple[int, int] | None = None,
    mode: str = "auto",
    device=None,
    strict: bool | None = None,
) -> MappedTable:
    """Open one PLE layer's table from the checkpoint directory ``path`` (see DESIGN.md)."""
    t0 = time.perf_counter()
    # A knob set to a value it does not take is an error here, not a rejected mode (PLE_UM_MODE:
    # read by requested_mode, and only when no mode is given).
    envs.check(skip=("PLE_UM_MODE",))
    forced = requested_mode(mode)
    layout = read_layout(os.fspath(path), layer)
    if rows is None:
        rows = (0, layout.num_rows)
    try:
        start, end = (operator.index(x) for x in rows)
    except (TypeError, ValueError):
        raise ValueError(f"rows={rows!r} must be two integers (start, end)") from None
    if not 0 <= start <= end <= layout.num_rows:
        raise ValueError(f"rows={rows!r} must satisfy 0 <= start <= end <= num_rows ({layout.num_rows})")
    dev = resolve_device(device)
    caps = read_capabilities(dev)
    budget = pin_budget()
    mapping = MappedShards(layout, (start, end))
    try:
        scale_mapping = MappedShards(layout.scale_layout(), (start, end)) if layout.is_nvfp4 else None
    except BaseException:
        mapping.close()
        raise
    pinned_bytes = mapping.mapped_bytes + (scale_mapping.mapped_bytes if scale_mapping is not None else 0)
    rejected: dict[str, str] = {}
    table = None
    try:
        while True:
            report = decide(caps, mode=forced, table_bytes=pinned_bytes, budget=budget, exclude=rejected)
            table = MappedTable(
                layout,
                rows=(start, end),
                device=dev,
                mapping=mapping,
                report=report,
                strict=envs.PLE_UM_STRICT if strict is None else strict,
                scale_mapping=scale_mapping,
            )
            try:
                first_read.check(report, caps, layout, (start, end), dev)  # the first read, in a child
                table._build(caps.cuda)
                why = None
                if table.gpu is not None:
                    why = table.self_test(envs.PLE_UM_SELF_TEST_ROWS)
                elif isinstance(table.host, HostGather):
                    _self_test_host_node(table, caps.cuda)
            except StreamBlockedError:
                ops.unregister_table(table.handle)
                raise  # nothing may synchronize the device now: no release through it
            except Exception as exc:  # noqa: BLE001 - a mode that fails to build is rejected with its reason
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                break
            ops.unregister_table(table.handle)
            table._release_access()
            if forced != "auto":
                raise ModeUnavailableError(report.mode, why)
            logger.warning("ple-um: %s mode rejected for %s: %s", report.mode, layout.directory, why)
            rejected[report.mode] = why
    except BaseException:
        if table is None or not table.mappings_kept:
            if scale_mapping is not None:
                scale_mapping.close()
            mapping.close()
        raise
    knob = envs.PLE_UM_BULK_ROWS
    if table.gpu is not None and isinstance(table.host, HostGather) and knob != 0 and mapping.owned:
        if table.mode in ("ats", "registered"):
            if knob == "auto":
                table.bulk_calibration = table.calibrate_bulk()
            else:
                table.bulk_rows = int(knob)
    if envs.PLE_UM_PREWARM:
        with metrics.progress(pinned_bytes, "ple-um prewarm") as advance:
            for each in (mapping, scale_mapping):
                if each is not None:
                    each.populate(progress=advance)
    table._reset_counts()  # the self-test's and the calibration's rows were not lookups
    table.metrics = metrics.LookupMetrics(table.mode, host_counted=isinstance(table.host, SyncGather))
    if isinstance(table.host, SyncGather):
        table.host.metrics = table.metrics
    registrations = [r for r in (table.registration, table.scale_registration) if r is not None]
    if registrations:
        table.metrics.registration(sum(r.seconds for r in registrations))
    residency = mapping.residency
    if scale_mapping is not None:  # the page-cache figures count the block scales beside the rows
        residency = lambda: [*mapping.residency(), *scale_mapping.residency()]  # noqa: E731
    table.watch = metrics.watch(
        functools.partial(table.stats, sync=False), table.metrics, residency, device=dev
    )
    table.open_seconds = time.perf_counter() - t0
    logger.info(
        "ple-um: %s opened in %s mode (%.2f s), capture-safe=%s\n%s\n  row reads: %s",
        layout.directory,
        table.mode,
        table.open_seconds,
        table.capture_safe,
        report.describe(),
        table.row_reads,
    )
    return table


def _self_test_host_node(table: MappedTable, caps_cuda: bool) -> None:
    """The cpu mode's host node, tried on sample rows: where its rows differ from the files (or it
    fails), the table falls back to the synchronous host path, which is not capture-safe, and the
    log says why. Never raises for a failed try."""
    try:
        why = table.self_test(envs.PLE_UM_SELF_TEST_ROWS)
    except Exception as exc:  # noqa: BLE001 - any failure of the host node sends it to the fallback
        why = f"{type(exc).__name__}: {exc}"
    if why is None:
        return
    logger.warning("ple-um: the cpu mode's host node failed its self-test (%s): synchronous host path", why)
    table._release_access()
    table._build(caps_cuda, host_node=False)
    table.row_reads += f"; the host node failed its self-test: {why}"
