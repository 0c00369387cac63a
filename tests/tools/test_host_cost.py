"""tools/host_cost.py: the host's cost of small lookups through the public API, on a real table,
with the package it imported and whether the open made a row cache named in the JSON."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.tools import load_tool

import ple_um


def test_host_cost_times_back_to_back_and_single_lookups(make_checkpoint, tmp_path, monkeypatch, capsys):
    script = load_tool("host_cost")
    layout = make_checkpoint(num_rows=20_000, row_dim=160, dtype="fp8", shards=4, files=2, seed=3)
    out = tmp_path / "host.json"
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    argv = ["host_cost.py", "--dir", str(layout.directory), "--device", "cpu", "--rounds", "2"]
    argv += ["--calls", "4", "--json-file", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert script.main() == 0
    found = json.loads(out.read_text())
    assert found["package"] == ple_um.__file__ and found["mode"] == "cpu" and found["row_cache"] is None
    figures = found["figures"]
    assert set(figures) == {"back_to_back_16", "eager_1024"}  # no CUDA: no graph replay
    assert figures["back_to_back_16"]["samples"] == 2 and figures["eager_1024"]["samples"] == 4
    for q in figures.values():
        assert 0 < q["p10_us"] <= q["median_us"] <= q["p90_us"]
    eager = figures["eager_1024"]
    # The row copy is part of each call and its figure a mean: at most the calls' mean wall time.
    assert 0 < eager["returned_median_us"] and 0 < eager["row_copy_mean_us"] <= eager["mean_us"]
    text = capsys.readouterr().out
    assert "no row cache" in text and "| back_to_back_16 |" in text and "| eager_1024 |" in text


def test_compare_puts_two_builds_runs_side_by_side(make_checkpoint, tmp_path, monkeypatch, capsys):
    """Runs of this build compared with themselves: every figure in both, ratios from the medians,
    and runs of another mode refused (their figures are not comparable)."""
    script = load_tool("host_cost")
    layout = make_checkpoint(num_rows=20_000, row_dim=160, dtype="fp8", shards=4, files=2, seed=4)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    runs = []
    for k in range(3):
        runs.append(tmp_path / f"run{k}.json")
        argv = ["--dir", str(layout.directory), "--device", "cpu", "--rounds", "2", "--calls", "4"]
        assert script.main([*argv, "--seed", str(k), "--json-file", str(runs[-1])]) == 0
    out = tmp_path / "compare.json"
    args = ["--compare", str(runs[0]), str(runs[1]), "--against", str(runs[2]), "--json-file", str(out)]
    assert script.main(args) == 0
    found = json.loads(out.read_text())
    loaded = [json.loads(path.read_text()) for path in runs]
    assert found["mode"] == "cpu" and found["runs"] == [2, 1]
    assert set(found["figures"]) == {"back_to_back_16", "eager_1024"}
    for name, f in found["figures"].items():
        new = sorted(run["figures"][name]["median_us"] for run in loaded[:2])
        assert f["new_us"] == (new[0] + new[1]) / 2  # the median of two runs
        assert f["old_us"] == loaded[2]["figures"][name]["median_us"]
        assert f["ratio"] == f["new_us"] / f["old_us"]
        assert f["regression"] == (f["ratio"] > 1 + script.REGRESSION)
    assert "| eager_1024 |" in capsys.readouterr().out
    other = json.loads(runs[2].read_text())
    other["mode"] = "registered"
    runs[2].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="differ in mode"):
        script.main(["--compare", str(runs[0]), "--against", str(runs[2])])
