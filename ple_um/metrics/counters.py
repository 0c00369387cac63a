"""The process's Prometheus counters and gauges, labelled by access mode, and one table's feed into them.

Every figure is declared once in ``METRICS``: its key, its ``vllm:ple_um_*`` name and, where the
meaning is the same, its alias (the ``vllm:ple_mmap_*`` name of the earlier CPU-gather patches,
exported too so that their dashboards keep working). The metrics are created on first
use (``PROMETHEUS_MULTIPROC_DIR`` must be set before the first one exists), not at all when
``PLE_UM_PROMETHEUS=0`` or when ``prometheus_client`` is not installed.

The cpu mode's synchronous path knows every lookup's figures on the host and counts them in
``LookupMetrics.observe``; every other path counts rows where it runs (the device, graph replays
included, with no host code running; the host node), and the reporter thread brings the counters up
to the table's ``stats()`` with ``absorb``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ple_um import envs
from ple_um.lookup.counts import PHASES
from ple_um.metrics.stats_line import CACHE_COUNTED, FIGURES, figures

# One logger for the whole of ple_um.metrics: the stats line and every metrics warning come under
# the name an operator filters on, whichever module writes them.
logger = logging.getLogger("ple_um.metrics")
_warned: set[str] = set()

# The counters absorb brings up to a table's stats(), by the keys ``figures`` gives them (the
# phases' sum is the lookup seconds).
ABSORBED = (*FIGURES, *PHASES, "lookup_seconds", *CACHE_COUNTED)


def warn_once(key: str, message: str, *args) -> None:
    """The one rule of every metric: it never fails the caller. A failure of kind ``key`` is logged
    the first time it happens in this process, then swallowed, so a broken exporter or reader costs
    a line in the log and nothing else."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning("ple-um metrics: " + message, *args)


@dataclass(frozen=True)
class MetricSpec:
    """One exported figure: its key in ``observe``/``stats()``, its names, and what it counts."""

    key: str
    name: str  # vllm:ple_um_*
    alias: str | None  # the earlier CPU-gather patches' vllm:ple_mmap_* name, where the meaning is the same
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
        "row_cache_hits",
        "vllm:ple_um_row_cache_hits_total",
        None,
        "Host path: rows the row cache served (a table not in memory at open keeps one).",
    ),
    MetricSpec(
        "row_cache_misses",
        "vllm:ple_um_row_cache_misses_total",
        None,
        "Host path: owned rows the row cache did not hold (read from the files).",
    ),
    MetricSpec(
        "row_cache_evictions",
        "vllm:ple_um_row_cache_evictions_total",
        None,
        "Host path: rows the row cache dropped to take others.",
    ),
    MetricSpec(
        "file_reads",
        "vllm:ple_um_file_reads_total",
        None,
        "Host path: rows read from the files by the reader of misses (many in flight), not faulted in.",
    ),
    MetricSpec(
        "file_read_seconds",
        "vllm:ple_um_file_read_seconds_total",
        None,
        "Host path: seconds the reader of misses waited for the files.",
    ),
    MetricSpec(
        "row_cache_rows",
        "vllm:ple_um_row_cache_rows",
        None,
        "Rows the row cache holds now, read every stats period.",
        kind="gauge",
    ),
    MetricSpec(
        "row_cache_bytes",
        "vllm:ple_um_row_cache_bytes",
        None,
        "Bytes of the row cache's memory in RAM now, read every stats period.",
        kind="gauge",
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

# The process's metrics, created once on first use.
_lock = threading.Lock()
_prom: dict[str, list] | None = None  # key -> [metric, alias metric]
_prom_tried = False


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
            warn_once("create", "Prometheus metrics unavailable: %s: %s", type(exc).__name__, exc)
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
            "process; see docs/OPERATING.md, Metrics: Multiprocess mode"
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

    The cpu mode's synchronous host path (no C row copy) calls ``observe`` after each lookup and
    counts everything there. Every other path counts where it runs (the kernel on the device, the C
    row copy in its host counters; graph replays too), and ``absorb`` (called by the reporter
    thread with the table's ``stats()``) brings lookups, rows, bytes, out-of-range ids, phase
    seconds and the row cache's counts up to those totals. So nothing is counted twice. Nothing here
    raises: a failure is logged once and the lookup goes on."""

    def __init__(self, mode: str, host_counted: bool | None = None) -> None:
        self.mode = mode
        # The cpu mode's synchronous host path counts in observe(); every other path counts where
        # it runs (the device's counters, the host node's) and reaches here through absorb().
        self.host_counted = mode == "cpu" if host_counted is None else host_counted
        self._children: dict[str, list] | None = None
        self._ready = False
        self._absorbed = dict.fromkeys(ABSORBED, 0.0)
        self._absorb_lock = threading.Lock()

    def _metrics(self) -> dict[str, list] | None:
        if not self._ready:
            prom = prometheus()
            if prom is not None:
                try:
                    self._children = {k: [m.labels(mode=self.mode) for m in ms] for k, ms in prom.items()}
                except Exception as exc:  # noqa: BLE001
                    warn_once("labels", "cannot label metrics: %s: %s", type(exc).__name__, exc)
            self._ready = True
        return self._children

    def _feed(self, what: str, values: dict[str, float], *, gauges: bool = False) -> None:
        """Raise this mode's counters named in ``values`` by them (a 0 leaves one as it is), or, with
        ``gauges``, set its gauges to them; nothing where there are no metrics. A failure is
        ``warn_once``'s of kind ``what``: metrics never fail a lookup."""
        try:
            children = self._metrics()
            for key, value in values.items() if children is not None else ():
                for child in children[key]:
                    if gauges:
                        child.set(value)
                    elif value:
                        child.inc(value)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a lookup
            warn_once(what, what + " failed (counters may be short): %s: %s", type(exc).__name__, exc)

    def observe(
        self,
        rows: int,
        nbytes: int,
        out_of_range: int = 0,
        phases: dict[str, float] | None = None,
        seconds: float | None = None,
    ) -> None:
        """Count one host-side lookup: ``rows`` ids, ``nbytes`` bytes of rows, ``out_of_range`` ids
        outside the table (these three only where the table is ``host_counted``), its phase seconds
        (gather, stage, wait) and its wall ``seconds`` (default: the phases' sum)."""
        try:
            counted = {"lookups": 1, "rows": rows, "bytes": nbytes, "out_of_range": out_of_range}
            spent = {key: (phases or {}).get(key, 0.0) for key in PHASES}
            seconds = sum(spent.values()) if seconds is None else seconds
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a lookup
            warn_once("observe", "observe failed (counters may be short): %s: %s", type(exc).__name__, exc)
            return
        self._feed("observe", {**(counted if self.host_counted else {}), **spent, "lookup_seconds": seconds})

    def registration(self, seconds: float) -> None:
        """Count the seconds spent registering the mapping with CUDA."""
        self._feed("registration", {"registration": seconds})

    def absorb(self, stats: dict) -> None:
        """Bring the counters up to a table's cumulative ``stats()`` (lookups, rows, bytes,
        out_of_range, and the host path's phase seconds, whose sum is its lookup seconds): adds what
        rose since the last call. A no-op for the cpu mode's synchronous path, whose lookups
        ``observe`` already counted."""
        if self.host_counted:
            return
        try:
            now = figures(stats)
            now["lookup_seconds"] = sum(now[key] for key in PHASES)
            with self._absorb_lock:
                rise = {key: max(0.0, now[key] - self._absorbed[key]) for key in ABSORBED}
                self._absorbed = {key: now[key] for key in ABSORBED}
        except Exception as exc:  # noqa: BLE001
            warn_once("absorb", "absorb failed: %s: %s", type(exc).__name__, exc)
            return
        self._feed("absorb", rise)

    def set_gauges(self, values: dict[str, int]) -> None:
        """Set this mode's gauges named in ``values`` for this process (the page cache's
        ``resident_bytes`` and ``mapped_bytes``, the row cache's ``row_cache_rows`` and
        ``row_cache_bytes`` in RAM)."""
        self._feed("gauge", values, gauges=True)
