"""The bench's printed report and JSON from made-up results: the header (date, command, versions,
device, table), one line per contender, every cell's median with its p10-p90 spread and the noisy
mark, full rows for a skipped path, rates and ratios that never print as zero, and files written
whole or not at all."""

from __future__ import annotations

import json
import os
import re

import pytest

from ple_um.bench import report, runner


def _timing(median: float, p10: float | None = None, p90: float | None = None, gbps: float = 1.0) -> dict:
    return {
        "median_us": median,
        "p10_us": median if p10 is None else p10,
        "p90_us": median if p90 is None else p90,
        "gbps": gbps,
        "calls": 3,
    }


def _result() -> dict:
    ids = ("uniform", "zipf:1.1")
    return {
        "date": "2026-12-01 10:00:00 +0000",
        "command": "ple-um bench --rows 16",
        "host": "box",
        "device": "CPU (2 cores)",
        "versions": {"ple-um": "0.1.0", "torch": "2.14", "vllm": None},
        "table": {
            "bytes": 1 << 30,
            "row_bytes": 160,
            "shards": 8,
            "dtype": "F8_E4M3",
            "layer": 1,
            "directory": "/t",
        },
        "probe": {"mode": "cpu"},
        "ids": {d: {} for d in ids},
        "anchor": {"name": runner.ANCHOR, "memory": "host memory (no CUDA device)"},
        "kind": "side-by-side",
        "method": {
            "rows": [16],
            "host_overhead": {"calls": 300, "rows": 16},
            "decode_step": {"tokens": 8, "heads": 4},
        },
        "contenders": {
            runner.ANCHOR: "the anchor",
            "ple-um cpu": "ple-um's cpu mode",
            "seeds cpu": "the seeds",
        },
        "lookup": {
            runner.ANCHOR: {
                d: {"16": _timing(2.0), "host": {"median_us": 1.0, "p10_us": 0.9, "p90_us": 1.1}} for d in ids
            },
            "ple-um cpu": {
                d: {"16": _timing(200.0, 90.0, 300.0, gbps=1.2e-5), "host": {"median_us": 150.0}} for d in ids
            },
            "ple-um ats": {"skipped": "ModeUnavailableError: no ATS"},
        },
        "decode_step": {
            runner.ANCHOR: {
                "capture_safe": True,
                "uniform": {"eager": _timing(50.0)},
                "zipf:1.1": {"eager": _timing(40.0)},
            },
            "ple-um cpu": {
                "capture_safe": False,
                "uniform": {"eager": _timing(500.0)},
                "zipf:1.1": {"eager": _timing(40000.0, 10000.0, 50000.0)},
            },
        },
        "startup": {
            "warm": {
                "mode": "cpu",
                "open_s": 0.5,
                "gpu_bytes": 0,
                "anon_rss_added_bytes": 3 << 20,
                "pinned_bytes": 0,
            }
        },
        "processes": {"ple-um": {"skipped": "a ple-um process exited with 1"}},
    }


def test_the_header_says_when_where_with_what_and_how():
    lines = report.format_report(_result()).splitlines()
    assert lines[0] == "ple-um bench, 2026-12-01 10:00:00 +0000: ple-um bench --rows 16"
    assert lines[1] == "device: CPU (2 cores) on box; ple-um 0.1.0, torch 2.14, vllm not installed"
    assert lines[2] == "table: 1.00 GiB, 160 B rows, 8 shards (F8_E4M3, layer 1, /t); auto mode: cpu"
    assert lines[3:7] == [
        "paths:",
        f"  {runner.ANCHOR}: the anchor",
        "  ple-um cpu: ple-um's cpu mode",
        "  seeds cpu: the seeds",
    ]
    assert lines[7] == (
        "cells: median us [p10-p90, 'noisy' where p90/p10 > 2] (rows' bytes/s, x torch); x torch: the "
        f"median over `{runner.ANCHOR}`'s, over the table in host memory (no CUDA device) "
        "(below 1x: faster than it, above 1x: slower)"
    )
    # The decode step's shape as the run had it, not a figure of the report's own.
    assert "| decode step (8 tokens x 4 rows -> dequant -> proj), us |" in "\n".join(lines)


def test_cells_show_the_spread_rates_and_ratios():
    result = _result()
    runner.ratios(result)
    text = report.format_report(result)
    assert "lookups, uniform ids" in text and "lookups, zipf:1.1 ids" in text
    assert text.count("| path | 16 rows | host: us per call, 300 x 16 rows back to back |") == 2
    # p90/p10 = 3.3: noisy; a rate of 12 KB/s is not 0.00 GB/s.
    assert "| ple-um cpu | 200.0 [90.0-300.0 noisy] (11.72 KiB/s, 100.00x) | 150.0 (150.00x) |" in text
    assert f"| {runner.ANCHOR} | 2.0 [2.0-2.0] (953.67 MiB/s, 1.00x) | 1.0 [0.9-1.1] (1.00x) |" in text
    assert (
        f"| {runner.ANCHOR} | 50.0 [50.0-50.0] (1.00x) | no CUDA graphs on the CPU | "
        "40.0 [40.0-40.0] (1.00x) |" in text
    )
    assert "| ple-um cpu | 500.0 [500.0-500.0] (10.00x) | not capture-safe |" in text
    assert "40000.0 [10000.0-50000.0 noisy] (1000.00x)" in text
    assert not re.search(r"(?<![\d.])0\.00 ?(GB/s|x)", text)


def test_a_skipped_row_has_every_column():
    result = _result()
    result["method"]["rows"] = [16, 1024]
    text = report.format_report(result)
    head = next(line for line in text.splitlines() if line.startswith("| path |"))
    row = next(line for line in text.splitlines() if line.startswith("| ple-um ats |"))
    assert row == "| ple-um ats | skipped: ModeUnavailableError: no ATS | - | - |"
    assert row.count("|") == head.count("|")
    procs = next(line for line in text.splitlines() if line.startswith("| ple-um | skipped"))
    assert procs.count(
        "|"
    ) == "| processes opening the same table | mode | host memory taken after 1st, 2nd, ... |".count("|")


@pytest.mark.parametrize(
    "x,text", [(1.0, "1.00x"), (0.1, "0.10x"), (0.0036, "0.0036x"), (0.00012, "0.00012x"), (123.4, "123.40x")]
)
def test_ratios_never_print_as_zero(x, text):
    assert report.ratio(x) == text


def test_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "r.json"
    report.write_json({"a": 1}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}
    mode = os.stat(path).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
    with pytest.raises(TypeError):
        report.write_atomically(str(path), _fails)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file stands
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # no partial file


def _fails(tmp: str) -> None:
    with open(tmp, "w") as f:
        f.write("{half")
    raise TypeError("the writer failed half way")


def test_a_graph_replay_that_differs_from_the_eager_step_is_marked():
    """The bench checks that replays of each captured decode step equal the eager step
    (``graph_replay_equals_eager``); a replay that does not computes other rows, and its time is
    no figure of the lookup: the report says so beside it, as the JSON does."""
    result = _result()
    steps = result["decode_step"]
    for name, equal in ((runner.ANCHOR, True), ("ple-um cpu", False)):
        steps[name].update(capture_safe=True, graph_replay_equals_eager=equal)
        for dist in result["ids"]:
            steps[name][dist]["graph"] = _timing(30.0)
    text = report.format_report(result)
    assert f"| {runner.ANCHOR} | 50.0 [50.0-50.0] | 30.0 [30.0-30.0] |" in text
    wrong = "30.0 [30.0-30.0] (its replays differ from the eager step: graph_replay_equals_eager false)"
    assert f"| ple-um cpu | 500.0 [500.0-500.0] | {wrong} |" in text
    assert text.count(wrong) == 2
