"""The bench's timing harness on the CPU clock: which contender is called with which id set, in
which order, how often; the summaries and the spread judged noisy. No times are asserted."""

from __future__ import annotations

import pytest
import torch

from ple_um.bench import report
from ple_um.bench.timing import NOISY_SPREAD, Timer, host_summary, noisy, spread, summary


def test_side_by_side_times_every_path_once_per_fresh_id_set_in_rotated_rounds():
    """The bench's timing harness on the CPU clock: each path gets ``calls`` timed calls, each on
    its own fresh id set (index >= warmup, once), in rounds whose path order rotates; warm-up
    calls use only the warm-up sets."""
    log: list[tuple[str, int]] = []
    fns = {name: (lambda k, name=name: log.append((name, k))) for name in ("a", "b", "c")}
    times = Timer(torch.device("cpu")).side_by_side(fns, calls=10, warmup=2, rounds=4)
    assert {name: len(t) for name, t in times.items()} == {"a": 10, "b": 10, "c": 10}
    assert all(t >= 0 for ts in times.values() for t in ts)
    for name in fns:
        timed = [k for n, k in log if n == name and k >= 2]
        assert timed == list(range(2, 12))  # every fresh set once, in order
        assert {k for n, k in log if n == name and k < 2} <= {0, 1}
    # Rounds of 3, 3, 2, 2 timed calls; round r starts with path r % 3.
    firsts, seen = [], 2
    for block in (3, 3, 2, 2):
        firsts.append(next(n for n, k in log if k == seen))
        seen += block
    assert firsts == ["a", "b", "c", "a"]


def test_side_by_side_without_warm_up_calls_each_set_once():
    """warmup=0: no untimed calls, so no timed call's ids were read just before it (the GPU's L2
    would hold its rows)."""
    log: list[tuple[str, int]] = []
    fns = {name: (lambda k, name=name: log.append((name, k))) for name in ("a", "b")}
    Timer(torch.device("cpu")).side_by_side(fns, calls=6, warmup=0, rounds=2)
    for name in fns:
        assert [k for n, k in log if n == name] == list(range(6))


def test_back_to_back_runs_each_burst_of_calls_in_rotated_rounds():
    log: list[tuple[str, int]] = []
    fns = {name: (lambda k, name=name: log.append((name, k))) for name in ("a", "b", "c")}
    per_call = Timer(torch.device("cpu")).back_to_back(fns, calls=30, rounds=4)
    assert {name: len(t) for name, t in per_call.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for ts in per_call.values() for t in ts)
    # A round per contender: 10 warm calls on the warm-up sets (120 .. 129), then the burst on the
    # round's own sets (r * 30 .. r * 30 + 29); round r starts with path r % 3.
    warm = list(range(120, 130))
    blocks = [log[i : i + 40] for i in range(0, len(log), 40)]
    assert len(log) == 3 * 4 * 40
    for index, blk in enumerate(blocks):
        r = index // 3
        assert len({n for n, _ in blk}) == 1
        assert [k for _, k in blk] == warm + list(range(r * 30, r * 30 + 30))
    order = [blk[0][0] for blk in blocks]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # Every timed call of a path on ids of its own, and as many sets as the runner draws.
    for name in "abc":
        timed = [k for n, k in log if n == name and k < 120]
        assert sorted(timed) == list(range(120))
    assert Timer.back_to_back_sets(30, 4) == 130


def test_summaries_carry_the_spread_and_noisy_is_p90_over_p10():
    times = [1e-6 * t for t in (10, 11, 12, 13, 14, 15, 16, 17, 18, 100)]
    row = summary(times, 1000)
    assert row["p10_us"] < row["median_us"] < row["p90_us"]
    assert row["gbps"] == 1000 / (row["median_us"] * 1e-6) / 1e9
    assert row["calls"] == 10 and row["times_us"] == pytest.approx([t * 1e6 for t in times])
    assert row["noisy"] is True  # p90 26.2, p10 10.9: the mark the report prints, in the JSON too
    host = host_summary([2e-6, 3e-6, 4e-6], 300)
    assert (host["p10_us"], host["median_us"], host["p90_us"]) == (2.2, 3.0, 3.8)
    assert host["rounds_us"] == [2.0, 3.0, 4.0] and host["calls"] == 300 and host["noisy"] is False
    assert NOISY_SPREAD == 2
    assert not noisy({"p10_us": 10.0, "p90_us": 20.0})
    assert noisy({"p10_us": 10.0, "p90_us": 20.1})
    assert not noisy({"median_us": 5.0})


def test_a_single_time_has_no_spread_and_is_neither_noisy_nor_not():
    """One timed call (--repeats 1) or one round of the host burst (--rounds 1): no spread to judge,
    ``noisy`` None in the JSON, and the report says so instead of printing [x-x]."""
    row = summary([5e-6], 1000)
    assert row["noisy"] is None and row["calls"] == 1
    assert row["p10_us"] == row["median_us"] == row["p90_us"] == pytest.approx(5.0)
    host = host_summary([7e-6], 300)
    assert host["noisy"] is None and host["rounds_us"] == [7.0]
    assert summary([5e-6, 5e-6], 1000)["noisy"] is False  # two equal times: a spread, and tight
    assert report.cell(row, rate=False) == "5.0 [1 sample]"
    assert report.cell(host | {"vs_torch": 1.4}, rate=False) == "7.0 [1 sample] (1.40x)"
    assert report.step_cell(spread([2e-3])) == "2.00 [1 sample]"
    assert report.cell(summary([5e-6, 5e-6], 1000), rate=False) == "5.0 [5.0-5.0]"
