"""The open path: ``open_table`` and ``probe``, and the one mode-selection loop both run.

The pieces come first, then the table from them. ``_open`` maps the owned rows (``MappedShards``;
the block scales too), then ``_select_mode`` chooses a mode: the probe's policy
(``access.probe.decide``) names the first mode whose requirements pass; a guarded mode's first read
is made in a child process (``access.first_read``); the mode is built (``access.build.ModeAccess``
and ``lookup.build.build_paths``), its resident pages mapped for the host path
(``PLE_UM_MAP_RESIDENT``), and self-tested through its lookup paths (``verify``). A mode that
fails any step is rejected with its reason, what it built released, and the next one is tried; a
forced mode that fails raises ``ModeUnavailableError``. ``probe(path=...)`` runs the same loop
without building.

Once a mode serves, ``_start_serving`` measures the bulk crossover (``PLE_UM_BULK_ROWS=auto``),
prewarms (``PLE_UM_PREWARM``), zeroes the counters its checks caused and starts the fit checks;
then ``MappedTable`` is made from the pieces, and holds them. Until then the open holds them, and
releases them where it fails.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import operator
import os
import time
from collections.abc import Callable

import torch

from ple_um import envs, metrics, verify
from ple_um.access import first_read, machine
from ple_um.access.build import ModeAccess
from ple_um.access.capabilities import DeviceCapabilities, resolve_device
from ple_um.access.probe import ALL_MODES, ProbeReport, decide, pin_budget, requested_mode
from ple_um.checkpoint import EngramGeometry, ShardLayout, read_engram_layout, read_layout
from ple_um.errors import KnobError, ModeUnavailableError
from ple_um.kernels.launch import current_stream
from ple_um.lookup.build import build_paths
from ple_um.lookup.host.cuda import StreamBlockedError
from ple_um.lookup.paths import LookupPaths
from ple_um.mapping import MappedShards
from ple_um.table import MappedTable, mappings_kept, release_mode

logger = logging.getLogger(__name__)


def _select_mode(
    caps: DeviceCapabilities,
    forced: str,
    layout: ShardLayout,
    rows: tuple[int, int],
    device: torch.device,
    *,
    table_bytes: int,
    mappings: tuple[MappedShards, MappedShards | None] | None = None,
    scale: torch.Tensor | None = None,
    recheck: bool = False,
) -> tuple[ProbeReport, ModeAccess | None, LookupPaths | None]:
    """The first mode that passes the policy, its first read and, at an open (``mappings``: the
    rows' and the block scales'; ``scale``: the dequantization scale on the device), its build and
    self-test: its report, access and lookup paths (a probe: the report, None, None). A mode that
    fails is rejected with its reason, what it built released, and the next one is tried; a forced
    one raises ModeUnavailableError. ``StreamBlockedError`` passes through at once, once what was
    built is released without synchronizing the device (a stream of it waits for ever):
    ``_release_blocked``; ``KnobError`` passes through once what was built is released: a knob no
    mode can take is the caller's to fix, not a reason to serve the table another way."""
    budget = pin_budget()
    rejected: dict[str, str] = {}
    while True:
        report = decide(caps, mode=forced, table_bytes=table_bytes, budget=budget, exclude=rejected)
        access = paths = knob_error = None
        try:
            verdict = first_read.first_read_verdict(report.mode, caps, layout, rows, device, recheck=recheck)
            report.first_read = [verdict]
            if not verdict.passed:  # now, or as the cached verdict says
                raise first_read.FirstReadRejected(verdict)
            if mappings is None:
                return report, None, None
            access = ModeAccess(
                report.mode,
                mappings[0],
                device,
                cuda=caps.cuda,
                scale_mapping=mappings[1],
                progress=metrics.progress,
            )
            paths = build_paths(access, layout, rows=rows, scale=scale)
            if paths.row_copy is not None and access.mode in ("ats", "cpu") and envs.PLE_UM_MAP_RESIDENT:
                # Before the self-test and the crossover, so that they, like serving, take no minor
                # faults on the host path's reads of resident rows.
                access.map_resident()
            paths, why = _self_test(access, paths, rows, scale)
            if why is None:
                return report, access, paths
        except StreamBlockedError:
            try:
                _release_blocked(device, access, paths, mappings)
            except Exception as exc:  # noqa: BLE001 - the blocked stream is what the caller must hear of
                logger.error("ple-um: releasing the %s mode (a stream blocked) failed: %s", access.mode, exc)
            raise
        except KnobError as exc:
            knob_error = exc
        except Exception as exc:  # noqa: BLE001 - a mode that fails is rejected with its reason
            why = f"{type(exc).__name__}: {exc}"
        if access is not None:  # outside the handling above: a release that fails raises
            release_mode(device, access, paths, *mappings)
        if knob_error is not None:
            raise knob_error
        if forced != "auto":
            raise ModeUnavailableError(report.mode, why)
        logger.warning("ple-um: %s mode rejected for %s: %s", report.mode, layout.directory, why)
        rejected[report.mode] = why


def _release_blocked(device: torch.device, access, paths, mappings) -> None:
    """Release what a mode built (its registrations, prefetch threads, host paths) where the open
    found a stream of ``device`` blocked for good: no wait for the device, which would never end.
    No lookup of this open is queued but its self-test's (the signals' check comes before any),
    on the current stream, which is not the blocked one: that alone is waited for. Where the release
    fails the mappings are kept, as ``release_mode`` says, and it raises."""
    if access is None:
        return
    queued = set()
    if paths is not None and device.type == "cuda":
        queued.add(current_stream(device.index))
    release_mode(device, access, paths, *mappings, streams=queued)


def probe(
    device=None,
    *,
    table_bytes: int | None = None,
    mode: str = "auto",
    path=None,
    layer: int | None = None,
    recheck: bool = False,
) -> ProbeReport:
    """Read the device's capabilities and pick a mode (no self-test: that needs the mode built).

    Without ``path`` the report lists the first-read verdicts cached for the chosen mode on this
    machine. With a checkpoint directory ``path`` the chosen mode's first read is made as an open
    makes it (from the cache, or in a child process; ``recheck`` ignores the cache), and a mode
    whose first read fails gives way to the next."""
    _check_types(device=device, mode=mode, layer=layer, **({"path": path} if path is not None else {}))
    forced = requested_mode(mode)
    if path is None:
        caps = machine.capabilities(device)
        report = decide(caps, mode=forced, table_bytes=table_bytes, budget=pin_budget())
        report.first_read = first_read.cached_verdicts(report, caps)
        return report
    layout = read_layout(os.fspath(path), layer)
    dev = resolve_device(device)
    caps = machine.capabilities(dev)
    report, _, _ = _select_mode(
        caps, forced, layout, (0, layout.num_rows), dev, table_bytes=layout.nbytes, recheck=recheck
    )
    return report


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# What each argument of the openers and ``probe`` takes, and the words for it.
_TAKES: dict[str, tuple[Callable[[object], bool], str]] = {
    "path": (lambda v: isinstance(v, (str, os.PathLike)), "a checkpoint directory (a str or os.PathLike)"),
    "layer": (lambda v: v is None or _is_int(v), "a layer number (an int), or None for the only layer"),
    "mode": (lambda v: isinstance(v, str), f"a mode's name (a str: auto, {', '.join(ALL_MODES)})"),
    "device": (
        lambda v: v is None or isinstance(v, (str, torch.device)) or _is_int(v),
        "a torch.device, a str (cpu, cuda, cuda:N), a CUDA index (an int), or None",
    ),
    "strict": (lambda v: v is None or isinstance(v, bool), "a bool, or None for PLE_UM_STRICT"),
    "geometry": (lambda v: v is None or isinstance(v, EngramGeometry), "an EngramGeometry, or None"),
}


def _check_types(**given) -> None:
    """TypeError naming the first argument that is not of a type it takes, and what to pass: before
    anything is read, where a wrong type found deep inside would name nothing the caller wrote (a
    bool is no layer nor device: ``True`` would be layer 1, or ``cuda:1``)."""
    for name, value in given.items():
        takes, expected = _TAKES[name]
        if not takes(value):
            raise TypeError(f"{name}={value!r} ({type(value).__name__}): expected {expected}")


def _owned_rows(rows, num_rows: int) -> tuple[int, int]:
    if rows is None:
        return 0, num_rows
    try:
        start, end = (operator.index(x) for x in rows)
    except (TypeError, ValueError):
        raise ValueError(f"rows={rows!r} must be two integers (start, end)") from None
    if not 0 <= start <= end <= num_rows:
        raise ValueError(f"rows={rows!r} must satisfy 0 <= start <= end <= num_rows ({num_rows})")
    return start, end


def open_table(
    path: str | os.PathLike,
    *,
    layer: int | None = None,
    rows: tuple[int, int] | None = None,
    mode: str = "auto",
    device=None,
    strict: bool | None = None,
) -> MappedTable:
    """Open one PLE layer's table from the checkpoint directory ``path`` (see docs/DESIGN.md)."""
    _check_types(path=path, layer=layer, mode=mode, device=device, strict=strict)
    return _open(lambda: read_layout(os.fspath(path), layer), rows, mode, device, strict)


def open_engram_table(
    path: str | os.PathLike,
    *,
    layer: int | None = None,
    rows: tuple[int, int] | None = None,
    geometry: EngramGeometry | None = None,
    mode: str = "auto",
    device=None,
    strict: bool | None = None,
) -> MappedTable:
    """Open one DeepSeek-V4.1 Engram table (``layer``: the model layer id in the tensors' names;
    None: the only one) from the checkpoint directory ``path``, checked against ``geometry`` where
    given; ``rows``: the owned rows (a rank's heads: ``geometry.head_rows``). Its rows decode as
    MXFP8 (``lookup`` with a float out) or come raw with their E8M0 scales (``lookup_packed``)."""
    _check_types(path=path, layer=layer, geometry=geometry, mode=mode, device=device, strict=strict)
    return _open(lambda: read_engram_layout(os.fspath(path), layer, geometry), rows, mode, device, strict)


def _open(read: Callable[[], ShardLayout], rows, mode: str, device, strict: bool | None) -> MappedTable:
    """The table of the layout ``read`` returns, once the knobs are checked: a knob set to a value it
    does not take is an error here, not a rejected mode (PLE_UM_MODE: read by requested_mode, and
    only when ``mode`` is auto)."""
    t0 = time.perf_counter()
    envs.check(skip=("PLE_UM_MODE",))
    forced = requested_mode(mode)
    layout = read()
    owned = _owned_rows(rows, layout.num_rows)
    dev = resolve_device(device)
    caps = machine.capabilities(dev)
    strict = envs.PLE_UM_STRICT if strict is None else strict
    scale = (
        torch.tensor([layout.scale], dtype=torch.float32, device=dev) if layout.scale is not None else None
    )
    with contextlib.ExitStack() as held:  # what the open holds, released in reverse where it fails
        mapping = MappedShards(layout, owned)
        held.callback(_close_unless_kept, mapping)
        scale_mapping = None
        if layout.has_block_scales:
            scale_mapping = MappedShards(layout.scale_layout(), owned)
            held.callback(_close_unless_kept, scale_mapping)
        mappings = (mapping, scale_mapping)
        report, access, paths = _select_mode(
            caps,
            forced,
            layout,
            owned,
            dev,
            table_bytes=sum(m.mapped_bytes for m in mappings if m is not None),
            mappings=mappings,
            scale=scale,
        )
        held.callback(release_mode, dev, access, paths, *mappings)
        calibration = _start_serving(access, paths, owned)
        table = MappedTable(
            *mappings,
            report,
            access,
            paths,
            strict=strict,
            open_seconds=time.perf_counter() - t0,
            bulk_calibration=calibration,
        )
        held.pop_all()  # the table holds them now
    paths.opened()  # the checks of the tables that serve count it from here (OPEN_TABLES)
    logger.info(
        "ple-um: %s opened in %s mode (%.2f s), capture-safe=%s\n%s\n  row reads: %s\n  decode lookups: %s",
        layout.directory,
        table.mode,
        table.open_seconds,
        table.capture_safe,
        table.report.describe(),
        table.row_reads,
        table.paths.serving.why,
    )
    return table


def _close_unless_kept(mapping: MappedShards) -> None:
    """Unmap, unless a failed release kept the mapping for host threads that may still read it."""
    if not mappings_kept(mapping):
        mapping.close()


def _self_test(
    access: ModeAccess, paths: LookupPaths, rows: tuple[int, int], scale: torch.Tensor | None
) -> tuple[LookupPaths, str | None]:
    """The paths the built mode serves through, and why it may not serve (its self-test failed), or
    None. The cpu mode's host node that fails its self-test (or fails) gives way to the synchronous
    host path, which is not capture-safe, and the log says why; that is not a rejection."""
    count, mapping = envs.PLE_UM_SELF_TEST_ROWS, access.mapping
    if paths.gpu is not None:
        on_host, paths.decode_on_host = paths.decode_on_host, False  # the kernel: a fit check may pick it
        try:
            why = verify.self_test(paths, mapping, count)
        finally:
            paths.decode_on_host = on_host
        return paths, why or (verify.self_test(paths, mapping, count) if on_host else None)
    if paths.row_copy is None:
        return paths, None
    try:
        why = verify.self_test(paths, mapping, count)
    except StreamBlockedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the host node sends it to the fallback
        why = f"{type(exc).__name__}: {exc}"
    if why is None:
        return paths, None
    logger.warning("ple-um: the cpu mode's host node failed its self-test (%s): synchronous host path", why)
    if access.device.type == "cuda":
        torch.cuda.synchronize(access.device)
    paths.close()
    paths = build_paths(access, paths.layout, rows=rows, scale=scale, row_copy=False)
    paths.row_reads += f"; the host node failed its self-test: {why}"
    return paths, None


def _start_serving(access: ModeAccess, paths: LookupPaths, rows: tuple[int, int]) -> dict:
    """After the mode is chosen: the bulk crossover (its timings returned), the prewarm, counters
    zeroed, the fit checks started."""
    knob, mode = envs.PLE_UM_BULK_ROWS, access.mode
    calibration: dict = {}
    # The crossover is a GPU's: on the CPU (the interpreter) a GPU mode's host path serves only a
    # table that does not fit.
    bulk = paths.gpu is not None and paths.row_copy is not None and access.device.type == "cuda"
    if bulk and knob != 0 and access.mapping.owned and mode in ("ats", "registered"):
        if knob == "auto":
            calibration = verify.calibrate_bulk(paths, rows)
        else:
            paths.bulk_rows = int(knob)
    if envs.PLE_UM_PREWARM:
        with metrics.progress(sum(m.mapped_bytes for m in access.mappings), "ple-um prewarm") as advance:
            for each in access.mappings:
                each.populate(progress=advance)
    paths.reset_counts()  # the self-test's and the calibration's rows were not lookups
    if paths.fit is not None:
        paths.fit.start()  # the fit decided again while the table serves (lookup.fit_watch)
    return calibration
