"""What the PLE traffic trace says (docs/TRAFFIC.md): its tables printed as markdown, its JSON and
its plot, from one trace file.

    PYTHONPATH=/tmp/qt python tools/traffic_report.py

reads the full trace (``--trace``, made by tools/make_trace.py, which this script runs first
when the file is absent: that needs vLLM, the tokenizer in PYTHONPATH and the Debian archive) and
writes ``--json`` and ``--plot``. ``--trace ple_um/bench/data/trace_sample.npz`` runs it on the
committed sample instead (no vLLM, no tokenizer). Takes about 10 minutes for the full trace on
one core (the cache simulations are pure Python: ``tools/cache_sim.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cache_sim
import traffic  # noqa: E402

from ple_um import envs  # noqa: E402
from ple_um.bench.trace import read_trace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def mib(b) -> str:
    b = int(b)
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB"


def tables(r: dict, trace_about: dict) -> str:
    f = r["figures"]
    lines = [
        f"trace: {f['tokens']} tokens in {f['requests']} requests, {f['lookups']} lookups of "
        f"{f['rows_per_token']} rows per token, {f['distinct_rows']} distinct rows "
        f"({f['distinct_fraction']:.1%} of the lookups)",
        f"tokenizer: {trace_about.get('tokenizer', {}).get('name')}",
        "",
        "| repeated ids in a step | trace | " + " | ".join(f"zipf:{s}" for s in r["zipf"]) + " |",
        "|" + " --- |" * (len(r["zipf"]) + 2),
    ]
    for kind, label in (
        ("decode", "decode step, 64 tokens of 64 requests"),
        ("prefill", "prefill chunk, 8192 tokens"),
    ):
        cells = [f"{r['repeats'][kind]['mean']:.1%}"] + [
            f"{z['repeats'][kind]['mean']:.1%}" for z in r["zipf"].values()
        ]
        lines.append(f"| {label} (mean) | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| share of lookups served by the hottest x of the rows looked up | trace | "
        + " | ".join(f"zipf:{s}" for s in r["zipf"])
        + " |",
        "|" + " --- |" * (len(r["zipf"]) + 2),
    ]
    for x, hot in r["hottest"].items():
        cells = [f"{hot['share']:.1%}"] + [f"{z['hottest'][x]['share']:.1%}" for z in r["zipf"].values()]
        lines.append(
            f"| {float(x):.0%} ({hot['rows']} rows, {mib(hot['rows'] * r['row_bytes'])}) | "
            + " | ".join(cells)
            + " |"
        )
    distinct = [f"{z['distinct_fraction']:.1%}" for z in r["zipf"].values()]
    lines.append(f"| distinct rows / lookups | {f['distinct_fraction']:.1%} | " + " | ".join(distinct) + " |")
    c = r["caches"]
    for label, what in (
        ("cold", "whole trace, from an empty cache"),
        ("warm", "second half, the first half warming the cache"),
    ):
        policies = list(next(iter(c[label].values())))
        lines += [
            "",
            f"hit rates, {what} (first lookups of a row: {c['new_rows_share'][label]:.1%} of these)",
            "| budget | " + " | ".join(policies) + f" | lru on zipf:{r['best_zipf']} |",
            "|" + " --- |" * (len(policies) + 2),
        ]
        for b, rates in c[label].items():
            z = r["zipf"][r["best_zipf"]]["lru"][label][b]["lru"]
            lines.append(
                f"| {mib(b)} ({int(b) // r['row_bytes']} rows) | "
                + " | ".join(f"{rates[p]:.1%}" for p in policies)
                + f" | {z:.1%} |"
            )
    lines += ["", "| zipf:S | mean abs. difference of the warm LRU curve from the trace's |", "| --- | --- |"]
    lines += [f"| {s} | {z['lru_difference']:.3f} |" for s, z in r["zipf"].items()]
    lines.append(f"best: zipf:{r['best_zipf']}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    budgets = [int(b) for b in r["caches"]["warm"]]
    x = [b / (1 << 20) for b in budgets]
    for policy in next(iter(r["caches"]["warm"].values())):
        if policy == "static":  # preloaded, it never misses a first lookup: not a demand cache
            continue
        ax.plot(x, [r["caches"]["warm"][str(b)][policy] for b in budgets], marker="o", label=policy)
    best = r["best_zipf"]
    ax.plot(
        x, [r["zipf"][best]["lru"]["warm"][str(b)]["lru"] for b in budgets], "k--", label=f"lru, zipf:{best}"
    )
    ax.axhline(
        1 - r["caches"]["new_rows_share"]["warm"],
        color="grey",
        lw=0.8,
        ls=":",
        label="no first lookups missed",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [mib(b) for b in budgets])
    ax.set_xlabel("cache bytes")
    ax.set_ylabel("hit rate (second half of the trace, warmed on the first)")
    ax.set_title("row caches on the trace, equal bytes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    curve = "hottest_curve" if "hottest_curve" in r else "hottest"
    for label, hot in [("trace", r[curve])] + [(f"zipf:{s}", z[curve]) for s, z in r["zipf"].items()]:
        xs = [float(k) for k in hot]
        style = (
            {"color": "k", "lw": 2}
            if label == "trace"
            else {"lw": 1, "ls": "--" if label != f"zipf:{best}" else "-"}
        )
        bx.plot(xs, [h["share"] for h in hot.values()], label=label, **style)
    bx.set_xscale("log")
    bx.set_xlabel("hottest fraction of the rows looked up")
    bx.set_ylabel("share of the lookups")
    bx.set_title("skew: trace against the bench's zipf:S ids")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=os.path.join(envs.PLE_UM_CACHE_DIR, "trace.npz"))
    p.add_argument("--json", default=os.path.join(HERE, "..", "docs", "results", "traffic.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "traffic.png"))
    p.add_argument("--policies", default=",".join(cache_sim.POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-json", action="store_true", help="tables and plot again from --json, no analysis")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.json) as f:
            result = json.load(f)
        plot(result, args.plot)
        print(tables(result, result["trace"]["description"]))
        return 0
    if not os.path.exists(args.trace):
        import make_trace

        make_trace.main(["--out", args.trace])
    t0 = time.time()
    trace = read_trace(args.trace)
    result = traffic.analyse(
        trace, policies=tuple(args.policies.split(",")), seed=args.seed, log=lambda m: print(m, flush=True)
    )
    result["trace"] = {
        "file": os.path.basename(args.trace),
        "description": {k: v for k, v in trace.description.items() if k != "requests"},
    }
    result["seconds"] = time.time() - t0
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=float)
    plot(result, args.plot)
    print(tables(result, trace.description))
    print(f"\n{args.json}, {args.plot}: {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)  # `import make_trace`
    raise SystemExit(main())
