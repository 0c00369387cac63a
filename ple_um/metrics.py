"""What a table tells its operator while it serves: Prometheus counters, a stats line, progress bars.

Three things, none of which may ever fail a lookup (a failure is logged once and swallowed):

- ``LookupMetrics``: one table's feed into the process's Prometheus counters, labelled by access
  mode. The cpu mode knows every lookup's figures on the host and calls ``observe`` per lookup;
  the GPU modes count rows on the device (graph replays included, with no host code running), so
  their counters are brought up to date from the table's ``stats()`` by ``absorb``, which the
  reporter thread calls. The counters are created on first use (``PROMETHEUS_MULTIPROC_DIR`` must
  be set before the first one exists), not at all when ``PLE_UM_PROMETHEUS=0`` or when
  ``prometheus_client`` is not installed. Every ``vllm:ple_um_*`` counter that still means what
  a seed counter meant is also exported under the seed's ``vllm:ple_mmap_*`` name.
- ``StatsReporter``: one daemon thread per process that every ``PLE_UM_STATS_SEC`` seconds reads
  each watched table's ``stats()`` (and page-cache residency), logs one line with the figures of
  the window since the last line, and absorbs the GPU modes' device counters into Prometheus. The
  device counters are read there, in its own thread on its own CUDA stream, never in a lookup.
- ``progress``: a tqdm bar for long work (prewarm, registering many shards), as a callable that
  takes the bytes just done: what ``MappedShards.populate`` and ``RegisteredMapping`` accept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ple_um import envs
from ple_um.errors import TableClosedError

logger = logging.getLogger(__name__)

PHASES = ("dedup", "gather", "stage", "wait")


@dataclass(frozen=True)
class MetricSpec:
    """One exported figure: its key in ``observe``/``stats()``, its names, and what it counts."""

    key: str
    name: str  # vllm:ple_um_*
    alias: str | None  # the seeds' vllm:ple_mmap_* name, where the meaning still applies
    doc: str
    kind: str = "counter"  # "counter" | "gauge"


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "lookups",
        "vllm:ple_um_lookups_total",
        "vllm:ple_mmap_lookup_ops_total",
        "PLE lookups executed (eager calls; a GPU mode's CUDA graph replays run no host code and "
        "are counted in rows only).",
    ),
    MetricSpec(
        "lookup_seconds",
        "vllm:ple_um_lookup_seconds_total",
        "vllm:ple_mmap_op_seconds_total",
        "Seconds in lookups on the host path (every cpu-mode lookup, a GPU mode's bulk lookups), "
        "including the GPU wait (vllm:ple_um_gpu_wait_seconds_total).",
    ),
    MetricSpec(
        "rows",
        "vllm:ple_um_rows_total",
        "vllm:ple_mmap_rows_total",
        "Rows looked up in the mapped PLE table (one per id, duplicates and out-of-range ids included).",
    ),
    MetricSpec(
        "bytes",
        "vllm:ple_um_bytes_total",
        "vllm:ple_mmap_bytes_total",
        "Bytes of the rows looked up (rows x row bytes), from the page cache or the disk.",
    ),
    MetricSpec(
        "out_of_range",
        "vllm:ple_um_out_of_range_total",
        None,
        "Ids outside [0, num_rows): served as zero rows.",
    ),
    MetricSpec(
        "dedup",
        "vllm:ple_um_dedup_seconds_total",
        "vllm:ple_mmap_dedup_seconds_total",
        "Host path: seconds deduplicating (planning) the row ids.",
    ),
    MetricSpec(
        "gather",
        "vllm:ple_um_gather_seconds_total",
        "vllm:ple_mmap_gather_seconds_total",
        "Host path: seconds reading rows from the mapping (page cache or disk: the disk reads).",
    ),
    MetricSpec(
        "stage",
        "vllm:ple_um_stage_seconds_total",
        "vllm:ple_mmap_stage_seconds_total",
        "Host path: seconds staging gathered rows for the GPU (pinned copy, H2D launch, expansion).",
    ),
    MetricSpec(
        "wait",
        "vllm:ple_um_gpu_wait_seconds_total",
        "vllm:ple_mmap_gpu_wait_seconds_total",
        "Host path: seconds waiting for the GPU (work queued ahead of the lookup, which the host "
        "syncs on to read the ids; a staging buffer's previous copy): not PLE cost; subtract it from "
        "the lookup seconds.",
    ),
    MetricSpec(
        "registration",
        "vllm:ple_um_registration_seconds_total",
        None,
        "Seconds spent registering the mapped shards with CUDA (cudaHostRegister) at open.",
    ),
    MetricSpec(
        "resident_bytes",
        "vllm:ple_um_resident_bytes",
        None,
        "Bytes of this process's mapped table in the page cache (mincore), read every stats period.",
        kind="gauge",
    ),
    MetricSpec(
        "mapped_bytes",
        "vllm:ple_um_mapped_bytes",
        None,
        "Bytes of the PLE table this process maps.",
        kind="gauge",
    ),
)

# -- the process's Prometheus metrics, created once on first use --------------------------------
_lock = threading.Lock()
_prom: dict[str, list] | None = None  # key -> [metric, alias metric]
_prom_tried = False
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    """Log a metrics failure the first time it happens; metrics never fail the caller."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning("ple-um metrics: " + message, *args)


def prometheus() -> dict[str, list] | None:
    """The process's metrics (key -> [metric, its alias]), created on the first call; None when
    PLE_UM_PROMETHEUS=0, prometheus_client is missing or creating them failed. Never raises."""
    global _prom, _prom_tried
    if _prom_tried:
        return _prom
    with _lock:
        if _prom_tried:
            return _prom
        try:
            _prom = _create()
        except Exception as exc:  # noqa: BLE001 - metrics must never break serving
            _warn_once("create", "Prometheus metrics unavailable: %s: %s", type(exc).__name__, exc)
            _prom = None
        _prom_tried = True
    return _prom


def _create() -> dict[str, list] | None:
    if not envs.PLE_UM_PROMETHEUS:
        logger.info("ple-um: PLE_UM_PROMETHEUS=0: no Prometheus metrics")
        return None
    try:
        import prometheus_client
    except ImportError:
        logger.info("ple-um: prometheus_client is not installed: no Prometheus metrics")
        return None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # The default: vLLM turns multiprocess mode on only for api_server_count > 1, so say how to
        # export them rather than warn about the expected configuration.
        logger.info(
            "ple-um: PROMETHEUS_MULTIPROC_DIR is unset, so the vllm:ple_um_* metrics stay in this "
            "process and do not reach the API server's /metrics while the engine runs in its own "
            "process; see the README, Prometheus metrics: Multiprocess mode"
        )
    made: dict[str, list] = {}
    for spec in METRICS:
        pair = []
        for name in (spec.name, spec.alias):
            if name is None:
                continue
            doc = spec.doc if name == spec.name else f"{spec.doc} Alias of {spec.name}."
            if spec.kind == "gauge":
                metric = prometheus_client.Gauge(name, doc, ["mode"], multiprocess_mode="livesum")
            else:
                metric = prometheus_client.Counter(name, doc, ["mode"])
            pair.append(metric)
        made[spec.key] = pair
    logger.info("ple-um: Prometheus metrics registered (vllm:ple_um_*, aliases vllm:ple_mmap_*)")
    return made


class LookupMetrics:
    """One table's feed into the process's Prometheus metrics, labelled with its access mode.

    The table calls ``observe`` after each lookup that runs on the host (every cpu-mode lookup, a
    GPU mode's bulk lookups). In the cpu mode that counts everything; in the GPU modes, whose rows
    are counted on the device (graph replays too), it counts only the phase and lookup seconds, and
    ``absorb`` (called by the reporter thread with the table's ``stats()``) brings lookups, rows,
    bytes and out-of-range ids up to the device's totals. So nothing is counted twice. Nothing here
    raises: a failure is logged once and the lookup goes on."""

    def __init__(self, mode: str, host_counted: bool | None = None) -> None:
        self.mode = mode
        # The cpu mode's synchronous host path counts in observe(); every other path counts where
        # it runs (the device's counters, the host node's) and reaches here through absorb().
        self.host_counted = mode == "cpu" if host_counted is None else host_counted
        self._children: dict[str, list] | None = None
        self._ready = False
        self._absorbed = {"lookups": 0, "rows": 0, "bytes": 0, "out_of_range": 0}
        self._absorbed_seconds = dict.fromkeys((*PHASES, "lookup_seconds"), 0.0)
        self._absorb_lock = threading.Lock()

    def _metrics(self) -> dict[str, list] | None:
        if not self._ready:
            prom = prometheus()
            if prom is not None:
                try:
                    self._children = {k: [m.labels(mode=self.mode) for m in ms] for k, ms in prom.items()}
                except Exception as exc:  # noqa: BLE001
                    _warn_once("labels", "cannot label metrics: %s: %s", type(exc).__name__, exc)
            self._ready = True
        return self._children

    def _inc(self, children: dict[str, list], key: str, value: float) -> None:
        if value:
            for child in children[key]:
                child.inc(value)

    def observe(
        self,
        rows: int,
        nbytes: int,
        out_of_range: int = 0,
        phases: dict[str, float] | None = None,
        seconds: float | None = None,
    ) -> None:
        """Count one host-side lookup: ``rows`` ids, ``nbytes`` bytes of rows, ``out_of_range`` ids
        outside the table (these three only in the cpu mode: see the class), its phase seconds
        (dedup, gather, stage, wait) and its wall ``seconds`` (default: the phases' sum)."""
        try:
            children = self._metrics()
            if children is None:
                return
            if self.host_counted:
                self._inc(children, "lookups", 1)
                self._inc(children, "rows", rows)
                self._inc(children, "bytes", nbytes)
                self._inc(children, "out_of_range", out_of_range)
            if phases:
                for key in PHASES:
                    self._inc(children, key, phases.get(key, 0.0))
            if seconds is None and phases:
                seconds = sum(phases.get(key, 0.0) for key in PHASES)
            if seconds:
                self._inc(children, "lookup_seconds", seconds)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a lookup
            _warn_once("observe", "observe failed (counters may be short): %s: %s", type(exc).__name__, exc)

    def registration(self, seconds: float) -> None:
        """Count the seconds spent registering the mapping with CUDA."""
        try:
            children = self._metrics()
            if children is not None:
                self._inc(children, "registration", seconds)
        except Exception as exc:  # noqa: BLE001
            _warn_once("registration", "registration failed: %s: %s", type(exc).__name__, exc)

    def absorb(self, stats: dict) -> None:
        """Bring the counters up to a table's cumulative ``stats()`` (lookups, rows, bytes,
        out_of_range, and the host path's phase seconds, whose sum is its lookup seconds): adds what
        rose since the last call. A no-op for the cpu mode's synchronous path, whose lookups
        ``observe`` already counted."""
        if self.host_counted:
            return
        try:
            phases = stats.get("phase_seconds") or {}
            seconds = {key: float(phases.get(key, 0.0)) for key in PHASES}
            seconds["lookup_seconds"] = sum(seconds.values())
            with self._absorb_lock:
                rise: dict[str, float] = {}
                for key, before in self._absorbed.items():
                    now = int(stats.get(key, 0))
                    rise[key] = max(0, now - before)
                    self._absorbed[key] = now
                for key, before in self._absorbed_seconds.items():
                    rise[key] = max(0.0, seconds[key] - before)
                    self._absorbed_seconds[key] = seconds[key]
            children = self._metrics()
            if children is not None:
                for key, value in rise.items():
                    self._inc(children, key, value)
        except Exception as exc:  # noqa: BLE001
            _warn_once("absorb", "absorb failed: %s: %s", type(exc).__name__, exc)

    def set_residency(self, resident: int, mapped: int) -> None:
        """Set this mode's page-cache gauges (bytes resident, bytes mapped) for this process."""
        try:
            children = self._metrics()
            if children is not None:
                for child in children["resident_bytes"]:
                    child.set(resident)
                for child in children["mapped_bytes"]:
                    child.set(mapped)
        except Exception as exc:  # noqa: BLE001
            _warn_once("gauge", "residency gauge failed: %s: %s", type(exc).__name__, exc)


# -- the stats line ------------------------------------------------------------------------------
_FIGURES = ("lookups", "rows", "bytes", "out_of_range")


def _figures(stats: dict) -> dict[str, float]:
    """The cumulative figures of a ``stats()`` dict that the stats line shows."""
    out = {key: float(stats.get(key, 0)) for key in _FIGURES}
    phases = stats.get("phase_seconds") or {}
    for key in PHASES:
        out[key] = float(phases.get(key, 0.0))
    return out


def _fold(window: dict[str, dict[str, float]], watch: Watch, stats: dict) -> None:
    """Add what the watched table did since its last reading to its mode's window figures."""
    figures = _figures(stats)
    watch.mode = watch.mode or str(stats.get("mode", "?"))
    if watch.last is not None:
        acc = window.setdefault(watch.mode, dict.fromkeys(figures, 0.0))
        for key, value in figures.items():
            acc[key] += value - watch.last[key]
    watch.last = figures


class Watch:
    """One table watched by a StatsReporter; ``close()`` (idempotent) folds in its last figures and
    stops watching it. Close it before the table closes: it reads the table's stats() once more."""

    def __init__(
        self,
        reporter: StatsReporter,
        stats: Callable[[], dict],
        metrics: LookupMetrics | None,
        residency: Callable[[], Iterable[tuple]] | None,
        device,
    ) -> None:
        self.reporter = reporter
        self.stats = stats
        self.metrics = metrics
        self.residency = residency
        self.device = device
        self.mode = metrics.mode if metrics is not None else None
        self.last: dict[str, float] | None = None  # figures at the previous tick
        self.resident = (0, 0)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.reporter.remove(self)


class StatsReporter:
    """A daemon thread that every ``interval`` seconds logs one windowed line for the tables this
    process watches and absorbs their device counters into Prometheus.

    The line has the figures of the window since the previous line: lookups, rows, rows/s, MB/s,
    out-of-range ids, the cpu mode's phase milliseconds, and how much of the mapped table is in the
    page cache. A window without lookups or rows logs nothing; ``log=False`` logs no line at all
    (the reporter then only feeds Prometheus). ``tick()`` does one pass (tests call it directly);
    ``hold()`` pauses ticks."""

    def __init__(
        self,
        interval: float,
        *,
        log: bool = True,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = float(interval)
        self.log = log
        self.pid = os.getpid()
        self.emit = emit or (lambda line: logger.info("%s", line))
        self.clock = clock
        self.watches: list[Watch] = []
        self._gauged: dict[str, LookupMetrics] = {}  # the modes whose page-cache gauges were set
        self._retired: dict[str, dict[str, float]] = {}  # figures of watches closed mid-window
        self._lock = threading.RLock()  # one tick at a time; add/remove wait for it
        self._held = 0
        self._window_start = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
                watch.last = _figures(stats())
            except Exception as exc:  # noqa: BLE001
                _warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
            self.watches.append(watch)
        return watch

    def remove(self, watch: Watch) -> None:
        """Stop watching; what it did since the last tick still shows in the next line."""
        with self._lock:
            if watch.closed:
                return
            watch.closed = True
            try:
                # On the caller's stream: the table's last lookups are ordered before this read.
                stats = watch.stats()
                if watch.metrics is not None:
                    watch.metrics.absorb(stats)
                _fold(self._retired, watch, stats)
            except Exception as exc:  # noqa: BLE001
                _warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
            if watch in self.watches:
                self.watches.remove(watch)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """No tick runs inside this block (and one in progress finishes before it starts)."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    # -- one pass --------------------------------------------------------------------------
    def _read(self, watch: Watch) -> dict:
        """The watch's stats(), read on this reporter's own stream of its CUDA device and in the
        relaxed capture mode: the copy of the device counters never joins, waits for, or breaks
        the stream a lookup or a CUDA graph capture runs on (checked on an H200: 600 captures of
        registered-mode lookups while another thread read the counters 33,000 times, all sound,
        every replayed row counted)."""
        stream = self._stream(watch.device)
        if stream is None:
            return watch.stats()
        import torch

        with _relaxed_capture_mode(), torch.cuda.stream(stream):
            return watch.stats()

    def _stream(self, device):
        """This reporter's own stream on a CUDA ``device`` (None for anything else), made once.

        Created through the CUDA runtime, not ``torch.cuda.Stream()``: torch hands out streams from
        a small pool in turn, so a pool stream can be the very stream another thread captures on
        (seen on an H200: a tick's copy then broke that capture)."""
        if device is None or getattr(device, "type", None) != "cuda":
            return None
        if device not in self._streams:
            try:
                from ple_um.lookup.streams import own_stream

                self._streams[device] = own_stream(device)  # lives as long as the reporter
            except Exception as exc:  # noqa: BLE001
                _warn_once("stream", "no stream of its own on %s: %s: %s", device, type(exc).__name__, exc)
                self._streams[device] = None
        made = self._streams[device]
        if made is None:
            # Reading on a shared stream could break another thread's graph capture: never do.
            raise RuntimeError(f"the stats reporter has no stream of its own on {device}")
        return made

    def tick(self) -> str | None:
        """Read every watched table, feed Prometheus, and emit the line of the window that ends
        now; returns it (None when nothing happened in the window or ticks are held)."""
        with self._lock:
            if self._held:
                return None
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
                    _warn_once("read", "cannot read a table's stats: %s: %s", type(exc).__name__, exc)
                    continue
                if watch.metrics is not None:
                    watch.metrics.absorb(stats)
                _fold(window, watch, stats)
                if watch.residency is not None:
                    try:
                        parts = list(watch.residency())
                        watch.resident = (sum(p[1] for p in parts), sum(p[2] for p in parts))
                    except Exception as exc:  # noqa: BLE001
                        _warn_once("residency", "cannot read residency: %s: %s", type(exc).__name__, exc)
                    resident += watch.resident[0]
                    mapped += watch.resident[1]
            self._set_gauges()
            line = format_line(window, elapsed, resident, mapped)
        if line is not None and self.log:
            try:
                self.emit(line)
            except Exception as exc:  # noqa: BLE001
                _warn_once("emit", "cannot emit the stats line: %s: %s", type(exc).__name__, exc)
        return line

    def _set_gauges(self) -> None:
        by_mode: dict[str, tuple[LookupMetrics, int, int]] = {}
        for watch in self.watches:
            if watch.metrics is None or watch.residency is None:
                continue
            m, r, t = by_mode.get(watch.mode, (watch.metrics, 0, 0))
            by_mode[watch.mode] = (m, r + watch.resident[0], t + watch.resident[1])
        for metrics, resident, mapped in by_mode.values():
            metrics.set_residency(resident, mapped)
        for mode, metrics in self._gauged.items():  # the last table of a mode closed: nothing mapped
            if mode not in by_mode:
                metrics.set_residency(0, 0)
        self._gauged = {mode: entry[0] for mode, entry in by_mode.items()}

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> StatsReporter:
        """Start the daemon thread (once); a non-positive interval starts nothing."""
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="ple-um-stats", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one failure
                _warn_once("tick", "stats tick failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        """Stop the thread (idempotent); the watches stay as they are."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None


def format_line(
    window: dict[str, dict[str, float]], elapsed: float, resident: int, mapped: int
) -> str | None:
    """The stats line for one window (figures per mode), or None when nothing was looked up."""
    parts = []
    for mode, f in sorted(window.items()):
        if not f.get("lookups") and not f.get("rows"):
            continue
        n = f["lookups"]
        host_ms = sum(f[k] for k in PHASES if k != "wait") * 1e3
        text = (
            f"{mode}: {n:.0f} lookups, {f['rows']:.0f} rows ({f['rows'] / elapsed:.0f} rows/s, "
            f"{f['bytes'] / elapsed / 1e6:.2f} MB/s), {f['out_of_range']:.0f} out-of-range"
        )
        if any(f[k] for k in PHASES):
            per = f", host {host_ms / n:.3f} ms/lookup" if n else ""
            text += (
                f"{per}; phases ms: dedup {f['dedup'] * 1e3:.1f}, gather {f['gather'] * 1e3:.1f}, "
                f"stage {f['stage'] * 1e3:.1f}, gpu-wait {f['wait'] * 1e3:.1f}"
            )
        parts.append(text)
    if not parts:
        return None
    line = f"ple-um stats (last {elapsed:.0f}s, pid {os.getpid()}): " + "; ".join(parts)
    if mapped:
        line += (
            f"; page cache: {_size(resident)} of {_size(mapped)} resident ({100.0 * resident / mapped:.1f}%)"
        )
    return line


def _size(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _relaxed_capture_mode():
    """Let this thread copy from the device while another thread captures a CUDA graph: vLLM's
    start-up captures would fail whenever a tick landed inside one (seen on an H200). The copy runs
    on the reporter's own stream, which the capture does not record. Without the relaxed mode (no
    cuda-python) the read goes on in the default mode, warned once."""
    from ple_um.lookup.streams import relaxed_capture_mode

    return relaxed_capture_mode(
        lambda exc: _warn_once(
            "capture-mode", "cannot relax the capture mode: %s: %s", type(exc).__name__, exc
        )
    )


_reporter: StatsReporter | None = None


def reporter() -> StatsReporter | None:
    """The process's reporter, started on first use: every PLE_UM_STATS_SEC seconds with the stats
    line; with the line off (0) and Prometheus on, every PLE_UM_METRICS_SEC seconds without it (the
    GPU modes' rows reach the counters only through it); else None."""
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
        _warn_once("watch", "cannot start the stats reporter: %s: %s", type(exc).__name__, exc)
        return None


# -- progress bars -------------------------------------------------------------------------------
@contextlib.contextmanager
def progress(
    total: int, desc: str, *, min_bytes: int = 1 << 30, disable: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """A tqdm bar over ``total`` bytes (to stderr), given as ``advance(nbytes)``: the callback
    ``MappedShards.populate(progress=)`` and ``RegisteredMapping(progress=)`` take. Shown when
    ``total >= min_bytes`` unless ``disable`` says otherwise."""
    from tqdm import tqdm

    off = total < min_bytes if disable is None else disable
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=off, leave=not off
    ) as bar:
        yield bar.update
