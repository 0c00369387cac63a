"""The reporter thread: one per process, it reads every watched table's ``stats()`` each period,
logs the stats line of the window since the last one, and absorbs the counters the lookup paths
keep where they run (the device's, the C row copy's) into Prometheus. The device counters are read
there, on the reporter's own CUDA stream, never in a lookup.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ple_um import envs
from ple_um.errors import TableClosedError
from ple_um.lookup.streams import own_stream, relaxed_capture_mode
from ple_um.metrics.counters import LookupMetrics, logger, prometheus, warn_once
from ple_um.metrics.stats_line import CACHE_HELD, figures, format_line
from ple_um.ticker import Ticker

# The gauges a mode's watches add up to: the page cache's (bytes resident, mapped), the row cache's.
_GAUGES = ("resident_bytes", "mapped_bytes", *CACHE_HELD)


@dataclass(eq=False)
class Watch:
    """One table watched by a StatsReporter; ``close()`` (idempotent) folds in its last figures and
    stops watching it. Close it before the table releases anything: it reads its stats once more."""

    reporter: StatsReporter
    stats: Callable[[], dict]
    metrics: LookupMetrics | None
    residency: Callable[[], Iterable[tuple]] | None
    device: object
    mode: str | None = field(init=False, default=None)  # the metrics' mode, else what its stats() names
    last: dict[str, float] | None = None  # figures at the previous tick
    # The page cache's and the row cache's figures at the last reading, under the gauges' keys.
    gauges: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_GAUGES, 0))
    closed: bool = False

    def __post_init__(self) -> None:
        self.mode = self.metrics.mode if self.metrics is not None else None

    def close(self, last: Callable[[], dict] | None = None) -> None:
        """``last``: the last reading of a table dropped without close() (its ``stats`` can no
        longer read it), taken on the reporter's own stream as a tick's."""
        if not self.closed:
            self.reporter.remove(self, last)

    def fold(self, stats: dict, window: dict[str, dict[str, float]]) -> None:
        """Absorb the table's ``stats()`` into its metrics, and add what it did since its last
        reading to its mode's ``window`` figures (and what its row cache holds now to the mode's)."""
        if self.metrics is not None:
            self.metrics.absorb(stats)
        now = figures(stats)
        self.mode = self.mode or str(stats.get("mode", "?"))
        self.gauges.update({key: int(now[key]) for key in CACHE_HELD})
        if self.last is not None:
            acc = window.setdefault(self.mode, dict.fromkeys(now, 0.0))
            for key, value in now.items():
                acc[key] += value if key in CACHE_HELD else value - self.last[key]
        self.last = now


class StatsReporter(Ticker):
    """A daemon thread that every ``interval`` seconds logs one windowed line for the tables this
    process watches and absorbs their device counters into Prometheus.

    The line has the figures of the window since the previous line: lookups, rows, rows/s, MB/s,
    out-of-range ids, the host path's phase milliseconds, the row cache's hits and file reads, and
    how much of the mapped table is in the page cache. A window without lookups or rows logs
    nothing; ``log=False`` logs no line at all (the reporter then only feeds Prometheus). ``tick()``
    does one pass (tests call it directly)."""

    thread_name = "ple-um-stats"

    def __init__(
        self,
        interval: float,
        *,
        log: bool = True,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(float(interval))
        self.log = log
        self.pid = os.getpid()
        self.emit = emit or (lambda line: logger.info("%s", line))
        self.clock = clock
        self.watches: list[Watch] = []
        self._gauged: dict[str, LookupMetrics] = {}  # the modes whose page-cache gauges were set
        self._retired: dict[str, dict[str, float]] = {}  # figures of watches closed mid-window
        self._lock = threading.RLock()  # one tick at a time; add/remove wait for it
        self._window_start = clock()
        self._streams: dict = {}

    # -- watching --------------------------------------------------------------------------
    def add(
        self,
        stats: Callable[[], dict],
        metrics: LookupMetrics | None = None,
        residency: Callable[[], Iterable[tuple]] | None = None,
        device=None,
    ) -> Watch:
        """Watch a table: ``stats`` returns its cumulative stats() dict; ``residency`` returns
        (path, resident bytes, mapped bytes) per mapping (``MappedShards.residency``); ``device``
        is where its counters live (read on a side stream of that device)."""
        watch = Watch(self, stats, metrics, residency, device)
        with self._lock:
            try:
                self._stream(device)  # made now, not in a tick that may overlap a graph capture
            except RuntimeError:
                pass  # warned once; its ticks skip it
            try:
                watch.last = figures(stats())
            except Exception as exc:  # noqa: BLE001
                warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
            self.watches.append(watch)
        return watch

    def remove(self, watch: Watch, last: Callable[[], dict] | None = None) -> None:
        """Stop watching; what it did since the last tick still shows in the next line. ``last``:
        the reading to take instead of ``watch.stats`` (``Watch.close``)."""
        with self._lock:
            if watch.closed:
                return
            watch.closed = True
            try:
                if last is None:  # on the caller's stream: its last lookups are ordered before this read
                    stats = watch.stats()
                else:  # a dropped table's, on the release thread: its streams were waited for
                    watch.stats = last
                    stats = self._read(watch)
                watch.fold(stats, self._retired)
            except Exception as exc:  # noqa: BLE001
                warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
            if watch in self.watches:
                self.watches.remove(watch)

    # -- one pass --------------------------------------------------------------------------
    def _read(self, watch: Watch) -> dict:
        """The watch's stats(), read on this reporter's own stream of its CUDA device and in the
        relaxed capture mode: the copy of the device counters never joins, waits for, or breaks
        the stream a lookup or a CUDA graph capture runs on."""
        stream = self._stream(watch.device)
        if stream is None:
            return watch.stats()
        # The relaxed mode lets this thread copy from the device while another thread captures a
        # CUDA graph: vLLM's start-up captures would fail whenever a tick landed inside one. The copy
        # runs on the reporter's own stream, which the capture does not record. Without the relaxed
        # mode (no cuda-python) the read goes on in the default mode, warned once.
        relaxed = relaxed_capture_mode(
            lambda exc: warn_once(
                "capture-mode", "cannot relax the capture mode: %s: %s", type(exc).__name__, exc
            )
        )
        with relaxed, torch.cuda.stream(stream):
            return watch.stats()

    def _stream(self, device):
        """This reporter's own stream on a CUDA ``device`` (None for anything else), made once.

        Created through the CUDA runtime, not ``torch.cuda.Stream()``: torch hands out streams from
        a small pool in turn, so a pool stream can be the very stream another thread captures on,
        and a tick's copy on it would break that capture."""
        if device is None or getattr(device, "type", None) != "cuda":
            return None
        if device not in self._streams:
            try:
                self._streams[device] = own_stream(device)  # lives as long as the reporter
            except Exception as exc:  # noqa: BLE001
                warn_once("stream", "no stream of its own on %s: %s: %s", device, type(exc).__name__, exc)
                self._streams[device] = None
        made = self._streams[device]
        if made is None:
            # Reading on a shared stream could break another thread's graph capture: never do.
            raise RuntimeError(f"the stats reporter has no stream of its own on {device}")
        return made

    def tick(self) -> str | None:
        """Read every watched table, feed Prometheus, and emit the line of the window that ends
        now; returns it (None when nothing happened in the window)."""
        with self._lock:
            now = self.clock()
            elapsed = max(now - self._window_start, 1e-9)
            self._window_start = now
            window: dict[str, dict[str, float]] = {m: dict(f) for m, f in self._retired.items()}
            self._retired.clear()
            resident = mapped = 0
            for watch in list(self.watches):
                try:
                    stats = self._read(watch)
                except TableClosedError:  # closed without closing its watch first
                    self.watches.remove(watch)
                    continue
                except Exception as exc:  # noqa: BLE001 - skip this tick, try again at the next
                    warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
                    continue
                watch.fold(stats, window)
                if watch.residency is not None:
                    try:
                        parts = list(watch.residency())
                        watch.gauges["resident_bytes"] = sum(p[1] for p in parts)
                        watch.gauges["mapped_bytes"] = sum(p[2] for p in parts)
                    except Exception as exc:  # noqa: BLE001
                        warn_once("residency", "cannot read residency: %s: %s", type(exc).__name__, exc)
                    resident += watch.gauges["resident_bytes"]
                    mapped += watch.gauges["mapped_bytes"]
            self._set_gauges()
            line = format_line(window, elapsed, resident, mapped)
        if line is not None and self.log:
            try:
                self.emit(line)
            except Exception as exc:  # noqa: BLE001
                warn_once("emit", "cannot emit the stats line: %s: %s", type(exc).__name__, exc)
        return line

    def _set_gauges(self) -> None:
        by_mode: dict[str, tuple[LookupMetrics, dict[str, int]]] = {}
        for watch in self.watches:
            if watch.metrics is None or watch.residency is None:
                continue
            _, gauges = by_mode.setdefault(watch.mode, (watch.metrics, dict.fromkeys(_GAUGES, 0)))
            for key, value in watch.gauges.items():
                gauges[key] += value
        for metrics, gauges in by_mode.values():
            metrics.set_gauges(gauges)
        for mode, metrics in self._gauged.items():  # the last table of a mode closed: nothing mapped
            if mode not in by_mode:
                metrics.set_gauges(dict.fromkeys(_GAUGES, 0))
        self._gauged = {mode: entry[0] for mode, entry in by_mode.items()}

    # -- the thread (Ticker's start and close; close leaves the watches as they are) -----------
    def tick_failed(self, exc: Exception) -> None:
        warn_once("tick", "stats tick failed: %s: %s", type(exc).__name__, exc)


_lock = threading.Lock()
_reporter: StatsReporter | None = None


def reporter() -> StatsReporter | None:
    """The process's reporter, started on first use: every PLE_UM_STATS_SEC seconds with the stats
    line; with the line off (0) and Prometheus on, every PLE_UM_METRICS_SEC seconds without it (rows
    counted where the paths run reach the counters only through it); else None."""
    global _reporter
    if _reporter is not None and _reporter.pid == os.getpid():
        return _reporter
    stats_sec = envs.PLE_UM_STATS_SEC
    if stats_sec > 0:
        interval, log = stats_sec, True
    elif envs.PLE_UM_METRICS_SEC > 0 and prometheus() is not None:
        interval, log = envs.PLE_UM_METRICS_SEC, False
    else:
        return None
    with _lock:
        if _reporter is None or _reporter.pid != os.getpid():  # a forked child has no thread
            _reporter = StatsReporter(interval, log=log).start()
        return _reporter


def watch(
    stats: Callable[[], dict],
    metrics: LookupMetrics | None = None,
    residency: Callable[[], Iterable[tuple]] | None = None,
    device=None,
) -> Watch | None:
    """Watch a table with the process's reporter (see ``reporter``); None when there is none.
    Close the Watch before the table. Never raises."""
    try:
        rep = reporter()
        return None if rep is None else rep.add(stats, metrics, residency, device)
    except Exception as exc:  # noqa: BLE001
        warn_once("watch", "cannot start the stats reporter: %s: %s", type(exc).__name__, exc)
        return None
