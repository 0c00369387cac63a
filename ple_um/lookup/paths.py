"""LookupPaths: the lookup paths one access mode serves through, and when each serves.

Two paths, each owning its buffers, its dequantization and its counting:
- the kernel (``GpuGather``: the ``ats``, ``registered`` and ``device`` modes), which reads each row
  through the per-shard bases ``access.build.ModeAccess`` made;
- the host path: the C row copy (``HostGather``: stream-ordered, capture-safe), or where the C row
  copy cannot be built the ``cpu`` mode's synchronous gather (``SyncGather``: not capture-safe).

The ``cpu`` mode has only the host path. A GPU mode has the kernel, plus the host path for its big
lookups (at least ``bulk_rows`` ids: the crossover the open measures, ``PLE_UM_BULK_ROWS``) and, in
the ``ats`` mode while the table is not resident, for a page touch queued before each kernel
(``PLE_UM_ATS_PREFETCH``). Every path reports the same counts (``read_counts``), so the table adds
them up without asking which path it holds.
"""

from __future__ import annotations

import functools

import torch

from ple_um import envs
from ple_um.access.build import ModeAccess
from ple_um.checkpoint import ShardLayout
from ple_um.lookup import rowcopy
from ple_um.lookup.counts import path_counts
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.lookup.host import cold
from ple_um.lookup.host.gather import HostGather, warm_row_cache
from ple_um.lookup.sync_gather import SyncGather


class LookupPaths:
    """The paths of one built mode. ``gpu``: the kernel, or None (cpu mode); ``host``: the host
    path, or None; ``bulk_rows``: GPU-mode lookups of at least this many ids take the host path
    (None: never); ``touch_pages``: a page touch on the host path is queued before each kernel;
    ``capture_safe``: every lookup is stream-ordered work; ``row_reads``: how rows are read, in
    words, for the open's log line."""

    def __init__(self, gpu: GpuGather | None, host: HostGather | SyncGather | None, row_reads: str) -> None:
        self.gpu = gpu
        self.host = host
        self.row_reads = row_reads
        self.bulk_rows: int | None = None
        self.touch_pages = False
        self.capture_safe = not isinstance(host, SyncGather)

    @property
    def counts_on_host(self) -> bool:
        """Whether lookups are counted on the host as they are made (the synchronous path), rather
        than in counters the paths add to where they run (read by the stats reporter)."""
        return isinstance(self.host, SyncGather)

    @property
    def row_copy(self) -> HostGather | None:
        """The C row copy's host path, or None."""
        return self.host if isinstance(self.host, HostGather) else None

    def prefetch_touch(self):
        """What a prefetch's threads do with its ids: None, fault in their pages (the kernel reads
        them through the mapping, or the host path copies resident rows from it); with no kernel
        and a row cache, read the rows the cache lacks into it (``warm_row_cache``: the page touch
        would fill the page cache, which the reads of the cache's misses pass by)."""
        host = self.row_copy
        if self.gpu is None and host is not None and host.rows.cache is not None:
            return functools.partial(warm_row_cache, host)
        return None

    def row_cache_stats(self) -> dict | None:
        """The host path's row cache (``HostGather.row_cache_stats``), or None."""
        host = self.row_copy
        return host.row_cache_stats() if host is not None else None

    def file_reader_stats(self) -> dict:
        """``file_reader``: how the host path reads misses from the files (``RowSources.file_reader``),
        or None; ``file_reader_fallback``: why by reader threads though io_uring was planned (a ring
        failed: ``RowSources.fallback``), or None."""
        host = self.row_copy
        sources = host.sources if host is not None else None
        return {
            "file_reader": sources.file_reader() if sources is not None else None,
            "file_reader_fallback": sources.fallback() if sources is not None else None,
        }

    def read_counts(self) -> dict:
        """The paths' counts added up (``counts.path_counts``' keys). Device counters are read on
        the current stream."""
        total = path_counts()
        for path in (self.gpu, self.host):
            if path is None:
                continue
            counts = path.read_counts()
            for key in ("rows", "out_of_range", "broken", "lookups", "file_reads", "file_read_seconds"):
                total[key] += counts[key]
            for key, seconds in counts["phase_seconds"].items():
                total["phase_seconds"][key] += seconds
        return total

    def reset_counts(self) -> None:
        for path in (self.gpu, self.host):
            if path is not None:
                path.reset_counts()

    def close(self) -> None:
        """Release the host path (its threads' work done, its buffers). The kernel holds nothing
        that needs releasing but device tensors."""
        if self.host is not None:
            self.host.close()
        self.host = self.gpu = None


def build_paths(
    access: ModeAccess,
    layout: ShardLayout,
    *,
    rows: tuple[int, int],
    scale: torch.Tensor | None,
    row_copy: bool = True,
) -> LookupPaths:
    """The lookup paths of ``access``'s mode. ``row_copy`` False: the cpu mode's synchronous host
    path even where the C row copy builds (its self-test failed)."""
    mode, device = access.mode, access.device
    mapping, scale_mapping = access.mapping, access.scale_mapping
    lib, why = rowcopy.load(envs.PLE_UM_CACHE_DIR) if envs.PLE_UM_ROWCOPY else (None, "PLE_UM_ROWCOPY=0")
    if not row_copy and lib is not None:
        lib, why = None, "the host node's self-test failed"

    def host_gather() -> HostGather:
        with cold.one_sizing_at_a_time():  # sized from the memory left and faulted in, then let go
            return HostGather(
                lib,
                mapping,
                device,
                storage=layout.dtype,
                scale=scale,
                threads=envs.PLE_UM_CPU_THREADS,
                scale_mapping=scale_mapping,
                built=why,
                cold=cold.plan(lib, mapping, scale_mapping),
            )

    if mode == "cpu":
        if lib is not None:
            host = host_gather()
        else:
            host = SyncGather(
                mapping,
                device,
                storage=layout.dtype,
                scale=scale,
                threads=envs.PLE_UM_CPU_THREADS,
                chunk=envs.PLE_UM_CPU_CHUNK,
                slots=envs.PLE_UM_STAGING_SLOTS,
                why=why,
                scale_mapping=scale_mapping,
            )
        paths = LookupPaths(None, host, host.row_reads)
    else:
        gpu = GpuGather(
            layout,
            access.bases,
            device=device,
            row_start=rows[0],
            row_end=rows[1],
            base_align=access.base_align,
            scale=scale,
            scale_bases=access.scale_bases,
        )
        knob = envs.PLE_UM_ATS_PREFETCH
        # Any page out: the touch costs little beside a GPU's fault on a page not in memory.
        touch = knob == "on" or (knob == "auto" and mode == "ats" and not mapping.resident(slack=0))
        touch = touch and mode != "device" and device.type == "cuda"
        bulk = mode in ("ats", "registered") and device.type == "cuda" and envs.PLE_UM_BULK_ROWS != 0
        paths = LookupPaths(gpu, None, "the GPU kernel only")
        if lib is not None and (bulk or touch):
            paths.host = host_gather()
            paths.touch_pages = touch
            paths.row_reads = f"the GPU kernel; big lookups: {paths.host.row_reads}"
        elif bulk or touch:
            paths.row_reads = f"the GPU kernel only (no host path: {why})"
    if paths.row_copy is not None and mode in ("ats", "cpu") and envs.PLE_UM_MAP_RESIDENT:
        access.map_resident()
    return paths
