"""How the bench times its contenders: side by side in rotated rounds, and back-to-back bursts for
the host's cost of an eager call; and the summaries of what it timed (median, p10, p90; the row
cache's hit rate over the timed calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

# Warm-up at the start of every block of timed calls: at least this long (and `warmup` calls).
SETTLE_S = 0.005
# The host-overhead figure: this many back-to-back eager calls of this many rows.
HOST_CALLS, HOST_ROWS = 300, 16
# A figure whose p90 is more than this many times its p10 is marked noisy: its median alone says
# little about a typical call.
NOISY_SPREAD = 2.0


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def once(self, fn: Callable[[int], object], k: int) -> float:
        """Seconds of one call fn(k), from an idle device to its work done."""
        if self.cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(k)
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        fn(k)
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def back_to_back(
        self, fns: dict[str, Callable[[int], object]], calls: int, rounds: int
    ) -> dict[str, list[float]]:
        """Wall seconds per call of ``calls`` back-to-back calls with no synchronisation between
        them and one at the end: what an eager caller pays per call, the host's launch work where
        the host is the slower side (the device's time where the device is). Once per round for
        each contender, in side_by_side's rotated order, each burst after a few warm calls. Every
        timed call has ids of its own: round r calls fn(r * calls + i); the warm calls reuse
        fn(rounds * calls + j), j < 10. So fn takes ``back_to_back_sets(calls, rounds)`` id sets."""
        names = list(fns)
        per_call: dict[str, list[float]] = {name: [] for name in names}
        rounds = max(1, rounds)
        for r in range(rounds):
            first = r % len(names)
            for name in names[first:] + names[:first]:
                fn = fns[name]
                for j in range(min(calls, 10)):
                    fn(rounds * calls + j)
                self.sync()
                t0 = time.perf_counter()
                for k in range(r * calls, (r + 1) * calls):
                    fn(k)
                self.sync()
                per_call[name].append((time.perf_counter() - t0) / calls)
        return per_call

    @staticmethod
    def back_to_back_sets(calls: int, rounds: int) -> int:
        """How many id sets ``back_to_back`` uses: one per timed call, and the warm calls'."""
        return max(1, rounds) * calls + min(calls, 10)

    def side_by_side(
        self, fns: dict[str, Callable[[int], object]], calls: int, warmup: int, rounds: int
    ) -> dict[str, list[float]]:
        """Seconds of ``calls`` timed calls fn(k) of each contender (k >= warmup: fresh ids), in
        ``rounds`` rounds: round r times a block of every contender's calls, contender after
        contender in an order rotated by r. Each block starts warm: ``warmup`` untimed calls
        (k < warmup, reused) and more until SETTLE_S has passed, so that the device and the host
        are back at speed after the other contenders' work (a GPU left idle through a long host
        gather answers its next launches slowly)."""
        names = list(fns)
        times: dict[str, list[float]] = {name: [] for name in names}
        rounds = max(1, min(rounds, calls))
        warm, k = max(warmup, 1), warmup
        for r in range(rounds):
            block = calls // rounds + (r < calls % rounds)
            first = r % len(names)
            for name in names[first:] + names[:first]:
                fn = fns[name]
                t0 = time.perf_counter()
                for w in range(100 * warm):
                    if w >= warm and time.perf_counter() - t0 >= SETTLE_S:
                        break
                    fn(w % warm)
                times[name] += [self.once(fn, k + j) for j in range(block)]
            k += block
        return times


def spread(times: list[float]) -> dict:
    """Median, p10 and p90 of ``times`` (seconds) in microseconds."""
    p10, median, p90 = np.quantile(times, [0.1, 0.5, 0.9]) * 1e6
    return {"median_us": median, "p10_us": p10, "p90_us": p90}


def summary(times: list[float], nbytes: int) -> dict:
    """``spread(times)``, the median's bytes per second and the number of calls."""
    row = spread(times)
    return {**row, "gbps": nbytes / (row["median_us"] * 1e-6) / 1e9, "calls": len(times)}


def host_summary(per_call: list[float], calls: int) -> dict:
    """The back-to-back figure: the median of the rounds' per-call times, with their p10 and p90."""
    rounds_us = [t * 1e6 for t in per_call]
    return {**spread(per_call), "rounds_us": rounds_us, "calls": calls, "rows": HOST_ROWS}


def row_cache_counts(stats: dict) -> tuple[int, int] | None:
    """The row cache's hits and misses in a table's ``stats()``, or None where it has none."""
    found = stats.get("row_cache")
    return (int(found["hits"]), int(found["misses"])) if found else None


def hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """hits / (hits + misses) between two readings of ``row_cache_counts`` (None: no cache, or no
    row asked of it)."""
    if before is None or after is None:
        return None
    hits, misses = after[0] - before[0], after[1] - before[1]
    return hits / (hits + misses) if hits + misses else None


def noisy(row: dict) -> bool:
    """Whether a summary's spread is too wide for its median to stand alone (p90/p10 > NOISY_SPREAD)."""
    low, high = row.get("p10_us"), row.get("p90_us")
    return low is not None and high is not None and high > NOISY_SPREAD * max(low, 1e-9)
