"""What a trace of PLE row lookups says about caching them: repeated ids within a step, the share
of lookups the hottest rows serve, the hit rates of row caches (``cache_sim``) as their bytes grow,
and how close the bench's ``zipf:S`` ids come to the trace. ``analyse`` computes all of it;
``tools/traffic_report.py`` prints it, writes its JSON and draws the plot of docs/TRAFFIC.md.
"""

from __future__ import annotations

import cache_sim
import numpy as np

from ple_um.bench.ids import hash_onto_rows, zipf_ngrams
from ple_um.bench.trace import DecodeReplay, PrefillReplay, Trace

HOT_FRACTIONS = (0.01, 0.1, 0.3, 0.6)
# The plot's skew curves: finer near the hottest end.
CURVE_FRACTIONS = (0.001, 0.003, 0.01, 0.02, 0.05) + tuple(k / 20 for k in range(2, 21))
BUDGETS = tuple(m << 20 for m in (1, 4, 16, 64, 256, 1024))
ZIPF_S = (1.01, 1.02, 1.03, 1.05, 1.075, 1.1, 1.15, 1.2, 1.3, 1.5)
DECODE_TOKENS, PREFILL_TOKENS = 64, 8192


def step_repeats(steps) -> dict:
    """Over the steps (arrays of row ids, one per step): the share of a step's ids that repeat an
    id looked up earlier in the same step, 1 - distinct / ids (mean, p10, p50, p90)."""
    shares = np.array([1.0 - np.unique(s).size / s.size for s in steps if s.size])
    q = np.quantile(shares, [0.1, 0.5, 0.9])
    return {"steps": int(shares.size), "mean": float(shares.mean()), "p10": q[0], "p50": q[1], "p90": q[2]}


def hottest_share(rows: np.ndarray, fractions=HOT_FRACTIONS) -> dict:
    """For each fraction x: the share of the lookups that go to the hottest x of the distinct rows
    looked up (rows ranked by lookup count), and how many rows that is."""
    _, counts = np.unique(np.asarray(rows).reshape(-1), return_counts=True)
    ranked = np.cumsum(np.sort(counts)[::-1])
    out = {}
    for x in fractions:
        k = max(1, int(round(x * counts.size)))
        out[f"{x:g}"] = {"rows": k, "share": float(ranked[k - 1] / ranked[-1])}
    return out


def new_rows_share(rows: np.ndarray, start: int) -> float:
    """The share of the lookups from ``start`` on whose row was not looked up before: the misses
    no cache avoids (the rest of any cache's misses are capacity misses)."""
    rows = np.asarray(rows).reshape(-1)
    _, first = np.unique(rows, return_index=True)
    return float(np.count_nonzero(first >= start) / (rows.size - start))


def cache_curves(rows: np.ndarray, budgets=BUDGETS, policies=cache_sim.POLICIES, log=None) -> dict:
    """Hit rates of every policy at every budget, twice: ``cold`` over the whole sequence from an
    empty cache, and ``warm`` over its second half with the first half filling the cache."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    half = rows.size // 2
    out: dict = {"budgets": list(budgets), "cold": {}, "warm": {}, "new_rows_share": {}}
    out["new_rows_share"] = {"cold": new_rows_share(rows, 0), "warm": new_rows_share(rows, half)}
    for b in budgets:
        rates = cache_sim.cold_and_warm(rows, b, policies, warmup=half)
        for label in ("cold", "warm"):
            out[label][str(b)] = rates[label]
            if log:
                log(
                    f"  {label} {b >> 20:5d} MiB: "
                    + ", ".join(f"{p} {r:.3f}" for p, r in rates[label].items())
                )
    return out


def replay_steps(trace: Trace, rng: np.random.Generator, decode_steps: int) -> dict:
    """Repeated ids within a decode step of DECODE_TOKENS requests and within a prefill chunk of
    PREFILL_TOKENS tokens, replayed as the bench replays them (``trace.DecodeReplay``,
    ``PrefillReplay``); the prefill chunks cover the trace once."""
    decode = DecodeReplay(trace, DECODE_TOKENS, rng)
    prefill = PrefillReplay(trace, PREFILL_TOKENS, rng)
    chunks = max(1, trace.num_tokens // PREFILL_TOKENS)
    return {
        "decode": step_repeats(decode.step().reshape(-1) for _ in range(decode_steps)),
        "prefill": step_repeats(prefill.step().reshape(-1) for _ in range(chunks)),
    }


def zipf_rows(s: float, n: int, num_rows: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids as the bench's ``zipf:S`` draws them (ids.py): Zipf(s) n-gram ranks hashed onto
    ``num_rows`` rows."""
    return hash_onto_rows(zipf_ngrams(rng, s, n), num_rows)


def zipf_figures(
    s: float, n: int, num_rows: int, rng, *, budgets, decode_steps: int, per_token: int, log=None
) -> dict:
    """The trace's figures for ``zipf:s`` ids: as many lookups as the trace, every id drawn
    afresh (so a decode step of DECODE_TOKENS tokens is ``per_token`` x that many independent ids)."""
    rows = zipf_rows(s, n, num_rows, rng)
    decode_steps = max(1, min(decode_steps, n // (DECODE_TOKENS * per_token)))
    decode = rows[: decode_steps * DECODE_TOKENS * per_token].reshape(decode_steps, -1)
    chunk = PREFILL_TOKENS * per_token
    prefill = rows[: max(1, n // chunk) * chunk].reshape(-1, min(chunk, n))
    if log:
        log(f"zipf:{s:g}")
    return {
        "distinct_fraction": float(np.unique(rows).size / rows.size),
        "hottest": hottest_share(rows),
        "hottest_curve": hottest_share(rows, CURVE_FRACTIONS),
        "repeats": {"decode": step_repeats(decode), "prefill": step_repeats(prefill)},
        "lru": cache_curves(rows, budgets, ("lru",), log),
    }


def closeness(trace_lru: dict, zipf_lru: dict) -> float:
    """Mean absolute difference of two LRU hit-rate curves (warm, over the same budgets)."""
    keys = trace_lru["warm"].keys()
    return float(np.mean([abs(trace_lru["warm"][b]["lru"] - zipf_lru["warm"][b]["lru"]) for b in keys]))


def analyse(
    trace: Trace,
    *,
    budgets=BUDGETS,
    zipf_s=ZIPF_S,
    policies=cache_sim.POLICIES,
    decode_steps: int = 2000,
    seed: int = 0,
    log=None,
) -> dict:
    """Everything docs/TRAFFIC.md reports, for ``trace`` (its rows in request order)."""
    rng = np.random.default_rng(seed)
    rows = trace.rows.reshape(-1).astype(np.int64)
    if log:
        log(f"trace: {trace.num_tokens} tokens, {rows.size} lookups")
    result = {
        "figures": trace.figures(),
        "row_bytes": cache_sim.ROW_BYTES,
        "page_bytes": cache_sim.PAGE_BYTES,
        "hottest": hottest_share(rows),
        "hottest_curve": hottest_share(rows, CURVE_FRACTIONS),
        "repeats": replay_steps(trace, rng, decode_steps),
        "caches": cache_curves(rows, budgets, policies, log),
        "zipf": {},
    }
    for s in zipf_s:
        z = zipf_figures(
            s,
            rows.size,
            trace.total_rows,
            rng,
            budgets=budgets,
            decode_steps=decode_steps,
            per_token=trace.rows_per_token,
            log=log,
        )
        z["lru_difference"] = closeness(result["caches"], z["lru"])
        result["zipf"][f"{s:g}"] = z
    result["best_zipf"] = min(result["zipf"], key=lambda k: result["zipf"][k]["lru_difference"])
    return result
