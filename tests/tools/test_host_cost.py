"""tools/host_cost.py: the host's cost of small lookups through the public API, on a real table,
with the package it imported and whether the open made a row cache named in the JSON."""

from __future__ import annotations

import json
import sys

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
