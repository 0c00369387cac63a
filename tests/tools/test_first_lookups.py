"""tools/first_lookups.py: the unbounded cache's hit rates at points of the bench's id stream,
against the same stream counted with a Python set, and its JSON and table."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.tools import load_tool

from ple_um.bench.ids import parse_ids


@pytest.fixture(scope="module")
def script():
    return load_tool("first_lookups")


def by_set(table_rows, ids, batch, at, window, seed):
    (dist,) = parse_ids(ids)
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    looked, rows, point = 0, [], 0
    served = counted = 0
    while point < len(at):
        drawn = dist.draw(rng, table_rows, batch).tolist()
        counting = looked >= at[point]
        if counting and counted == 0:
            start, distinct = looked, len(seen)
        for row in drawn:
            served += counting and row in seen
            seen.add(row)
        if counting:
            counted += batch
            if counted >= window:
                rows.append({"after_rows": start, "hit_rate": served / counted, "distinct_rows": distinct})
                served = counted = 0
                point += 1
        looked += batch
    return rows


@pytest.mark.parametrize("ids", ["zipf:1.1", "uniform"])
def test_hit_rates_equal_a_set_count(script, ids, tmp_path, capsys):
    out = tmp_path / "fl.json"
    args = ["--table-rows", "50000", "--ids", ids, "--batch", "64", "--at", "0,3000,20000"]
    assert script.main([*args, "--window", "640", "--seed", "7", "--json-file", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["at"] == by_set(50000, ids, 64, [0, 3000, 20000], 640, 7)
    assert got["at"][0]["hit_rate"] < got["at"][-1]["hit_rate"]  # the cache fills as rows repeat
    assert "| 20,032 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,says",
    [
        (["--batch", "0"], "must be at least 1"),
        (["--ids", "zipf:1.1,uniform"], "one distribution at a time"),
        (["--ids", "zipf:0.5"], "expected uniform or zipf:S"),
        (["--at", "1e6"], "--at '1e6'"),
    ],
)
def test_refuses_bad_arguments(script, args, says, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(args)
    assert exc.value.code == 2 and says in capsys.readouterr().err
