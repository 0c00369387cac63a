"""The host's cost of small lookups, with whichever ple_um is importable: two builds compared by
running this once with each on its PYTHONPATH (or from its source folder), alternately.

It uses nothing but the public API (``open_table``, ``MappedTable.lookup``), so any version of the
package runs it. Three figures, each the median of rounds with its p10 and p90:

- back to back: the wall time per call of 300 eager 16-row lookups with no sync between them
  (what an eager caller pays per call; fresh ids for every call);
- eager 1 024 rows: one lookup's wall time, synchronised; beside it the time until ``lookup``
  returned (its Python and queuing) and the host path's row copy's mean time a call;
- graph replay 1 024 rows (CUDA only): a lookup captured once, replayed with new ids copied into
  its input first.

    python tools/host_cost.py --dir TABLE --mode cpu --json-file out.json
    python tools/host_cost.py --compare new1.json new2.json --against old1.json old2.json

``--compare`` reads the JSON of runs of one build against those of another (the same table, mode and
device, taken alternately) and prints each figure's median over the runs of each build and their
ratio, marking a figure more than ``REGRESSION`` slower (``tools/gpu_run.sh regress`` takes them).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import ple_um

BACK_TO_BACK_ROWS, BACK_TO_BACK_CALLS = 16, 300
BIG_ROWS = 1024
# A figure this much slower than the other build's is marked a regression by --compare.
REGRESSION = 0.05


def quantiles(seconds: list[float]) -> dict:
    q = np.quantile(seconds, [0.1, 0.5, 0.9]) * 1e6
    return {
        "median_us": float(q[1]),
        "p10_us": float(q[0]),
        "p90_us": float(q[2]),
        "mean_us": float(np.mean(seconds) * 1e6),
        "samples": len(seconds),
    }


def row_copy_seconds(table) -> float:
    """The host path's row copy seconds so far (``stats()``' ``phase_seconds`` ``gather``, which
    every build of the package reports; after the device has finished the lookups queued)."""
    return table.stats()["phase_seconds"]["gather"]


def measure(table, device: torch.device, rounds: int, calls: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def fresh(n: int, count: int) -> list[torch.Tensor]:
        ids = torch.randint(0, table.num_rows, (count, n), generator=gen, dtype=torch.int64)
        return list(ids.to(device).unbind(0))

    result = {}
    per_call = []
    for _ in range(rounds):
        batches = fresh(BACK_TO_BACK_ROWS, BACK_TO_BACK_CALLS + 10)
        for ids in batches[:10]:
            table.lookup(ids)
        sync()
        t0 = time.perf_counter()
        for ids in batches[10:]:
            table.lookup(ids)
        sync()
        per_call.append((time.perf_counter() - t0) / BACK_TO_BACK_CALLS)
    result["back_to_back_16"] = quantiles(per_call)

    once, queued = [], []
    copied = row_copy_seconds(table)
    for ids in fresh(BIG_ROWS, calls + 5)[5:]:
        sync()
        t0 = time.perf_counter()
        table.lookup(ids)
        queued.append(time.perf_counter() - t0)
        sync()
        once.append(time.perf_counter() - t0)
    copied = row_copy_seconds(table) - copied
    result["eager_1024"] = quantiles(once)
    # Where its time goes: until lookup() returns (Python and the queuing of the work), and the
    # host path's row copy itself (a mean: the C code counts its seconds, not each call's).
    result["eager_1024"]["returned_median_us"] = float(np.median(queued) * 1e6)
    result["eager_1024"]["row_copy_mean_us"] = copied / len(once) * 1e6

    if device.type == "cuda" and table.capture_safe:
        batches = fresh(BIG_ROWS, calls + 1)
        ids_in = batches[0].clone()
        out = table.lookup(ids_in)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                table.lookup(ids_in, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(ids_in, out=out)
        replays = []
        for ids in batches[1:]:
            ids_in.copy_(ids)
            sync()
            t0 = time.perf_counter()
            graph.replay()
            sync()
            replays.append(time.perf_counter() - t0)
        result["graph_1024"] = quantiles(replays)
    return result


def compare(new_runs: list[dict], old_runs: list[dict]) -> dict:
    """Each figure both builds measured: the median over each build's runs of the runs' medians,
    and new / old. Refuses runs of different modes or devices (their figures are not comparable)."""
    runs = new_runs + old_runs
    if not new_runs or not old_runs:
        raise ValueError("--compare needs runs of both builds")
    for key in ("mode", "device"):
        if len({run[key] for run in runs}) != 1:
            raise ValueError(f"the runs differ in {key}: {sorted({run[key] for run in runs})}")
    found = {}
    for name in new_runs[0]["figures"]:
        if not all(name in run["figures"] for run in runs):
            continue
        new = float(np.median([run["figures"][name]["median_us"] for run in new_runs]))
        old = float(np.median([run["figures"][name]["median_us"] for run in old_runs]))
        found[name] = {
            "new_us": new,
            "old_us": old,
            "ratio": new / old,
            "regression": new > old * (1 + REGRESSION),
        }
    return {
        "mode": runs[0]["mode"],
        "device": runs[0]["device"],
        "runs": [len(new_runs), len(old_runs)],
        "figures": found,
    }


def print_comparison(found: dict) -> None:
    print(
        f"mode {found['mode']}, device {found['device']}, runs new/old {found['runs'][0]}/{found['runs'][1]}"
    )
    print("| figure | new us | old us | new / old |")
    print("| --- | --- | --- | --- |")
    for name, f in found["figures"].items():
        mark = f" (more than {REGRESSION:.0%} slower)" if f["regression"] else ""
        print(f"| {name} | {f['new_us']:.1f} | {f['old_us']:.1f} | {f['ratio']:.3f}{mark} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="the table's checkpoint directory")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="runs of one build (this script's JSON)")
    p.add_argument("--against", nargs="+", metavar="JSON", help="with --compare: runs of the other build")
    p.add_argument("--mode", default="cpu")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=7, help="back-to-back rounds")
    p.add_argument("--calls", type=int, default=200, help="timed single calls of each 1 024-row figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    if args.compare or args.against:
        if not (args.compare and args.against):
            p.error("--compare and --against go together")
        load = lambda paths: [json.load(open(path)) for path in paths]  # noqa: E731
        found = compare(load(args.compare), load(args.against))
        print_comparison(found)
        if args.json_file:
            with open(args.json_file, "w") as f:
                json.dump(found, f, indent=1)
        return 0
    if not args.dir:
        p.error("--dir is needed (or --compare)")
    device = torch.device(args.device)
    table = ple_um.open_table(args.dir, mode=args.mode, device=device)
    try:
        result = {
            "package": ple_um.__file__,
            "mode": args.mode,
            "device": str(device),
            "figures": measure(table, device, args.rounds, args.calls, args.seed),
        }
        # Whether the open made a row cache (a table not resident at open): its lookups then take
        # the row cache's path, not the mapping's, and the figures are not comparable.
        result["row_cache"] = table.stats().get("row_cache")
    finally:
        table.close()
    cache = result["row_cache"]
    print(f"ple_um from {result['package']}, mode {args.mode}, device {device}, ", end="")
    print(f"a row cache of {cache['bytes']} bytes" if cache else "no row cache")
    print("| figure | median us [p10-p90] |")
    print("| --- | --- |")
    for name, q in result["figures"].items():
        print(f"| {name} | {q['median_us']:.1f} [{q['p10_us']:.1f}-{q['p90_us']:.1f}] |")
    eager = result["figures"]["eager_1024"]
    print(
        f"eager_1024: lookup() returned after {eager['returned_median_us']:.1f} us (median); "
        f"the row copy took {eager['row_copy_mean_us']:.1f} us a call (mean)"
    )
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
