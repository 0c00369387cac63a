"""The profiler of several processes that serve one table under one memory limit: what each
process's own row cache costs and gives, against the page cache they share.

Each process of a run looks up the same table at once (the bench's steady state,
``ple_um.bench.cold.timed_runs``, in this script run with ``--child``: a warm-up, then the
timed calls, fresh ids of its own), all of them in one memory cgroup (``ple_um.bench.memlimit``).
Two runs per limit and process count, the table's pages dropped before each:
- ``row cache``: the tables opened as not fitting in memory (``PLE_UM_FIT=spills``, whatever their
  size; ``PLE_UM_ROW_CACHE`` auto by default: each process takes ``PLE_UM_ROW_CACHE_FRACTION`` of the
  room it sees at open, for itself);
- ``page cache``: ``PLE_UM_ROW_CACHE=0``, the rows kept only in the page cache the processes share.
Per run: each process's median lookup time and hit rates, its row cache's bytes, the group's peak,
and a process the limit's OOM killer ended. Prints a table and writes everything as JSON.

    python tools/profile_shared_table.py --dir TABLE --memory-limit 1GiB --processes 1,2 \\
        --ids zipf:1.1 --rows 1024 --out shared.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ple_um import units
from ple_um.bench.cold import drop_table_pages, open_with, table_files, timed_runs
from ple_um.bench.ids import parse_ids
from ple_um.bench.memlimit import MemoryLimit, child_main, find_hierarchy
from ple_um.checkpoint import read_layout
from ple_um.mapping import MappedShards

RUNS = {"row cache": {"PLE_UM_FIT": "spills"}, "page cache": {"PLE_UM_ROW_CACHE": "0"}}


def _run(request: dict, limit: MemoryLimit, processes: int, knobs: dict[str, str]) -> list[dict]:
    """``processes`` children at once in ``limit``'s group, each with a seed of its own: their
    figures, or ``{"failed": why}``."""
    env = {**os.environ, **knobs}
    children = []
    for k in range(processes):
        with tempfile.TemporaryFile("w+") as text:  # the request, read by the child from its start
            json.dump({**request, "seed": request["seed"] + 1000 * k}, text)
            text.seek(0)
            child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child"],
                stdin=text,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                preexec_fn=limit.preexec,
            )
        children.append(child)
    found = []
    for child in children:
        out, err = child.communicate()
        if child.returncode == 0:
            found.append(json.loads(out))
        elif child.returncode == -9:
            found.append({"failed": "killed (SIGKILL): the limit's OOM killer most likely"})
        else:
            tail = err.strip().splitlines()[-1:] or [""]
            found.append({"failed": f"exited with {child.returncode}: {tail[0]}"})
    return found


def _serve(request: dict) -> dict:
    """One process of a run (``--child``): the steady state only, in a table opened as the
    environment says. No page is dropped here (the other processes' would go too): the parent
    dropped them before it started the processes. ``window``: when the timed part ran (epoch
    seconds), to check that the processes overlapped."""
    import torch

    device = torch.device(request["device"])
    layout = read_layout(request["directory"], request["layer"])
    out: dict = {"pid": os.getpid(), "modes": {}}
    for mode in request["modes"]:
        rng = np.random.default_rng(request["seed"])
        try:
            with MappedShards(layout) as probe, open_with(layout, mode, device, {}) as table:
                graph = device.type == "cuda" and table.capture_safe
                entry: dict = {"timing": "graph replay" if graph else "eager", "row_reads": table.row_reads}
                started = time.time()
                timed_runs(table, layout, request, device, graph, probe, None, rng, entry, "steady")
                entry["window"] = [started, time.time()]
                cache = table.stats()["row_cache"]
                entry["row_cache_bytes"] = cache["bytes"] if cache else 0
        except Exception as exc:  # noqa: BLE001 - a mode this child cannot run is reported, not fatal
            entry = {"skipped": f"{type(exc).__name__}: {exc}"}
        out["modes"][mode] = entry
    return out


def _one(request, files, hierarchy, limit: int, processes: int, kept_in: str, knobs) -> dict | None:
    """One run: the table's pages dropped (charged anew to the group, from nothing), then
    ``processes`` children in one group of ``limit`` bytes. None where no group can be made."""
    drop_table_pages(files)
    name = f"ple-um-shared-{os.getpid()}-{limit}-{processes}-{kept_in.replace(' ', '-')}"
    with MemoryLimit.open(limit, name, hierarchy) as held:
        if not held.enforced:
            print(f"no memory limit can be made here: {held.why}", file=sys.stderr)
            return None
        print(
            f"{units.format_bytes(limit)}: {processes} processes, rows kept in the {kept_in}", file=sys.stderr
        )
        outs = _run(request, held, processes, knobs)
        peak = held.peak()
    return {
        "limit": limit,
        "processes": processes,
        "kept_in": kept_in,
        "knobs": knobs,
        "how": held.how,
        "peak_bytes": peak,
        "status": [out.get("status") for out in outs],
        "outs": outs,
    }


def _figures(out: dict, mode: str, dist: str, n: int) -> dict:
    """One process's figures for ``n`` rows of ``dist`` (``{"failed": why}`` where it gave none)."""
    if "failed" in out:
        return out
    entry = out["modes"][mode]
    if "skipped" in entry:
        return {"failed": entry["skipped"]}
    steady = entry[dist][str(n)]["steady"]
    return {
        "median_us": steady["median_us"],
        "p10_us": steady["p10_us"],
        "p90_us": steady["p90_us"],
        "page_cache_hits": steady["page_cache_hits"],
        "row_cache_hits": steady["row_cache_hits"],
        "row_cache_bytes": entry["row_cache_bytes"],
        "window": entry["window"],
        "warmup": entry["warmup"][dist],
    }


def _overlap(figures: list[dict]) -> float | None:
    """Seconds during which every process was in its timed part (None: fewer than two gave
    figures)."""
    windows = [f["window"] for f in figures if "window" in f]
    if len(windows) < 2:
        return None
    return max(0.0, min(w[1] for w in windows) - max(w[0] for w in windows))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def report(result: dict) -> str:
    lines = [
        f"table: {units.format_bytes(result['table_bytes'])}, {result['directory']}; mode {result['mode']}",
        "| limit | processes | kept in | rows | ids | median us per process [p10-p90] | "
        "page cache hits | row cache hits | row cache each | group peak | overlap s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        for (dist, n), procs in run["figures"].items():
            done = [f for f in procs if "failed" not in f]
            failed = [f["failed"] for f in procs if "failed" in f]
            times = "; ".join(f"{f['median_us']:.0f} [{f['p10_us']:.0f}-{f['p90_us']:.0f}]" for f in done)
            if failed:
                times += ("; " if times else "") + "; ".join(failed)
            page = "/".join(_pct(f["page_cache_hits"]) for f in done) or "-"
            row = "/".join(_pct(f["row_cache_hits"]) for f in done) or "-"
            each = "/".join(units.format_bytes(f["row_cache_bytes"]) for f in done) or "-"
            peak = units.format_bytes(run["peak_bytes"]) if run["peak_bytes"] else "-"
            overlap = _overlap(done)
            overlap = "-" if overlap is None else f"{overlap:.1f}"
            limit = units.format_bytes(run["limit"])
            lines.append(
                f"| {limit} | {run['processes']} | {run['kept_in']} | {n} | {dist} | {times} | {page} | "
                f"{row} | {each} | {peak} | {overlap} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--child"]:
        child_main(_serve)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the table's checkpoint directory")
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--memory-limit", required=True, help="limits, comma-separated (1GiB,2GiB)")
    p.add_argument("--processes", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument("--mode", default="cpu", choices=("cpu", "ats"))
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--ids", default="zipf:1.1", help="id distributions, as the bench's --ids")
    p.add_argument("--rows", default="1024", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of lookups before the timed calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    layout = read_layout(args.dir, args.layer)
    limits = [units.parse_size(x) for x in args.memory_limit.split(",")]
    counts = [int(x) for x in args.processes.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    dists = [dist.name for dist in parse_ids(args.ids)]  # the names the children file figures under
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    files = table_files(layout)
    request = {
        "directory": layout.directory,
        "layer": layout.layer,
        "modes": [args.mode],
        "device": args.device,
        "rows": rows,
        "ids": args.ids,
        "repeats": args.repeats,
        "warmup_s": args.warmup,
        "seed": args.seed,
    }
    hierarchy = find_hierarchy()
    result = {"directory": layout.directory, "table_bytes": layout.nbytes, "mode": args.mode, "runs": []}
    result["request"] = request
    for limit in limits:
        for processes in counts:
            for kept_in, knobs in RUNS.items():
                run = _one(request, files, hierarchy, limit, processes, kept_in, knobs)
                if run is None:
                    return 1
                outs = run.pop("outs")
                run["figures"] = {
                    (dist, n): [_figures(out, args.mode, dist, n) for out in outs]
                    for dist in dists
                    for n in rows
                }
                result["runs"].append(run)
    print(report(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(_jsonable(result), f, indent=1)
    return 0


def _jsonable(result: dict) -> dict:
    runs = []
    for run in result["runs"]:
        figures = {f"{dist} {n}": procs for (dist, n), procs in run["figures"].items()}
        runs.append({**run, "figures": figures})
    out = {**result, "runs": runs}
    for run in out["runs"]:
        for procs in run["figures"].values():
            for f in procs:
                for key, value in list(f.items()):
                    if isinstance(value, np.generic):
                        f[key] = value.item()
    return out


if __name__ == "__main__":
    sys.exit(main())
