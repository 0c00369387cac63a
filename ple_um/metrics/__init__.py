"""What a table tells its operator while it serves; none of it may ever fail a lookup (a failure
is logged once and swallowed, ``counters.warn_once``).

- ``counters``: the process's Prometheus counters and gauges (``METRICS``: names, and the aliases
  the earlier CPU-gather patches exported) and ``LookupMetrics``, one table's feed into them,
  labelled by access mode.
- ``reporter``: one daemon thread per process (``reporter()``; a table joins it with ``watch()``
  and leaves it by closing the ``Watch``) that every ``PLE_UM_STATS_SEC`` seconds reads each
  watched table's ``stats()`` and page-cache residency, logs the stats line (``stats_line``) of
  the window since the last one, and absorbs the counters the lookup paths keep where they run
  (the device's, the C row copy's) into Prometheus.
- ``progress_bars``: ``progress(total_bytes, description)``, a bar over long work.
"""

from ple_um.metrics.counters import METRICS, PHASES, LookupMetrics, prometheus
from ple_um.metrics.progress_bars import progress
from ple_um.metrics.reporter import StatsReporter, reporter, watch

__all__ = [
    "METRICS",
    "PHASES",
    "LookupMetrics",
    "StatsReporter",
    "progress",
    "prometheus",
    "reporter",
    "watch",
]
