"""The serving loop's printed report: when, where and how it ran, what each configuration is, one
table of step times (a row per GPU work and id distribution, a column per configuration, every
cell its median with the p10-p90 spread, its ratio to the resident table's step and its row-cache
hit rate), and the lookups' time alone."""

from __future__ import annotations

from ple_um.bench.timing import noisy
from ple_um.units import format_bytes

WHAT = {
    "no PLE": "the GPU work alone: the step without any lookup",
    "resident": "the table copied into GPU memory (ple-um's device mode): the lookups' best case",
}


def describe(name: str, entry: dict) -> str:
    """One line saying what configuration ``name`` is."""
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    if name in WHAT:
        return WHAT[name]
    alone = name.startswith("lookups alone, ")
    mode = entry.get("mode")
    text = f"ple-um's {mode} mode, the table where it lies"
    if " under " in name:
        text += f", in a child process held to {name.split(' under ', 1)[1]} of memory"
    if alone:
        text += ": the step's lookups with no GPU work"
    if entry.get("row_cache"):
        text += " (with a row cache)"
    if entry.get("capture_safe") is False:
        text += " (not capture-safe: its steps run eagerly)"
    return text


def cell(row: dict | None) -> str:
    """``median [p10-p90 (noisy)] (x resident, hits)`` in milliseconds."""
    if row is None:
        return "-"
    text = f"{row['median_us'] / 1e3:.2f} [{row['p10_us'] / 1e3:.2f}-{row['p90_us'] / 1e3:.2f}"
    text += " noisy]" if noisy(row) else "]"
    extra = []
    if "vs_resident" in row:
        extra.append(f"{row['vs_resident']:.2f}x")
    if row.get("row_cache_hits") is not None:
        extra.append(f"{100 * row['row_cache_hits']:.1f}% row-cache hits")
    elif row.get("page_cache_hits") is not None:
        extra.append(f"{100 * row['page_cache_hits']:.0f}% of rows in the page cache")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _header(result: dict) -> list[str]:
    t, m, cal = result["table"], result["method"], result["calibration"]
    lookups = ", ".join(
        f"{name} {s['ids']} ids ({s['tokens']} tokens x {s['rows_per_token']} rows)"
        for name, s in m["lookups"].items()
    )
    work = ", ".join(f"{ms} ms: {k} matmuls" for ms, k in cal["matmuls"].items())
    lines = [
        f"ple-um bench --serving, {result['date']}"
        + (f": {result['command']}" if result.get("command") else ""),
        f"device: {result['device']} on {result.get('host', '?')}",
        f"table: {format_bytes(t['bytes'])}, {t['row_bytes']} B rows, {t['shards']} shards "
        f"({t.get('dtype', '?')}, {t.get('directory', '?')})",
        f"step: {m['step']}; lookups: {lookups}",
        f"GPU work ({cal['matmul_size']}x{cal['matmul_size']} bf16 matmuls): {work}",
        f"timing: {m['timing']}; {m['timed_steps']} timed steps a figure after {m['warmup_s']:g} s of "
        f"steps; ids {m['ids']}",
        "configurations:",
    ]
    lines += [f"  {name}: {describe(name, entry)}" for name, entry in result["configs"].items()]
    for limit in result.get("limits", {}).values():
        lines.append(f"  memory limit {format_bytes(limit['bytes'])}: {limit['how']}")
        if "failed" in limit:
            lines.append(f"    failed: {limit['failed']}")
    lines.append(
        "cells: median step ms [p10-p90, 'noisy' where p90/p10 > 2] (x the resident table's step, "
        "row-cache hit rate or the share of the last step's rows in the page cache)"
    )
    return lines


def columns(result: dict) -> list[str]:
    """The configurations with step figures, in the order they ran."""
    seen = {name for by_dist in result["steps"].values() for rows in by_dist.values() for name in rows}
    return [name for name in result["configs"] if name in seen]


def format_serving(result: dict) -> str:
    """The whole printed report of a serving-loop run."""
    names = columns(result)
    lines = _header(result) + ["", "| GPU work | ids | " + " | ".join(names) + " |"]
    lines.append("|" + " --- |" * (len(names) + 2))
    for ms, by_dist in result["steps"].items():
        for dist, rows in by_dist.items():
            lines.append(f"| {ms} ms | {dist} | " + " | ".join(cell(rows.get(n)) for n in names) + " |")
    alone = result.get("lookups_alone", {})
    if alone:
        names = sorted({n for rows in alone.values() for n in rows})
        lines += ["", "| ids | " + " | ".join(f"{n} (no GPU work), ms" for n in names) + " |"]
        lines.append("|" + " --- |" * (len(names) + 1))
        for dist, rows in alone.items():
            lines.append(f"| {dist} | " + " | ".join(cell(rows.get(n)) for n in names) + " |")
    return "\n".join(lines)
