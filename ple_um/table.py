"""MappedTable and open_table: one PLE table served from its checkpoint files.

The table owns, in the order it builds them and releases them in reverse: the mapping
(fds + mmaps), the access mode's resources (CUDA registration, device copy, staging buffers and
threads), and the prefetch threads. Lookups go through the torch op in ``ple_um.ops``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ple_um import envs, metrics, ops
from ple_um.access.capabilities import read_capabilities, resolve_device
from ple_um.access.prefetch import PagePrefetcher
from ple_um.access.probe import CAPTURE_SAFE, ProbeReport, decide, pin_budget, requested_mode
from ple_um.access.registration import RegisteredMapping
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.errors import CheckpointError, ModeUnavailableError, TableClosedError
from ple_um.lookup.cpu_gather import CpuGather
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.lookup.nvfp4 import BLOCK, decode_nvfp4
from ple_um.mapping import MappedShards

logger = logging.getLogger(__name__)

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


@dataclass
class _HostStats:
    lookups: int = 0
    phases: dict = field(default_factory=lambda: {"dedup": 0.0, "gather": 0.0, "stage": 0.0, "wait": 0.0})


class MappedTable:
    """A PLE table served from its mapped checkpoint files through one access mode."""

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
        self.scale_cpu: CpuGather | None = None
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
        self.cpu: CpuGather | None = None
        self.bulk: CpuGather | None = None
        self.bulk_rows: int | None = None  # eager GPU-mode lookups this big take the bulk path
        self.prefetcher: PagePrefetcher | None = None
        self.open_seconds = 0.0
        self.bulk_calibration: dict = {}
        # Device counters: [rows looked up, ids outside the table]; see kernels/gather.py.
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        self._pair = torch.arange(2, device=device)  # the counters' indices, for index_add_
        self._scale_dev = (
            torch.tensor([layout.scale], dtype=torch.float32, device=device)
            if layout.scale is not None
            else None
        )
        self._host = _HostStats()
        self.metrics: metrics.LookupMetrics | None = None  # set by open_table once the table serves
        self.watch: metrics.Watch | None = None
        self._closed = False
        # Lookups in flight: close() waits for them before it unmaps anything.
        self._cond = threading.Condition()
        self._users = 0
        self._closing = False
        self._released = threading.Event()
        self._count_lock = threading.Lock()
        self.handle = ops.register_table(self)

    # -- building the access mode ---------------------------------------------------------
    def _build(self, caps_cuda: bool) -> None:
        """Create the resources of ``self.mode``; on error the caller closes them."""
        mode, layout, m, sm = self.mode, self.layout, self.mapping, self.scale_mapping
        advice = envs.PLE_UM_MADVISE
        if advice == "auto":
            advice = "random" if mode in ("cpu", "ats") else "normal"
        if advice != "none":
            for mapping in (m, sm):
                if mapping is not None:
                    mapping.advise(advice)
        common = dict(
            device=self.device,
            row_start=self.rows[0],
            row_end=self.rows[1],
            base_align=_alignment(layout),
            counters=self.counters,
            scale=self._scale_dev,
        )
        if mode == "cpu":
            self.cpu = self._host_gather(m)
            self.scale_cpu = self._host_gather(sm) if sm is not None else None
        else:
            bases = self._device_bases(m, caps_cuda)
            scale_bases = self._device_bases(sm, caps_cuda, scales=True) if sm is not None else None
            if mode == "device":
                # The allocation is 256-byte aligned and every shard's rows start at a multiple of row_bytes.
                common["base_align"] = _alignment_rows(layout)
            self.gpu = GpuGather(layout, bases, scale_bases=scale_bases, **common)
        if mode in ("ats", "cpu"):
            self.prefetcher = PagePrefetcher(m)
        bulk_ok = mode in ("ats", "registered") and self.device.type == "cuda" and sm is None
        if bulk_ok and envs.PLE_UM_BULK_ROWS != 0:
            self.bulk = self._host_gather(m)

    def _host_gather(self, mapping: MappedShards) -> CpuGather:
        return CpuGather(
            mapping,
            self.device,
            threads=envs.PLE_UM_CPU_THREADS,
            chunk=envs.PLE_UM_CPU_CHUNK,
            slots=envs.PLE_UM_STAGING_SLOTS,
            row_copy=envs.PLE_UM_ROWCOPY,
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for res in (
            self.prefetcher,
            self.bulk,
            self.scale_cpu,
            self.cpu,
            self.scale_registration,
            self.registration,
        ):
            if res is not None:
                res.close()
        self.prefetcher = self.bulk = self.scale_cpu = self.cpu = None
        self.scale_registration = self.registration = None
        self.bulk_rows = None
        self.gpu = None
        self.device_copy = self.scale_device_copy = None

    def self_test(self, count: int) -> str | None:
        """Gather sample rows through this mode and compare them with the bytes read from the files;
        None when equal, else what differed."""
        if count <= 0 or not self.mapping.owned:
            return None  # self-test disabled (PLE_UM_SELF_TEST_ROWS=0) or nothing owned
        ids_np = _sample_ids(self.mapping, count)
        expect = _file_rows(self.layout, ids_np)
        ids = torch.from_numpy(ids_np).to(self.device)
        before = self.counters.clone()
        if self.scale_mapping is None:
            got = self._lookup_flat(ids, None).view(torch.uint8).reshape(ids_np.size, -1)
        else:  # NVFP4: the packed rows and the block scales, side by side
            got = torch.cat(self._packed_flat(ids), dim=1)
            expect = np.concatenate([expect, _file_rows(self.layout.scale_layout(), ids_np)], axis=1)
        self.counters.copy_(before)  # the self-test is not a lookup
        got = got.cpu().numpy()
        if not np.array_equal(got, expect):
            bad = np.flatnonzero((got != expect).any(axis=1))
            first = ids_np[bad[0]]
            return f"self-test: {bad.size} of {ids_np.size} sample rows differ from the file (first: {first})"
        return None

    def calibrate_bulk(self, sizes=(262144, 131072, 65536, 32768, 16384, 4096), repeats: int = 3) -> dict:
        """Time the GPU gather and the CPU bulk gather on random owned ids, largest batch first, and
        set ``bulk_rows`` to the smallest size from which the bulk path wins at every size measured
        (None when it does not win at the largest). Returns the medians measured, in seconds."""
        rng = np.random.default_rng(1)
        start, end = self.rows
        self.bulk_rows = None
        measured = {}

        def batches(n: int, count: int) -> list[torch.Tensor]:
            return [torch.from_numpy(rng.integers(start, end, size=n)).to(self.device) for _ in range(count)]

        out = torch.empty((max(sizes), self.row_dim), dtype=self.dtype, device=self.device)
        for batch in batches(max(sizes), self.bulk.slots):  # staging buffers allocated before timing
            self._bulk_lookup(batch, out[: batch.numel()])
        for n in sorted(sizes, reverse=True):
            times = {"gpu": [], "bulk": []}
            for path in ("gpu", "bulk"):
                for k, batch in enumerate(batches(n, repeats + 1)):
                    torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    if path == "gpu":
                        self.gpu.gather(batch, out[:n])
                    else:
                        self._bulk_lookup(batch, out[:n])
                    torch.cuda.synchronize(self.device)
                    if k:  # the first call of each is a warm-up
                        times[path].append(time.perf_counter() - t0)
            measured[n] = {path: float(np.median(t)) for path, t in times.items()}
            if measured[n]["bulk"] >= measured[n]["gpu"]:
                break
            self.bulk_rows = n
        self.counters.zero_()
        for key in self._host.phases:
            self._host.phases[key] = 0.0
        return measured

    # -- lookups --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TableClosedError("the table is closed")

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Hold the table open for the work inside: close() waits until no one holds it."""
        with self._cond:
            if self._closed:
                raise TableClosedError("the table is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    def _count(self, rows: int, bad: torch.Tensor, phases: dict | None = None) -> None:
        """Host-side lookups add to the device counters (``bad``: a 0-dim tensor of the ids
        outside the table, on the counters' device, so counting needs no sync) and to the phase
        seconds. index_add_ adds atomically on a GPU, so lookups from several streams all count;
        the lock orders the additions on the host (+= is not atomic)."""
        with self._count_lock:
            self.counters.index_add_(0, self._pair, torch.stack((torch.full_like(bad, rows), bad)))
        self._add_phases(phases or {})

    def _add_phases(self, phases: dict) -> None:
        with self._count_lock:
            for key, value in phases.items():
                self._host.phases[key] += value

    def _lookup_flat(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype=None) -> torch.Tensor:
        """Eager body of a lookup: flat ids on the table's device -> out [n, row_dim]."""
        with self._in_use():
            return self._gather_flat(ids, out, out_dtype)

    def _gather_flat(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype) -> torch.Tensor:
        n = ids.numel()
        dtype = out.dtype if out is not None else (out_dtype or self.dtype)
        if out is None:
            width = (
                self.layout.row_bytes
                if self.scale_mapping is not None and dtype == self.dtype
                else self.row_dim
            )
            out = torch.empty((n, width), dtype=dtype, device=self.device)
        if self.gpu is None:
            return self._cpu_lookup(ids, out, self.cpu)
        bulk = self.bulk_rows is not None and n >= self.bulk_rows
        if bulk and not torch.cuda.is_current_stream_capturing():
            return self._bulk_lookup(ids, out)
        return self.gpu.gather(ids, out)

    def _bulk_lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A GPU mode's big eager batch through the CPU bulk path (the device counts the lookup);
        dequantized on the device when ``out`` is a float tensor."""
        t0 = time.perf_counter()
        if out.dtype == self.dtype:
            self.bulk.gather_bulk(ids, out.view(torch.uint8), self.counters)
        else:
            raw = torch.empty((ids.numel(), self.layout.row_bytes), dtype=torch.uint8, device=self.device)
            self._dequantize(self.bulk.gather_bulk(ids, raw, self.counters), out)
        phases = dict(self.bulk.last_phases)
        self._add_phases(phases)
        if self.metrics is not None:
            n = ids.numel()
            self.metrics.observe(n, n * self.layout.row_bytes, 0, phases, time.perf_counter() - t0)
        return out

    def _dequantize(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """Raw rows gathered on the host (uint8 [n, row_bytes]) into the float ``out``:
        ``float32(row) * scale`` cast, as the GPU kernel dequantizes."""
        rows = raw.view(self.dtype).float()
        out.copy_(rows * self._scale_dev if self._scale_dev is not None else rows)

    def _classify(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a host-side gather: (ids as int64, which are owned, the count of ids outside the
        table as a 0-dim tensor on the counters' device, for ``_count``)."""
        ids = ids.to(torch.int64)
        in_table = (ids >= 0) & (ids < self.num_rows)
        owned = in_table & (ids >= self.rows[0]) & (ids < self.rows[1])
        return ids, owned, (~in_table).sum().to(self.counters.device)

    def _cpu_lookup(self, ids: torch.Tensor, out: torch.Tensor, gather: CpuGather) -> torch.Tensor:
        t0 = time.perf_counter()
        ids, owned, bad = self._classify(ids)
        if out.dtype == self.dtype:
            gather.gather(ids, owned, out.view(torch.uint8))
        elif self.scale_cpu is not None:
            decode_nvfp4(gather.gather(ids, owned), self.scale_cpu.gather(ids, owned), self._scale_dev, out)
        else:
            self._dequantize(gather.gather(ids, owned), out)
        phases = dict(gather.last_phases)
        self._count(ids.numel(), bad, phases)
        if self.metrics is not None:
            n = ids.numel()
            # Only the cpu mode counts ids on the host (see LookupMetrics); reading them syncs.
            out_of_range = int(bad) if self.metrics.host_counted else 0
            self.metrics.observe(n, n * self.layout.row_bytes, out_of_range, phases, time.perf_counter() - t0)
        return out

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
        or dequantized. Ids outside the owned range give zero rows; ids outside the table give zero
        rows and are counted, or raise IndexError when strict (which synchronizes)."""
        self._check_open()
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, not {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        if out is not None:
            if out_dtype is not None and out_dtype != out.dtype:
                raise TypeError(f"out is {out.dtype} but out_dtype is {out_dtype}: pass one of them")
            out_dtype = out.dtype
        if self.scale_mapping is not None and out_dtype not in FLOAT_OUT:
            raise TypeError(
                "an NVFP4 table decodes its rows: pass out_dtype (bf16, f16 or f32) or a float out=, "
                "or use lookup_packed() for the packed bytes and block scales"
            )
        if out_dtype is not None and out_dtype != self.dtype and out_dtype not in FLOAT_OUT:
            raise TypeError(f"out_dtype must be {self.dtype} (raw) or one of bf16, f16, f32; got {out_dtype}")
        shape = (*ids.shape, self.row_dim)
        if out is not None:
            if tuple(out.shape) != shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
            if out.device != self.device:
                raise ValueError(f"out is on {out.device}, the table on {self.device}")
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        if ids.device != self.device and not (self.mode == "cpu" and ids.device.type == "cpu"):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    f"ids are on {ids.device} but the table is on {self.device} (cannot copy during capture)"
                )
            ids = ids.to(self.device)
        if strict if strict is not None else self.strict:
            bad = ((ids < 0) | (ids >= self.num_rows)).sum().item()
            if bad:
                raise IndexError(f"{bad} ids outside [0, {self.num_rows}) (strict lookup)")
        self._host.lookups += 1  # eager calls; rows are counted on the device (graph replays too)
        flat = ids.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        # Eager calls skip the op's dispatch (tens of microseconds of Python); torch.compile traces
        # the op, which it sees as one opaque call with a known output.
        if out is not None:
            if torch.compiler.is_compiling():
                ops.lookup_out(flat, out.view(-1, self.row_dim), self.handle)
            else:
                self._lookup_flat(flat, out.view(-1, self.row_dim))
            return out
        if torch.compiler.is_compiling():
            return ops.lookup(flat, self.handle, out_dtype or self.dtype).view(shape)
        return self._lookup_flat(flat, None, out_dtype).view(shape)

    def lookup_packed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NVFP4: the raw rows of ``ids`` for callers that decode themselves: packed bytes
        ``ids.shape + (row_dim // 2,)`` (uint8) and block scales ``ids.shape + (row_dim // 16,)``
        (float8_e4m3fn); zeros outside the owned range and the table. Eager only."""
        self._check_open()
        if self.scale_mapping is None:
            raise TypeError("lookup_packed() is for NVFP4 tables; use lookup()")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        flat = ids.to(self.device).reshape(-1).contiguous()
        with self._in_use():
            packed, scales = self._packed_flat(flat)
        return (packed.view(*ids.shape, -1), scales.view(torch.float8_e4m3fn).view(*ids.shape, -1))

    def _packed_flat(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = ids.numel()
        packed = torch.empty((n, self.layout.row_bytes), dtype=torch.uint8, device=self.device)
        scales = torch.empty((n, self.row_dim // BLOCK), dtype=torch.uint8, device=self.device)
        if self.gpu is not None:
            self.gpu.gather(ids, packed)
            self.gpu.gather_block_scales(ids, scales.view(torch.float8_e4m3fn))
        else:
            ids, owned, bad = self._classify(ids)
            self.cpu.gather(ids, owned, packed)
            self.scale_cpu.gather(ids, owned, scales)
            self._count(n, bad)
        return packed, scales

    def prefetch(self, ids) -> Future:
        """Start bringing the pages of ``ids``' rows into memory (a hint; modes whose pages are
        resident need none). Returns a Future of the number of rows touched."""
        with self._in_use():
            if self.prefetcher is None:
                done: Future = Future()
                done.set_result(0)
                return done
            return self.prefetcher.submit(ids)

    def stats(self) -> dict:
        """Counters: lookups and rows (rows counted on the device, graph replays included), ids
        outside the table, bytes, and the cpu mode's phase seconds. Reads the device: synchronizes."""
        with self._in_use():
            return self._stats()

    def _stats(self) -> dict:
        rows, oob = (int(v) for v in self.counters.tolist())
        return {
            "mode": self.mode,
            "lookups": self._host.lookups,
            "rows": rows,
            "bytes": rows * self.layout.row_bytes,
            "out_of_range": oob,
            "phase_seconds": dict(self._host.phases),
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
        and mappings. Idempotent; a second caller returns once the first has released everything."""
        with self._cond:
            closing, self._closing = self._closing, True
        if closing:
            self._released.wait()
            return
        try:
            if self.watch is not None:
                self.watch.close()  # its last stats() read, while the table is still open
            with self._cond:
                self._closed = True
                while self._users:
                    self._cond.wait()
            ops.unregister_table(self.handle)
            try:
                self._release_access()
            finally:
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
    itemsize = torch.tensor([], dtype=layout.dtype).element_size()
    for spec in layout.shards:
        if spec.rows and spec.offset % itemsize:
            raise CheckpointError(
                f"tensor data starts at byte {spec.offset}, not aligned to its {itemsize}-byte elements",
                path=spec.path,
                tensor=spec.tensor,
            )
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
                table._build(caps.cuda)
                why = None
                if table.gpu is not None:
                    why = table.self_test(envs.PLE_UM_SELF_TEST_ROWS)
            except Exception as exc:  # noqa: BLE001 - a mode that fails to build is rejected with its reason
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                break
            if forced != "auto":
                table._release_access()
                ops.unregister_table(table.handle)
                raise ModeUnavailableError(report.mode, why)
            logger.warning("ple-um: %s mode rejected for %s: %s", report.mode, layout.directory, why)
            table._release_access()
            ops.unregister_table(table.handle)
            rejected[report.mode] = why
    except BaseException:
        if scale_mapping is not None:
            scale_mapping.close()
        mapping.close()
        raise
    if table.bulk is not None and mapping.owned:
        knob = envs.PLE_UM_BULK_ROWS
        if knob == "auto":
            table.bulk_calibration = table.calibrate_bulk()
        else:
            table.bulk_rows = int(knob)
    if envs.PLE_UM_PREWARM:
        with metrics.progress(mapping.mapped_bytes, "ple-um prewarm") as advance:
            mapping.populate(progress=advance)
    table.metrics = metrics.LookupMetrics(table.mode)
    if table.registration is not None:
        table.metrics.registration(table.registration.seconds)
    table.watch = metrics.watch(table.stats, table.metrics, mapping.residency, device=dev)
    table.open_seconds = time.perf_counter() - t0
    host = table.bulk or table.cpu
    logger.info(
        "ple-um: %s opened in %s mode (%.2f s)\n%s%s",
        layout.directory,
        table.mode,
        table.open_seconds,
        report.describe(),
        f"\n  host row reads: {host.row_reads}" if host is not None else "",
    )
    return table
