"""Metrics: Prometheus counters that rise by exactly what a cpu-mode table looked up (and agree
with its stats()), device-counted modes absorbed without double counting, the windowed stats
line, multiprocess export, PLE_UM_PROMETHEUS=0 and a missing prometheus_client, progress bars, and
a metrics failure that never fails the lookup."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import ple_um
from ple_um import metrics
from ple_um.mapping import MappedShards

prometheus_client = pytest.importorskip("prometheus_client")
REGISTRY = prometheus_client.REGISTRY

COUNTED = ("lookups", "rows", "bytes", "out_of_range")
NAMES = {spec.key: spec for spec in metrics.METRICS}


@pytest.fixture(autouse=True)
def _prometheus_on():
    if metrics.prometheus() is None:
        pytest.skip("Prometheus metrics are off in this process")


def sample(key: str, mode: str, alias: bool = False) -> float:
    spec = NAMES[key]
    name = spec.alias if alias else spec.name
    value = REGISTRY.get_sample_value(name, {"mode": mode})
    return 0.0 if value is None else value


def counters(mode: str) -> dict[str, float]:
    return {key: sample(key, mode) for key in (*COUNTED, *metrics.PHASES, "lookup_seconds")}


# -- counters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_cpu_counters_rise_by_exactly_the_rows_looked_up(make_checkpoint, monkeypatch, rowcopy):
    """The synchronous host path counts at each lookup (observe); the host node counts where it
    runs, and the reporter's absorb of the table's stats() brings the metrics up to it (called here
    as the reporter would; a tick of the real reporter in between changes nothing: rises are taken
    from totals)."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    layout = make_checkpoint(num_rows=5000, row_dim=32, shards=8)
    rng = np.random.default_rng(7)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert table.metrics.host_counted == (rowcopy == "0")
        before, stats0 = counters("cpu"), table.stats()
        aliases0 = {key: sample(key, "cpu", alias=True) for key in ("lookups", "rows", "bytes")}
        sizes, bad_total = (1, 17, 300, 4096, 9000), 0
        for n in sizes:
            ids = rng.integers(0, layout.num_rows, size=n)
            bad = rng.integers(0, n, size=min(n, 5))  # a few ids outside the table, both sides
            ids[bad[::2]] = -3
            ids[bad[1::2]] = layout.num_rows + 11
            bad_total += int(((ids < 0) | (ids >= layout.num_rows)).sum())
            table.lookup(torch.from_numpy(ids).view(-1, 1) if n > 1 else torch.from_numpy(ids))
        stats1 = table.stats()
        table.metrics.absorb(stats1)  # the reporter's read (a no-op for the synchronous path)
        after = counters("cpu")

    rows = sum(sizes)
    rise = {key: after[key] - before[key] for key in after}
    assert rise["lookups"] == len(sizes)
    assert rise["rows"] == rows
    assert rise["bytes"] == rows * layout.row_bytes
    assert rise["out_of_range"] == bad_total > 0
    for key in ("lookups", "rows", "bytes"):
        assert sample(key, "cpu", alias=True) - aliases0[key] == rise[key]
    # The table's own counters agree.
    assert stats1["lookups"] - stats0["lookups"] == len(sizes)
    assert stats1["rows"] - stats0["rows"] == rows
    assert stats1["bytes"] - stats0["bytes"] == rows * layout.row_bytes
    assert stats1["out_of_range"] - stats0["out_of_range"] == bad_total
    # Phase seconds: what the table summed, and the lookup seconds at least their sum.
    for key in metrics.PHASES:
        spent = stats1["phase_seconds"][key] - stats0["phase_seconds"][key]
        assert rise[key] == pytest.approx(spent, rel=1e-6, abs=1e-9)
    assert rise["gather"] > 0
    assert rise["lookup_seconds"] >= sum(rise[k] for k in metrics.PHASES) * (1 - 1e-6)


def test_device_counted_modes_absorb_rises_once():
    """A GPU mode's totals come from stats(); observe() adds only its seconds there."""
    feed = metrics.LookupMetrics("registered")
    before = counters("registered")
    feed.observe(1000, 160000, 3, {"dedup": 0.5, "gather": 1.0, "stage": 0.25, "wait": 0.125})
    feed.absorb({"lookups": 4, "rows": 1000, "bytes": 160000, "out_of_range": 3})
    feed.absorb({"lookups": 4, "rows": 1000, "bytes": 160000, "out_of_range": 3})  # nothing new
    feed.absorb({"lookups": 9, "rows": 1500, "bytes": 240000, "out_of_range": 5})
    feed.absorb({"lookups": 0, "rows": 0, "bytes": 0, "out_of_range": 0})  # counters zeroed: no fall
    feed.absorb({"lookups": 1, "rows": 16, "bytes": 2560, "out_of_range": 0})
    rise = {key: value - before[key] for key, value in counters("registered").items()}
    assert rise["lookups"] == 10
    assert rise["rows"] == 1516
    assert rise["bytes"] == 242560
    assert rise["out_of_range"] == 5
    assert rise["gather"] == 1.0 and rise["wait"] == 0.125
    assert rise["lookup_seconds"] == 1.875


def test_cpu_mode_absorb_adds_nothing():
    feed = metrics.LookupMetrics("cpu")
    before = counters("cpu")
    feed.absorb({"lookups": 50, "rows": 5000, "bytes": 1, "out_of_range": 2})
    assert counters("cpu") == before


def test_registration_seconds():
    feed = metrics.LookupMetrics("ats")
    before = sample("registration", "ats")
    feed.registration(1.25)
    assert sample("registration", "ats") - before == 1.25


def test_metrics_never_fail_a_lookup(make_checkpoint, caplog, monkeypatch):
    layout = make_checkpoint()
    monkeypatch.setattr(metrics, "_warned", set())  # as in a fresh process: nothing warned yet
    feed = metrics.LookupMetrics("cpu")
    with caplog.at_level(logging.WARNING, logger="ple_um.metrics"):
        for _ in range(3):
            feed.observe(-5, 10, 0, {"dedup": "not a number"})  # a negative inc raises in the client
            feed.absorb({"rows": "many"})
        feed.registration(float("nan"))
    warnings = [r.getMessage() for r in caplog.records if r.name == "ple_um.metrics"]
    assert sum("observe failed" in w for w in warnings) == 1, warnings  # logged, once per kind of failure
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        out = table.lookup(torch.arange(layout.num_rows))
        feed.observe(-1, -1, -1, {"gather": -1.0})
        assert out.shape == (layout.num_rows, layout.row_dim)


# -- the stats line ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LINE = re.compile(
    r"ple-um stats \(last (\d+)s, pid \d+\): cpu: (\d+) lookups, (\d+) rows \((\d+) rows/s, ([\d.]+) MB/s\), "
    r"(\d+) out-of-range, host [\d.]+ ms/lookup; phases ms: dedup [\d.]+, gather [\d.]+, stage [\d.]+, "
    r"gpu-wait [\d.]+; page cache: .* resident \(([\d.]+)%\)$"
)


def test_stats_line_is_windowed(make_checkpoint):
    layout = make_checkpoint(num_rows=4000, row_dim=40, shards=4)
    clock, lines = Clock(), []
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


def test_hold_pauses_ticks(make_checkpoint):
    layout = make_checkpoint()
    reporter = metrics.StatsReporter(30, emit=lambda line: None)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        reporter.add(table.stats)
        table.lookup(torch.arange(5))
        with reporter.hold():
            assert reporter.tick() is None
        assert "5 rows" in reporter.tick()


# -- process-wide switches, in fresh processes ---------------------------------------------------
def python(code: str, **env: str) -> subprocess.CompletedProcess:
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


def test_prometheus_off_by_knob_and_alias():
    code = """
        from prometheus_client import generate_latest
        from ple_um import metrics
        feed = metrics.LookupMetrics("cpu")
        feed.observe(10, 1600, 0, {"gather": 0.1})
        assert metrics.prometheus() is None
        assert b"ple_um" not in generate_latest() and b"ple_mmap" not in generate_latest()
    """
    python(code, PLE_UM_PROMETHEUS="0")
    python(code, VLLM_PLE_MMAP_PROMETHEUS="0")


def test_prometheus_client_missing_means_no_ops():
    python(
        """
        import sys
        sys.modules["prometheus_client"] = None  # as if it were not installed
        from ple_um import metrics
        feed = metrics.LookupMetrics("cpu")
        feed.observe(10, 1600, 0, {"gather": 0.1})
        feed.absorb({"rows": 3})
        feed.registration(1.0)
        assert metrics.prometheus() is None
        """
    )


def test_created_lazily_on_first_use():
    python(
        """
        from prometheus_client import generate_latest
        from ple_um import metrics
        feed = metrics.LookupMetrics("cpu")
        assert b"ple_um" not in generate_latest()
        feed.observe(4, 640)
        text = generate_latest().decode()
        assert 'vllm:ple_um_rows_total{mode="cpu"} 4.0' in text, text
        assert 'vllm:ple_mmap_rows_total{mode="cpu"} 4.0' in text, text
        """
    )


def test_multiprocess_mode_aggregates_processes(tmp_path):
    """Two engine-like processes write under PROMETHEUS_MULTIPROC_DIR; a collector sums them."""
    shared = tmp_path / "prom"
    shared.mkdir()
    worker = """
        from ple_um import metrics
        metrics.LookupMetrics("cpu").observe(100, 16000, 2, {"gather": 0.5})
        metrics.LookupMetrics("registered").absorb({"lookups": 3, "rows": 7, "bytes": 70, "out_of_range": 0})
    """
    for _ in range(2):
        python(worker, PROMETHEUS_MULTIPROC_DIR=str(shared))
    done = python(
        f"""
        from prometheus_client import CollectorRegistry, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path={str(shared)!r})
        get = registry.get_sample_value
        cpu, registered = {{"mode": "cpu"}}, {{"mode": "registered"}}
        print(get("vllm:ple_um_rows_total", cpu), get("vllm:ple_mmap_rows_total", cpu),
              get("vllm:ple_um_out_of_range_total", cpu), get("vllm:ple_um_gather_seconds_total", cpu),
              get("vllm:ple_um_rows_total", registered))
        """,
        PROMETHEUS_MULTIPROC_DIR=str(shared),
    )
    assert done.stdout.split() == ["200.0", "200.0", "4.0", "1.0", "14.0"]


def test_stats_sec_starts_the_process_reporter(make_checkpoint):
    layout = make_checkpoint()
    done = python(
        f"""
        import logging, time, torch
        logging.basicConfig(level=logging.INFO)
        import ple_um
        from ple_um import metrics
        with ple_um.open_table({layout.directory!r}, mode="cpu", device="cpu") as table:
            # Once table.py watches itself (table.watch), nothing to add here.
            watch = getattr(table, "watch", None) or metrics.watch(table.stats, None, table.mapping.residency)
            assert watch is not None and metrics.reporter().interval == 0.1 and metrics.reporter().log
            table.lookup(torch.arange(30))
            time.sleep(1.0)
            watch.close()
        """,
        VLLM_PLE_MMAP_STATS_SEC="0.1",
    )
    assert re.search(r"ple-um stats \(last 0s, pid \d+\): cpu: 1 lookups, 30 rows", done.stderr), done.stderr


def test_reporter_off_without_stats_or_prometheus():
    python(
        """
        from ple_um import metrics
        assert metrics.watch(lambda: {}) is None and metrics.reporter() is None
        """,
        PLE_UM_STATS_SEC="0",
        PLE_UM_PROMETHEUS="0",
    )
    python(
        """
        from ple_um import metrics
        rep = metrics.reporter()
        assert rep is not None and rep.interval == 15.0 and not rep.log  # Prometheus only
        """,
        PLE_UM_STATS_SEC="0",
    )


# -- progress ------------------------------------------------------------------------------------
def test_progress_bar_over_populate(make_checkpoint, capsys):
    layout = make_checkpoint(num_rows=20000, row_dim=64, shards=4)
    with MappedShards(layout) as mapping:
        with metrics.progress(mapping.mapped_bytes, "prewarm", min_bytes=0) as advance:
            done = mapping.populate(progress=advance)
        assert done == mapping.mapped_bytes
    err = capsys.readouterr().err
    assert "prewarm" in err and "100%" in err
    with metrics.progress(10 << 20, "register") as advance:  # below min_bytes: no bar
        advance(10 << 20)
    assert capsys.readouterr().err == ""


def test_the_page_cache_gauges_fall_to_zero_when_a_modes_last_table_closes(make_checkpoint):
    """`count by (mode) (vllm:ple_um_mapped_bytes)` must not keep reporting a closed table's mode."""
    layout = make_checkpoint(num_rows=4000, row_dim=40, shards=4)
    reporter = metrics.StatsReporter(30, emit=lambda line: None, clock=Clock())
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


@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_packed_lookups_reach_the_counters(make_checkpoint, monkeypatch, rowcopy):
    """NVFP4's lookup_packed counts its rows and bytes (rows and block scales) in stats() and in
    Prometheus on both host paths (the synchronous one left them out of Prometheus)."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    layout = make_checkpoint(num_rows=300, row_dim=64, dtype="nvfp4", shards=3)
    reporter = metrics.StatsReporter(30, emit=lambda line: None, clock=Clock())
    rows_before = REGISTRY.get_sample_value("vllm:ple_um_rows_total", {"mode": "cpu"}) or 0
    try:
        with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
            watch = reporter.add(table.stats, table.metrics, table.mapping.residency)
            table.lookup_packed(torch.arange(100))
            assert table.stats()["rows"] == 100
            reporter.tick()
            watch.close()
    finally:
        reporter.close()
    assert REGISTRY.get_sample_value("vllm:ple_um_rows_total", {"mode": "cpu"}) - rows_before == 100
