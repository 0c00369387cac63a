"""The serving loop (``ple-um bench --serving``): what a server's decode step sees of ple-um.

A step is a fixed amount of GPU work, a chain of bf16 matmuls calibrated to take ``--step-ms``
milliseconds, with the step's PLE lookups (a decode step's ``decode_tokens`` x ``heads`` rows and a
prefill chunk's ``prefill_tokens`` x ``heads``) forked onto a side stream at the step's start and
joined at its end, as an integration that looks rows up as soon as the step's ids exist would
(issue 43). The whole step is captured in one CUDA graph and replayed, as vLLM replays FULL graphs;
every step looks up fresh ids: a pool of id batches drawn ahead on the host, copied to the device,
and each step's batch copied into the graph's static inputs before its replay (``IdPool``).

Without CUDA the same step runs eagerly, one stream, timed with perf_counter: the plumbing's
tests run so on the CPU; the CLI refuses ``--serving`` there, since no figure of it would mean
what it says.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ple_um.bench.calls import capture
from ple_um.bench.timing import hit_rate, row_cache_counts, spread

# The square matmuls a step's GPU work is made of: bf16, this many rows and columns (about 0.2 ms
# each on an H200; a step of 5 ms is some 25 of them).
MATMUL_SIZE = 4096
# The CPU's stand-in (the plumbing's tests): small enough to take well under a millisecond.
CPU_MATMUL_SIZE = 64
# Steps each figure is timed over between two refills of the id pool (and one device sync).
POOL_STEPS = 32
# Steps of every warm-up at least, whatever its seconds.
MIN_WARMUP_STEPS = 10


def matmuls_for(target_s: float, per_matmul_s: float) -> int:
    """How many matmuls of ``per_matmul_s`` seconds each make a step of ``target_s`` (at least 1)."""
    if per_matmul_s <= 0:
        raise ValueError(f"a matmul must take some time, got {per_matmul_s} s")
    return max(1, round(target_s / per_matmul_s))


def refine(count: int, target_s: float, measured_s: float) -> int:
    """The matmul count corrected once: ``count`` matmuls took ``measured_s`` as a captured step (a
    replay runs them back to back, faster than the eager calls the first count came from)."""
    if measured_s <= 0:
        return count
    return max(1, round(count * target_s / measured_s))


class IdPool:
    """Fresh ids for every step: ``steps`` batches of each lookup's ids, drawn on the host from
    ``dist`` in one go and copied to the device (``batches[name]``: ``[steps, n]`` int64). ``load(k)``
    copies batch k of every lookup into the step's static inputs (stream-ordered, before the
    replay); ``refill()`` draws the next batches, once the steps that read the previous ones are
    done (the caller syncs first)."""

    def __init__(self, dist, num_rows: int, sizes: dict[str, int], steps: int, device, rng) -> None:
        self.dist, self.num_rows, self.sizes, self.steps = dist, num_rows, dict(sizes), steps
        self.device, self.rng = torch.device(device), rng
        self.batches = {
            name: torch.empty((steps, n), dtype=torch.int64, device=self.device)
            for name, n in self.sizes.items()
        }
        self.refill()

    def refill(self) -> None:
        for name, n in self.sizes.items():
            drawn = np.stack([self.dist.draw(self.rng, self.num_rows, n) for _ in range(self.steps)])
            self.batches[name].copy_(torch.from_numpy(drawn.astype(np.int64, copy=False)))

    def load(self, k: int, inputs: dict[str, torch.Tensor]) -> None:
        for name, ids in inputs.items():
            ids.copy_(self.batches[name][k], non_blocking=True)


class GpuWork:
    """The step's fixed GPU work: ``count`` bf16 matmuls of ``size`` x ``size``, chained (each
    reads the one before), into two buffers allocated once. The operand is scaled so that the
    chain's values stay finite."""

    def __init__(self, size: int, device, seed: int = 0) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.size, self.count = size, 0
        w = torch.randn((size, size), generator=gen) / size**0.5
        self.w = w.to(device=device, dtype=torch.bfloat16)
        self.x = [
            torch.randn((size, size), generator=gen).to(device=device, dtype=torch.bfloat16) for _ in "ab"
        ]

    def run(self, count: int | None = None) -> None:
        for i in range(self.count if count is None else count):
            torch.matmul(self.x[i % 2], self.w, out=self.x[(i + 1) % 2])


class ServingStep:
    """One step: ``work.count`` matmuls on the current stream and, when ``table`` is given, its
    lookups of ``sizes`` ids forked onto a side stream at the start and joined at the end (on the
    CPU: one after the other, eagerly). ``inputs`` and ``outputs``: the static ids and rows, by
    lookup. ``graph``: the captured step on CUDA (None where ``table`` is not capture-safe: then
    the step runs eagerly, and ``eager_why`` says so)."""

    def __init__(
        self, table, sizes: dict[str, int], row_dim: int, dtype, work: GpuWork, matmuls: int, device
    ):
        self.table, self.work, self.matmuls = table, work, matmuls
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        names = sizes if table is not None else {}
        self.inputs = {
            name: torch.zeros(n, dtype=torch.int64, device=self.device) for name, n in names.items()
        }
        self.outputs = {
            name: torch.empty((n, row_dim), dtype=dtype, device=self.device) for name, n in names.items()
        }
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.graph, self.eager_why = None, None
        if self.cuda:
            if table is None or getattr(table, "capture_safe", False):
                self.graph = capture(self.body)[0]
            else:
                self.eager_why = "the table's lookup is not capture-safe: the step runs eagerly"

    def _lookups(self) -> None:
        for name, ids in self.inputs.items():
            self.table.lookup(ids, out=self.outputs[name])

    def body(self) -> None:
        if self.side is None:
            self._lookups()
            self.work.run(self.matmuls)
            return
        main = torch.cuda.current_stream(self.device)
        if self.inputs:
            self.side.wait_stream(main)  # the fork: the lookups start with the step
            with torch.cuda.stream(self.side):
                self._lookups()
        self.work.run(self.matmuls)
        if self.inputs:
            main.wait_stream(self.side)  # the join: the step ends when its rows are there

    def go(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


def time_steps(step: ServingStep, pool: IdPool, steps: int) -> list[float]:
    """Seconds of ``steps`` steps, each on fresh ids from ``pool`` (refilled every ``pool.steps``):
    on CUDA the replays are queued back to back, as a server's decode loop queues them, each timed
    by the events around it; on the CPU each step by perf_counter."""
    times: list[float] = []
    while len(times) < steps:
        block = min(pool.steps, steps - len(times))
        if step.cuda:
            marks = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(block)
            ]
            for k, (start, end) in enumerate(marks):
                pool.load(k, step.inputs)
                start.record()
                step.go()
                end.record()
            torch.cuda.synchronize(step.device)
            times += [start.elapsed_time(end) / 1e3 for start, end in marks]
        else:
            for k in range(block):
                pool.load(k, step.inputs)
                t0 = time.perf_counter()
                step.go()
                times.append(time.perf_counter() - t0)
        pool.refill()
    return times


def warm_up(step: ServingStep, pool: IdPool, seconds: float) -> dict:
    """Steps on fresh ids for at least ``seconds`` (and MIN_WARMUP_STEPS): a table's row cache and
    the page cache fill as a server's would."""
    t0, done = time.perf_counter(), 0
    while done < MIN_WARMUP_STEPS or time.perf_counter() - t0 < seconds:
        done += len(time_steps(step, pool, pool.steps))
    return {"steps": done, "seconds": time.perf_counter() - t0}


def measure(step: ServingStep, pool: IdPool, steps: int, warmup_s: float, resident: Callable | None) -> dict:
    """A configuration's figure: the warm-up, then ``steps`` timed steps (median, p10, p90 in
    microseconds), the row cache's hit rate over them (None: no row cache), and ``resident``'s
    share of the last step's rows in the page cache (None where not asked)."""
    warm = warm_up(step, pool, warmup_s)
    counts = (lambda: row_cache_counts(step.table.stats())) if step.table is not None else (lambda: None)
    before = counts()
    times = time_steps(step, pool, steps)
    row = spread(times) | {"calls": len(times), "warmup": warm, "row_cache_hits": hit_rate(before, counts())}
    if resident is not None and step.inputs:
        ids = np.concatenate([t.cpu().numpy() for t in step.inputs.values()])
        row["page_cache_hits"] = float(resident(ids).mean())
    if step.eager_why:
        row["eager"] = step.eager_why
    return row
