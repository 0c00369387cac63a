"""ple_um.metrics.reporter: the windowed stats line of the watched tables, the reporter thread and
its page-cache gauges, tables closed or unreadable under a watch, held ticks, and the process's
reporter started (or not) by PLE_UM_STATS_SEC and PLE_UM_PROMETHEUS."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

import ple_um
from ple_um import metrics

prometheus_client = pytest.importorskip("prometheus_client")
REGISTRY = prometheus_client.REGISTRY
pytestmark = pytest.mark.usefixtures("prometheus_on")


LINE = re.compile(
    r"ple-um stats \(last (\d+)s, pid \d+\): cpu: (\d+) lookups, (\d+) rows \((\d+) rows/s, ([\d.]+) MB/s\), "
    r"(\d+) out-of-range, host [\d.]+ ms/lookup; phases ms: gather [\d.]+, stage [\d.]+, "
    r"gpu-wait [\d.]+; page cache: .* resident \(([\d.]+)%\)$"
)


def test_stats_line_is_windowed(make_checkpoint, clock):
    layout = make_checkpoint(num_rows=4000, row_dim=40, shards=4)
    lines = []
    reporter = metrics.StatsReporter(30, emit=lines.append, clock=clock)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        watch = reporter.add(table.stats, table.metrics, table.mapping.residency)
        for n in (100, 200):
            table.lookup(torch.arange(n) * 3)
        table.lookup(torch.tensor([-1, 5, 4000, 7]))
        clock.now += 30
        line = reporter.tick()
        m = LINE.match(line)
        assert m, line
        assert m.groups()[:6] == ("30", "3", "304", f"{304 / 30:.0f}", f"{304 * 80 / 30 / 1e6:.2f}", "2")
        assert float(m.group(7)) == pytest.approx(100.0)  # freshly written: all in the page cache
        assert lines == [line]

        clock.now += 30
        assert reporter.tick() is None  # nothing looked up: no line
        table.lookup(torch.arange(50))
        clock.now += 10
        m = LINE.match(reporter.tick())
        assert m.groups()[:4] == ("10", "1", "50", "5")  # only this window's figures

        table.lookup(torch.arange(20))
        watch.close()  # the table's last window shows in the next line
        clock.now += 5
        line = reporter.tick()
        assert "cpu: 1 lookups, 20 rows (4 rows/s" in line and "page cache" not in line
        assert lines[-1] == line
        assert reporter.watches == []
    reporter.close()


def test_stats_line_thread_and_residency_gauge(make_checkpoint):
    layout = make_checkpoint(num_rows=4000, row_dim=40, shards=4)
    lines: list[str] = []
    reporter = metrics.StatsReporter(0.05, emit=lines.append).start()
    try:
        with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
            watch = reporter.add(table.stats, table.metrics, table.mapping.residency)
            table.lookup(torch.arange(64))
            deadline = time.monotonic() + 10
            while not lines and time.monotonic() < deadline:
                time.sleep(0.02)
            assert lines and "cpu: 1 lookups, 64 rows" in lines[0]
            mapped = sum(r[2] for r in table.mapping.residency())
            assert REGISTRY.get_sample_value("vllm:ple_um_mapped_bytes", {"mode": "cpu"}) == mapped
            resident = REGISTRY.get_sample_value("vllm:ple_um_resident_bytes", {"mode": "cpu"})
            assert 0 < resident <= mapped
            watch.close()
    finally:
        reporter.close()


def test_a_closed_table_stops_being_watched(make_checkpoint, caplog):
    layout = make_checkpoint()
    reporter = metrics.StatsReporter(30, emit=lambda line: None)
    table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    reporter.add(table.stats)
    table.close()  # without closing the watch first: the tick must not raise
    with caplog.at_level(logging.WARNING, logger="ple_um.metrics"):
        assert reporter.tick() is None
    assert reporter.watches == []


def test_a_failed_read_skips_one_tick(make_checkpoint):
    """A read that fails (say, refused during another thread's graph capture) keeps the watch."""
    layout = make_checkpoint()
    reporter = metrics.StatsReporter(30, emit=lambda line: None)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        fail = [False]

        def stats():
            if fail[0]:
                fail[0] = False
                raise RuntimeError("transient")
            return table.stats()

        reporter.add(stats)
        table.lookup(torch.arange(7))
        fail[0] = True
        assert reporter.tick() is None
        assert len(reporter.watches) == 1
        assert "1 lookups, 7 rows" in reporter.tick()


def test_the_page_cache_gauges_fall_to_zero_when_a_modes_last_table_closes(make_checkpoint, clock):
    """`count by (mode) (vllm:ple_um_mapped_bytes)` must not keep reporting a closed table's mode."""
    layout = make_checkpoint(num_rows=4000, row_dim=40, shards=4)
    reporter = metrics.StatsReporter(30, emit=lambda line: None, clock=clock)
    try:
        with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
            watch = reporter.add(table.stats, table.metrics, table.mapping.residency)
            reporter.tick()
            assert REGISTRY.get_sample_value("vllm:ple_um_mapped_bytes", {"mode": "cpu"}) > 0
            watch.close()
        reporter.tick()
        for gauge in ("vllm:ple_um_mapped_bytes", "vllm:ple_um_resident_bytes"):
            assert REGISTRY.get_sample_value(gauge, {"mode": "cpu"}) == 0
    finally:
        reporter.close()


def test_stats_sec_starts_the_process_reporter(make_checkpoint, run_python):
    layout = make_checkpoint()
    done = run_python(
        f"""
        import logging, time, torch
        logging.basicConfig(level=logging.INFO)
        import ple_um
        from ple_um import metrics
        with ple_um.open_table({layout.directory!r}, mode="cpu", device="cpu") as table:
            watch = table.watch  # a table joins the process's reporter when it opens
            assert watch is not None and metrics.reporter().interval == 0.1 and metrics.reporter().log
            table.lookup(torch.arange(30))
            time.sleep(1.0)
            watch.close()
        """,
        VLLM_PLE_MMAP_STATS_SEC="0.1",
    )
    assert re.search(r"ple-um stats \(last 0s, pid \d+\): cpu: 1 lookups, 30 rows", done.stderr), done.stderr


def test_reporter_off_without_stats_or_prometheus(run_python):
    run_python(
        """
        from ple_um import metrics
        assert metrics.watch(lambda: {}) is None and metrics.reporter() is None
        """,
        PLE_UM_STATS_SEC="0",
        PLE_UM_PROMETHEUS="0",
    )
    run_python(
        """
        from ple_um import metrics
        rep = metrics.reporter()
        assert rep is not None and rep.interval == 15.0 and not rep.log  # Prometheus only
        """,
        PLE_UM_STATS_SEC="0",
    )
