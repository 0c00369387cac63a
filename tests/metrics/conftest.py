"""Fixtures of the metrics tests: Prometheus on (or the test skips), a clock the test moves, and a
fresh Python process with the metrics knobs cleared."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ple_um import metrics


@pytest.fixture
def prometheus_on():
    if metrics.prometheus() is None:
        pytest.skip("Prometheus metrics are off in this process")


class Clock:
    """A monotonic clock that stands still until the test moves ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    for name in (
        "PLE_UM_PROMETHEUS",
        "VLLM_PLE_MMAP_PROMETHEUS",
        "PLE_UM_STATS_SEC",
        "PROMETHEUS_MULTIPROC_DIR",
    ):
        if name not in env:
            full.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture
def run_python():
    """``run_python(code, **env)``: run ``code`` in a fresh interpreter (the process-wide switches
    act once per process) with ``env`` added and the metrics knobs it does not name removed; the
    process must exit 0."""
    return _python
