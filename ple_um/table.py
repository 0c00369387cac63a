"""MappedTable: one PLE table served from its mapped checkpoint files, as a caller holds it.

The table is made from finished pieces (``ple_um.opening`` builds them) and owns them, released in
reverse in one place (``_release``): the mappings (fds + mmaps: the rows, and an NVFP4 or MXFP8
table's block scales), the access mode's reach into them (``access.build.ModeAccess``:
registrations, device copies, the page prefetcher) and its lookup paths (``lookup.paths.LookupPaths``:
the kernel and the host path, with their buffers and threads). A lookup checks its arguments, then
``LookupPaths.route`` sends it down one path; under torch.compile it goes through the torch ops of
``ple_um.ops``, whose body is ``op_lookup``. A table dropped without ``close()`` is released all
the same, through ``ple_um.dropped``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from ple_um import dropped, metrics, ops, verify
from ple_um.access.build import ModeAccess
from ple_um.access.probe import ProbeReport
from ple_um.errors import TableClosedError
from ple_um.kernels.launch import current_stream
from ple_um.lookup.paths import FLOAT_OUT, LookupPaths, PackedRows, check_args, check_ids, check_range
from ple_um.lookup.streams import ids_to_device, wait_for_streams
from ple_um.mapping import MappedShards

logger = logging.getLogger(__name__)

# What a mode whose release failed still holds: never freed (see release_mode).
_KEPT_AFTER_FAILED_CLOSE: list[tuple[object, ...]] = []


class MappedTable:
    """A PLE table served from its mapped checkpoint files through one access mode (see the module
    docstring), made by ``open_table`` from finished pieces: the mappings, the mode's ``access`` and
    its lookup ``paths``; ``report`` says which mode and why not the others. The table holds them
    from here, and what it adds to serve: its metrics and its watch by the stats reporter, its handle
    in the torch ops' registry, its release when dropped; ``close()`` releases all of it."""

    def __init__(
        self,
        mapping: MappedShards,
        scale_mapping: MappedShards | None,
        report: ProbeReport,
        access: ModeAccess,
        paths: LookupPaths,
        *,
        strict: bool,
        open_seconds: float,
        bulk_calibration: dict,
    ) -> None:
        self.layout = layout = mapping.layout
        self.rows = (mapping.row_start, mapping.row_end)
        self.device = access.device
        self.mapping = mapping
        self.scale_mapping = scale_mapping  # NVFP4, MXFP8: the block scales, mapped like the rows
        self.report = report
        self.mode = report.mode
        self.access = access
        self.paths = paths
        self.strict = strict
        self.num_rows = layout.num_rows
        self.row_dim = layout.row_dim
        self.dtype = layout.dtype
        self.scale = layout.scale
        self.open_seconds = open_seconds
        self.bulk_calibration = bulk_calibration  # the crossover's timings (PLE_UM_BULK_ROWS=auto)
        # The dtypes an out may have: an NVFP4 table's rows are always decoded.
        self.out_dtypes = frozenset(FLOAT_OUT if scale_mapping is not None else (layout.dtype, *FLOAT_OUT))
        self._lookups = 0  # eager lookup() calls
        self._closed = False
        # Calls in flight (one entry each; list.append and .pop are atomic under the GIL, the
        # cheapest guard there is): close() waits until it is empty before it unmaps anything.
        self._inflight: list[None] = []
        # The raw handles of the streams its lookups were queued on: the release of a dropped table
        # waits for these rather than for the device, which its thread may not synchronize while
        # another thread captures a graph (close() waits for the device: graphs replayed anywhere).
        self._streams: set[int] = set()
        # The current stream's raw handle through torch's private call, as the paths read it
        # (``kernels.launch.current_stream`` says why), bound here: no Python call per lookup.
        self._stream_of = (
            functools.partial(current_stream, self.device.index) if self.device.type == "cuda" else None
        )
        self._close_lock = threading.Lock()
        self._closing = False
        self._released = threading.Event()
        self.metrics = metrics.LookupMetrics(self.mode, host_counted=paths.counts_on_host)
        if paths.counts_on_host:
            paths.host.metrics = self.metrics  # the synchronous path counts each lookup as it makes it
        if access.registrations:
            self.metrics.registration(access.registration_seconds)
        residency = mapping.residency
        if scale_mapping is not None:  # the page-cache figures count the block scales beside the rows
            residency = lambda: [*mapping.residency(), *scale_mapping.residency()]  # noqa: E731
        # The watch holds the table weakly (a failure below leaves the reporter a dropped table,
        # which it lets go of); the handle and the release when dropped come last: a failure
        # before them leaves the pieces to the open alone, which releases them once.
        self.watch = metrics.watch(_weak_stats(self), self.metrics, residency, device=self.device)
        self.handle = ops.register_table(self)
        self._finalizer = dropped.on_drop(self, vars(self), _release, cuda=self.device.type == "cuda")

    # -- the paths, as the caller and the tests see them ------------------------------------
    @property
    def bulk_rows(self) -> int | None:
        """GPU-mode lookups of at least this many ids take the host path (None: never)."""
        return self.paths.bulk_rows if self.paths is not None else None

    @property
    def row_reads(self) -> str:
        """How this table's rows are read, in words (the open's log line)."""
        return self.paths.row_reads if self.paths is not None else "released"

    @property
    def capture_safe(self) -> bool:
        """Whether a lookup may be captured in a CUDA graph (every mode but the synchronous path)."""
        return self.paths.capture_safe if self.paths is not None else False

    def self_test(self, count: int) -> str | None:
        """Sample rows through this mode's lookup path against the files (``verify.self_test``),
        holding the table open as a lookup does (a closed table raises ``TableClosedError``)."""
        with self._in_use():
            return verify.self_test(self.paths, self.mapping, count)

    # -- lookups ----------------------------------------------------------------------------
    def _enter(self) -> None:
        """Hold the table open (close() waits until no one holds it); the caller leaves in a finally.
        Plain calls rather than a context manager: every eager lookup pays for them."""
        self._inflight.append(None)
        if self._closed:  # checked after the entry is in: close() either sees it or we see closed
            self._inflight.pop()
            raise TableClosedError("the table is closed")
        if self._stream_of is not None:
            self._streams.add(self._stream_of())

    def _leave(self) -> None:
        self._inflight.pop()

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Hold the table open for the work inside (``_enter`` / ``_leave``)."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _out(self, shape: torch.Size, out_dtype: torch.dtype | None) -> torch.Tensor:
        # A table with block scales always decodes (``check_args``): every out is ``row_dim`` wide.
        return torch.empty((*shape, self.row_dim), dtype=out_dtype or self.dtype, device=self.device)

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
        out_dtype = check_args(self, ids, out, out_dtype)
        if ids.device != self.device:
            ids = ids_to_device(ids, self.device)
        if strict if strict is not None else self.strict:
            check_range(ids, self.num_rows)
        self._lookups += 1  # eager calls; rows are counted by the paths (graph replays too)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        # Eager calls skip the op's dispatch (its Python costs more than the lookup itself);
        # torch.compile traces the op, which it sees as one opaque call with a known output.
        if torch.compiler.is_compiling():
            flat = ids.view(-1)
            if out is not None:
                ops.lookup_out(flat, out.view(-1, self.row_dim), self.handle)
                return out
            return ops.lookup(flat, self.handle, out_dtype or self.dtype).view(*ids.shape, self.row_dim)
        self._enter()
        try:
            return self.paths.route(ids, out if out is not None else self._out(ids.shape, out_dtype))
        finally:
            self._leave()

    def op_lookup(self, ids: torch.Tensor, out: torch.Tensor | None, out_dtype=None) -> torch.Tensor:
        """The body of the torch ops (``ple_um::lookup`` / ``lookup_out``): flat ids on the table's
        device, checked as ``lookup`` checks its arguments (the ops are public)."""
        if self._closed:
            raise TableClosedError("the table is closed")
        out_dtype = check_args(self, ids, out, out_dtype)
        if ids.dim() != 1:
            raise ValueError(f"the ple_um ops take flat ids (1-D), got shape {tuple(ids.shape)}")
        if ids.device != self.device:
            raise ValueError(f"ids are on {ids.device}, the table on {self.device}")
        ids = ids.contiguous()
        self._enter()
        try:
            return self.paths.route(ids, out if out is not None else self._out(ids.shape, out_dtype))
        finally:
            self._leave()

    def lookup_packed(self, ids: torch.Tensor, *, strict: bool | None = None) -> PackedRows:
        """NVFP4, MXFP8: the raw rows of ``ids`` for callers that decode themselves. NVFP4: packed
        bytes ``ids.shape + (row_dim // 2,)`` (uint8) and block scales ``(row_dim // 16,)`` (E4M3);
        MXFP8: E4M3 bytes ``(row_dim,)`` and E8M0 exponents ``(row_dim // 32,)``, both uint8. Ids as in
        ``lookup``: zeros outside the owned range and the table, or IndexError there when strict."""
        if self._closed:
            raise TableClosedError("the table is closed")
        if self.scale_mapping is None:
            raise TypeError("lookup_packed() is for NVFP4 and MXFP8 tables; use lookup()")
        check_ids(ids)
        flat = ids_to_device(ids, self.device).reshape(-1).contiguous()
        if strict if strict is not None else self.strict:
            check_range(flat, self.num_rows)
        with self._in_use():
            packed, scales = self.paths.packed(flat)
        if self.layout.is_nvfp4:
            scales = scales.view(torch.float8_e4m3fn)
        return packed.view(*ids.shape, packed.shape[1]), scales.view(*ids.shape, scales.shape[1])

    def prefetch(self, ids, *, strict: bool | None = None) -> Future:
        """Start bringing ``ids``' rows into memory from CPU threads, a hint (``LookupPaths.
        prefetch_touch``: their pages, or their rows into a row cache). A Future of the distinct
        owned rows. ``ids`` checked as ``lookup`` checks them: its TypeError (``check_ids``), ids
        outside the table passed over or, when strict, its IndexError (``check_range``)."""
        with self._in_use():
            check_ids(ids)
            wide = ids.detach().to("cpu").reshape(-1).long()  # widened on the host, never narrowed
            if strict if strict is not None else self.strict:
                check_range(wide, self.num_rows)
            prefetcher = self.access.prefetcher
            if prefetcher is None:  # modes whose pages are resident need none
                (done := Future()).set_result(0)
                return done
            return prefetcher.submit(wide.numpy(), self.paths.prefetch_touch())

    def stats(self, *, sync: bool = True) -> dict:
        """Counters: lookups, the paths' counts (``lookup.counts.path_counts``: graph replays too), the
        reader of misses, bytes, memory, the row cache, what serves decode-sized lookups; ``sync`` first
        waits for the device, so that every lookup queued before is in the figures."""
        with self._in_use():
            return _read_stats(vars(self), sync)

    # -- life -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for lookups in flight and for the device, then release the lookup paths, the access
        mode and the mappings. Idempotent; a second caller returns once the first has released
        everything. Where that wait or a release fails (a CUDA error), the error is raised and the
        mappings are kept until the process exits: host threads may still read them. Not while
        this thread captures a CUDA graph (its lookups could not be waited for): that raises, and
        the table stays open."""
        if self._stream_of is not None and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("close() during a CUDA graph capture: close the table after the capture")
        with self._close_lock:
            closing, self._closing = self._closing, True
        if closing:
            self._released.wait()
            return
        self._finalizer.detach()  # released here, not again when the table is dropped
        try:
            self._closed = True
            while self._inflight:
                time.sleep(1e-3)
            if self.watch is not None:
                self.watch.close()  # its last reading: every lookup made is in it; nothing released yet
            # Where the mode's release fails, the mappings stay mapped (and it raises).
            _release(vars(self), whole_device=True)
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


def release_mode(
    device: torch.device, access, paths, mapping: MappedShards, scale_mapping, streams=None, last_reading=None
) -> None:
    """Wait for the lookups queued on ``streams`` (a set of raw handles; None: for the whole device,
    as the open does on its own thread), call ``last_reading`` (None: none; the counts are final and
    nothing is released yet), then release a mode's lookup ``paths`` and ``access`` (None: not built;
    the mappings stay). Where that fails (a CUDA error) the device is not known to be idle: a host
    thread (the dispatcher, a host node, the pool) may still read the mappings or a job struct, so
    they are kept for the life of the process (``mappings_kept``) and the error is raised."""
    try:
        if device.type == "cuda":  # every queued kernel and host node has run
            if streams is None:
                torch.cuda.synchronize(device)
            else:
                wait_for_streams(device, sorted(streams))
        if access is not None:
            access.stop_prefetcher()  # a prefetch may be reading into the row cache
        if last_reading is not None:
            last_reading()
        for res in (paths, access):
            if res is not None:
                res.close()
    except BaseException:
        _KEPT_AFTER_FAILED_CLOSE.append((paths, mapping, scale_mapping))
        logger.error("ple-um: releasing %s failed; its mappings stay until exit", mapping.layout.directory)
        raise


def mappings_kept(mapping: MappedShards) -> bool:
    """Whether a failed ``release_mode`` kept ``mapping`` (rows' or block scales') to the process's end."""
    return any(mapping is each for kept in _KEPT_AFTER_FAILED_CLOSE for each in kept[1:])


def _release(state: dict, *, whole_device: bool = False) -> None:
    """What a table holds, released in reverse of its open once nothing uses it: its handle, its
    mode (``release_mode``: where that fails the mappings stay, and it raises), its mappings.
    ``close()`` runs it on the table's attributes ``vars(table)``, after a wait for the whole device
    (a graph that captured a lookup may be replayed on any stream); ``ple_um.dropped`` runs it for a
    table dropped without ``close()``, after a wait for the streams its lookups were queued on: a
    graph that captured its lookups reads buffers the table owns, so a table must outlive its graphs'
    replays, including one queued on another stream just before it is dropped."""
    ops.unregister_table(state["handle"])
    watch = state["watch"]  # close() took its last reading; a dropped table's is taken here
    last = None if whole_device or watch is None else functools.partial(_read_stats, state, False)
    release_mode(
        state["device"],
        state["access"],
        state["paths"],
        state["mapping"],
        state["scale_mapping"],
        None if whole_device else state["_streams"],
        None if last is None else functools.partial(watch.close, last),
    )
    state["paths"] = state["access"] = None
    for each in (state["scale_mapping"], state["mapping"]):
        if each is not None:
            each.close()


def _read_stats(state: dict, sync: bool) -> dict:
    """``stats()`` of the table whose attributes are ``state`` (``vars(table)``), without holding it
    open: what its watch reads, until ``close()`` takes the watch's last reading (after the wait for
    the lookups in flight), or the release of a table dropped without it does (``_release``)."""
    if sync and state["device"].type == "cuda":
        torch.cuda.synchronize(state["device"])
    counts = state["paths"].read_counts()
    return {
        "mode": state["mode"],
        "lookups": state["_lookups"],
        "rows": counts["rows"],
        "bytes": counts["rows"] * state["layout"].row_bytes,
        "out_of_range": counts["out_of_range"],
        "host_lookups": counts["lookups"],
        "broken_rows": counts["broken"],
        **{key: counts[key] for key in ("file_reads", "file_read_seconds", "phase_seconds")},
        **state["paths"].file_reader_stats(),
        "mapped_bytes": sum(m.mapped_bytes for m in (state["mapping"], state["scale_mapping"]) if m),
        "pinned_bytes": state["access"].pinned_bytes,
        "device_bytes": state["access"].device_bytes,
        "open_seconds": state["open_seconds"],
        "row_cache": state["paths"].row_cache_stats(),
        "serving": state["paths"].serving_stats(),
    }


def _weak_stats(table: MappedTable) -> Callable[[], dict]:
    """``table``'s stats (``_read_stats``, no sync) for the reporter, holding the table weakly: a
    table dropped without ``close()`` is not kept alive by its watch (its release takes the last
    reading from what the table held)."""
    ref = weakref.ref(table)

    def stats() -> dict:
        held = ref()
        if held is None:
            raise TableClosedError("the table was dropped")
        return _read_stats(vars(held), False)

    return stats
