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

Configurations, each timed on the same steps (``run``):
- ``no PLE``: the GPU work alone, what the step costs without any lookup;
- ``resident``: the lookups from the table copied into GPU memory (the ``device`` mode);
- each mode asked for (``cpu`` unless ``--modes`` says), the table served where it lies;
- ``<mode> under <limit>``: that mode in a child process in a memory cgroup of that size
  (``bench/memlimit.py``; its pages dropped before it opens the table), its GPU work the same
  number of matmuls as the parent's calibration chose;
- ``lookups alone, <mode>``: the step's lookups with no GPU work, once per id distribution.

Run as ``python -m ple_um.bench.serving``: a request as JSON on stdin, the figures as JSON on
stdout (the child under a limit, ``serve``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from ple_um.access.capabilities import on_device, resolve_device
from ple_um.bench.cold import drop_table_pages, table_files
from ple_um.bench.config import MATMUL_SIZE, POOL_STEPS, Config, bench_layout, child_request, open_ple_um
from ple_um.bench.ids import parse_ids
from ple_um.bench.memlimit import child_main, run_limited
from ple_um.bench.runner import run_header
from ple_um.bench.timing import capture, row_cache_hits, spread
from ple_um.checkpoint import read_layout
from ple_um.mapping import MappedShards
from ple_um.operating import resident_rows
from ple_um.units import format_bytes

# The CPU's stand-in for MATMUL_SIZE (the plumbing's tests): small enough to take well under a
# millisecond.
CPU_MATMUL_SIZE = 64
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
        self.size = size
        w = torch.randn((size, size), generator=gen) / size**0.5
        self.w = w.to(device=device, dtype=torch.bfloat16)
        self.x = [
            torch.randn((size, size), generator=gen).to(device=device, dtype=torch.bfloat16) for _ in "ab"
        ]

    def run(self, count: int) -> None:
        for i in range(count):
            torch.matmul(self.x[i % 2], self.w, out=self.x[(i + 1) % 2])


class ServingStep:
    """One step: ``matmuls`` matmuls of ``work`` on the current stream and, when ``table`` is given, its
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
    """A configuration's figure: the warm-up, then ``steps`` timed steps (median, p10, p90 and each
    step's in microseconds), the row cache's hit rate over them (None: no row cache), and ``resident``'s
    share of the next step's rows in the page cache, before it reads them (None where not asked)."""
    warm = warm_up(step, pool, warmup_s)
    stats = step.table.stats if step.table is not None else dict
    before = stats()
    times = time_steps(step, pool, steps)
    row = spread(times) | {"calls": len(times), "times_us": [t * 1e6 for t in times], "warmup": warm}
    row["row_cache_hits"] = row_cache_hits(before, stats())
    if resident is not None and step.inputs:
        # The next step's rows, drawn and not read yet: the rows a step has read are all there.
        ids = np.concatenate([pool.batches[name][0].cpu().numpy() for name in step.inputs])
        row["page_cache_hits"] = float(resident(ids).mean())
    if step.eager_why:
        row["eager"] = step.eager_why
    return row


NO_PLE, RESIDENT = "no PLE", "resident"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def calibrate(work: GpuWork, step_ms, device, log) -> dict:
    """Matmuls per step for each target: from the time of one matmul (eager, after a warm-up), then
    corrected once by the captured step's own median (``refine``)."""
    cuda = device.type == "cuda"
    for _ in range(3):
        work.run(10)
    pool = IdPool(None, 1, {}, POOL_STEPS, device, None)
    timed = time_steps(ServingStep(None, {}, 1, torch.uint8, work, 10, device), pool, 10)
    per = float(np.median(timed)) / 10
    counts = {}
    for ms in step_ms:
        count = matmuls_for(ms / 1e3, per)
        step = ServingStep(None, {}, 1, torch.uint8, work, count, device)
        measured = float(np.median(time_steps(step, pool, 5 if cuda else 3)))
        counts[f"{ms:g}"] = refine(count, ms / 1e3, measured)
        log(f"GPU work of {ms:g} ms: {counts[f'{ms:g}']} matmuls of {work.size}x{work.size} bf16")
    return {"matmul_size": work.size, "matmul_us": per * 1e6, "matmuls": counts}


def _configs(request: dict) -> list[tuple[str, str | None, bool]]:
    """(name, the mode its table opens in or None, whether its steps run the GPU work)."""
    found: list[tuple[str, str | None, bool]] = []
    if request.get("baselines"):
        found += [(NO_PLE, None, True), (RESIDENT, "device", True)]
    suffix = f" under {format_bytes(request['limit'])}" if request.get("limit") else ""
    for mode in request["modes"]:
        found.append((f"{mode}{suffix}", mode, True))
        if request.get("baselines"):
            found.append((f"lookups alone, {mode}", mode, False))
    return found


def _config(name, mode, with_work, layout, request, work, counts, probe, device, result, log) -> None:
    """One configuration at every step time (one figure without GPU work) and id distribution. One
    that cannot open is skipped; one whose timing fails keeps the figures it took and is marked
    failed, with why (``configs[name]["failed"]``): the run goes on with the others."""
    rng = np.random.default_rng(request["seed"])
    try:
        table = open_ple_um(layout, device, mode) if mode is not None else None
    except Exception as exc:  # noqa: BLE001 - a configuration this machine cannot run is reported
        result["configs"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
        log(f"{name}: skipped ({exc})")
        return
    entry = result["configs"][name] = {"mode": mode}
    try:
        if table is not None:
            entry.update(
                capture_safe=table.capture_safe, row_cache=table.stats().get("row_cache") is not None
            )
        sizes = request["lookups"] if table is not None else {}
        dtype = torch.bfloat16 if layout.is_nvfp4 else layout.dtype
        resident = (lambda ids: resident_rows(probe, ids)) if table is not None and mode != "device" else None
        for ms in (f"{float(ms):g}" for ms in request["step_ms"]) if with_work else [None]:
            matmuls = counts[ms] if with_work else 0
            for dist in parse_ids(request["ids"]):
                pool = IdPool(dist, layout.num_rows, sizes, POOL_STEPS, device, rng)
                step = ServingStep(table, sizes, layout.row_dim, dtype, work, matmuls, device)
                row = measure(step, pool, request["repeats"], request["warmup_s"], resident)
                where = result["steps"].setdefault(ms, {}) if with_work else result["lookups_alone"]
                where.setdefault(dist.name, {})[name] = row
                work_ms = f"{ms} ms" if with_work else "no GPU work"
                log(f"{name}, {work_ms}, {dist.name}: {row['median_us'] / 1e3:.2f} ms")
                del step, pool
    except Exception as exc:  # noqa: BLE001 - this configuration's failure, reported; not the run's
        entry["failed"] = f"{type(exc).__name__}: {exc}"
        log(f"{name}: failed ({entry['failed']})")
    finally:
        if table is not None:
            table.close()


def serve(request: dict, log: Callable[[str], None] = _say) -> dict:
    """Every configuration of ``request`` in this process: {"calibration", "configs", "steps":
    {ms: {dist: {config: figure}}}, "lookups_alone": {dist: {config: figure}}}."""
    device = torch.device(request["device"])
    layout = read_layout(request["directory"], request["layer"])
    with on_device(device):  # the events, streams and graphs of the steps: the device's
        size = MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE
        work = GpuWork(request.get("matmul_size") or size, device, request["seed"])
        out: dict = {"configs": {}, "steps": {}, "lookups_alone": {}}
        if request.get("matmuls"):
            out["calibration"] = {"matmul_size": work.size, "matmuls": request["matmuls"]}
        else:
            out["calibration"] = calibrate(work, request["step_ms"], device, log)
        counts = out["calibration"]["matmuls"]
        if request.get("limit"):  # a run under a limit grows its steady state from nothing
            drop_table_pages(table_files(layout))
        with MappedShards(layout) as probe:
            for name, mode, with_work in _configs(request):
                _config(name, mode, with_work, layout, request, work, counts, probe, device, out, log)
    del work
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(cfg: Config, log: Callable[[str], None] = print, hierarchy=None) -> dict:
    """The serving loop's figures: this process's configurations, then each of ``cfg.memory_limits``'
    in a child (``hierarchy``: as ``memlimit.run_limited``)."""
    device = resolve_device(cfg.device)
    layout = bench_layout(cfg)
    request = child_request(cfg, layout, device, cfg.modes or ("cpu",)) | {
        "step_ms": [float(ms) for ms in cfg.step_ms],
        "lookups": cfg.serving_lookups,
        "heads": cfg.heads,
        "baselines": True,
    }
    result = {**run_header(cfg, layout, device), "method": method(request, device)}
    log(f"table: {format_bytes(layout.nbytes)} in {layout.parts} shards ({layout.directory})")
    result.update(serve(request, log))
    # Each child runs the served modes alone, with the parent's matmul counts.
    cal = result["calibration"]
    child = request | {"baselines": False, "matmuls": cal["matmuls"], "matmul_size": cal["matmul_size"]}
    result["limits"] = run_limited(cfg.memory_limits, child, "ple_um.bench.serving", log, hierarchy)
    for entry in result["limits"].values():
        merge(result, entry)
    ratios(result)
    return result


def merge(result: dict, child: dict) -> None:
    """A child's configurations and figures moved into ``result`` (the child's entry keeps the
    limit's own fields: bytes, how, peak, or why it failed)."""
    result["configs"].update(child.pop("configs", {}))
    for ms, by_dist in child.pop("steps", {}).items():
        for dist, rows in by_dist.items():
            result["steps"].setdefault(ms, {}).setdefault(dist, {}).update(rows)
    for dist, rows in child.pop("lookups_alone", {}).items():
        result["lookups_alone"].setdefault(dist, {}).update(rows)
    child.pop("calibration", None)


def method(request: dict, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "step": "a chain of bf16 matmuls (the GPU work) on the step's stream; the step's lookups "
        "forked onto a side stream at its start and joined at its end",
        "lookups": {
            name: {"ids": n, "tokens": n // request["heads"], "rows_per_token": request["heads"]}
            for name, n in request["lookups"].items()
        },
        "timing": "the whole step captured in one CUDA graph, replays queued back to back, CUDA "
        "events around each"
        if cuda
        else "eager steps, perf_counter (no CUDA: plumbing only)",
        "ids": "fresh every step: a pool of id batches drawn ahead, each step's copied into the "
        "graph's static inputs before its replay",
        "timed_steps": request["repeats"],
        "warmup_s": request["warmup_s"],
        "step_ms": request["step_ms"],
    }


def ratios(result: dict) -> None:
    """Each figure's median over the same step's ``resident`` and ``no PLE`` medians, where those ran."""
    for by_dist in result["steps"].values():
        for rows in by_dist.values():
            for name, row in rows.items():
                for base, key in ((RESIDENT, "vs_resident"), (NO_PLE, "vs_no_ple")):
                    if base in rows and name != base:
                        row[key] = row["median_us"] / rows[base]["median_us"]


if __name__ == "__main__":
    child_main(serve)
