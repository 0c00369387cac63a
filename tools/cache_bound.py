"""The most any cache of a given size serves of a stream of row lookups drawn i.i.d. from fixed
probabilities (the independent reference model; the bench's ``zipf:S`` ids are such a stream,
``row_probabilities`` their probabilities), however long the stream runs.

What a cache holds before a lookup cannot depend on that lookup's row, so no cache that does not
know the future serves more than the sum of the K largest probabilities (``best_hits``). A static
cache of those K rows serves exactly that; the best demand cache (Aho, Denning and Ullman 1971,
policy A0), which must take in each miss, at most the largest missing probability less; Belady's
MIN, which knows the future, can pass it. A lookup's second miss of a row counts as a miss here (a
hit in ``cache_sim.seen_before``): no matter at 1 024-row lookups of millions of rows.
``page_probabilities`` and ``pages_held_hits`` bound the best page cache from above and below.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ple_um.bench.ids import IdDistribution, hash_onto_rows


def best_hits(probabilities: np.ndarray, capacities: Iterable[int]) -> list[float]:
    """For each capacity K, the most a cache of K rows serves when each lookup is row r with
    probability ``probabilities[r]`` (non-negative, summing to 1), i.i.d.: the sum of the K largest
    probabilities; 0 for K = 0, 1 for K at least the rows."""
    p = _probabilities(probabilities)
    total = float(p.sum())
    return [min(1.0, s / total) for s in _largest_sums(p, capacities, total)]


def best_distinct_misses(probabilities: np.ndarray, capacities: Iterable[int], batch: int) -> list[float]:
    """For each capacity K, the expected distinct rows a lookup of ``batch`` rows drawn i.i.d. from
    ``probabilities`` finds outside the best cache of K rows: the fewest reads its misses need (a
    row missed twice in one lookup is read once). A row r is in a lookup with probability
    ``1 - (1 - p_r)^batch``, which grows with p_r: the best cache keeps the rows it is largest for."""
    if batch < 1:
        raise ValueError(f"need a batch of at least 1 row, got {batch}")
    p = _probabilities(probabilities)
    with np.errstate(divide="ignore"):  # a row of probability 1: log1p(-1) = -inf, present = 1
        present = -np.expm1(batch * np.log1p(-np.minimum(p, 1.0)))
    total = float(present.sum())
    return [max(0.0, total - s) for s in _largest_sums(present, capacities, total)]


def page_probabilities(row_probabilities: np.ndarray, row_bytes: int, page_bytes: int) -> np.ndarray:
    """Each page's probability of being looked up, rows laid out in order from the start of page 0:
    the sum over the rows in it, row r counted in page ``r * row_bytes // page_bytes``. A row that
    crosses a page boundary is counted in its first page only, though a cache needs both pages to
    serve it, so ``best_hits`` of these is an upper bound on the best page cache (exact when
    ``page_bytes`` is a multiple of ``row_bytes``)."""
    if row_bytes <= 0 or page_bytes <= 0:
        raise ValueError(f"need row_bytes and page_bytes > 0, got {row_bytes}, {page_bytes}")
    p = np.asarray(row_probabilities, dtype=np.float64).reshape(-1)
    pages = np.arange(p.size, dtype=np.int64) * row_bytes // page_bytes
    return np.bincount(pages, weights=p, minlength=int(pages[-1]) + 1 if p.size else 0)


def pages_held_hits(
    row_probabilities: np.ndarray, capacities: Iterable[int], row_bytes: int, page_bytes: int
) -> list[float]:
    """For each capacity P, the hit rate a page cache holding the P most probable pages of
    ``page_probabilities`` reaches, counting only the rows whose every byte lies in those pages: a
    rate some cache of P pages does reach, so the best page cache's lies between this and
    ``best_hits`` of the page probabilities."""
    if row_bytes <= 0 or page_bytes <= 0:
        raise ValueError(f"need row_bytes and page_bytes > 0, got {row_bytes}, {page_bytes}")
    capacities = [int(k) for k in capacities]
    if any(k < 0 for k in capacities):
        raise ValueError(f"capacities must be >= 0, got {capacities}")
    p = _probabilities(row_probabilities)
    pages = page_probabilities(p, row_bytes, page_bytes)
    rank = np.empty(pages.size, dtype=np.int64)
    rank[np.argsort(-pages, kind="stable")] = np.arange(pages.size)
    start = np.arange(p.size, dtype=np.int64) * row_bytes
    first, last = start // page_bytes, (start + row_bytes - 1) // page_bytes
    # A row is held once both its first and its last page are: by the later of their ranks.
    needs = np.maximum(rank[first], rank[np.minimum(last, pages.size - 1)])
    needs[last >= pages.size] = pages.size  # its last page lies past the pages ranked: never held
    held = np.cumsum(np.bincount(needs, weights=p, minlength=pages.size + 1))
    return [0.0 if k == 0 else float(held[min(k, pages.size) - 1]) for k in capacities]


def _probabilities(probabilities: np.ndarray) -> np.ndarray:
    p = np.asarray(probabilities, dtype=np.float64).reshape(-1)
    if p.size == 0 or not np.all(np.isfinite(p)) or p.min() < 0 or abs(p.sum() - 1.0) > 1e-6:
        raise ValueError("expected non-negative finite probabilities summing to 1")
    return p


def _largest_sums(values: np.ndarray, capacities: Iterable[int], total: float) -> list[float]:
    """The sum of the K largest ``values`` for each K (``total`` once K covers them all)."""
    capacities = [int(k) for k in capacities]
    if any(k < 0 for k in capacities):
        raise ValueError(f"capacities must be >= 0, got {capacities}")
    descending = np.cumsum(np.sort(values)[::-1])
    return [0.0 if k == 0 else total if k >= values.size else float(descending[k - 1]) for k in capacities]


def zipf_mass(s: float, a: int, b: int) -> float:
    """``sum_{r=a}^{b} r^-s`` (s > 1, 1 <= a <= b) by the midpoint integral
    ``int_{a-1/2}^{b+1/2} x^-s dx``: too many terms to add one by one. x^-s is convex, so the
    integral is a little more than the sum, by about ``s / 24 * a^(-s-1)`` (the midpoint rule's
    f''/24 a term): 2.3e-8 from a = 1000 on at s = 1.1, where the sum to 2^40 is 9.96.
    """
    return ((a - 0.5) ** (1 - s) - (b + 0.5) ** (1 - s)) / (s - 1)


def row_probabilities(
    dist: IdDistribution, num_rows: int, exact_ranks: int = 1 << 30, chunk: int = 1 << 24
) -> np.ndarray:
    """The probability that a draw of ``dist.draw(rng, num_rows, n)`` is each row (float64, sums to 1):
    rank r of ``[1, space]`` has probability ``r^-s / sum_{q<=space} q^-s`` (``zipf_ngrams``
    draws again past the space), and a row the sum over the ranks it hashes onto. A zipf
    distribution only (ValueError for the others).

    Ranks 1 to ``exact_ranks`` are hashed one by one, ``chunk`` at a time. The ranks past them
    (up to the space: 2^40 by default, too many to hash) carry the tail mass
    ``zipf_mass(s, exact_ranks + 1, space)``, spread evenly over all rows: their hashes scatter
    them over the table, each row getting the mass of many such ranks. That is the
    approximation (beside ``zipf_mass``'s own, near 1e-8), and ``tail_share(dist, exact_ranks)`` its
    size: it moves at most that share of the mass between rows, so a sum over a set of rows (a
    cache's hit rate) is off by at most the tail share, and so is the best such sum.

    Memory: two float64 arrays of ``num_rows``; time: about 30 s for 2^30 exact ranks.
    """
    s = _zipf_exponent(dist)
    if num_rows < 1 or exact_ranks < 1 or chunk < 1:
        raise ValueError(f"need num_rows, exact_ranks and chunk >= 1, got {num_rows}, {exact_ranks}, {chunk}")
    head_ranks = min(exact_ranks, dist.space)
    mass = np.zeros(num_rows)
    head = 0.0
    for lo in range(1, head_ranks + 1, chunk):
        ranks = np.arange(lo, min(lo + chunk, head_ranks + 1), dtype=np.int64)
        weights = ranks.astype(np.float64) ** -s
        head += float(weights.sum())
        mass += np.bincount(hash_onto_rows(ranks, num_rows), weights=weights, minlength=num_rows)
    tail = zipf_mass(s, head_ranks + 1, dist.space) if dist.space > head_ranks else 0.0
    mass /= head + tail
    mass += tail / (head + tail) / num_rows
    return mass


def tail_share(dist: IdDistribution, exact_ranks: int = 1 << 30) -> float:
    """The share of the draws that ``row_probabilities(dist, n, exact_ranks)`` spreads evenly over the
    rows: the ranks past ``exact_ranks`` (0 when the space holds no more)."""
    s = _zipf_exponent(dist)
    if exact_ranks >= dist.space:
        return 0.0
    first = min(1000, exact_ranks)  # added term by term, the rest by the midpoint integral
    total = float((np.arange(1, first + 1, dtype=np.float64) ** -s).sum()) + zipf_mass(
        s, first + 1, dist.space
    )
    return zipf_mass(s, exact_ranks + 1, dist.space) / total


def _zipf_exponent(dist: IdDistribution) -> float:
    if dist.s is None:
        raise ValueError(f"{dist.name!r} has no n-gram ranks: row probabilities are for zipf:S ids")
    return dist.s
