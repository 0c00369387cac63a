"""Reference simulations of a row cache in front of the PLE table: which share of a sequence of row
lookups a cache of a given byte budget serves, for several eviction and admission policies.

Pure Python and numpy, written to be read and checked, not to be fast. Every policy sees the same
sequence, one lookup at a time, and counts a hit when the looked-up row is in the cache at that
moment. A cache of ``budget`` bytes holds
``budget // row_bytes`` rows; the page cache holds ``budget // page_bytes`` pages of
``page_bytes // row_bytes`` rows each, rows laid out in row order (row r in page r // rows per page).
The cache starts empty, so a short sequence's misses include every row's first lookup.

Each simulator ``policy(keys, capacity, warmup)`` returns its hits over all the lookups and over
those from position ``warmup`` on. Two bounds hold for streams too long to simulate:

- ``seen_before``, the bound with limited traffic: an unbounded cache that starts empty, which
  misses only a row's first lookup.
- ``cache_bound.best_hits``, the bound with unbounded traffic: the most any cache of K rows serves
  when each lookup's row is drawn i.i.d. from fixed probabilities, as the bench's ``zipf:S`` ids are.

Policies (``POLICIES``):

- ``belady``: Belady's MIN, the optimal demand cache that may bypass: on a miss it keeps the rows
  whose next use comes soonest, and does not admit the row if that one's next use is the farthest.
  Knows the future: the bound no online policy passes at that size.
- ``static``: the best static set: the ``capacity`` rows most looked up over the whole sequence,
  loaded before it starts and never changed (no first-lookup misses: it counts them as hits).
- ``lru``: least recently used rows.
- ``lru-pages``: least recently used 4 KiB pages (what the OS page cache or a page-grained GPU
  cache does with the same bytes).
- ``clock``: CLOCK (second chance): a reference bit per row, the hand clears set bits and evicts
  the first row whose bit is clear.
- ``s3-fifo``: S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 % of the rows) that new rows
  enter, a main FIFO (90 %), a ghost FIFO of the keys evicted from the small one (as many keys as
  the main holds); a row found in the ghost enters the main directly, a small-FIFO row looked up
  more than once moves to the main when evicted, and the main reinserts rows with a non-zero
  frequency (2-bit, decremented on reinsertion).
- ``tinylfu``: W-TinyLFU (Einziger et al., 2017) in a simplified form: a window LRU (1 % of the
  rows) that new rows enter, and a main LRU (99 %) that a row evicted from the window enters only
  if it was looked up more often than the main's LRU victim. Frequencies are exact counts, halved
  every ``10 * capacity`` lookups (the aging of TinyLFU; a count-min sketch at its most accurate).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

import numpy as np

ROW_BYTES = 160
PAGE_BYTES = 4096
POLICIES = ("belady", "static", "lru", "lru-pages", "clock", "s3-fifo", "tinylfu")


def hit_rates(
    rows: np.ndarray,
    budget: int,
    policies: tuple[str, ...] = POLICIES,
    row_bytes: int = ROW_BYTES,
    page_bytes: int = PAGE_BYTES,
    warmup: int = 0,
) -> dict[str, float]:
    """The hit rate of each policy's cache of ``budget`` bytes over ``rows`` (a sequence of row
    ids, in lookup order): hits over lookups, both counted from position ``warmup`` on (the
    lookups before it only fill the cache)."""
    return cold_and_warm(rows, budget, policies, row_bytes, page_bytes, warmup)["warm"]


def cold_and_warm(
    rows: np.ndarray,
    budget: int,
    policies: tuple[str, ...] = POLICIES,
    row_bytes: int = ROW_BYTES,
    page_bytes: int = PAGE_BYTES,
    warmup: int = 0,
) -> dict[str, dict[str, float]]:
    """``hit_rates`` twice from one simulation of each policy: ``cold`` counts every lookup,
    ``warm`` those from ``warmup`` on."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: expected some of {', '.join(POLICIES)}")
    if budget < 0 or row_bytes <= 0 or page_bytes < row_bytes:
        raise ValueError(
            f"need budget >= 0 and page_bytes >= row_bytes > 0, got {budget}, {row_bytes}, {page_bytes}"
        )
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if not 0 <= warmup < rows.size:
        raise ValueError(f"warmup {warmup} leaves none of the {rows.size} lookups to count")
    capacity = budget // row_bytes
    out: dict[str, dict[str, float]] = {"cold": {}, "warm": {}}
    for policy in policies:
        if policy == "lru-pages":
            total, after = lru(rows // (page_bytes // row_bytes), budget // page_bytes, warmup)
        elif policy == "static":  # a static set is chosen for the lookups it is counted on
            total, after = static(rows, capacity, 0)[0], static(rows, capacity, warmup)[1]
        else:
            total, after = SIMULATORS[policy](rows, capacity, warmup)
        out["cold"][policy] = total / rows.size
        out["warm"][policy] = after / (rows.size - warmup)
    return out


def seen_before(lookups: Iterable[np.ndarray], num_rows: int) -> Iterator[int]:
    """For each lookup of ``lookups`` (arrays of row ids in ``[0, num_rows)``, in order), the rows an
    unbounded cache that starts empty serves: every row looked up before, in an earlier lookup or
    earlier in the same one. No cache that fills on demand serves more (each of them misses a row's
    first lookup), so a measured row cache's hits are read against it. One bit per row."""
    seen = np.zeros(num_rows, dtype=bool)
    for ids in lookups:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        first = np.unique(ids[~seen[ids]]).size
        seen[ids] = True
        yield ids.size - first


def next_uses(keys: np.ndarray) -> np.ndarray:
    """For each position, the position of the next lookup of the same key (len(keys) if none)."""
    n = keys.size
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    nxt = next_uses(keys).tolist()
    never = len(nxt)
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hits = base = 0
    for i, k in enumerate(keys.tolist()):
        if i == warmup:
            base = hits
        n = nxt[i]
        if k in cached:
            hits += 1
        elif n == never:
            continue  # never looked up again: bypass
        elif len(cached) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if cached.get(victim) == -far:
                    break
            if -far <= n:  # every cached row is needed sooner than this one: bypass
                heapq.heappush(heap, (far, victim))
                continue
            del cached[victim]
        if n == never:
            del cached[k]
            continue
        cached[k] = n
        heapq.heappush(heap, (-n, k))
        if len(heap) > 4 * capacity + 64:  # drop the stale entries
            heap = [(-v, key) for key, v in cached.items()]
            heapq.heapify(heap)
    return hits, hits - base


def static(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    _, counts = np.unique(keys[warmup:], return_counts=True)
    hits = int(np.sort(counts)[::-1][:capacity].sum())
    return hits, hits


def lru(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    cache: OrderedDict[int, None] = OrderedDict()
    touch, evict = cache.move_to_end, cache.popitem
    hits = base = 0
    for i, k in enumerate(keys.tolist()):
        if i == warmup:
            base = hits
        if k in cache:
            touch(k)
            hits += 1
        else:
            cache[k] = None
            if len(cache) > capacity:
                evict(last=False)
    return hits, hits - base


def clock(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    slot_of: dict[int, int] = {}
    held = [0] * capacity
    referenced = bytearray(capacity)
    hand = used = hits = base = 0
    for i, k in enumerate(keys.tolist()):
        if i == warmup:
            base = hits
        s = slot_of.get(k)
        if s is not None:
            referenced[s] = 1
            hits += 1
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            while referenced[hand]:
                referenced[hand] = 0
                hand = hand + 1 if hand + 1 < capacity else 0
            s = hand
            del slot_of[held[s]]
            hand = hand + 1 if hand + 1 < capacity else 0
        held[s] = k
        slot_of[k] = s
    return hits, hits - base


def s3_fifo(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    small_cap = max(1, capacity // 10)
    main_cap = capacity - small_cap
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}  # every cached key -> 0..3
    in_main: set[int] = set()
    hits = base = 0

    def evict_main() -> None:
        while main:
            t = main.popleft()
            f = freq[t]
            if f > 0:
                freq[t] = f - 1
                main.append(t)
            else:
                del freq[t]
                in_main.discard(t)
                return

    def evict_small() -> None:
        while small:
            t = small.popleft()
            if freq[t] > 1 and main_cap > 0:
                freq[t] = 0
                main.append(t)
                in_main.add(t)
                if len(main) > main_cap:
                    evict_main()
            else:
                del freq[t]
                ghost[t] = None
                if len(ghost) > max(main_cap, 1):
                    ghost.popitem(last=False)
                return

    for i, k in enumerate(keys.tolist()):
        if i == warmup:
            base = hits
        f = freq.get(k)
        if f is not None:
            hits += 1
            if f < 3:
                freq[k] = f + 1
            continue
        while len(small) + len(main) >= capacity:
            if len(small) >= small_cap or not main:
                evict_small()
            else:
                evict_main()
        freq[k] = 0
        if k in ghost and main_cap > 0:
            del ghost[k]
            main.append(k)
            in_main.add(k)
        else:
            small.append(k)
    return hits, hits - base


def tinylfu(keys: np.ndarray, capacity: int, warmup: int = 0) -> tuple[int, int]:
    if capacity <= 0:
        return 0, 0
    window_cap = max(1, capacity // 100)
    main_cap = capacity - window_cap
    window: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    counts: dict[int, int] = {}
    period, seen, hits, base = 10 * capacity, 0, 0, 0
    for i, k in enumerate(keys.tolist()):
        if i == warmup:
            base = hits
        counts[k] = counts.get(k, 0) + 1
        seen += 1
        if seen >= period:  # aging: halve every count, forget the zeros
            counts = {key: c >> 1 for key, c in counts.items() if c > 1}
            seen = 0
        if k in window:
            window.move_to_end(k)
            hits += 1
            continue
        if k in main:
            main.move_to_end(k)
            hits += 1
            continue
        window[k] = None
        if len(window) <= window_cap:
            continue
        candidate, _ = window.popitem(last=False)
        if len(main) < main_cap:
            main[candidate] = None
            continue
        victim = next(iter(main)) if main else None
        if victim is not None and counts.get(candidate, 0) > counts.get(victim, 0):
            del main[victim]
            main[candidate] = None
    return hits, hits - base


SIMULATORS = {
    "belady": belady,
    "static": static,
    "lru": lru,
    "clock": clock,
    "s3-fifo": s3_fifo,
    "tinylfu": tinylfu,
}
