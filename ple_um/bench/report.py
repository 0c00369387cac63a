"""The bench's printed reports, one per kind of run, each opening with a header that says when,
where, with what and by which command it ran, then its tables; every timed cell shows its median
with the p10-p90 spread beside it, marked noisy where p90/p10 > 2 (``[1 sample]`` where one time
is all there is). And the JSON, written whole or not at all.

- ``format_table``: the side-by-side run: one line per contender saying what it is, the lookups per
  id distribution, the decode step, the start-up and memory figures.
- ``format_cold``: the run for tables larger than memory: the storage's ceiling, then per memory
  limit and id distribution one row per path and batch size: cold and steady medians with their
  spread, the cold figure's ratio to the ceiling, and the share of rows found in the page cache and
  in the row cache (``-`` where the table has none), and where it has one the steady state again
  without it, the page cache alone under the same limit; beside the cold figure, its rows' share in
  the page cache (where any: not cold), its reads from the files and, on one thread, their wait. The cold
  calls' table has no row cache (``bench/cold.py``).
- ``format_serving``: the serving loop: what each configuration is, one table of step times (a row
  per GPU work and id distribution, a column per configuration, every cell its median with the
  p10-p90 spread, its ratio to the resident table's step and its row-cache hit rate), and the
  lookups' time alone.
"""

from __future__ import annotations

import json
import os
import tempfile

from ple_um.bench.serving import NO_PLE, RESIDENT
from ple_um.bench.timing import NOISY_SPREAD, noisy
from ple_um.lookup.rowcopy import INLINE_ROWS
from ple_um.units import format_bytes

# Which way a ratio to its baseline is better: each is a median over the baseline's.
FASTER = "below 1x: faster than it, above 1x: slower"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: its head, the separator, one line per row of cells, a short row (a path
    skipped, with why) filled out with ``-``."""
    rows = [cells + ["-"] * (len(head) - len(cells)) for cells in rows]
    return [f"| {' | '.join(cells)} |" for cells in [head, ["---"] * len(head), *rows]]


def _header(result: dict, kind: str = "") -> list[str]:
    """When, where, with which versions and by which command the run was made; the table."""
    v = result.get("versions", {})
    versions = ", ".join(f"{name} {v[name] or 'not installed'}" for name in v)
    t = result["table"]
    return [
        f"ple-um bench{kind}, {result['date']}" + (f": {result['command']}" if result.get("command") else ""),
        f"device: {result['device']} on {result.get('host', '?')}" + (f"; {versions}" if versions else ""),
        f"table: {format_bytes(t['bytes'])}, {t['row_bytes']} B rows, {t['shards']} shards "
        f"({t.get('dtype', '?')}, layer {t.get('layer', '?')}, {t.get('directory', '?')})",
    ]


def _with(text: str, extra: list[str]) -> str:
    return text + (f" ({', '.join(extra)})" if extra else "")


def _spread(r: dict, unit: float = 1.0, digits: int = 1) -> str:
    """``median [p10-p90 (noisy)]`` of a timed figure, in microseconds over ``unit``; ``median
    [1 sample]`` for a single time (``noisy`` None: no spread)."""
    text = f"{r['median_us'] / unit:.{digits}f}"
    if "noisy" in r and r["noisy"] is None:
        text += " [1 sample]"
    elif "p10_us" in r and "p90_us" in r:
        low, high = r["p10_us"] / unit, r["p90_us"] / unit
        text += f" [{low:.{digits}f}-{high:.{digits}f}{' noisy' if noisy(r) else ''}]"
    return text


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def ratio(x: float) -> str:
    """A ratio to the anchor: two decimals, or two significant digits below 0.1 (never 0.00x)."""
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def cell(r: dict | None, rate: bool = True) -> str:
    """A timed figure: ``median [p10-p90 (noisy)] (bytes/s, x torch)``, in microseconds."""
    if r is None:
        return "-"
    extra = [f"{format_bytes(r['gbps'] * 1e9)}/s"] if rate and "gbps" in r else []
    if "vs_torch" in r:
        extra.append(ratio(r["vs_torch"]))
    return _with(_spread(r), extra)


def header(result: dict) -> list[str]:
    """The side-by-side run's header, with the auto mode; what each contender is; how to read a
    cell."""
    anchor = result["anchor"]
    lines = _header(result)
    lines[-1] += f"; auto mode: {result['probe']['mode']}"
    if result.get("contenders"):
        lines.append("paths:")
        lines += [f"  {name}: {what}" for name, what in result["contenders"].items()]
    lines.append(
        f"cells: median us [p10-p90, 'noisy' where p90/p10 > {NOISY_SPREAD:g}] (rows' bytes/s, x torch); "
        f"x torch: the median over `{anchor['name']}`'s, over the table in {anchor['memory']} ({FASTER})"
        + (f" (left out: {anchor['left_out']})" if "left_out" in anchor else "")
    )
    return lines


def _lookup_tables(result: dict, rows: list[int]) -> list[str]:
    host = result["method"]["host_overhead"]
    lines: list[str] = []
    for dist in result["ids"]:
        head = ["path", *(f"{n} rows" for n in rows)]
        head.append(f"host: us per call, {host['calls']} x {host['rows']} rows back to back")
        cells = []
        for name, entry in result["lookup"].items():
            if "skipped" in entry:
                cells.append([name, f"skipped: {entry['skipped']}"])
                continue
            mine = entry.get(dist, {})
            cells.append([name, *(cell(mine.get(str(n))) for n in rows), cell(mine.get("host"), rate=False)])
        lines += ["", f"lookups, {dist} ids", *_table(head, cells)]
    return lines


def _decode_table(result: dict) -> list[str]:
    heads = [f"{dist}: {kind}" for dist in result["ids"] for kind in ("eager", "graph replay")]
    cells = []
    for name, d in result["decode_step"].items():
        absent = "not capture-safe" if not d["capture_safe"] else "no CUDA graphs on the CPU"
        row = [name]
        for dist in result["ids"]:
            runs = d.get(dist, {})
            graph = cell(runs["graph"], rate=False) if "graph" in runs else absent
            if "graph" in runs and d.get("graph_replay_equals_eager") is False:  # other rows: no figure
                graph += " (its replays differ from the eager step: graph_replay_equals_eager false)"
            row += [cell(runs.get("eager"), rate=False), graph]
        cells.append(row)
    step = result["method"]["decode_step"]
    what = f"decode step ({step['tokens']} tokens x {step['heads']} rows -> dequant -> proj), us"
    return ["", *_table([what, *heads], cells)]


def _memory_tables(result: dict) -> list[str]:
    opens = [
        [f"{label} page cache", s["mode"], f"{s['open_s']:.3f}"]
        + [format_bytes(s[k]) for k in ("gpu_bytes", "anon_rss_added_bytes", "pinned_bytes")]
        for label, s in result["startup"].items()
        if label != "skipped"
    ] + ([["open", f"skipped: {result['startup']['skipped']}"]] if "skipped" in result["startup"] else [])
    lines = ["", *_table(["open", "mode", "seconds", "GPU bytes", "anon RSS added", "pinned bytes"], opens)]
    if result.get("processes"):
        cells = [
            [kind, f"skipped: {p['skipped']}"]
            if "skipped" in p
            else [kind, p["mode"], ", ".join(format_bytes(d) for d in p["mem_available_drop_bytes"])]
            for kind, p in result["processes"].items()
        ]
        head = ["processes opening the same table", "mode", "host memory taken after 1st, 2nd, ..."]
        lines += ["", *_table(head, cells)]
    return lines


def format_table(result: dict) -> str:
    """The whole printed report of a side-by-side run."""
    rows = result["method"]["rows"]
    lines = header(result) + _lookup_tables(result, rows) + _decode_table(result) + _memory_tables(result)
    return "\n".join(lines)


def _storage_lines(storage: dict) -> list[str]:
    depths = [d for d in next(iter(storage["sizes"].values())) if d.isdigit()]
    cells = [
        [format_bytes(int(size)), entry["how"]]
        + [f"{entry[d]['reads_per_s']:,.0f} ({entry[d]['us_per_read']:.1f})" for d in depths]
        for size, entry in storage["sizes"].items()
    ]
    head = ["read size", "how", *(f"depth {d}: reads/s (us each)" for d in depths)]
    files = f"{storage['files']} files ({format_bytes(storage['bytes'])})"
    return ["", f"storage: random reads from the table's {files}", *_table(head, cells)]


def _limit_lines(entry: dict, ids: dict) -> list[str]:
    peak = f", peak {format_bytes(entry['peak_bytes'])}" if entry.get("peak_bytes") else ""
    lines = ["", f"memory limit {format_bytes(entry['bytes'])}: {entry['how']}{peak}"]
    if entry.get("left"):
        lines.append(f"  note: {entry['left']}")
    if not entry["enforced"]:
        knob = entry.get("row_cache_knob")
        held = (
            f"only ple-um's row cache is held to the limit ({knob})"
            if knob
            else "nothing is held to the limit"
        )
        lines.append(f"  the page cache is the machine's here: {held}")
    if "failed" in entry:
        return [*lines, f"  no figures: {entry['failed']}"]
    status = entry.get("status", {})
    if status:
        lines.append(f"  the child's own anonymous memory (RssAnon): {status.get('RssAnon', '?')}")
    for mode, runs in entry["modes"].items():
        if "row_reads" in runs:
            lines.append(f"  ple-um {mode}, steady state: {runs['row_reads']}")
        if "steady_failed" in runs:
            lines.append(f"  ple-um {mode}: failed (its cold figures stand): {runs['steady_failed']}")
    head = ["path", "rows", "cold us [p10-p90]", "x storage", "cold: reads, wait us", "steady us [p10-p90]"]
    head += [
        "page cache hits",
        "row cache hits",
        "page cache only: steady us [p10-p90]",
        "its page cache hits",
    ]
    for dist in ids:
        lines.append(f"  {dist} ids")
        for mode, runs in entry["modes"].items():
            for key, what in (("warmup", ""), ("warmup_page_cache", " without its row cache")):
                warm = runs.get(key, {}).get(dist)
                if not warm:
                    continue
                cached = warm.get("row_cache_hits")
                rows = f" ({warm['rows']} rows)" if key == "warmup" else ""
                lines.append(
                    f"  steady state of ple-um {mode}{what}: {warm['calls']} calls{rows} in "
                    f"{warm['seconds']:.1f} s, rows in the page cache {_share(warm['first_hits'])} -> "
                    f"{_share(warm['last_hits'])}"
                    + ("" if cached is None else f", row cache hits {_share(cached)} over them")
                )
        cells = []
        for mode, runs in entry["modes"].items():
            if "skipped" in runs:
                cells.append([f"ple-um {mode}", f"skipped: {runs['skipped']}"])
                continue
            for n, row in runs.get(dist, {}).items():
                cold, steady, alone = row["cold"], row.get("steady"), row.get("steady_page_cache")
                cells.append(
                    [f"ple-um {mode} ({runs['timing']})", n, _cold_cell(cold)]
                    + [f"{cold['vs_ceiling']:.2f}x" if "vs_ceiling" in cold else "-", _reads_cell(cold)]
                    # ``-`` where the steady state failed (``steady_failed``): the cold figures stand.
                    + [cell(steady, rate=False), _share(steady and steady["page_cache_hits"])]
                    + [_share(steady and steady.get("row_cache_hits"))]
                    # The steady state without the row cache (``-`` where the steady table had
                    # none, so that run is the page cache's already).
                    + ([cell(alone, rate=False), _share(alone["page_cache_hits"])] if alone else [])
                )
        lines += _table(head, cells)
    return lines


def _cold_cell(cold: dict) -> str:
    """A cold figure, and the share of its rows in the page cache where any was: pages the child
    could not drop (another process maps them; tmpfs files are their page cache)."""
    share = cold.get("page_cache_hits")
    mark = f" ({_share(share)} of its rows in the page cache: not cold)" if share else ""
    return cell(cold, rate=False) + mark


def _reads_cell(cold: dict) -> str:
    """A cold call's reads from the files and, where one thread read them, the time it waited for
    them (means per call); ``-`` where they were not counted."""
    if "file_reads_per_call" not in cold:
        return "-"
    wait = cold.get("read_wait_us")
    return f"{cold['file_reads_per_call']:.0f}, " + ("-" if wait is None else f"{wait:.1f}")


def format_cold(result: dict) -> str:
    """The whole printed report of a run under memory limits."""
    m = result["method"]
    lines = _header(result) + [
        f"cold: {m['cold']}; steady: {m['steady']}; {m['timing']}",
        f"x storage: the cold median over {m['ceiling']} ({FASTER}); cold: reads, wait us: a cold "
        "call's reads from the files and the time it waited for them, means per call (the wait where one "
        f"thread reads: up to {INLINE_ROWS} ids); page cache hits: the share of a steady call's rows in "
        "the page cache before it (mincore); row cache hits: hits / (hits + misses)",
    ]
    lines += [f"left out: ple-um {mode}: {why}" for mode, why in result.get("left_out", {}).items()]
    lines += _storage_lines(result["storage"])
    for entry in result["limits"].values():
        lines += _limit_lines(entry, result["ids"])
    return "\n".join(lines)


# The serving loop's baselines, in words.
WHAT = {
    NO_PLE: "the GPU work alone: the step without any lookup",
    RESIDENT: "the table copied into GPU memory (ple-um's device mode): the lookups' best case",
}


def describe(name: str, entry: dict) -> str:
    """One line saying what the serving loop's configuration ``name`` is."""
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    # A configuration whose timing failed: its figures taken before the error are in the table.
    failed = f"; failed: {entry['failed']}" if "failed" in entry else ""
    if name in WHAT:
        return WHAT[name] + failed
    text = f"ple-um's {entry.get('mode')} mode, the table where it lies"
    if " under " in name:
        text += f", in a child process held to {name.split(' under ', 1)[1]} of memory"
    if name.startswith("lookups alone, "):
        text += ": the step's lookups with no GPU work"
    if entry.get("row_cache"):
        text += " (with a row cache)"
    if entry.get("capture_safe") is False:
        text += " (not capture-safe: its steps run eagerly)"
    return text + failed


def step_cell(row: dict | None) -> str:
    """A serving figure: ``median [p10-p90 (noisy)] (x resident, hits)`` in milliseconds."""
    if row is None:
        return "-"
    extra = [f"{row['vs_resident']:.2f}x"] if "vs_resident" in row else []
    if row.get("row_cache_hits") is not None:
        extra.append(f"{100 * row['row_cache_hits']:.1f}% row-cache hits")
    elif row.get("page_cache_hits") is not None:
        extra.append(f"{100 * row['page_cache_hits']:.0f}% of rows in the page cache")
    return _with(_spread(row, 1e3, 2), extra)


def _serving_header(result: dict) -> list[str]:
    m, cal = result["method"], result["calibration"]
    lookups = ", ".join(
        f"{name} {s['ids']} ids ({s['tokens']} tokens x {s['rows_per_token']} rows)"
        for name, s in m["lookups"].items()
    )
    work = ", ".join(f"{ms} ms: {k} matmuls" for ms, k in cal["matmuls"].items())
    lines = _header(result, " --serving") + [
        f"step: {m['step']}; lookups: {lookups}",
        f"GPU work ({cal['matmul_size']}x{cal['matmul_size']} bf16 matmuls): {work}",
        f"timing: {m['timing']}; {m['timed_steps']} timed steps a figure after {m['warmup_s']:g} s of "
        f"steps; ids {m['ids']}",
        "configurations:",
    ]
    lines += [f"  {name}: {describe(name, entry)}" for name, entry in result["configs"].items()]
    for limit in result.get("limits", {}).values():
        lines.append(f"  memory limit {format_bytes(limit['bytes'])}: {limit['how']}")
        if limit.get("left"):
            lines.append(f"    note: {limit['left']}")
        if "failed" in limit:
            lines.append(f"    failed: {limit['failed']}")
    lines.append(
        f"cells: median step ms [p10-p90, 'noisy' where p90/p10 > {NOISY_SPREAD:g}] (x the resident "
        f"table's step: the median over its ({FASTER}); row-cache hit rate or the share of a "
        "step's rows in the page cache before it reads them)"
    )
    return lines


def columns(result: dict) -> list[str]:
    """The serving loop's configurations with step figures, in the order they ran."""
    seen = {name for by_dist in result["steps"].values() for rows in by_dist.values() for name in rows}
    return [name for name in result["configs"] if name in seen]


def format_serving(result: dict) -> str:
    """The whole printed report of a serving-loop run."""
    names = columns(result)
    cells = [
        [f"{ms} ms", dist, *(step_cell(rows.get(n)) for n in names)]
        for ms, by_dist in result["steps"].items()
        for dist, rows in by_dist.items()
    ]
    lines = _serving_header(result) + ["", *_table(["GPU work", "ids", *names], cells)]
    alone = result.get("lookups_alone", {})
    if alone:
        names = sorted({n for rows in alone.values() for n in rows})
        cells = [[dist, *(step_cell(rows.get(n)) for n in names)] for dist, rows in alone.items()]
        lines += ["", *_table(["ids", *(f"{n} (no GPU work), ms" for n in names)], cells)]
    return "\n".join(lines)


def format_report(result: dict) -> str:
    """The whole printed report of any run, by its ``kind``."""
    return {"serving": format_serving, "memory-limit": format_cold}.get(result["kind"], format_table)(result)


def write_atomically(path: str, write) -> None:
    """``write(tmp_path)`` into a temporary file beside ``path``, renamed onto it once complete: a
    failure leaves neither a partial file nor a changed ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".partial", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it (mkstemp's file is private)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(result: dict, path: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)

    write_atomically(path, write)
