"""build_paths: the lookup paths of a built access mode (``LookupPaths``), decided at open by the
fit of the table's owned rows (``lookup.fit``): the kernel, the host path (the C row copy with its
row cache and reader of misses, or the synchronous gather where it cannot be built), the page
touch's word, and the fit checks that decide again while the table serves."""

from __future__ import annotations

import numpy as np
import torch

from ple_um import envs
from ple_um.access.build import ModeAccess
from ple_um.checkpoint import ShardLayout
from ple_um.lookup import fit, fit_watch, open_tables, rowcopy
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.lookup.host import misses
from ple_um.lookup.host.gather import HostGather
from ple_um.lookup.host.signal_check import prepare_device
from ple_um.lookup.paths import LookupPaths
from ple_um.lookup.sync_gather import SyncGather


def build_paths(
    access: ModeAccess,
    layout: ShardLayout,
    *,
    rows: tuple[int, int],
    scale: torch.Tensor | None,
    row_copy: bool = True,
) -> LookupPaths:
    """The lookup paths of ``access``'s mode, serving as the fit of the table's owned rows decides
    (``lookup.fit``). ``row_copy`` False: the cpu mode's synchronous host path even where the C row
    copy builds (its self-test failed). A build that fails releases what it made (the kernel, a host
    path, the fit checks) before it raises, not when its traceback is let go; StreamBlockedError
    too: the release waits for nothing on the device (the build queued no lookup)."""
    made: list[LookupPaths] = []  # what the build made so far, released at once where it fails
    try:
        return _build(access, layout, rows, scale, row_copy, made)
    except BaseException:
        for paths in made:
            paths.close()
        raise


def _build(
    access: ModeAccess, layout: ShardLayout, rows: tuple[int, int], scale, row_copy: bool, made: list
) -> LookupPaths:
    """``build_paths``' work; the paths it makes are put in ``made`` as soon as they exist, with
    what it adds to them (a host path, the fit checks) as it goes."""
    mode, device = access.mode, access.device
    mapping, scale_mapping = access.mapping, access.scale_mapping
    lib, why = rowcopy.for_open()
    if not row_copy and lib is not None:
        lib, why = None, "the host node's self-test failed"
    if mode == "device":
        paths = LookupPaths(layout, device, _kernel(access, layout, rows, scale), None, "the GPU kernel only")
        made.append(paths)
        paths.serving = fit.Serving("kernel", False, "the device mode: the rows are in GPU memory")
        return paths
    mappings = [m for m in (mapping, scale_mapping) if m is not None]
    # Counted before its fit is measured: of two tables opened at once, the one measured last counts
    # the other (measured before either was counted, both could fit alone where together they do
    # not). Until the open succeeds (``LookupPaths.opened``) only other opens count it, not the
    # checks of the tables that serve. The paths own the entry once they exist (``count_in_fits``);
    # a failure before drops it.
    counted = open_tables.OPEN_TABLES.add(mappings, access.pinned_bytes)
    try:
        return _build_counted(access, layout, rows, scale, lib, why, mappings, counted, made)
    except BaseException:
        if not made:
            open_tables.OPEN_TABLES.remove(counted)
        raise


def _build_counted(
    access: ModeAccess,
    layout: ShardLayout,
    rows: tuple[int, int],
    scale,
    lib,
    why: str,
    mappings: list,
    counted: int,
    made: list,
) -> LookupPaths:
    """``_build``'s work for a mode that reads host memory, its ``mappings`` counted in the fits
    already (``counted``: their entry in ``OPEN_TABLES``, which the paths own from when they exist,
    and are put in ``made``)."""
    mode, device = access.mode, access.device
    mapping, scale_mapping = access.mapping, access.scale_mapping
    verdict = fit.measure(mappings, pinned=access.pinned_bytes, opening=True)
    host_for = _host_builder(access, layout, scale, lib, why)
    touch_knob, touch_here = fit.touch_setting(mode, cuda=device.type == "cuda")
    if mode == "cpu":
        if lib is not None:
            host = host_for(not verdict.fits)
        else:
            host = SyncGather(
                mapping,
                device,
                storage=layout.dtype,
                scale=scale,
                chunk=envs.PLE_UM_CPU_CHUNK,
                why=why,
                scale_mapping=scale_mapping,
            )
        paths = LookupPaths(layout, device, None, host, host.row_reads)
        paths.count_in_fits(counted)
        made.append(paths)
        paths.set_serving(fit.Serving("host", False, f"{verdict.why}: the cpu mode's host path"))
    else:
        paths = LookupPaths(layout, device, _kernel(access, layout, rows, scale), None, "the GPU kernel only")
        paths.count_in_fits(counted)
        made.append(paths)
        if touch_here and touch_knob == "auto":
            paths.touch_live = np.zeros(1, dtype=np.int32)
        serving = fit.choose(None, verdict, touch_knob=touch_knob, touch_here=touch_here)
        # The host path serves big lookups on a GPU, the page touch (under auto: every capture's),
        # or every lookup (spilled).
        bulk = device.type == "cuda" and envs.PLE_UM_BULK_ROWS != 0
        needed = bulk or serving.touch or paths.touch_live is not None or serving.path == "host"
        if lib is None:
            serving = fit.no_host_path(serving, verdict, why)
        elif needed:
            paths.host = host_for(serving.path == "host")
        if serving.path == "host":
            serving = fit.Serving("host", False, f"{serving.why}, {fit.host_words(paths.host)}")
        paths.set_serving(serving)
        if paths.decode_on_host:
            paths.row_reads = f"{paths.host.row_reads}, every lookup (the kernel while the rows fit)"
        elif paths.host is not None:
            paths.row_reads = f"the GPU kernel; big lookups: {paths.host.row_reads}"
        elif needed:
            paths.row_reads = f"the GPU kernel only (no host path: {why})"
    if lib is not None and mode in ("cpu", *fit.SWITCHING_MODES) and envs.PLE_UM_FIT == "auto":
        if device.type == "cuda":  # the host path a check builds later makes no CUDA call there
            prepare_device(lib, device)
        paths.fit = fit_watch.FitWatch(
            paths,
            mappings,
            interval=envs.PLE_UM_FIT_CHECK_SEC,
            pinned=access.pinned_bytes,
            touch_knob=touch_knob,
            touch_here=touch_here,
            host_for=host_for,
        )
        paths.capture_checks = paths.touch_live is not None  # a capture's lookups see it already
    return paths


def _kernel(access: ModeAccess, layout: ShardLayout, rows: tuple[int, int], scale) -> GpuGather:
    return GpuGather(
        layout,
        access.bases,
        device=access.device,
        row_start=rows[0],
        row_end=rows[1],
        base_align=access.base_align,
        scale=scale,
        scale_bases=access.scale_bases,
    )


def _host_builder(access: ModeAccess, layout: ShardLayout, scale, lib, why: str):
    """``host_for(spills, cut=False)``: a new host path through the C row copy ``lib`` for
    ``access``'s table, with the row cache and reader of misses ``misses.plan`` gives it (a row cache
    when ``spills``; ``cut``: built while the table serves)."""

    def host_for(spills: bool, cut: bool = False) -> HostGather:
        with misses.one_sizing_at_a_time():  # sized from the memory left and faulted in, then let go
            return HostGather(
                lib,
                access.mapping,
                access.device,
                storage=layout.dtype,
                scale=scale,
                threads=envs.PLE_UM_CPU_THREADS,
                scale_mapping=access.scale_mapping,
                built=why,
                misses=misses.plan(lib, access.mapping, access.scale_mapping, spills=spills, cut=cut),
            )

    return host_for
