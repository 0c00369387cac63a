"""The open path: ``open_table`` and ``probe``, and the one mode-selection loop both run.

Choosing a mode (``_select_mode``): the probe's policy (``access.probe.decide``) names the first
mode whose requirements pass; a guarded mode's first read is made in a child process
(``access.first_read``); ``open_table`` then builds the mode (``access.build.ModeAccess`` and
``lookup.paths.build_paths``) and self-tests it through its lookup path (``verify``). A mode that
fails any step is rejected with its reason and the next one is tried; a forced mode that fails
raises ``ModeUnavailableError``. ``probe(path=...)`` runs the same loop without building.

Once a mode serves, the open measures the bulk crossover (``PLE_UM_BULK_ROWS=auto``), prewarms
(``PLE_UM_PREWARM``), zeroes the counters its checks caused, and starts the metrics.
"""

from __future__ import annotations

import logging
import operator
import os
import time
import weakref
from collections.abc import Callable

import torch

from ple_um import envs, metrics, ops, verify
from ple_um.access import first_read, machine
from ple_um.access.build import ModeAccess
from ple_um.access.capabilities import DeviceCapabilities, resolve_device
from ple_um.access.probe import ProbeReport, decide, pin_budget, requested_mode
from ple_um.checkpoint import EngramGeometry, ShardLayout, read_engram_layout, read_layout
from ple_um.errors import KnobError, ModeUnavailableError, TableClosedError
from ple_um.lookup.host.cuda import StreamBlockedError
from ple_um.lookup.paths import build_paths
from ple_um.mapping import MappedShards
from ple_um.table import MappedTable

logger = logging.getLogger(__name__)


def _select_mode(
    caps: DeviceCapabilities,
    forced: str,
    layout: ShardLayout,
    rows: tuple[int, int],
    device: torch.device,
    *,
    table_bytes: int,
    attempt: Callable[[ProbeReport], tuple[object, str | None]],
    reject: Callable[[], None] | None = None,
    recheck: bool = False,
):
    """The first mode that passes the policy, its first read and ``attempt(report)``, which returns
    what it built and None, or why it failed: what ``attempt`` built. ``reject()`` releases a failed
    attempt's work, outside the rejection's handling (a release that fails raises). A mode that
    fails is rejected with its reason and the next one is tried; a forced one raises
    ModeUnavailableError. ``StreamBlockedError`` passes through at once: nothing may synchronize
    the device after it; so does ``KnobError``: a knob no mode can take is the caller's to fix,
    not a reason to serve the table another way."""
    budget = pin_budget()
    rejected: dict[str, str] = {}
    while True:
        report = decide(caps, mode=forced, table_bytes=table_bytes, budget=budget, exclude=rejected)
        tried = False
        try:
            first_read.check(report, caps, layout, rows, device, recheck=recheck)
            tried = True
            built, why = attempt(report)
        except (StreamBlockedError, KnobError):
            raise
        except Exception as exc:  # noqa: BLE001 - a mode that fails is rejected with its reason
            built, why = None, f"{type(exc).__name__}: {exc}"
        if why is None:
            return built
        if tried and reject is not None:
            reject()
        if forced != "auto":
            raise ModeUnavailableError(report.mode, why)
        logger.warning("ple-um: %s mode rejected for %s: %s", report.mode, layout.directory, why)
        rejected[report.mode] = why


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
    forced = requested_mode(mode)
    if path is None:
        caps = machine.capabilities(device)
        report = decide(caps, mode=forced, table_bytes=table_bytes, budget=pin_budget())
        report.first_read = first_read.cached_verdicts(report, caps)
        return report
    layout = read_layout(os.fspath(path), layer)
    dev = resolve_device(device)
    caps = machine.capabilities(dev)
    return _select_mode(
        caps,
        forced,
        layout,
        (0, layout.num_rows),
        dev,
        table_bytes=layout.nbytes,
        attempt=lambda report: (report, None),
        recheck=recheck,
    )


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
    t0 = time.perf_counter()
    # A knob set to a value it does not take is an error here, not a rejected mode (PLE_UM_MODE:
    # read by requested_mode, and only when no mode is given).
    envs.check(skip=("PLE_UM_MODE",))
    forced = requested_mode(mode)
    return _open(read_layout(os.fspath(path), layer), rows, forced, device, strict, t0)


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
    t0 = time.perf_counter()
    envs.check(skip=("PLE_UM_MODE",))
    forced = requested_mode(mode)
    return _open(read_engram_layout(os.fspath(path), layer, geometry), rows, forced, device, strict, t0)


def _open(layout: ShardLayout, rows, forced: str, device, strict: bool | None, t0: float) -> MappedTable:
    owned = _owned_rows(rows, layout.num_rows)
    dev = resolve_device(device)
    caps = machine.capabilities(dev)
    strict = envs.PLE_UM_STRICT if strict is None else strict
    scale = (
        torch.tensor([layout.scale], dtype=torch.float32, device=dev) if layout.scale is not None else None
    )
    builds = _Builds(layout, owned, dev, caps, strict=strict, scale=scale)
    try:
        table = _select_mode(
            caps,
            forced,
            layout,
            owned,
            dev,
            table_bytes=builds.mapped_bytes(),
            attempt=builds.attempt,
            reject=builds.reject,
        )
    except BaseException as exc:
        builds.abandon(blocked=isinstance(exc, StreamBlockedError))
        raise
    mapping, scale_mapping = builds.mapping, builds.scale_mapping
    _start_serving(table, dev, mapping, scale_mapping)
    table.open_seconds = time.perf_counter() - t0
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


def _mapped_bytes(*mappings: MappedShards | None) -> int:
    return sum(m.mapped_bytes for m in mappings if m is not None)


class _Builds:
    """What ``open_table`` builds while it chooses a mode: the mappings (shared by every try) and one
    table per mode tried, the last of which serves."""

    def __init__(self, layout, owned, dev, caps, *, strict: bool, scale: torch.Tensor | None) -> None:
        self.layout, self.owned, self.dev, self.caps = layout, owned, dev, caps
        self.strict, self.scale = strict, scale
        self.tables: list[MappedTable] = []
        self.scale_mapping = None
        self.mapping = MappedShards(layout, owned)
        try:
            if layout.has_block_scales:
                self.scale_mapping = MappedShards(layout.scale_layout(), owned)
        except BaseException:
            self.mapping.close()
            raise

    def mapped_bytes(self) -> int:
        return _mapped_bytes(self.mapping, self.scale_mapping)

    def attempt(self, report: ProbeReport) -> tuple[MappedTable, str | None]:
        """The table in ``report.mode``, and why it may not serve (None: it may)."""
        table = MappedTable(
            self.layout,
            rows=self.owned,
            device=self.dev,
            mapping=self.mapping,
            report=report,
            strict=self.strict,
            scale=self.scale,
            scale_mapping=self.scale_mapping,
        )
        self.tables.append(table)
        try:
            _build(table, self.caps.cuda)
            return table, _check(table)
        except (StreamBlockedError, KnobError):
            raise
        except Exception as exc:  # noqa: BLE001 - a mode that fails to build is rejected with its reason
            return table, f"{type(exc).__name__}: {exc}"

    def reject(self) -> None:
        """Release the last try (where that fails, the mappings stay mapped, and it raises)."""
        self.tables[-1].release_nothing_when_dropped()
        ops.unregister_table(self.tables[-1].handle)
        self.tables[-1].release_mode()

    def abandon(self, *, blocked: bool) -> None:
        """The open failed: unmap, unless a failed release kept the mappings for host threads that
        may still read them. ``blocked``: a stream waits for ever, so nothing is released through
        the device (the tables only leave the ops' registry)."""
        for table in self.tables:
            table.release_nothing_when_dropped()  # released here, or kept with the mappings
        for table in self.tables if blocked else ():
            ops.unregister_table(table.handle)
        if not any(table.mappings_kept for table in self.tables):
            for each in (self.scale_mapping, self.mapping):
                if each is not None:
                    each.close()


def _build(table: MappedTable, cuda: bool) -> None:
    """Give ``table`` its mode's access and lookup paths (``table.release_mode`` releases both)."""
    table.access = ModeAccess(
        table.mode,
        table.mapping,
        table.device,
        cuda=cuda,
        scale_mapping=table.scale_mapping,
        progress=metrics.progress,
    )
    table.paths = build_paths(table.access, table.layout, rows=table.rows, scale=table.scale_on_device)


def _check(table: MappedTable) -> str | None:
    """Why the built mode may not serve (its self-test failed), or None. The cpu mode's host node
    that fails its self-test (or fails) gives way to the synchronous host path, which is not
    capture-safe, and the log says why; that is not a rejection."""
    count = envs.PLE_UM_SELF_TEST_ROWS
    paths = table.paths
    if paths.gpu is not None:
        on_host, paths.decode_on_host = paths.decode_on_host, False  # the kernel: a fit check may pick it
        try:
            why = table.self_test(count)
        finally:
            paths.decode_on_host = on_host
        return why or (table.self_test(count) if on_host else None)
    if table.paths.row_copy is None:
        return None
    try:
        why = table.self_test(count)
    except StreamBlockedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the host node sends it to the fallback
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        logger.warning(
            "ple-um: the cpu mode's host node failed its self-test (%s): synchronous host path", why
        )
        if table.device.type == "cuda":
            torch.cuda.synchronize(table.device)
        table.paths.close()
        table.paths = build_paths(
            table.access, table.layout, rows=table.rows, scale=table.scale_on_device, row_copy=False
        )
        table.paths.row_reads += f"; the host node failed its self-test: {why}"
    return None


def _start_serving(
    table: MappedTable, dev, mapping: MappedShards, scale_mapping: MappedShards | None
) -> None:
    """After the mode is chosen: the bulk crossover, the prewarm, counters zeroed, the metrics."""
    knob = envs.PLE_UM_BULK_ROWS
    paths = table.paths
    # The crossover is a GPU's: on the CPU (the interpreter) a GPU mode's host path serves only a
    # table that does not fit.
    bulk = paths.gpu is not None and paths.row_copy is not None and dev.type == "cuda"
    if bulk and knob != 0 and mapping.owned:
        if table.mode in ("ats", "registered"):
            if knob == "auto":
                table.bulk_calibration = verify.calibrate_bulk(table)
            else:
                paths.bulk_rows = int(knob)
    if envs.PLE_UM_PREWARM:
        with metrics.progress(_mapped_bytes(mapping, scale_mapping), "ple-um prewarm") as advance:
            for each in (mapping, scale_mapping):
                if each is not None:
                    each.populate(progress=advance)
    paths.reset_counts()  # the self-test's and the calibration's rows were not lookups
    if paths.fit is not None:
        paths.fit.start()  # the fit decided again while the table serves (lookup.fit)
    table.metrics = metrics.LookupMetrics(table.mode, host_counted=paths.counts_on_host)
    if paths.counts_on_host:
        paths.host.metrics = table.metrics
    seconds = table.access.registration_seconds
    if table.access.registrations:
        table.metrics.registration(seconds)
    residency = mapping.residency
    if scale_mapping is not None:  # the page-cache figures count the block scales beside the rows
        residency = lambda: [*mapping.residency(), *scale_mapping.residency()]  # noqa: E731
    table.watch = metrics.watch(_weak_stats(table), table.metrics, residency, device=dev)


def _weak_stats(table: MappedTable) -> Callable[[], dict]:
    """``table.stats(sync=False)`` for the reporter, holding the table weakly: a table dropped
    without ``close()`` is not kept alive by its watch (which the reporter then lets go of)."""
    method = weakref.WeakMethod(table.stats)

    def stats() -> dict:
        bound = method()
        if bound is None:
            raise TableClosedError("the table was dropped")
        return bound(sync=False)

    return stats
