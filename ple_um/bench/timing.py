"""The calls the bench times and how it times them: one lookup into an output allocated once, a
decode step eager and graph-replayed, and a GPU-mode table seen with its kernel for every batch
size; side by side in rotated rounds, and back-to-back bursts for the host's cost of an eager call;
and the summaries of what it timed (median, p10, p90; the row cache's hit rate over the timed
calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

import ple_um
from ple_um.checkpoint import ShardLayout

# Warm-up at the start of every block of timed calls: at least this long (and `warmup` calls).
SETTLE_S = 0.005
# The host-overhead figure's rows a call (its back-to-back calls: ``Config.host_calls``).
HOST_ROWS = 16
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
        gather answers its next launches slowly); none where ``warmup`` is 0, since any would
        read a set that is timed."""
        names = list(fns)
        times: dict[str, list[float]] = {name: [] for name in names}
        rounds = max(1, min(rounds, calls))
        k = warmup
        for r in range(rounds):
            block = calls // rounds + (r < calls % rounds)
            first = r % len(names)
            for name in names[first:] + names[:first]:
                fn = fns[name]
                t0 = time.perf_counter()
                for w in range(100 * warmup):
                    if w >= warmup and time.perf_counter() - t0 >= SETTLE_S:
                        break
                    fn(w % warmup)
                times[name] += [self.once(fn, k + j) for j in range(block)]
            k += block
        return times


def spread(times: list[float]) -> dict:
    """Median, p10 and p90 of ``times`` (seconds) in microseconds, and whether they are ``noisy``
    (the mark the report prints, in the JSON too): None for a single time, which has no spread to
    judge (its p10 and p90 are the time itself)."""
    p10, median, p90 = np.quantile(times, [0.1, 0.5, 0.9]) * 1e6
    row = {"median_us": median, "p10_us": p10, "p90_us": p90}
    return row | {"noisy": noisy(row) if len(times) > 1 else None}


def summary(times: list[float], nbytes: int) -> dict:
    """``spread(times)``, the median's bytes per second, the number of calls and every call's
    microseconds, in the order they ran."""
    row = spread(times)
    gbps = nbytes / (row["median_us"] * 1e-6) / 1e9
    return {**row, "gbps": gbps, "calls": len(times), "times_us": [t * 1e6 for t in times]}


def host_summary(per_call: list[float], calls: int) -> dict:
    """The back-to-back figure: the median of the rounds' per-call times, with their p10 and p90."""
    rounds_us = [t * 1e6 for t in per_call]
    return {**spread(per_call), "rounds_us": rounds_us, "calls": calls, "rows": HOST_ROWS}


def row_cache_hits(before: dict, after: dict) -> float | None:
    """The row cache's hits / (hits + misses) between two of a table's ``stats()`` (None: it has no
    row cache, or no row was asked of it)."""
    if not before.get("row_cache") or not after.get("row_cache"):
        return None
    hits, misses = (int(after["row_cache"][k]) - int(before["row_cache"][k]) for k in ("hits", "misses"))
    return hits / (hits + misses) if hits + misses else None


def noisy(row: dict) -> bool:
    """Whether a summary's spread is too wide for its median to stand alone (p90/p10 > NOISY_SPREAD)."""
    low, high = row.get("p10_us"), row.get("p90_us")
    return low is not None and high is not None and bool(high > NOISY_SPREAD * max(low, 1e-9))


class KernelOnly:
    """A GPU-mode table with the GPU kernel for every batch size: its bulk path switched off for
    the call. Shares the table (one mapping, one registration); closing it leaves the table open."""

    def __init__(self, table) -> None:
        self.table = table
        self.capture_safe = table.capture_safe

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        paths = self.table.paths
        saved, paths.bulk_rows = paths.bulk_rows, None
        try:
            return self.table.lookup(ids, out=out)
        finally:
            paths.bulk_rows = saved

    def close(self) -> None:
        pass


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run once on a side stream (its first-call work: compiles, allocations, buffers), then
    captured into a CUDA graph on the current device: (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def lookup_output(impl, layout: ShardLayout, n: int, device: torch.device) -> torch.Tensor:
    """Where ``impl`` looks ``n`` rows up to: the decoded rows of a block-scaled (NVFP4, MXFP8)
    table in bf16, else the raw rows, in the storage dtype for ple-um's tables and as bytes for a
    contender's."""
    if layout.has_block_scales:
        return torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device=device)
    out = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=device)
    return out.view(layout.dtype) if isinstance(impl, (ple_um.MappedTable, KernelOnly)) else out


def lookup_call(impl, ids, layout: ShardLayout, n: int, device: torch.device) -> Callable[[int], object]:
    """fn(k): one lookup of ``ids[k]`` (n ids) by ``impl`` into an output allocated here, once
    (``lookup_output``)."""
    out = lookup_output(impl, layout, n, device)
    return lambda k: impl.lookup(ids[k], out=out)


class DecodeStep:
    """ids [T, heads] -> lookup -> dequant -> short projection, with its own buffers:
    ``eager(ids)`` runs it, ``replay(ids)`` replays its CUDA graph. ``graph`` is None where the
    contender is not capture-safe (its ``capture_safe``, as the table reports it) or there is no
    CUDA; ``graph_ok``: replays of the ``check`` id sets equal the eager step."""

    def __init__(
        self, impl, layout: ShardLayout, device: torch.device, tokens: int, heads: int, check
    ) -> None:
        self.impl, self.layout, self.T, self.H = impl, layout, tokens, heads
        self.proj = torch.randn(layout.row_dim, 64, dtype=torch.bfloat16, device=device) / 16
        self.ids = torch.zeros((tokens * heads,), dtype=torch.int64, device=device)
        self.out = lookup_output(impl, layout, tokens * heads, device)
        self.scale = torch.tensor(layout.scale or 1.0, dtype=torch.float32, device=device)
        self.capture_safe = bool(getattr(impl, "capture_safe", False))
        self.graph = None
        self.graph_ok = False
        if device.type == "cuda" and self.capture_safe:
            self._capture(check)

    def _capture(self, check) -> None:
        self.ids.copy_(check[0])
        self.graph, self.y = capture(self.step)
        ok = True
        for ids in check:
            self.replay(ids)
            ok &= bool(torch.equal(self.y, self.step()))
        self.graph_ok = ok

    def step(self) -> torch.Tensor:
        self.impl.lookup(self.ids, out=self.out)
        rows = self.out  # NVFP4, MXFP8: the lookup decodes; else the raw rows, dequantized here
        if not self.layout.has_block_scales:
            rows = (rows.view(self.layout.dtype).float() * self.scale).to(torch.bfloat16)
        return (rows @ self.proj).view(self.T, self.H, -1).sum(1)

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        return self.step()

    def replay(self, ids: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.graph.replay()
