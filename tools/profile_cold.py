"""The profiler of rows not in memory: how the host path's ways of reading misses and the row cache's
policies compare, on one table, in one run. (The user-facing figures are ``ple-um bench
--memory-limit``'s; this measures the choices behind its defaults.)

Parts (``--parts``, default readers and policies):
- ``readers``: cold lookups (every page of the table dropped before each call, fresh uniform ids)
  of 16, 1 024 and 16 384 rows in the cpu mode, eager and, on a GPU, replayed from a CUDA graph,
  for each way of reading misses (``PLE_UM_FILE_READS`` mmap, uring, threads; O_DIRECT or through
  the page cache; ``PLE_UM_READ_DEPTH``); beside them the storage's ceiling measured in the same run
  (``ple_um.bench.storage``) and each figure's ratio to it (rows / reads per second at depth 64).
- ``hits``: 1 024-id lookups of rows the row cache holds (``--hot`` rows, each looked up until it
  keeps them, in a cache of ``--cache`` bytes), beside the same lookups of the table with no row
  cache and every page in memory (the page cache's warm path), eager and, on a GPU, replayed from
  a CUDA graph, the rows as stored; fresh ids of the hot rows for each of ``--calls`` calls. Both
  tables are open at once and take turns in blocks of 40 calls (each after 40 untimed ones), so that
  the ratio of each pair of blocks' medians (row cache / page cache) is measured under the same
  state of the machine. Beside each median, the C row copy's own time per call (the host path's
  ``gather`` seconds, a mean over each block; the median of the blocks) and of it the wait for the
  reads of the few hot rows the cache did not keep (``file_read_seconds``).
- ``policies``: the row cache's hit rate under Zipf(1.1)-hashed ids and the real-traffic trace, at
  several budgets, for each policy of the C cache (``PLE_UM_ROW_CACHE_POLICY``), measured through
  the table's own lookups, beside the reference simulations of ``cache_sim`` (Belady's
  optimum, LRU rows, LRU 4 KiB pages: the page cache at the same bytes) on the same ids.

With ``--memory-limit`` the measurements run in a child process held to that many bytes by a memory
cgroup (``ple_um.bench.memlimit``), as a table larger than memory is served. Prints a table per part
and writes everything as JSON.

    python tools/profile_cold.py --dir TABLE --memory-limit 3GiB --out $OUT/profile_cold.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um import operating, units
from ple_um.bench.ids import parse_ids
from ple_um.bench.timing import capture
from ple_um.checkpoint import read_layout
from ple_um.residency import evict_pages

READERS = (
    ("mmap", {"PLE_UM_FILE_READS": "mmap", "PLE_UM_ROW_CACHE": "0"}),
    ("uring, O_DIRECT, depth 64", {"PLE_UM_FILE_READS": "uring", "PLE_UM_DIRECT_READS": "on"}),
    (
        "uring, O_DIRECT, depth 16",
        {"PLE_UM_FILE_READS": "uring", "PLE_UM_DIRECT_READS": "on", "PLE_UM_READ_DEPTH": "16"},
    ),
    (
        "uring, O_DIRECT, depth 128",
        {"PLE_UM_FILE_READS": "uring", "PLE_UM_DIRECT_READS": "on", "PLE_UM_READ_DEPTH": "128"},
    ),
    ("uring, page cache", {"PLE_UM_FILE_READS": "uring", "PLE_UM_DIRECT_READS": "off"}),
    ("threads, O_DIRECT, depth 64", {"PLE_UM_FILE_READS": "threads", "PLE_UM_DIRECT_READS": "on"}),
)
SIZES = (16, 1024, 16384)
# The hits part's blocks of timed calls per table, and the untimed calls before each.
HIT_BLOCK, HIT_BLOCK_WARM = 40, 40
POLICIES = ("tinylfu", "lru", "clock")
REFERENCES = ("belady", "lru", "lru-pages")


def say(text: str) -> None:
    """Progress, on stderr (the child's stdout carries its JSON)."""
    print(text, file=sys.stderr, flush=True)


def drop(table) -> None:
    """Every page of the table out of this process and the page cache."""
    for mapping in (table.mapping, table.scale_mapping):
        if mapping is None:
            continue
        evict_pages(mapping.layout.files, mapping.regions)


def with_knobs(knobs: dict[str, str]):
    """Set ``knobs`` (and clear the other cold-read knobs) for the next open."""
    for name in (
        "PLE_UM_FILE_READS",
        "PLE_UM_DIRECT_READS",
        "PLE_UM_READ_DEPTH",
        "PLE_UM_ROW_CACHE",
        "PLE_UM_ROW_CACHE_POLICY",
    ):
        os.environ.pop(name, None)
    os.environ.update(knobs)


class Lookup:
    """One batch size's lookup into buffers allocated once (of ``dtype``: bf16, dequantized, by
    default), eager or replayed from a graph."""

    def __init__(self, table, n: int, graph: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        self.table = table
        self.ids = torch.zeros(n, dtype=torch.int64, device=table.device)
        self.out = torch.empty((n, table.row_dim), dtype=dtype, device=table.device)
        self.graph = capture(lambda: table.lookup(self.ids, out=self.out))[0] if graph else None

    def time(self, ids: np.ndarray) -> float:
        self.ids.copy_(torch.from_numpy(ids))
        cuda = self.table.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.table.lookup(self.ids, out=self.out)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def readers(directory: str, device: str, reps: int, rng) -> dict:
    from ple_um.bench.storage import ceiling

    layout = read_layout(directory)
    found = {"ceiling": ceiling(layout.files), "runs": []}
    for name, knobs in READERS:
        with_knobs(knobs)
        with ple_um.open_table(directory, mode="cpu", device=device) as table:
            for graph in (False, True) if table.device.type == "cuda" else (False,):
                for n in SIZES:
                    call = Lookup(table, n, graph)
                    times = []
                    for _ in range(reps):
                        ids = rng.integers(0, layout.num_rows, n)
                        drop(table)
                        times.append(call.time(ids))
                    found["runs"].append(
                        {
                            "reads": name,
                            "knobs": knobs,
                            "row_reads": table.row_reads,
                            "graph": graph,
                            "rows": n,
                            "median_s": float(np.median(times)),
                            "p10_s": float(np.percentile(times, 10)),
                            "p90_s": float(np.percentile(times, 90)),
                        }
                    )
                    call_kind = "graph" if graph else "eager"
                    say(f"  {name:30s} {call_kind} {n:6d}: {np.median(times) * 1e3:8.2f} ms")
    return found


def hit_block(table, call: Lookup, hot_ids: np.ndarray, rng) -> tuple[list[float], float, float]:
    """One block of the hits part on ``table``: HIT_BLOCK_WARM untimed calls, then HIT_BLOCK timed
    ones of fresh hot ids. Returns their times, the row copy's mean seconds a call over them, and of
    those its mean wait for reads of misses."""
    for _ in range(HIT_BLOCK_WARM):
        call.time(rng.choice(hot_ids, 1024))
    at = table.stats()
    times = [call.time(rng.choice(hot_ids, 1024)) for _ in range(HIT_BLOCK)]
    now = table.stats()
    copied = now["phase_seconds"]["gather"] - at["phase_seconds"]["gather"]
    waited = now["file_read_seconds"] - at["file_read_seconds"]
    return times, copied / HIT_BLOCK, waited / HIT_BLOCK


def hits(directory: str, device: str, hot: int, cache: int, calls: int, rng) -> dict:
    layout = read_layout(directory)
    hot_ids = rng.choice(layout.num_rows, size=min(hot, layout.num_rows), replace=False)
    found = {"hot_rows": int(hot_ids.size), "cache_bytes": cache, "runs": [], "ratios": []}
    sources = (
        ("row cache", {"PLE_UM_ROW_CACHE": str(cache)}),
        ("page cache", {"PLE_UM_ROW_CACHE": "0"}),
    )
    with contextlib.ExitStack() as stack:
        tables = {}
        for source, knobs in sources:
            with_knobs(knobs)
            operating.prewarm(directory)  # every page in memory, read right before each table opens
            table = stack.enter_context(ple_um.open_table(directory, mode="cpu", device=device))
            tables[source] = table
            fill = torch.from_numpy(hot_ids).to(table.device)
            for _ in range(4 if source == "row cache" else 0):  # a row is kept once asked for again
                for k in range(0, fill.numel(), 16384):
                    table.lookup(fill[k : k + 16384])
        cuda = tables["row cache"].device.type == "cuda"
        for graph in (False, True) if cuda else (False,):
            # The rows as stored (no dequantizing). The two tables take turns in blocks of calls
            # (the order swapped every pair of blocks), each block after untimed calls of its own: the
            # machine's drift and slow spells fall on both alike, and neither's calls run with
            # the other's rows and page-table entries in the CPU's caches.
            lookups = {source: Lookup(table, 1024, graph, table.dtype) for source, table in tables.items()}
            before = {source: table.stats().get("row_cache") for source, table in tables.items()}
            times = {source: [] for source in tables}
            # Per block, the row copy's mean seconds a call, and of them its wait for reads of misses.
            copies = {source: [] for source in tables}
            waits = {source: [] for source in tables}
            ratios = []
            for k in range(-(-calls // HIT_BLOCK)):
                block = {}
                for source in list(tables)[:: 1 if k % 2 == 0 else -1]:
                    block[source], copy, wait = hit_block(tables[source], lookups[source], hot_ids, rng)
                    times[source] += block[source]
                    copies[source].append(copy)
                    waits[source].append(wait)
                ratios.append(np.median(block["row cache"]) / np.median(block["page cache"]))
            for source, table in tables.items():
                after, rate = table.stats().get("row_cache"), None
                if before[source] is not None:
                    served = after["hits"] - before[source]["hits"]
                    rate = served / max(1, served + after["misses"] - before[source]["misses"])
                found["runs"].append(
                    {
                        "source": source,
                        "graph": graph,
                        "row_reads": table.row_reads,
                        "median_s": float(np.median(times[source])),
                        "mean_s": float(np.mean(times[source])),
                        "p10_s": float(np.percentile(times[source], 10)),
                        "p90_s": float(np.percentile(times[source], 90)),
                        "row_copy_s": float(np.median(copies[source])),
                        "read_wait_s": float(np.median(waits[source])),
                        "hit_rate": rate,
                    }
                )
                kind = "graph" if graph else "eager"
                say(f"  {source:10s} {kind}: {np.median(times[source]) * 1e6:8.1f} us")
            found["ratios"].append(
                {
                    "graph": graph,
                    "median": float(np.median(ratios)),
                    "p10": float(np.percentile(ratios, 10)),
                    "p90": float(np.percentile(ratios, 90)),
                }
            )
    return found


def policies(directory: str, device: str, budgets: list[int], lookups: int, rng) -> dict:
    import cache_sim

    layout = read_layout(directory)
    found = {"runs": [], "references": []}
    for dist in parse_ids("zipf:1.1,trace"):
        draws = [dist.draw(rng, layout.num_rows, 1024) for _ in range(lookups)]
        flat = np.concatenate(draws)
        half = flat.size // 2
        for budget in budgets:
            for policy in POLICIES:
                with_knobs(
                    {
                        "PLE_UM_ROW_CACHE": str(budget),
                        "PLE_UM_ROW_CACHE_POLICY": policy,
                        "PLE_UM_FILE_READS": "uring",
                    }
                )
                with ple_um.open_table(directory, mode="cpu", device=device) as table:
                    ids = torch.zeros(1024, dtype=torch.int64, device=table.device)
                    for k, draw in enumerate(draws):
                        if k == len(draws) // 2:
                            first = table.stats()["row_cache"]
                        ids.copy_(torch.from_numpy(draw))
                        table.lookup(ids)
                    last = table.stats()["row_cache"]
                hits, misses = last["hits"] - first["hits"], last["misses"] - first["misses"]
                rate = hits / max(1, hits + misses)
                found["runs"].append(
                    {
                        "ids": dist.name,
                        "budget": budget,
                        "policy": policy,
                        "hit_rate": rate,
                        "slots": last["slots"],
                    }
                )
                say(f"  {dist.name:10s} {units.format_bytes(budget):>10s} {policy:8s} {rate:.3f}")
            rates = cache_sim.hit_rates(flat, budget, REFERENCES, row_bytes=layout.row_bytes, warmup=half)
            found["references"].append({"ids": dist.name, "budget": budget, "hit_rates": rates})
            say(f"  {dist.name:10s} {units.format_bytes(budget):>10s} references {rates}")
    return found


def child(args) -> dict:
    rng = np.random.default_rng(args.seed)
    out = {"device": args.device, "memory_limit": args.memory_limit}
    if "readers" in args.parts:
        out["readers"] = readers(args.dir, args.device, args.reps, rng)
    if "hits" in args.parts:
        out["hits"] = hits(args.dir, args.device, args.hot, units.parse_size(args.cache), args.calls, rng)
    if "policies" in args.parts:
        out["policies"] = policies(
            args.dir, args.device, [units.parse_size(b) for b in args.budgets.split(",")], args.lookups, rng
        )
    return out


def report(result: dict) -> None:
    if "readers" in result:
        ceiling = result["readers"]["ceiling"]["sizes"]
        rate, small = ceiling["4096"]["64"]["reads_per_s"], ceiling["512"]["64"]["reads_per_s"]
        print(f"\nstorage: {rate:.0f} O_DIRECT 4 KiB reads/s at depth 64 ({small:.0f} of 512 B)")
        print("| reads | call | rows | median ms | p10-p90 ms | x ceiling |")
        print("| --- | --- | --- | --- | --- | --- |")
        for run in result["readers"]["runs"]:
            kind, ms = "graph" if run["graph"] else "eager", run["median_s"] * 1e3
            spread = f"{run['p10_s'] * 1e3:.2f}-{run['p90_s'] * 1e3:.2f}"
            ratio = run["median_s"] / (run["rows"] / rate)
            print(f"| {run['reads']} | {kind} | {run['rows']} | {ms:.2f} | {spread} | {ratio:.2f} |")
    if "hits" in result:
        found = result["hits"]
        cache = units.format_bytes(found["cache_bytes"])
        print(f"\n1 024 rows of {found['hot_rows']} hot ones, a row cache of {cache}")
        print("| rows from | call | median us | p10-p90 us | C row copy, mean us | its reads' wait | hits |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for run in found["runs"]:
            kind, rate = "graph" if run["graph"] else "eager", run["hit_rate"]
            spread = f"{run['p10_s'] * 1e6:.1f}-{run['p90_s'] * 1e6:.1f}"
            shown = "-" if rate is None else f"{rate:.2%}"
            median, copy, wait = (run[key] * 1e6 for key in ("median_s", "row_copy_s", "read_wait_s"))
            print(
                f"| {run['source']} | {kind} | {median:.1f} | {spread} | {copy:.1f} | {wait:.1f} | {shown} |"
            )
        print("\n| call | row cache / page cache, per pair of blocks: median [p10-p90] |\n| --- | --- |")
        for ratio in found["ratios"]:
            kind = "graph" if ratio["graph"] else "eager"
            print(f"| {kind} | {ratio['median']:.2f} [{ratio['p10']:.2f}-{ratio['p90']:.2f}] |")
    if "policies" in result:
        print("\n| ids | budget | policy | hit rate |\n| --- | --- | --- | --- |")
        for run in result["policies"]["runs"]:
            budget = units.format_bytes(run["budget"])
            print(f"| {run['ids']} | {budget} | {run['policy']} | {run['hit_rate']:.3f} |")
        for ref in result["policies"]["references"]:
            budget = units.format_bytes(ref["budget"])
            for name, value in ref["hit_rates"].items():
                print(f"| {ref['ids']} | {budget} | {name} (simulated) | {value:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the table's checkpoint directory")
    p.add_argument(
        "--parts", default="readers,policies", help="readers, hits, policies (default readers,policies)"
    )
    p.add_argument(
        "--memory-limit", default=None, help="run the measurements in a memory cgroup of this size"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=7, help="cold calls per reader and size")
    p.add_argument("--budgets", default="16MiB,64MiB,256MiB", help="row-cache budgets of the policies part")
    p.add_argument("--lookups", type=int, default=400, help="1 024-id lookups per policy run")
    p.add_argument("--hot", type=int, default=500_000, help="hot rows of the hits part")
    p.add_argument("--cache", default="1GiB", help="the row cache of the hits part")
    p.add_argument(
        "--calls",
        type=int,
        default=200,
        help="timed calls of the hits part, per path (rounded up to blocks of 40)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_cold.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.parts = tuple(x.strip() for x in args.parts.split(","))
    if args.child:
        json.dump(child(args), sys.stdout)
        return 0
    if args.memory_limit is None:
        result = child(args)
    else:
        from ple_um.bench.memlimit import MemoryLimit

        with MemoryLimit.open(units.parse_size(args.memory_limit), f"ple-um-profile-{os.getpid()}") as limit:
            say(f"memory limit: {limit.describe()}")
            command = [sys.executable, __file__, *sys.argv[1:], "--child"]
            done = subprocess.run(command, stdout=subprocess.PIPE, preexec_fn=limit.preexec, check=False)
            if done.returncode != 0:
                print(f"the child exited with {done.returncode}", file=sys.stderr)
                return 1
            result = json.loads(done.stdout)
            result["memory_limit_how"] = limit.describe()
            result["memory_peak"] = limit.peak()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
