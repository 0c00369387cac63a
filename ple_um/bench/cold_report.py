"""The printed report of the bench for tables larger than memory: the header, the storage's
ceiling, then per memory limit and id distribution one row per path and batch size: cold and
steady medians with their spread, the cold figure's ratio to the ceiling, and the share of rows
found in the page cache and in the row cache (``-`` where the table has none), and where it has one
the steady state again without it, the page cache alone under the same limit; beside the cold
figure, the reads a cold call made from the files and, where one thread made them, how long it
waited for them. The cold calls' table has no row cache (``bench/cold_child.py``)."""

from __future__ import annotations

from ple_um.bench.report import cell
from ple_um.lookup.rowcopy import INLINE_ROWS
from ple_um.units import format_bytes


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _storage_lines(storage: dict) -> list[str]:
    depths = [d for d in next(iter(storage["sizes"].values())) if d.isdigit()]
    lines = [
        "",
        f"storage: random reads from the table's {storage['files']} files ({format_bytes(storage['bytes'])})",
        "| read size | how | " + " | ".join(f"depth {d}: reads/s (us each)" for d in depths) + " |",
        "|" + " --- |" * (len(depths) + 2),
    ]
    for size, entry in storage["sizes"].items():
        cells = [f"{entry[d]['reads_per_s']:,.0f} ({entry[d]['us_per_read']:.1f})" for d in depths]
        lines.append(f"| {format_bytes(int(size))} | {entry['how']} | " + " | ".join(cells) + " |")
    return lines


def _limit_lines(entry: dict, ids: dict) -> list[str]:
    peak = f", peak {format_bytes(entry['peak_bytes'])}" if entry.get("peak_bytes") else ""
    lines = ["", f"memory limit {format_bytes(entry['bytes'])}: {entry['how']}{peak}"]
    if not entry["enforced"]:
        knob = entry.get("row_cache_knob")
        lines.append(
            "  the page cache is the machine's here: "
            + (
                f"only ple-um's row cache is held to the limit ({knob})"
                if knob
                else "nothing is held to the limit"
            )
        )
    if "failed" in entry:
        return [*lines, f"  no figures: {entry['failed']}"]
    status = entry.get("status", {})
    if status:
        lines.append(f"  the child's own anonymous memory (RssAnon): {status.get('RssAnon', '?')}")
    for mode, runs in entry["modes"].items():
        if "row_reads" in runs:
            lines.append(f"  ple-um {mode}, steady state: {runs['row_reads']}")
    for dist in ids:
        lines.append(f"  {dist} ids")
        for mode, runs in entry["modes"].items():
            warm = runs.get("warmup", {}).get(dist)
            if warm:
                cached = warm.get("row_cache_hits")
                lines.append(
                    f"  steady state of ple-um {mode}: {warm['calls']} calls ({warm['rows']} rows) in "
                    f"{warm['seconds']:.1f} s, rows in the page cache {_share(warm['first_hits'])} -> "
                    f"{_share(warm['last_hits'])}"
                    + ("" if cached is None else f", row cache hits {_share(cached)} over them")
                )
            warm = runs.get("warmup_page_cache", {}).get(dist)
            if warm:
                lines.append(
                    f"  steady state of ple-um {mode} without its row cache: {warm['calls']} calls in "
                    f"{warm['seconds']:.1f} s, rows in the page cache {_share(warm['first_hits'])} -> "
                    f"{_share(warm['last_hits'])}"
                )
        lines += [
            "| path | rows | cold us [p10-p90] | x storage | cold: reads, wait us | steady us [p10-p90] | "
            "page cache hits | row cache hits | page cache only: steady us [p10-p90] | its page cache hits |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, runs in entry["modes"].items():
            if "skipped" in runs:
                lines.append(f"| ple-um {mode} | skipped: {runs['skipped']} |" + " - |" * 8)
                continue
            for n, row in runs.get(dist, {}).items():
                cold, steady = row["cold"], row["steady"]
                ratio = f"{cold['vs_ceiling']:.2f}x" if "vs_ceiling" in cold else "-"
                lines.append(
                    f"| ple-um {mode} ({runs['timing']}) | {n} | {cell(cold, rate=False)} | {ratio} | "
                    f"{_reads_cell(cold)} | {cell(steady, rate=False)} | "
                    f"{_share(steady['page_cache_hits'])} | {_share(steady.get('row_cache_hits'))} | "
                    f"{_page_cache_only(row)} |"
                )
    return lines


def _reads_cell(cold: dict) -> str:
    """A cold call's reads from the files and, where one thread read them, the time it waited for
    them (means per call); ``-`` where they were not counted."""
    if "file_reads_per_call" not in cold:
        return "-"
    wait = cold.get("read_wait_us")
    return f"{cold['file_reads_per_call']:.0f}, " + ("-" if wait is None else f"{wait:.1f}")


def _page_cache_only(row: dict) -> str:
    """The steady state without the row cache: its median and the page cache's share (``-`` where
    the steady table had no row cache, so that run is the page cache's already)."""
    alone = row.get("steady_page_cache")
    if alone is None:
        return "- | -"
    return f"{cell(alone, rate=False)} | {_share(alone['page_cache_hits'])}"


def format_cold(result: dict) -> str:
    v = result.get("versions", {})
    t = result["table"]
    lines = [
        f"ple-um bench, {result['date']}" + (f": {result['command']}" if result.get("command") else ""),
        f"device: {result['device']} on {result.get('host', '?')}; "
        + ", ".join(f"{name} {v[name] or 'not installed'}" for name in v),
        f"table: {format_bytes(t['bytes'])}, {t['row_bytes']} B rows, {t['shards']} shards ({t['dtype']}, "
        f"layer {t['layer']}, {t['directory']})",
        f"cold: {result['method']['cold']}; steady: {result['method']['steady']}; "
        f"{result['method']['timing']}",
        f"x storage: the cold median over {result['method']['ceiling']}; cold: reads, wait us: a cold "
        "call's reads from the files and the time it waited for them, means per call (the wait where one "
        f"thread reads: up to {INLINE_ROWS} ids); page cache hits: the share of a steady call's rows in "
        "the page cache before it (mincore); row cache hits: hits / (hits + misses)",
    ]
    lines += [f"left out: ple-um {mode}: {why}" for mode, why in result.get("left_out", {}).items()]
    lines += _storage_lines(result["storage"])
    for entry in result["limits"].values():
        lines += _limit_lines(entry, result["ids"])
    return "\n".join(lines)
