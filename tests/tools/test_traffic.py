"""The traffic figures on sequences whose answers are known, and the whole analysis on the
committed sample with a few budgets."""

from __future__ import annotations

import cache_sim
import numpy as np
import pytest
import traffic

from ple_um.bench.ids import hash_onto_rows, zipf_ngrams
from ple_um.bench.trace import read_trace, sample_path


def test_step_repeats_counts_ids_seen_earlier_in_the_same_step():
    steps = [np.array([1, 2, 3, 4]), np.array([5, 5, 5, 5]), np.array([1, 1, 2, 2])]
    r = traffic.step_repeats(steps)
    assert r["steps"] == 3
    assert r["mean"] == pytest.approx((0 + 0.75 + 0.5) / 3)
    assert r["p50"] == pytest.approx(0.5)


def test_hottest_share_ranks_rows_by_their_lookups():
    # row 9: 50 lookups, rows 0-49: one each (100 distinct would be needed for 1 %: rounds to 1 row)
    rows = np.concatenate([np.full(50, 9), np.arange(100, 150)])
    hot = traffic.hottest_share(rows, (0.01, 0.1, 0.6))
    assert hot["0.01"] == {"rows": 1, "share": 0.5}
    assert hot["0.1"] == {"rows": 5, "share": pytest.approx(54 / 100)}
    assert hot["0.6"] == {"rows": 31, "share": pytest.approx(80 / 100)}


def test_new_rows_share_is_the_first_lookups_from_a_position_on():
    rows = np.array([1, 2, 1, 3, 2, 4, 1, 5])
    assert traffic.new_rows_share(rows, 0) == pytest.approx(5 / 8)
    assert traffic.new_rows_share(rows, 4) == pytest.approx(2 / 4)  # 4 and 5 are new there


def test_zipf_rows_are_the_benchs_zipf_ids():
    got = traffic.zipf_rows(1.1, 5000, 12345, np.random.default_rng(4))
    want = hash_onto_rows(zipf_ngrams(np.random.default_rng(4), 1.1, 5000), 12345)
    np.testing.assert_array_equal(got, want)


def test_cache_curves_hold_both_counts_for_every_budget():
    rng = np.random.default_rng(2)
    rows = rng.zipf(1.2, 6000) % 3000
    curves = traffic.cache_curves(rows, (1600, 16000), ("lru", "belady"))
    half = rows.size // 2
    for b in (1600, 16000):
        assert (
            curves["cold"][str(b)] == cache_sim.cold_and_warm(rows, b, ("lru", "belady"), warmup=half)["cold"]
        )
        assert curves["warm"][str(b)] == cache_sim.hit_rates(rows, b, ("lru", "belady"), warmup=half)
    assert curves["new_rows_share"]["warm"] == traffic.new_rows_share(rows, half)


def test_analyse_the_sample():
    trace = read_trace(sample_path())
    r = traffic.analyse(
        trace, budgets=(1 << 20, 16 << 20), zipf_s=(1.05, 1.3), policies=("lru", "belady"), decode_steps=50
    )
    assert r["figures"] == trace.figures()
    assert set(r["hottest"]) == {"0.01", "0.1", "0.3", "0.6"}
    shares = [h["share"] for h in r["hottest"].values()]
    assert shares == sorted(shares) and 0 < shares[0] < shares[-1] <= 1
    assert r["hottest_curve"]["1"]["share"] == 1.0 and r["hottest_curve"]["0.1"] == r["hottest"]["0.1"]
    assert r["repeats"]["decode"]["steps"] == 50
    assert r["repeats"]["prefill"]["steps"] == trace.num_tokens // traffic.PREFILL_TOKENS
    assert set(r["zipf"]) == {"1.05", "1.3"}
    for z in r["zipf"].values():
        assert z["lru_difference"] == pytest.approx(traffic.closeness(r["caches"], z["lru"]))
    assert r["best_zipf"] == min(r["zipf"], key=lambda s: r["zipf"][s]["lru_difference"])
    # the more skewed law repeats more ids and hits more
    assert r["zipf"]["1.3"]["repeats"]["prefill"]["mean"] > r["zipf"]["1.05"]["repeats"]["prefill"]["mean"]
    assert (
        r["zipf"]["1.3"]["lru"]["warm"][str(1 << 20)]["lru"]
        > r["zipf"]["1.05"]["lru"]["warm"][str(1 << 20)]["lru"]
    )
