"""The row-cache simulations against references written another way: an exhaustive search of
every admission and eviction choice (the optimum Belady must reach), list-based LRU and CLOCK, hand
traces for S3-FIFO and W-TinyLFU, and the properties every policy must have on random sequences."""

from __future__ import annotations

import functools

import cache_sim
import numpy as np
import pytest
from cache_sim import POLICIES, cold_and_warm, hit_rates


def optimum(keys: list[int], capacity: int) -> int:
    """The most hits any cache of ``capacity`` keys can have on ``keys``, by trying every choice:
    on a miss, bypass or admit (evicting any one cached key when full)."""

    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cached:
            return 1 + best(i + 1, cached)
        options = [best(i + 1, cached)]
        if len(cached) < capacity:
            options.append(best(i + 1, cached | {k}))
        else:
            options += [best(i + 1, (cached - {v}) | {k}) for v in cached]
        return max(options)

    return best(0, frozenset())


def lru_by_list(keys: list[int], capacity: int) -> int:
    order: list[int] = []  # most recent last
    hits = 0
    for k in keys:
        if k in order:
            hits += 1
            order.remove(k)
        elif len(order) == capacity:
            order.pop(0)
        order.append(k)
    return hits


def clock_by_list(keys: list[int], capacity: int) -> int:
    frames: list[list[int]] = []  # [key, referenced], in hand order
    hand = hits = 0
    for k in keys:
        for frame in frames:
            if frame[0] == k:
                frame[1] = 1
                hits += 1
                break
        else:
            if len(frames) < capacity:
                frames.append([k, 0])
                continue
            while frames[hand][1]:
                frames[hand][1] = 0
                hand = (hand + 1) % capacity
            frames[hand] = [k, 0]
            hand = (hand + 1) % capacity
    return hits


def random_keys(rng, n, distinct):
    """Skewed keys: a few hot ones and a tail."""
    return (rng.zipf(1.3, n) % distinct).astype(np.int64)


@pytest.mark.parametrize("seed", range(12))
def test_belady_reaches_the_optimum_of_an_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 5, 13)
    for capacity in (1, 2, 3):
        hits, _ = cache_sim.belady(keys, capacity)
        assert hits == optimum(keys.tolist(), capacity), (keys.tolist(), capacity)


@pytest.mark.parametrize("seed", range(6))
def test_lru_clock_and_static_against_references(seed):
    rng = np.random.default_rng(100 + seed)
    keys = random_keys(rng, 3000, 300)
    for capacity in (1, 7, 50, 299, 400):
        assert cache_sim.lru(keys, capacity)[0] == lru_by_list(keys.tolist(), capacity)
        assert cache_sim.clock(keys, capacity)[0] == clock_by_list(keys.tolist(), capacity)
        _, counts = np.unique(keys, return_counts=True)
        assert cache_sim.static(keys, capacity)[0] == sum(sorted(counts.tolist(), reverse=True)[:capacity])


def test_s3_fifo_on_a_hand_trace():
    """Capacity 3: a small FIFO of 1, a main of 2, a ghost of 2 keys; nothing is evicted before
    the cache is full."""
    keys = [1, 2, 3, 4, 1, 1, 5, 4, 4, 6, 4, 1]
    # 4 evicts 1 from the small FIFO into the ghost; 1 misses, evicts 2, and enters the main from
    # the ghost; 1 hits; 5 evicts 3; 4 hits twice; 6 moves 4 (looked up 3 times) into the main and
    # sends 5 to the ghost; 4 and 1 hit in the main. LRU has evicted 1 by then.
    assert cache_sim.s3_fifo(np.array(keys), 3) == (5, 5)
    assert lru_by_list(keys, 3) == 4
    assert cache_sim.s3_fifo(np.array(keys), 3, warmup=6) == (5, 4)
    # Then 7 sends 6 to the ghost, 6 comes back into the main (3 keys now), and 8 makes the main
    # evict: 1 (frequency 2) and 4 (1) are reinserted with one less, 6 (0) goes; 1 and 4 hit.
    assert cache_sim.s3_fifo(np.array(keys + [7, 6, 8, 1, 4]), 3) == (7, 7)
    # Capacity 1 (no main): every new key replaces the last.
    assert cache_sim.s3_fifo(np.array([1, 1, 2, 1, 1]), 1) == (2, 2)


def test_tinylfu_admits_only_what_is_looked_up_more_than_the_victim():
    """Capacity 100: a window of 1 and a main of 99. Keys 0-98 fill the main, each looked up twice;
    a stream of keys seen once never displaces them (each is dropped as it leaves the window, its
    count 1 against the victim's 2), while a key looked up four times replaces the main's LRU
    victim (count 3) when it leaves the window."""
    fill = np.repeat(np.arange(99), 2)
    once = np.arange(1000, 1050)
    keys = np.concatenate([fill, once, np.arange(99), [7777] * 4, [8888, 0, 7777]])
    hits, _ = cache_sim.tinylfu(keys, 100)
    # the fill's 99 second lookups (in the window), the 99 fill keys again (all in the main),
    # 7777's three in the window; 8888 pushes 7777 into the main in place of 0, so 0 misses and
    # 7777 hits.
    assert hits == 99 + 99 + 3 + 1
    assert cache_sim.lru(keys, 100)[0] < hits  # LRU lets the stream of single lookups through


@pytest.mark.parametrize("seed", range(4))
def test_every_policy_on_random_sequences(seed):
    """Hit rates lie in [0, 1]; Belady is the best demand row cache; LRU and Belady never lose hits as
    the budget grows; a budget that holds every row misses only first lookups; lru-pages is LRU on
    the rows' pages; warm counts equal the whole run's hits less those of its first part."""
    rng = np.random.default_rng(seed)
    rows = random_keys(rng, 4000, 2500) * 7 + rng.integers(0, 7, 4000)
    distinct = np.unique(rows).size
    previous = None
    for budget in (0, 160, 1600, 16000, 160_000, 400_000, 10**7):
        rates = hit_rates(rows, budget)
        assert set(rates) == set(POLICIES)
        assert all(0.0 <= r <= 1.0 for r in rates.values())
        for policy in ("lru", "clock", "s3-fifo", "tinylfu"):  # row caches (pages bring in neighbours)
            assert rates["belady"] >= rates[policy] - 1e-12, (budget, policy)
        if previous:
            assert rates["lru"] >= previous["lru"] and rates["belady"] >= previous["belady"]
        previous = rates
        pages = budget // 4096
        assert rates["lru-pages"] * rows.size == cache_sim.lru(rows // 25, pages)[0]
    every = 10**7 // 160
    assert every >= distinct
    for policy in ("belady", "lru", "clock", "s3-fifo", "tinylfu"):
        assert previous[policy] == pytest.approx(1 - distinct / rows.size), policy
    assert previous["static"] == 1.0
    warmup = 1500
    both = cold_and_warm(rows, 16000, warmup=warmup)
    for policy in ("belady", "lru", "clock", "s3-fifo", "tinylfu"):
        total, after = cache_sim.SIMULATORS[policy](rows, 100, warmup)
        assert both["cold"][policy] * rows.size == pytest.approx(total), policy
        assert both["warm"][policy] * (rows.size - warmup) == pytest.approx(after), policy
        if policy != "belady":  # an online policy's first part is the same run on the prefix
            assert total - after == cache_sim.SIMULATORS[policy](rows[:warmup], 100)[0], policy
    assert hit_rates(rows, 16000, warmup=warmup) == both["warm"]


def test_next_uses():
    np.testing.assert_array_equal(cache_sim.next_uses(np.array([3, 1, 3, 3, 1, 2])), [2, 4, 3, 6, 6, 6])


def test_hit_rates_refuses_bad_arguments():
    rows = np.arange(10)
    with pytest.raises(ValueError, match="unknown policies \\['fifo'\\]"):
        hit_rates(rows, 1000, ("lru", "fifo"))
    with pytest.raises(ValueError, match="need budget >= 0"):
        hit_rates(rows, -1)
    with pytest.raises(ValueError, match="page_bytes >= row_bytes"):
        hit_rates(rows, 1000, row_bytes=160, page_bytes=100)
    with pytest.raises(ValueError, match="warmup 10 leaves none of the 10 lookups"):
        hit_rates(rows, 1000, warmup=10)


def test_seen_before_is_every_repeat_and_the_bound_of_every_policy(rng):
    """The unbounded cache serves exactly the repeats (a Python set, lookup by lookup), and no
    policy of any size serves more of the same sequence."""
    num_rows = 500
    lookups = [rng.zipf(1.3, int(rng.integers(1, 40))) % num_rows for _ in range(60)]
    seen: set[int] = set()
    want = []
    for ids in lookups:
        hits = 0
        for row in ids.tolist():
            hits += row in seen
            seen.add(row)
        want.append(hits)
    assert list(cache_sim.seen_before(lookups, num_rows)) == want
    keys = np.concatenate(lookups)
    for policy in ("belady", "lru", "clock", "s3-fifo", "tinylfu"):
        for capacity in (1, 16, 10_000):
            assert cache_sim.SIMULATORS[policy](keys, capacity)[0] <= sum(want), (policy, capacity)
    assert cache_sim.SIMULATORS["belady"](keys, 10_000)[0] == sum(want)  # room for every row


# -- the bound with unbounded traffic (A0) ---------------------------------------------------------
