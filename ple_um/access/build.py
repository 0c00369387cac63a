"""ModeAccess: what one access mode holds so that its lookup paths can reach a table's rows.

For the GPU modes that is the per-shard base addresses the kernel reads through, and what makes
them valid: nothing more in the ``ats`` mode (the mapping's own host addresses; with
``PLE_UM_ATS_POPULATE`` a registration that populates the pages), the CUDA registration in the
``registered`` mode (its device pointers), a copy of the owned rows in GPU memory in the ``device``
mode. An NVFP4 table's block scales get the same, beside the rows. Every mode advises the kernel how
its mappings will be read (``PLE_UM_MADVISE``), and the modes whose rows stay page cache (``ats``,
``cpu``) get a page prefetcher (``table.prefetch``).

The object owns the registrations, device copies and prefetcher it made and releases them in
``close()``, in reverse order; the mappings stay the caller's.

The pieces it holds are here too. ``RegisteredMapping``: cudaHostRegister(Mapped | ReadOnly |
Portable) over every mapped region. On a discrete GPU without ATS (an H200 in an x86 host, say)
registration pins the range and gives the GPU a device pointer to it: the kernel reads rows over
PCIe, no copy, no GPU memory. A ``PROT_READ`` mapping needs the ReadOnly flag (with the default
flags the driver refuses a read-only range with cudaErrorInvalidValue). On ATS systems the same
call only populates the pages (it does not pin), which the ats mode may use. The calls are the
machine's (``ple_um.access.machine.registration()``: CUDA's, or an injected machine's).

``PagePrefetcher``: CPU threads that fault in the pages a coming lookup will read. Under ATS the
GPU's faults on file pages that are not resident are served one page at a time by the OS, which
is slow; touching the rows from CPU threads first (in parallel, many faults in flight) makes the
GPU's reads hit resident pages. A hint only: lookups are correct without it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ple_um import envs
from ple_um.access.capabilities import on_device
from ple_um.access.machine import HostRegistration, RegistrationError, registration
from ple_um.checkpoint import ShardLayout
from ple_um.mapping import MappedShards

logger = logging.getLogger(__name__)

GPU_MODES = ("ats", "registered", "device")


def _alignment(layout: ShardLayout, *, rows_only: bool = False) -> int:
    """Widest power-of-two byte alignment (<= 8) of the row stride and, unless ``rows_only``, of
    every shard's row 0 in its file (a device copy puts the shards' rows back to back from the
    start of one allocation, so there every row starts at a multiple of the row stride)."""
    align = 8
    while layout.row_bytes % align:
        align //= 2
    if not rows_only:
        for spec in layout.shards:
            while spec.rows and spec.offset % align:
                align //= 2
    return align


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


class ModeAccess:
    """One access mode's reach into ``mapping`` (and an NVFP4 table's ``scale_mapping``) on
    ``device``: ``bases`` / ``scale_bases`` for the kernel (None in the cpu mode), ``base_align``,
    ``registrations``, ``device_copies``, ``prefetcher``. ``progress(total, description)`` makes
    the progress callback of a long registration (``ple_um.metrics.progress``), or None."""

    def __init__(
        self,
        mode: str,
        mapping: MappedShards,
        device: torch.device,
        *,
        cuda: bool,
        scale_mapping: MappedShards | None = None,
        progress=None,
    ) -> None:
        self.mode = mode
        self.mapping, self.scale_mapping = mapping, scale_mapping
        self.device = device
        self.registrations: list[RegisteredMapping] = []
        self.device_copies: list[torch.Tensor] = []
        self.bases: list[int] | None = None
        self.scale_bases: list[int] | None = None
        self.prefetcher: PagePrefetcher | None = None
        self.mapped_resident = 0  # bytes of page-table entries made at open (PLE_UM_MAP_RESIDENT)
        self._progress = progress
        layout = mapping.layout
        self.base_align = _alignment(layout, rows_only=mode == "device")
        try:
            self._advise()
            if mode in GPU_MODES:
                self.bases = self._bases(mapping, cuda)
                if scale_mapping is not None:
                    self.scale_bases = self._bases(scale_mapping, cuda)
            if mode in ("ats", "cpu"):
                self.prefetcher = PagePrefetcher(mapping)
        except BaseException:
            self.close()
            raise

    @property
    def mappings(self) -> list[MappedShards]:
        """The rows' mapping, and the block scales' where the table has them."""
        return [m for m in (self.mapping, self.scale_mapping) if m is not None]

    def _advise(self) -> None:
        advice = envs.PLE_UM_MADVISE
        if advice == "auto":
            advice = "random" if self.mode in ("cpu", "ats") else "normal"
        if advice != "none":
            for mapping in self.mappings:
                mapping.advise(advice)

    def _register(self, mapping: MappedShards) -> RegisteredMapping:
        report = self._progress or (lambda total, what: contextlib.nullcontext())
        with report(mapping.mapped_bytes, "ple-um register") as advance:
            self.registrations.append(RegisteredMapping(mapping, self.device, progress=advance))
        return self.registrations[-1]

    def _bases(self, mapping: MappedShards, cuda: bool) -> list[int]:
        """Per-shard addresses the kernel reads ``mapping`` through in this GPU mode."""
        if self.mode == "ats":
            if cuda and envs.PLE_UM_ATS_POPULATE:
                self._register(mapping)
            return mapping.host_bases()
        if self.mode == "registered":
            return self._register(mapping).device_bases()
        copy, bases = _copy_to_device(mapping, self.device)
        self.device_copies.append(copy)
        return bases

    def map_resident(self) -> int:
        """Map the pages of the table already in the page cache into this process (the host path's
        reads then take no minor faults); the bytes mapped."""
        self.mapped_resident = sum(m.map_resident() for m in self.mappings)
        return self.mapped_resident

    @property
    def pinned_bytes(self) -> int:
        """Bytes the registered mode pins (an ats populate registers but does not pin)."""
        if self.mode != "registered":
            return 0
        return sum(r.registered_bytes for r in self.registrations)

    @property
    def device_bytes(self) -> int:
        return sum(c.numel() for c in self.device_copies)

    @property
    def registration_seconds(self) -> float:
        return sum(r.seconds for r in self.registrations)

    def stop_prefetcher(self) -> None:
        """Wait for the prefetches in flight and stop their threads (they may read through the
        lookup paths' row cache: stopped before those are released). Idempotent."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def close(self) -> None:
        """Stop the prefetcher, unregister and drop the device copies, in reverse order of building,
        once no kernel reads them (the caller waited: ``table.release_mode``). Idempotent."""
        self.stop_prefetcher()
        while self.registrations:
            self.registrations[-1].close()
            self.registrations.pop()
        self.device_copies = []


class RegisteredMapping:
    """The CUDA registrations of a MappedShards' regions and the device base of each shard. It
    owns them: a failure part-way releases the earlier ones.

    ``calls``: the registration calls (default: the machine's, read when it is built)."""

    def __init__(
        self,
        mapping: MappedShards,
        device: torch.device,
        *,
        calls: HostRegistration | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        calls = calls or registration()
        self.mapping = mapping
        self.device = device
        self._unregister = calls.unregister
        self._registered: list[int] = []
        self.device_addrs: list[int] = []
        self.registered_bytes = 0
        t0 = time.perf_counter()
        try:
            with on_device(device):
                for region in mapping.regions:
                    try:
                        calls.register(region.addr, region.length)
                    except RegistrationError as exc:
                        raise RegistrationError(f"{exc} for {region.path}") from None
                    self._registered.append(region.addr)
                    self.registered_bytes += region.length
                    self.device_addrs.append(calls.device_pointer(region.addr))
                    if progress is not None:
                        progress(region.length)
        except BaseException:
            self.close()
            raise
        self.seconds = time.perf_counter() - t0

    def device_bases(self) -> list[int]:
        """Per shard: the device address of its local row 0 (0 for shards with no owned rows), its
        host address moved as far as its file's registration moves the mapping."""
        shift = [dev - r.addr for dev, r in zip(self.device_addrs, self.mapping.regions, strict=True)]
        owned = self.mapping.owned
        return [
            self.mapping.shard_base(i) + shift[owned[i].region] if i in owned else 0
            for i in range(self.mapping.layout.parts)
        ]

    def close(self) -> None:
        """Unregister every range, in reverse order, even where one fails (the first failure is
        raised once all were tried: a range is tried once); idempotent. The caller has waited for
        every kernel that reads the pages (``table.release_mode``)."""
        first: BaseException | None = None
        while self._registered:
            addr = self._registered.pop()
            try:
                self._unregister(addr)
            except BaseException as exc:  # noqa: BLE001 - the others are unregistered, then raised
                first = first or exc
        if first is not None:
            raise first


class PagePrefetcher:
    """Touches rows of a MappedShards from a small thread pool; owns the threads."""

    def __init__(self, mapping: MappedShards, threads: int = 4) -> None:
        self.mapping = mapping
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ple-um-prefetch")

    def submit(self, ids: np.ndarray, touch=None) -> Future:
        """Start touching the rows of ``ids``, an int64 array of global ids (``MappedTable.prefetch``
        checks the caller's ids as a lookup does and widens them; anything else is a TypeError here,
        not cast: a float id would be truncated, a wide one wrapped, to another row); returns a
        Future of the number of distinct owned rows touched. Each id goes to one thread once (an id
        asked for twice would otherwise be read twice, by two threads at once). ``touch(ids) ->
        rows``: what a thread does with its part of them (default: fault in their pages,
        ``MappedShards.touch_rows``); ids outside the owned rows are passed over."""
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
            what = f"{ids.dtype} array" if isinstance(ids, np.ndarray) else type(ids).__name__
            raise TypeError(f"PagePrefetcher.submit takes an int64 array of ids, not a {what}")
        flat = np.unique(ids.reshape(-1))
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
