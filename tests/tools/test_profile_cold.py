"""tools/profile_cold.py's hits part: lookups of rows the row cache holds beside the same lookups
from the page cache, on a real table, every row served from the cache, the JSON and the table."""

from __future__ import annotations

import json
import sys

from helpers.tools import load_tool


def test_the_hits_part_times_the_row_cache_beside_the_page_cache(
    make_checkpoint, tmp_path, monkeypatch, capsys
):
    script = load_tool("profile_cold")
    layout = make_checkpoint(num_rows=50_000, row_dim=160, dtype="fp8", shards=8, files=2, seed=5)
    out = tmp_path / "hits.json"
    argv = ["profile_cold.py", "--dir", str(layout.directory), "--parts", "hits", "--hot", "3000"]
    argv += ["--cache", "8MiB", "--calls", "5", "--device", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert script.main() == 0
    found = json.loads(out.read_text())["hits"]
    assert (found["hot_rows"], found["cache_bytes"]) == (3000, 8 << 20)
    runs = {run["source"]: run for run in found["runs"]}
    assert set(runs) == {"row cache", "page cache"} and not any(run["graph"] for run in found["runs"])
    # 3 000 hot rows in 8 MiB of 160-byte rows (about 40 000 slots): after the fill every timed row
    # is a hit; the page cache's table has no row cache and copies from the mapping.
    assert runs["row cache"]["hit_rate"] == 1.0 and runs["page cache"]["hit_rate"] is None
    assert runs["page cache"]["row_reads"] != runs["row cache"]["row_reads"]
    for run in found["runs"]:
        assert 0 < run["p10_s"] <= run["median_s"] <= run["p90_s"]
        # The C row copy is part of each call, and its figure a mean: with one block of calls (5
        # asked for) it is at most the calls' mean wall time, whatever one slow call does to it.
        assert 0 < run["row_copy_s"] <= run["mean_s"]
        assert 0 <= run["read_wait_s"] <= run["row_copy_s"]
    # The two tables take turns in blocks: one ratio per kind of call, of the blocks' medians.
    (ratio,) = found["ratios"]
    assert not ratio["graph"] and 0 < ratio["p10"] <= ratio["median"] <= ratio["p90"]
    table = capsys.readouterr().out
    assert "| row cache | eager |" in table and "| page cache | eager |" in table and "100.00%" in table
    assert "| eager | " in table.split("per pair of blocks")[1]
