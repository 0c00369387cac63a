"""The verbs that work on a checkpoint's files alone, without a device: `ple-um inspect` (what the
checkpoint holds and whether it is sound), `residency` (how much of the table is in the page cache)
and `prewarm` (read it into the page cache)."""

from __future__ import annotations

import argparse

from ple_um.cli import arguments as a
from ple_um.cli.output import EXIT_INVALID, EXIT_OK, EXIT_REFUSED, CliError, emit, emit_json
from ple_um.units import format_bytes

INSPECT = """\
Read a checkpoint's headers: its PLE tables (rows, dtype, scale, shards and the files that hold
them) and a full validation verdict, every problem listed, one per broken file. Exits 1 when the
checkpoint is not sound."""

RESIDENCY = """\
How much of the table is in the page cache now, per shard and in total (mincore over a read-only
mapping; no data is read), and the row cache a table opened now would take under the knobs set (a
serving process's own row cache is in its stats line and metrics)."""
# The knobs that decide the row cache and the reader of misses, the fit among them (residency
# reports them).
ROW_CACHE_KNOBS = (
    "PLE_UM_FIT",
    "PLE_UM_ROW_CACHE",
    "PLE_UM_ROW_CACHE_FRACTION",
    "PLE_UM_ROW_CACHE_POLICY",
    "PLE_UM_FILE_READS",
    "PLE_UM_DIRECT_READS",
    "PLE_UM_READ_DEPTH",
    "PLE_UM_ROWCOPY",
    "PLE_UM_CACHE_DIR",
)

PREWARM = """\
Read the table into the page cache (the first --fraction of the table's bytes in each file).
Refused (exit 3, nothing read) when that is more than --max-bytes, or than MemAvailable without
it: the cache would evict the table's own first pages, or other processes' memory, to hold the
rest."""


def add_parsers(sub) -> None:
    help = "a checkpoint's PLE tables and a full validation verdict"
    ins = a.add_verb(sub, "inspect", inspect, help, INSPECT, knobs=())
    a.add_dir(ins, layer_default="every layer found")
    ins.add_argument("--shards", action="store_true", help="list every shard")

    help = "how much of the table is in the page cache now (mincore)"
    a.add_dir(a.add_verb(sub, "residency", residency, help, RESIDENCY, knobs=ROW_CACHE_KNOBS))

    pw = a.add_verb(sub, "prewarm", prewarm, "read the table into the page cache", PREWARM, knobs=())
    a.add_dir(pw)
    pw.add_argument(
        "--fraction",
        type=a.fraction,
        default=1.0,
        help="prewarm the first F of the table's bytes in each file (0 < F <= 1)",
    )
    pw.add_argument("--force", action="store_true", help="prewarm even when larger than the limit")
    pw.add_argument(
        "--max-bytes",
        type=a.nonzero_size,
        default=None,
        help="refuse to read more than this, e.g. 20GiB (default: MemAvailable)",
    )
    pw.add_argument("--workers", type=a.positive, default=8, help="parallel readers")
    pw.add_argument("--quiet", action="store_true", help="no progress bar")


def _runs(indices: list[int]) -> str:
    """Shard indices in order as runs: ``0, 3-5`` (an index may send any shard to any file)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _table_lines(t: dict, shards: bool) -> list[str]:
    scale = "none (16-bit table)" if t["scale"] is None else f"{t['scale']:.8g} ({t['scale_tensor']})"
    lines = [
        f"layer {t['layer']}: {t['rows']} rows x {t['row_dim']} {t['dtype']} "
        f"({t['row_bytes']} B/row) = {format_bytes(t['bytes'])} ({t['bytes']} B)",
        f"  {t['parts']} shards of {t['rows_per_shard']} rows (ceil layout) in {len(t['files'])} files; "
        f"scale {scale}",
    ]
    for f in t["files"]:
        if not f["shards"]:  # an NVFP4 table's block scales in a file of their own
            lines.append(f"  {f['file']}: block scales, {format_bytes(f['bytes'])}")
            continue
        held = "shards" if len(f["shards"]) > 1 else "shard"
        lines.append(f"  {f['file']}: {held} {_runs(f['shards'])}, {format_bytes(f['bytes'])}")
    if shards:
        lines.append("  | shard | file | offset | rows | bytes |")
        lines += [
            f"  | {sh['index']} | {sh['file']} | {sh['offset']} | {sh['rows']} | {sh['bytes']} |"
            for sh in t["shards"]
        ]
    return lines


def inspect(args: argparse.Namespace) -> int:
    from ple_um import operating

    a.one_layer(args.dir, args.layer, every=True)
    result = operating.inspect(args.dir, args.layer)
    if args.json:
        emit_json(result)
        return EXIT_OK if result["valid"] else EXIT_INVALID
    layers = result["layers"]
    found = ", ".join(map(str, layers)) if layers else "none"
    emit(f"checkpoint: {result['directory']}", f"PLE layers with shards: {found}")
    for t in result["tables"]:
        emit(*_table_lines(t, args.shards))
    if result["valid"]:
        emit("verdict: sound")
        return EXIT_OK
    problems = result["problems"] or ["no PLE table found"]
    emit(f"verdict: INVALID, {len(problems)} problem{'s' if len(problems) != 1 else ''}:")
    emit(*(f"  - {p}" for p in problems))
    return EXIT_INVALID


def _residency_lines(r: dict) -> list[str]:
    lines = ["| shard | file | bytes | resident | % |", "| --- | --- | --- | --- | --- |"]
    for s in r["shards"]:
        lines.append(
            f"| {s['index']} | {s['file']} | {format_bytes(s['bytes'])} | "
            f"{format_bytes(s['resident_bytes'])} | {100 * s['fraction']:.1f} |"
        )
    if "block_scales" in r:  # NVFP4, MXFP8: counted in the total, read by every lookup
        b = r["block_scales"]["total"]
        lines.append(
            f"block scales: {format_bytes(b['resident_bytes'])} of {format_bytes(b['bytes'])} resident "
            f"({100 * b['fraction']:.1f}%)"
        )
    t = r["total"]
    lines.append(
        f"total: {format_bytes(t['resident_bytes'])} of {format_bytes(t['bytes'])} resident "
        f"({100 * t['fraction']:.1f}%), layer {r['layer']}, {r['directory']}"
    )
    lines.append(f"row cache of a table opened now: {r['row_cache']['why']}")
    return lines


def residency(args: argparse.Namespace) -> int:
    from ple_um import operating

    a.one_layer(args.dir, args.layer)
    result = operating.residency(args.dir, args.layer)
    emit_json(result) if args.json else emit(*_residency_lines(result))
    return EXIT_OK


def prewarm(args: argparse.Namespace) -> int:
    from ple_um import metrics, operating

    a.one_layer(args.dir, args.layer)
    bar = None if args.quiet else (lambda total, desc: metrics.progress(total, desc, min_bytes=0))
    try:
        result = operating.prewarm(
            args.dir,
            args.layer,
            fraction=args.fraction,
            force=args.force,
            limit=args.max_bytes,
            workers=args.workers,
            progress=bar,
        )
    except operating.PrewarmRefused as exc:
        raise CliError(str(exc), EXIT_REFUSED, refused=True) from None
    if args.json:
        emit_json(result)
        return EXIT_OK
    before, after = result["before"], result["after"]
    rate = f", {format_bytes(result['read_bytes'] / result['seconds'])}/s" if result["seconds"] > 0 else ""
    emit(
        f"prewarmed {format_bytes(result['read_bytes'])} "
        f"({100 * result['fraction']:.3g}% of the table's bytes in each file) "
        f"of layer {result['layer']} in {result['seconds']:.2f} s{rate}"
        + (" (forced past the limit)" if result["forced"] else ""),
        f"resident: {format_bytes(before['resident_bytes'])} -> {format_bytes(after['resident_bytes'])} of "
        f"{format_bytes(after['bytes'])} ({100 * before['fraction']:.1f}% -> {100 * after['fraction']:.1f}%)",
    )
    return EXIT_OK
