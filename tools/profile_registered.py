"""The `registered` mode's gather kernel alone, on the GPU's timeline: where a decode-sized lookup's
time goes when every row is read from host memory across PCIe.

Each figure is the GPU time of one lookup, from CUDA graphs of ``--graph-calls`` lookups on as many
id buffers (so no host work is inside), with fresh ids copied into the buffers before every replay
(the H200's L2 keeps host rows), the median of ``--replays`` replays with its p10 and p90. Every
replay's output is poisoned first and compared afterwards with the same rows looked up eagerly
(the device copy ``spread`` reads is itself made by eager lookups).

- ``spread``: the shipped kernel (``MappedTable.lookup``) against torch ``index_select`` from a copy
  of the table in device memory, on the same ids, drawn from windows of the table of growing span:
  consecutive rows, random rows within 64 KiB, 2 MiB, 64 MiB, 512 MiB, the whole table, and the
  bench's Zipf(1.1)-hashed ids. The rows read are the same in number; what grows with the span is
  the host memory the reads touch (the translations the GPU and the IOMMU make for it).
- ``shapes``: the kernel launched with other program shapes (rows per program x warps) on
  consecutive, 2 MiB-window, uniform and Zipf ids.

    python tools/profile_registered.py --dir TABLE --json-file registered.json

Needs a CUDA device that can register host memory, and a table that fits the pin budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Every lookup through the kernel, whatever its size: the kernel is what is measured.
os.environ.setdefault("PLE_UM_BULK_ROWS", "0")

import torch  # noqa: E402

import ple_um  # noqa: E402
from ple_um.bench.ids import parse_ids  # noqa: E402
from ple_um.kernels.gather import NUM_WARPS, ROWS_PER_PROGRAM, gather_rows  # noqa: E402

SPREAD_KINDS = ("sequential", "64KiB", "2MiB", "64MiB", "512MiB", "uniform", "zipf:1.1")
SHAPE_KINDS = ("sequential", "2MiB", "uniform", "zipf:1.1")
# (rows per program, warps): the shipped shape first.
SHAPES = (
    (ROWS_PER_PROGRAM, NUM_WARPS),
    *((1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 2), (16, 8), (32, 4)),
)
WINDOWS = {"64KiB": 64 << 10, "2MiB": 2 << 20, "64MiB": 64 << 20, "512MiB": 512 << 20}


def draw(kind: str, rng: np.random.Generator, num_rows: int, row_bytes: int, n: int) -> np.ndarray:
    """``n`` ids of one kind: ``sequential`` (consecutive rows from a random start), a window name
    of ``WINDOWS`` (random rows within a window of that many bytes at a random place), ``uniform``
    (over the table) or a bench id distribution (``zipf:1.1``)."""
    if kind == "uniform":
        return rng.integers(0, num_rows, n)
    if kind == "sequential":
        start = int(rng.integers(0, num_rows - n + 1))
        return np.arange(start, start + n)
    if kind in WINDOWS:
        span = min(num_rows, max(1, WINDOWS[kind] // row_bytes))
        start = int(rng.integers(0, num_rows - span + 1))
        return start + rng.integers(0, span, n)
    return parse_ids(kind)[0].draw(rng, num_rows, n)


def quantiles(us: list[float]) -> dict:
    q = np.quantile(us, [0.1, 0.5, 0.9])
    return {"median_us": float(q[1]), "p10_us": float(q[0]), "p90_us": float(q[2]), "samples": len(us)}


class Timer:
    """Replays of a graph of ``len(bufs)`` lookups, each with fresh ids of a kind; their outputs
    poisoned before and checked after against the table's own lookup."""

    def __init__(self, table, args, rng):
        self.table, self.args, self.rng = table, args, rng
        self.bufs = [
            torch.zeros(args.rows, dtype=torch.int64, device="cuda") for _ in range(args.graph_calls)
        ]
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def refill(self, kind: str) -> None:
        t = self.table
        for b in self.bufs:
            b.copy_(torch.from_numpy(draw(kind, self.rng, t.num_rows, t.layout.row_bytes, b.numel())))

    def capture(self, lookup, outs) -> torch.cuda.CUDAGraph:
        self.refill("uniform")
        for b, o in zip(self.bufs, outs, strict=True):
            lookup(b, o)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for b, o in zip(self.bufs, outs, strict=True):
                lookup(b, o)
        return graph

    def time(self, graph, outs, kind: str, reference) -> dict:
        us, exact = [], True
        for _ in range(self.args.replays):
            self.refill(kind)
            for o in outs:
                o.view(torch.uint8).fill_(0xA5)
            torch.cuda.synchronize()
            self.start.record()
            graph.replay()
            self.end.record()
            torch.cuda.synchronize()
            us.append(self.start.elapsed_time(self.end) * 1000 / len(self.bufs))
            exact &= all(
                torch.equal(o.view(torch.uint8), reference(b)) for b, o in zip(self.bufs, outs, strict=True)
            )
        return {**quantiles(us), "exact": bool(exact)}


def spread(table, timer: Timer) -> dict:
    """The shipped kernel against index_select from a device copy, by the ids' window."""
    layout, rows = table.layout, timer.args.rows
    copy = torch.empty((table.num_rows, layout.row_bytes), dtype=torch.uint8, device="cuda")
    step = 1 << 20
    for a in range(0, table.num_rows, step):
        ids = torch.arange(a, min(table.num_rows, a + step), device="cuda")
        copy[a : a + ids.numel()] = table.lookup(ids).view(torch.uint8)

    def reference(b):
        return copy[b]

    ours = [torch.empty((rows, layout.row_bytes), dtype=torch.uint8, device="cuda") for _ in timer.bufs]
    theirs = [torch.empty_like(o) for o in ours]
    g_ours = timer.capture(lambda b, o: table.lookup(b, out=o.view(layout.dtype)), ours)
    g_torch = timer.capture(lambda b, o: torch.index_select(copy, 0, b, out=o), theirs)
    found = {}
    for kind in SPREAD_KINDS:
        found[kind] = {
            "ple-um registered": timer.time(g_ours, ours, kind, reference),
            "torch index_select (device copy)": timer.time(g_torch, theirs, kind, reference),
        }
    return found


def shapes(table, timer: Timer) -> dict:
    """The kernel by program shape (the launch the table binds uses ROWS_PER_PROGRAM x NUM_WARPS)."""
    gpu, layout = table.paths.gpu, table.layout

    def reference(b):
        return table.lookup(b).view(torch.uint8)

    found = {}
    for r, w in SHAPES:
        shape = (timer.args.rows, layout.row_dim)
        outs = [torch.empty(shape, dtype=layout.dtype, device="cuda") for _ in timer.bufs]

        def launch(b, o, r=r, w=w):
            gather_rows(
                gpu.bases,
                b,
                o,
                gpu.counters,
                storage=layout.dtype,
                row_start=gpu.row_start,
                row_end=gpu.row_end,
                num_rows=layout.num_rows,
                rows_per_shard=layout.rows_per_shard,
                row_bytes=layout.row_bytes,
                base_align=gpu.base_align,
                rows_per_program=r,
                num_warps=w,
            )

        graph = timer.capture(launch, outs)
        found[f"{r}x{w}"] = {kind: timer.time(graph, outs, kind, reference) for kind in SHAPE_KINDS}
    return found


def cell(q: dict) -> str:
    return f"{q['median_us']:.1f} [{q['p10_us']:.1f}-{q['p90_us']:.1f}]" + ("" if q["exact"] else " WRONG")


def report(result: dict) -> list[str]:
    lines = [
        f"{result['rows']} rows a lookup; GPU time per lookup, us, median [p10-p90] of "
        f"{result['replays']} replays"
    ]
    if "spread" in result:
        names = list(next(iter(result["spread"].values())))
        lines += ["", "| ids | " + " | ".join(names) + " | ratio |", "|" + " --- |" * (len(names) + 2)]
        for kind, entry in result["spread"].items():
            ratio = entry[names[0]]["median_us"] / entry[names[1]]["median_us"]
            lines.append(f"| {kind} | " + " | ".join(cell(entry[n]) for n in names) + f" | {ratio:.2f}x |")
    if "shapes" in result:
        kinds = list(next(iter(result["shapes"].values())))
        lines += ["", "| rows x warps | " + " | ".join(kinds) + " |", "|" + " --- |" * (len(kinds) + 1)]
        for shape, entry in result["shapes"].items():
            lines.append(f"| {shape} | " + " | ".join(cell(entry[k]) for k in kinds) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the table's checkpoint folder")
    p.add_argument("--parts", default="spread,shapes", help="spread, shapes (default both)")
    p.add_argument("--rows", type=int, default=1024, help="ids a lookup (default 1024)")
    p.add_argument("--graph-calls", type=int, default=20, help="lookups a graph (default 20)")
    p.add_argument("--replays", type=int, default=30, help="replays a figure (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"spread", "shapes"}:
        p.error(f"--parts {args.parts!r}: expected spread, shapes")
    if not torch.cuda.is_available():
        print("profile_registered.py: needs a CUDA device (the registered mode's kernel)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    result = {"rows": args.rows, "replays": args.replays, "graph_calls": args.graph_calls, "table": args.dir}
    with ple_um.open_table(args.dir, mode="registered", device="cuda") as table:
        timer = Timer(table, args, rng)
        if "spread" in parts:
            result["spread"] = spread(table, timer)
        if "shapes" in parts:
            result["shapes"] = shapes(table, timer)
    print("\n".join(report(result)))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
