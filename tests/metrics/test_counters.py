"""ple_um.metrics.counters: Prometheus counters that rise by exactly what a cpu-mode table looked up
(and agree with its stats()), device-counted modes absorbed without double counting, multiprocess
export, PLE_UM_PROMETHEUS=0 and a missing prometheus_client, and a metrics failure that never fails
the lookup."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ple_um
from ple_um import metrics
from ple_um.metrics import counters as counters_module

prometheus_client = pytest.importorskip("prometheus_client")
REGISTRY = prometheus_client.REGISTRY
pytestmark = pytest.mark.usefixtures("prometheus_on")

COUNTED = ("lookups", "rows", "bytes", "out_of_range")
NAMES = {spec.key: spec for spec in metrics.METRICS}


def sample(key: str, mode: str, alias: bool = False) -> float:
    spec = NAMES[key]
    name = spec.alias if alias else spec.name
    value = REGISTRY.get_sample_value(name, {"mode": mode})
    return 0.0 if value is None else value


def counters(mode: str) -> dict[str, float]:
    return {key: sample(key, mode) for key in (*COUNTED, *metrics.PHASES, "lookup_seconds")}


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
    feed.observe(1000, 160000, 3, {"gather": 1.0, "stage": 0.25, "wait": 0.125})
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
    # Seconds are float counters that earlier tests of the session may have raised: their rise is
    # exact up to the rounding of the running total.
    assert rise["gather"] == pytest.approx(1.0, rel=1e-12) and rise["wait"] == pytest.approx(0.125, rel=1e-12)
    assert rise["lookup_seconds"] == pytest.approx(1.375, rel=1e-12)


def test_the_row_cache_counters_and_gauges_follow_its_stats(make_checkpoint, monkeypatch, rng):
    """A cpu-mode table with a row cache: the reporter's absorb brings the row-cache counters up to
    stats()["row_cache"] and the file reads up to stats(), rise by rise; the gauges hold what the
    cache holds."""
    layout = make_checkpoint(num_rows=5000, row_dim=32, dtype="fp8", shards=4)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "256KiB")
    keys = ("row_cache_hits", "row_cache_misses", "row_cache_evictions", "file_reads", "file_read_seconds")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        before = {key: sample(key, "cpu") for key in keys}
        for _ in range(3):
            table.lookup(torch.from_numpy(rng.integers(0, 5000, 3000)))
            stats = table.stats()
            table.metrics.absorb(stats)
            cache = stats["row_cache"]
            rise = {key: sample(key, "cpu") - before[key] for key in keys}
            expect = {key: cache[key.removeprefix("row_cache_")] for key in keys[:3]}
            expect |= {key: stats[key] for key in keys[3:]}
            assert rise == pytest.approx(expect) and stats["file_reads"] > 0
        assert cache["hits"] > 0 and cache["evictions"] > 0
        table.metrics.set_gauges(
            {"row_cache_rows": cache["rows"], "row_cache_bytes": cache["resident_bytes"]}
        )
        assert sample("row_cache_rows", "cpu") == cache["rows"] > 0
        assert sample("row_cache_bytes", "cpu") == cache["resident_bytes"] > 0


def test_a_lookup_in_flight_at_close_reaches_the_counters(make_checkpoint, check_rows):
    """close() waits for a lookup in flight; the rows it looks up meanwhile (counted by the host node,
    absorbed from stats()) reach the counters: the watch's last read comes after that wait."""
    layout = make_checkpoint(num_rows=3000, row_dim=16, dtype="bf16", shards=6, files=3)
    table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    assert table.watch is not None and not table.metrics.host_counted
    host, inside, closing = table.paths.host, threading.Event(), threading.Event()
    gather = host.gather

    def held_gather(ids, out):
        inside.set()
        closing.wait(10)
        time.sleep(0.3)  # close() has begun by now
        return gather(ids, out)

    host.gather = held_gather
    ids, got = torch.arange(0, 3000, 7), []
    before = sample("rows", "cpu")
    worker = threading.Thread(target=lambda: got.append(table.lookup(ids)))
    worker.start()
    assert inside.wait(30)
    closing.set()
    table.close()
    worker.join(timeout=60)
    check_rows(got[0], layout, ids)
    assert sample("rows", "cpu") - before == ids.numel()


def test_a_table_dropped_without_close_reaches_the_counters(make_checkpoint, run_python):
    """A table dropped without close(): its release (``ple_um.dropped``) takes the watch's last
    reading, as close() does, so what it looked up since the reporter's last tick reaches the
    counters, each equal to the table's own stats() (the reporter's period here is an hour: no tick
    comes between; the host node counts where it runs, so only that reading brings its rows in)."""
    layout = make_checkpoint(num_rows=3000, row_dim=16, dtype="bf16", shards=6, files=3)
    done = run_python(
        f"""
        import gc, json, sys
        import torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from helpers.dropped_tables import drain
        from prometheus_client import REGISTRY
        import ple_um
        table = ple_um.open_table({layout.directory!r}, mode="cpu", device="cpu")
        assert table.watch is not None and not table.metrics.host_counted
        for n in (1, 17, 300, 5000):
            table.lookup(torch.arange(-5, n - 5) % 3100 - 50)  # ids outside the table, both sides
        stats = table.stats()
        del table
        gc.collect()
        assert drain(60)
        names = {{spec.key: spec.name for spec in ple_um.metrics.METRICS}}
        got = {{k: REGISTRY.get_sample_value(names[k], {{"mode": "cpu"}}) for k in {COUNTED!r}}}
        print(json.dumps({{"stats": {{k: stats[k] for k in {COUNTED!r}}}, "counters": got}}))
        """,
        PLE_UM_METRICS_SEC="3600",
        PLE_UM_ROWCOPY="1",
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert stats["lookups"] == 4 and stats["rows"] == 5318 and stats["out_of_range"] > 0, stats
    assert result["counters"] == {key: float(stats[key]) for key in COUNTED}, result


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
    monkeypatch.setattr(counters_module, "_warned", set())  # as in a fresh process: nothing warned yet
    feed = metrics.LookupMetrics("cpu")
    with caplog.at_level(logging.WARNING, logger="ple_um.metrics"):
        for _ in range(3):
            feed.observe(-5, 10, 0, {"gather": "not a number"})  # a negative inc raises in the client
            feed.absorb({"rows": "many"})
        feed.registration(float("nan"))
    warnings = [r.getMessage() for r in caplog.records if r.name == "ple_um.metrics"]
    assert sum("observe failed" in w for w in warnings) == 1, warnings  # logged, once per kind of failure
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        out = table.lookup(torch.arange(layout.num_rows))
        feed.observe(-1, -1, -1, {"gather": -1.0})
        assert out.shape == (layout.num_rows, layout.row_dim)


@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_packed_lookups_reach_the_counters(make_checkpoint, monkeypatch, rowcopy, clock):
    """NVFP4's lookup_packed counts its rows and bytes (rows and block scales) in stats() and in
    Prometheus on both host paths."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    layout = make_checkpoint(num_rows=300, row_dim=64, dtype="nvfp4", shards=3)
    reporter = metrics.StatsReporter(30, emit=lambda line: None, clock=clock)
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


def test_prometheus_off_by_knob_and_alias(run_python):
    code = """
        from prometheus_client import generate_latest
        from ple_um import metrics
        feed = metrics.LookupMetrics("cpu")
        feed.observe(10, 1600, 0, {"gather": 0.1})
        assert metrics.prometheus() is None
        assert b"ple_um" not in generate_latest() and b"ple_mmap" not in generate_latest()
    """
    run_python(code, PLE_UM_PROMETHEUS="0")
    run_python(code, VLLM_PLE_MMAP_PROMETHEUS="0")


def test_prometheus_client_missing_means_no_ops(run_python):
    run_python(
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


def test_created_lazily_on_first_use(run_python):
    run_python(
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


def test_multiprocess_mode_aggregates_processes(tmp_path, run_python):
    """Two engine-like processes write under PROMETHEUS_MULTIPROC_DIR; a collector sums them."""
    shared = tmp_path / "prom"
    shared.mkdir()
    worker = """
        from ple_um import metrics
        metrics.LookupMetrics("cpu").observe(100, 16000, 2, {"gather": 0.5})
        metrics.LookupMetrics("registered").absorb({"lookups": 3, "rows": 7, "bytes": 70, "out_of_range": 0})
    """
    for _ in range(2):
        run_python(worker, PROMETHEUS_MULTIPROC_DIR=str(shared))
    done = run_python(
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
