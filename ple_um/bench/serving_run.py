"""The serving loop's run (``ple-um bench --serving``): every configuration at every step time and
id distribution, and the same loop under each ``--memory-limit`` in a child process held to it.

Configurations, each timed on the same steps (``bench/serving.py``):
- ``no PLE``: the GPU work alone, what the step costs without any lookup;
- ``resident``: the lookups from the table copied into GPU memory (the ``device`` mode);
- each mode asked for (``cpu`` unless ``--modes`` says), the table served where it lies;
- ``<mode> under <limit>``: that mode in a child process in a memory cgroup of that size
  (``bench/memlimit.py``; its pages dropped before it opens the table), its GPU work the same
  number of matmuls as the parent's calibration chose;
- ``lookups alone, <mode>``: the step's lookups with no GPU work, once per id distribution.

Run as ``python -m ple_um.bench.serving_run``: a request as JSON on stdin, the figures as JSON on
stdout (the child under a limit).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

from ple_um.access.capabilities import resolve_device
from ple_um.bench import serving
from ple_um.bench.cold_child import drop_table_pages, table_files
from ple_um.bench.config import Config, bench_layout, child_request, open_ple_um
from ple_um.bench.ids import parse_ids
from ple_um.bench.memlimit import child_main, run_limited
from ple_um.bench.runner import run_header
from ple_um.checkpoint import read_layout
from ple_um.mapping import MappedShards
from ple_um.operating import resident_rows
from ple_um.units import format_bytes

NO_PLE, RESIDENT = "no PLE", "resident"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def lookup_sizes(request: dict) -> dict[str, int]:
    """The step's lookups: ids of a decode step and of a prefill chunk (none when 0 tokens)."""
    heads = request["heads"]
    sizes = {"decode": request["decode_tokens"] * heads, "prefill": request["prefill_tokens"] * heads}
    return {name: n for name, n in sizes.items() if n > 0}


def calibrate(work: serving.GpuWork, step_ms, device, log) -> dict:
    """Matmuls per step for each target: from the time of one matmul (eager, after a warm-up), then
    corrected once by the captured step's own median (``serving.refine``)."""
    cuda = device.type == "cuda"
    for _ in range(3):
        work.run(10)
    pool = serving.IdPool(None, 1, {}, serving.POOL_STEPS, device, None)
    timed = serving.time_steps(serving.ServingStep(None, {}, 1, torch.uint8, work, 10, device), pool, 10)
    per = float(np.median(timed)) / 10
    counts = {}
    for ms in step_ms:
        count = serving.matmuls_for(ms / 1e3, per)
        step = serving.ServingStep(None, {}, 1, torch.uint8, work, count, device)
        measured = float(np.median(serving.time_steps(step, pool, 5 if cuda else 3)))
        counts[f"{ms:g}"] = serving.refine(count, ms / 1e3, measured)
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
    """One configuration at every step time (one figure without GPU work) and id distribution."""
    rng = np.random.default_rng(request["seed"])
    try:
        table = open_ple_um(layout, device, mode) if mode is not None else None
    except Exception as exc:  # noqa: BLE001 - a configuration this machine cannot run is reported
        result["configs"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
        log(f"{name}: skipped ({exc})")
        return
    try:
        entry = result["configs"][name] = {"mode": mode}
        if table is not None:
            entry.update(
                capture_safe=table.capture_safe, row_cache=table.stats().get("row_cache") is not None
            )
        sizes = lookup_sizes(request) if table is not None else {}
        dtype = torch.bfloat16 if layout.is_nvfp4 else layout.dtype
        resident = (lambda ids: resident_rows(probe, ids)) if table is not None and mode != "device" else None
        for ms in (f"{float(ms):g}" for ms in request["step_ms"]) if with_work else [None]:
            matmuls = counts[ms] if with_work else 0
            for dist in parse_ids(request["ids"]):
                pool = serving.IdPool(dist, layout.num_rows, sizes, serving.POOL_STEPS, device, rng)
                step = serving.ServingStep(table, sizes, layout.row_dim, dtype, work, matmuls, device)
                row = serving.measure(step, pool, request["repeats"], request["warmup_s"], resident)
                where = result["steps"].setdefault(ms, {}) if with_work else result["lookups_alone"]
                where.setdefault(dist.name, {})[name] = row
                work_ms = f"{ms} ms" if with_work else "no GPU work"
                log(f"{name}, {work_ms}, {dist.name}: {row['median_us'] / 1e3:.2f} ms")
                del step, pool
    finally:
        if table is not None:
            table.close()


def serve(request: dict, log: Callable[[str], None] = _say) -> dict:
    """Every configuration of ``request`` in this process: {"calibration", "configs", "steps":
    {ms: {dist: {config: figure}}}, "lookups_alone": {dist: {config: figure}}}."""
    device = torch.device(request["device"])
    layout = read_layout(request["directory"], request["layer"])
    size = serving.MATMUL_SIZE if device.type == "cuda" else serving.CPU_MATMUL_SIZE
    work = serving.GpuWork(request.get("matmul_size") or size, device, request["seed"])
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
        "decode_tokens": cfg.decode_tokens,
        "prefill_tokens": cfg.prefill_tokens,
        "heads": cfg.heads,
        "baselines": True,
    }
    result = {**run_header(cfg, layout, device), "method": method(request, device)}
    log(f"table: {format_bytes(layout.nbytes)} in {layout.parts} shards ({layout.directory})")
    result.update(serve(request, log))
    # Each child runs the served modes alone, with the parent's matmul counts.
    cal = result["calibration"]
    child = request | {"baselines": False, "matmuls": cal["matmuls"], "matmul_size": cal["matmul_size"]}
    result["limits"] = run_limited(cfg.memory_limits, child, "ple_um.bench.serving_run", log, hierarchy)
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
    sizes = lookup_sizes(request)
    cuda = device.type == "cuda"
    return {
        "step": "a chain of bf16 matmuls (the GPU work) on the step's stream; the step's lookups "
        "forked onto a side stream at its start and joined at its end",
        "lookups": {
            name: {"ids": n, "tokens": n // request["heads"], "rows_per_token": request["heads"]}
            for name, n in sizes.items()
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
