"""The bench's printed report: a header saying when, where, with what and by which command it ran,
one line per contender saying what it is, then the tables; every timed cell shows its median with
the p10-p90 spread beside it, marked noisy where p90/p10 > 2. And the JSON, written whole or not
at all."""

from __future__ import annotations

import json
import os
import tempfile

from ple_um.bench.timing import NOISY_SPREAD, noisy
from ple_um.units import format_bytes


def _rate(r: dict) -> str:
    return f"{format_bytes(r['gbps'] * 1e9)}/s"


def ratio(x: float) -> str:
    """A ratio to the anchor: two decimals, or two significant digits below 0.1 (never 0.00x)."""
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def cell(r: dict | None, rate: bool = True) -> str:
    """A timed figure: ``median [p10-p90 (noisy)] (bytes/s, x torch)``, in microseconds."""
    if r is None:
        return "-"
    text = f"{r['median_us']:.1f}"
    if "p10_us" in r and "p90_us" in r:
        text += f" [{r['p10_us']:.1f}-{r['p90_us']:.1f}{' noisy' if noisy(r) else ''}]"
    extra = [_rate(r)] if rate and "gbps" in r else []
    if "vs_torch" in r:
        extra.append(ratio(r["vs_torch"]))
    return text + (f" ({', '.join(extra)})" if extra else "")


def header(result: dict) -> list[str]:
    """When, where, with which versions and by which command the run was made; what each
    contender is; how to read a cell."""
    v = result.get("versions", {})
    versions = ", ".join(f"{name} {v[name] or 'not installed'}" for name in v)
    t, anchor = result["table"], result["anchor"]
    lines = [
        f"ple-um bench, {result['date']}" + (f": {result['command']}" if result.get("command") else ""),
        f"device: {result['device']} on {result.get('host', '?')}" + (f"; {versions}" if versions else ""),
        f"table: {format_bytes(t['bytes'])}, {t['row_bytes']} B rows, {t['shards']} shards "
        f"({t.get('dtype', '?')}, layer {t.get('layer', '?')}, {t.get('directory', '?')}); "
        f"auto mode: {result['probe']['mode']}",
    ]
    if result.get("contenders"):
        lines.append("paths:")
        lines += [f"  {name}: {what}" for name, what in result["contenders"].items()]
    lines.append(
        f"cells: median us [p10-p90, 'noisy' where p90/p10 > {NOISY_SPREAD:g}] (rows' bytes/s, x torch); "
        f"x torch: the ratio to `{anchor['name']}` over the table in {anchor['memory']}"
        + (f" (left out: {anchor['left_out']})" if "left_out" in anchor else "")
    )
    return lines


def _lookup_tables(result: dict, rows: tuple[int, ...]) -> list[str]:
    host = result["method"]["host_overhead"]
    lines: list[str] = []
    for dist in result["ids"]:
        lines += ["", f"lookups, {dist} ids"]
        head = (
            "| path | "
            + " | ".join(f"{n} rows" for n in rows)
            + f" | host: us per call, {host['calls']} x {host['rows']} rows back to back |"
        )
        lines += [head, "|" + " --- |" * (len(rows) + 2)]
        for name, entry in result["lookup"].items():
            if "skipped" in entry:
                lines.append(f"| {name} | skipped: {entry['skipped']} |" + " - |" * len(rows))
                continue
            mine = entry.get(dist, {})
            cells = [cell(mine.get(str(n))) for n in rows] + [cell(mine.get("host"), rate=False)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _decode_table(result: dict) -> list[str]:
    heads = [f"{dist}: {kind}" for dist in result["ids"] for kind in ("eager", "graph replay")]
    lines = [
        "",
        "| decode step (64 tokens x 16 rows -> dequant -> proj), us | " + " | ".join(heads) + " |",
        "|" + " --- |" * (len(heads) + 1),
    ]
    for name, d in result["decode_step"].items():
        absent = "not capture-safe" if not d["capture_safe"] else "no CUDA graphs on the CPU"
        cells = []
        for dist in result["ids"]:
            runs = d.get(dist, {})
            cells += [
                cell(runs.get("eager"), rate=False),
                cell(runs["graph"], rate=False) if "graph" in runs else absent,
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _memory_tables(result: dict) -> list[str]:
    lines = [
        "",
        "| open | mode | seconds | GPU bytes | anon RSS added | pinned bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, s in result["startup"].items():
        lines.append(
            f"| {label} page cache | {s['mode']} | {s['open_s']:.3f} | {format_bytes(s['gpu_bytes'])} | "
            f"{format_bytes(s['anon_rss_added_bytes'])} | {format_bytes(s['pinned_bytes'])} |"
        )
    if result.get("processes"):
        lines += [
            "",
            "| processes opening the same table | mode | host memory taken after 1st, 2nd, ... |",
            "| --- | --- | --- |",
        ]
        for kind, p in result["processes"].items():
            if "skipped" in p:
                lines.append(f"| {kind} | skipped: {p['skipped']} | - |")
                continue
            drops = ", ".join(format_bytes(d) for d in p["mem_available_drop_bytes"])
            lines.append(f"| {kind} | {p['mode']} | {drops} |")
    return lines


def format_table(result: dict, rows: tuple[int, ...]) -> str:
    """The whole printed report of a run."""
    lines = header(result) + _lookup_tables(result, rows) + _decode_table(result) + _memory_tables(result)
    return "\n".join(lines)


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


def unmeasured(result: dict, modes: tuple[str, ...] | None) -> list[str]:
    """What a finished run was asked for and has no figures of, each with why: a mode named by
    --modes that was skipped, a memory limit whose child gave no figures, a mode its child skipped."""
    missing = []
    for name, entry in result.get("lookup", {}).items():
        if modes and name.removeprefix("ple-um ") in modes and "skipped" in entry:
            missing.append(f"{name}: {entry['skipped']}")
    for name, entry in result.get("configs", {}).items():  # the serving loop's
        if "skipped" in entry:
            missing.append(f"{name}: {entry['skipped']}")
    for mode, why in result.get("left_out", {}).items():
        missing.append(f"ple-um {mode}: {why}")
    for entry in result.get("limits", {}).values():
        where = f"under {entry['how']}"
        if "failed" in entry:
            missing.append(f"{where}: {entry['failed']}")
        for mode, runs in entry.get("modes", {}).items():
            if "skipped" in runs:
                missing.append(f"ple-um {mode} {where}: {runs['skipped']}")
    return missing
