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
"""

from __future__ import annotations

import contextlib

import torch

from ple_um import envs
from ple_um.access.prefetch import PagePrefetcher
from ple_um.access.registration import RegisteredMapping
from ple_um.checkpoint import ShardLayout
from ple_um.mapping import MappedShards

GPU_MODES = ("ats", "registered", "device")


def _alignment(layout: ShardLayout, *, rows_only: bool = False) -> int:
    """Widest power-of-two byte alignment (<= 8) of the row stride and, unless ``rows_only``, of
    every shard's row 0 in its file (a device copy starts each shard at a 256-byte-aligned row)."""
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

    def _mappings(self) -> list[MappedShards]:
        return [m for m in (self.mapping, self.scale_mapping) if m is not None]

    def _advise(self) -> None:
        advice = envs.PLE_UM_MADVISE
        if advice == "auto":
            advice = "random" if self.mode in ("cpu", "ats") else "normal"
        if advice != "none":
            for mapping in self._mappings():
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
        self.mapped_resident = sum(m.map_resident() for m in self._mappings())
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
