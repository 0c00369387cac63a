"""The one rule of every metric: it never fails the caller. A failure is logged once per kind, then
swallowed, so a broken exporter or reader costs a line in the log and nothing else."""

from __future__ import annotations

import logging

# One logger for the whole of ple_um.metrics: the stats line and every metrics warning come under
# the name an operator filters on, whichever module writes them.
logger = logging.getLogger("ple_um.metrics")

_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    """Log a metrics failure of kind ``key`` the first time it happens in this process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning("ple-um metrics: " + message, *args)
