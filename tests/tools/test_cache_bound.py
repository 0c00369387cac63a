"""The bounds of ``tools/cache_bound.py`` and the row probabilities of the bench's zipf ids they
start from, on small tables: against sums written out, Python loops, the reference simulations of
``cache_sim`` and draws."""

from __future__ import annotations

import cache_bound
import cache_sim
import numpy as np
import pytest

from ple_um.bench.ids import HASH_MULTIPLIER, parse_ids


def test_best_hits_is_the_sum_of_the_largest_probabilities(rng):
    """Every K against a sum of the K largest found another way (a Python sort), the edges exact."""
    p = rng.dirichlet(np.full(300, 0.3))
    want = sorted(p.tolist(), reverse=True)
    ks = [0, 1, 2, 17, 150, 299, 300, 301, 10_000]
    got = cache_bound.best_hits(p, ks)
    for k, hits in zip(ks, got, strict=True):
        assert hits == pytest.approx(sum(want[:k]), abs=1e-12), k
    assert got[0] == 0.0 and got[6:] == [1.0, 1.0, 1.0]
    every = cache_bound.best_hits(p, range(302))
    assert np.all(np.diff(every) >= 0) and every[-1] == 1.0


def test_best_hits_refuses_what_is_not_a_distribution():
    for bad in ([0.5, 0.4], [1.2, -0.2], [np.nan, 1.0], []):
        with pytest.raises(ValueError, match="non-negative finite probabilities summing to 1"):
            cache_bound.best_hits(np.array(bad), [1])
    with pytest.raises(ValueError, match="capacities must be >= 0"):
        cache_bound.best_hits(np.array([0.5, 0.5]), [1, -1])
    with pytest.raises(ValueError, match="a batch of at least 1 row"):
        cache_bound.best_distinct_misses(np.array([0.5, 0.5]), [1], 0)
    with pytest.raises(ValueError, match="row_bytes and page_bytes > 0"):
        cache_bound.page_probabilities(np.array([1.0]), 0, 4096)


def test_best_hits_bounds_every_online_policy_on_iid_draws():
    """On a long i.i.d. draw from the probabilities, the best static set of the draw (``static``)
    serves best_hits' share within sampling noise, and no online policy serves more: at every
    lookup it holds some K rows chosen before the lookup is drawn. (Belady's MIN sees the future
    and may pass it.) Noise: 6 binomial standard deviations of n lookups."""
    (dist,) = parse_ids("zipf:1.1:5000")
    p = cache_bound.row_probabilities(dist, 1000)
    n = 200_000
    rows = dist.draw(np.random.default_rng(2), 1000, n)
    for k in (10, 50, 200):
        (best,) = cache_bound.best_hits(p, [k])
        noise = 6 * np.sqrt(best * (1 - best) / n)
        policies = ("static", "lru", "clock", "s3-fifo", "tinylfu")
        got = cache_sim.hit_rates(rows, k * cache_sim.ROW_BYTES, policies)
        assert abs(got.pop("static") - best) < noise, k
        for policy, rate in got.items():
            assert rate < best + noise, (policy, k)


def test_best_distinct_misses_is_the_expected_reads_of_a_lookup(rng):
    """The distinct rows outside the best cache: the formula by hand, one row a lookup (the misses
    themselves), and the mean over 20 000 drawn lookups within 6 standard errors."""
    p = rng.dirichlet(np.full(400, 0.5))
    top = np.argsort(p)[::-1]
    for k in (0, 5, 100, 400):
        outside = p[top[k:]]
        (got,) = cache_bound.best_distinct_misses(p, [k], 64)
        assert got == pytest.approx(float((1 - (1 - outside) ** 64).sum()), abs=1e-9)
        assert cache_bound.best_distinct_misses(p, [k], 1)[0] == pytest.approx(
            1 - cache_bound.best_hits(p, [k])[0]
        )
    held = np.zeros(400, dtype=bool)
    held[top[:100]] = True
    lookups = rng.choice(400, size=(20_000, 64), p=p)
    missed = np.array([np.unique(ids[~held[ids]]).size for ids in lookups])
    (want,) = cache_bound.best_distinct_misses(p, [100], 64)
    assert abs(missed.mean() - want) < 6 * missed.std() / np.sqrt(missed.size)


def test_page_probabilities_sum_the_rows_starting_in_each_page(rng):
    """Each page's mass is the rows whose first byte lies in it (a Python loop over the rows;
    row 25 of 160 bytes crosses into page 1 and counts in page 0); the best page cache of P pages
    serves at least the best P rows and at most the best 26 P (no page has more rows start in it),
    and it is exact when rows tile the page."""
    p = rng.dirichlet(np.full(1000, 0.4))
    pages = cache_bound.page_probabilities(p, 160, 4096)
    want = np.zeros(1000 * 160 // 4096 + 1)
    for r in range(1000):
        want[r * 160 // 4096] += p[r]
    np.testing.assert_allclose(pages, want, rtol=1e-12, atol=0)
    assert pages.sum() == pytest.approx(1.0) and pages[0] == pytest.approx(p[:26].sum())
    for count in (1, 3, 10, 39):
        page_best = cache_bound.best_hits(pages, [count])[0]
        row_best = cache_bound.best_hits(p, [count, 26 * count])
        assert row_best[0] <= page_best <= row_best[1] + 1e-12, count
    tiled = cache_bound.page_probabilities(p, 256, 4096)  # 16 rows a page, 8 in the last
    np.testing.assert_allclose(tiled[:62], p[:992].reshape(62, 16).sum(axis=1), rtol=1e-12)
    assert tiled.size == 63 and tiled[62] == pytest.approx(p[992:].sum(), rel=1e-12)


def test_pages_held_hits_counts_only_rows_wholly_in_the_pages_kept(rng):
    """The P most probable pages, and the rows whose first and last byte both lie in them (a Python
    loop over rows and page sets): at most the pages' upper bound, equal to it when rows tile the
    page, and 0 or the rows wholly inside for no page or every page."""
    for row_bytes, num_rows in ((160, 1000), (3000, 97), (256, 640)):
        p = rng.dirichlet(np.full(num_rows, 0.4))
        pages = cache_bound.page_probabilities(p, row_bytes, 4096)
        order = np.argsort(-pages, kind="stable")
        counts = [0, 1, 2, 5, pages.size // 2, pages.size]
        got = cache_bound.pages_held_hits(p, counts, row_bytes, 4096)
        upper = cache_bound.best_hits(pages, counts)
        for count, value, bound in zip(counts, got, upper, strict=True):
            kept = set(order[:count].tolist())
            want = sum(
                p[r]
                for r in range(num_rows)
                if r * row_bytes // 4096 in kept and (r * row_bytes + row_bytes - 1) // 4096 in kept
            )
            assert value == pytest.approx(want, abs=1e-12), (row_bytes, count)
            assert value <= bound + 1e-12
            if 4096 % row_bytes == 0:
                assert value == pytest.approx(bound, abs=1e-12)
        assert got[0] == 0.0
    with pytest.raises(ValueError, match="capacities must be >= 0"):
        cache_bound.pages_held_hits(p, [-1], 256, 4096)


def _rows_by_python(ranks: range, s: float, num_rows: int) -> np.ndarray:
    """Each row's sum of r^-s over ``ranks``, the hash done with Python's integers."""
    mass = np.zeros(num_rows)
    for r in ranks:
        h = (r * HASH_MULTIPLIER) % (1 << 64)
        mass[(h ^ (h >> 32)) % num_rows] += r**-s
    return mass


@pytest.mark.parametrize("ids,chunk", [("zipf:1.1:5000", 1 << 24), ("zipf:1.5:3000", 777), ("zipf:2:2", 1)])
def test_row_probabilities_hash_every_rank_of_a_small_space(ids, chunk):
    """Every rank hashed (the space within exact_ranks): the brute-force sum over the space,
    normalized, row by row; chunk boundaries included."""
    (dist,) = parse_ids(ids)
    got = cache_bound.row_probabilities(dist, 1000, chunk=chunk)
    want = _rows_by_python(range(1, dist.space + 1), dist.s, 1000)
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-12, atol=0)
    assert got.dtype == np.float64 and got.sum() == pytest.approx(1.0, abs=1e-12)
    assert cache_bound.tail_share(dist) == 0.0


def test_row_probabilities_spread_the_tail_evenly():
    """Ranks past exact_ranks: their exact mass (summed term by term here) spread over all rows;
    the midpoint integral off by under 1e-6. That approximation moves no more than tail_share of
    the mass from where it really falls, and so moves no best cache by more."""
    (dist,) = parse_ids("zipf:1.1:5000")
    head = _rows_by_python(range(1, 101), 1.1, 1000)
    tail = float((np.arange(101, 5001, dtype=np.float64) ** -1.1).sum())
    total = head.sum() + tail
    got = cache_bound.row_probabilities(dist, 1000, exact_ranks=100, chunk=33)
    np.testing.assert_allclose(got, (head + tail / 1000) / total, rtol=1e-6, atol=0)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)
    share = cache_bound.tail_share(dist, 100)
    assert share == pytest.approx(tail / total, rel=1e-6) and 0.3 < share < 0.35
    exact = cache_bound.row_probabilities(dist, 1000)
    assert 0.5 * np.abs(got - exact).sum() <= share
    ks = [1, 10, 100, 500]
    for approx, true in zip(cache_bound.best_hits(got, ks), cache_bound.best_hits(exact, ks), strict=True):
        assert abs(approx - true) <= share
    assert cache_bound.zipf_mass(1.1, 101, 5000) - tail == pytest.approx(1.1 / 24 * 100**-2.1, rel=0.1)


@pytest.mark.parametrize("ids,exact_ranks", [("zipf:1.1:5000", 1 << 30), ("zipf:1.5", 1 << 16)])
def test_row_probabilities_are_the_frequencies_of_the_draws(ids, exact_ranks):
    """2e6 draws of ``draw`` over 1000 rows: the 20 most probable rows within 6 binomial standard
    deviations, and the total variation within what sampling gives (its mean, from each row's
    binomial, plus 6 times a bound on its spread) plus the tail share spread evenly (zipf:1.5's
    2^40 n-grams past 2^16: 0.3% of the draws)."""
    (dist,) = parse_ids(ids)
    n = 2_000_000
    p = cache_bound.row_probabilities(dist, 1000, exact_ranks)
    freq = np.bincount(dist.draw(np.random.default_rng(1), 1000, n), minlength=1000) / n
    top = np.argsort(p)[::-1][:20]
    sigma = np.sqrt(p[top] * (1 - p[top]) / n)
    assert np.all(np.abs(freq[top] - p[top]) < 6 * sigma + cache_bound.tail_share(dist, exact_ranks) / 1000)
    mean_tv = 0.5 * np.sqrt(2 * p * (1 - p) / (np.pi * n)).sum()
    spread = 0.5 * np.sqrt((p * (1 - p)).sum() / n)
    tv = 0.5 * np.abs(freq - p).sum()
    assert tv < min(0.01, mean_tv + 6 * spread + cache_bound.tail_share(dist, exact_ranks))


def test_row_probabilities_refuse_ids_without_ranks():
    (uniform,) = parse_ids("uniform")
    with pytest.raises(ValueError, match="'uniform' has no n-gram ranks"):
        cache_bound.row_probabilities(uniform, 1000)
    with pytest.raises(ValueError, match="'uniform' has no n-gram ranks"):
        cache_bound.tail_share(uniform)
    (zipf,) = parse_ids("zipf:1.1:64")
    with pytest.raises(ValueError, match="need num_rows, exact_ranks and chunk >= 1, got 0, 1073741824, 16"):
        cache_bound.row_probabilities(zipf, 0, chunk=16)
