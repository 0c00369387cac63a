"""The `ple-um` command: bench, probe, inspect, residency, prewarm, knobs. Each verb takes --json.

Exit codes: 0 done; 1 the checkpoint is invalid or cannot be read; 2 bad arguments (argparse);
3 prewarm refused (the table is larger than the memory it may fill).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ple_um import envs


def _size(text: str) -> int:
    return envs._size(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rows(text: str) -> tuple[int, ...]:
    rows = tuple(_positive(x) for x in text.split(",") if x.strip())
    if not rows:
        raise argparse.ArgumentTypeError("no batch sizes given")
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    from ple_um.bench import runner

    cfg = runner.Config(
        directory=args.dir,
        size=args.size,
        row_bytes=args.row_bytes,
        shards=args.shards,
        rows=args.rows,
        modes=tuple(args.modes.split(",")) if args.modes else None,
        repeats=args.repeats,
        rounds=args.rounds,
        device=args.device,
        processes=args.processes,
    )
    result = runner.run(cfg, log=(lambda s: print(s, file=sys.stderr)) if args.quiet else print)
    print(runner.format_table(result, cfg.rows))
    if args.json:
        runner.write_json(result, args.json)
    if args.plot:
        from ple_um.bench.plot import plot

        plot(result, cfg.rows, args.plot)
    return 0


EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


def _human(n: float) -> str:
    from ple_um.operating import human_bytes

    return human_bytes(n)


def _emit_json(data: dict) -> None:
    print(json.dumps(data, indent=1, default=str))


def _fail(args: argparse.Namespace, message: str, code: int = EXIT_INVALID, **extra) -> int:
    """Report an error: a JSON object with "error" under --json, else a line on stderr."""
    if args.json:
        _emit_json({"error": message, **extra})
    else:
        print(f"ple-um {args.verb}: error: {message}", file=sys.stderr)
    return code


def cmd_probe(args: argparse.Namespace) -> int:
    import ple_um
    from ple_um.errors import CheckpointError, ModeUnavailableError

    if args.recheck and args.dir is None:
        return _fail(args, "--recheck needs DIR: the check reads the table's own files", EXIT_USAGE)
    try:
        report = ple_um.probe(args.device, path=args.dir, layer=args.layer, recheck=args.recheck)
    except (CheckpointError, ModeUnavailableError) as exc:
        return _fail(args, str(exc))
    if args.json:
        _emit_json(report.as_dict())
    else:
        print(report.describe())
        print("capabilities:")
        for key, value in report.capabilities.items():
            print(f"  {key}: {value}")
        if report.pin_budget is not None:
            print(f"pin budget: {_human(report.pin_budget)}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ple_um import operating

    result = operating.inspect(args.dir, args.layer)
    if args.json:
        _emit_json(result)
        return EXIT_OK if result["valid"] else EXIT_INVALID
    layers = result["layers"]
    found = "cannot tell (headers unreadable)" if layers is None else ", ".join(map(str, layers)) or "none"
    print(f"checkpoint: {result['directory']}")
    print(f"PLE layers with shards: {found}")
    for t in result["tables"]:
        scale = "none (16-bit table)" if t["scale"] is None else f"{t['scale']:.8g} ({t['scale_tensor']})"
        print(
            f"layer {t['layer']}: {t['rows']} rows x {t['row_dim']} {t['dtype']} "
            f"({t['row_bytes']} B/row) = {_human(t['bytes'])} ({t['bytes']} B)"
        )
        print(
            f"  {t['parts']} shards of {t['rows_per_shard']} rows (ceil layout) in {len(t['files'])} files; "
            f"scale {scale}"
        )
        for f in t["files"]:
            first, last = f["shards"][0], f["shards"][-1]
            span = f"shard {first}" if first == last else f"shards {first}-{last}"
            print(f"  {f['file']}: {span}, {_human(f['bytes'])}")
        if args.shards:
            print("  | shard | file | offset | rows | bytes |")
            for sh in t["shards"]:
                print(f"  | {sh['index']} | {sh['file']} | {sh['offset']} | {sh['rows']} | {sh['bytes']} |")
    if result["valid"]:
        print("verdict: sound")
        return EXIT_OK
    problems = result["problems"] or ["no PLE table found"]
    print(f"verdict: INVALID, {len(problems)} problem{'s' if len(problems) != 1 else ''}:")
    for p in problems:
        print(f"  - {p}")
    return EXIT_INVALID


def _residency_lines(r: dict) -> list[str]:
    lines = ["| shard | file | bytes | resident | % |", "| --- | --- | --- | --- | --- |"]
    for s in r["shards"]:
        lines.append(
            f"| {s['index']} | {s['file']} | {_human(s['bytes'])} | {_human(s['resident_bytes'])} | "
            f"{100 * s['fraction']:.1f} |"
        )
    t = r["total"]
    lines.append(
        f"total: {_human(t['resident_bytes'])} of {_human(t['bytes'])} resident "
        f"({100 * t['fraction']:.1f}%), layer {r['layer']}, {r['directory']}"
    )
    return lines


def cmd_residency(args: argparse.Namespace) -> int:
    from ple_um import operating
    from ple_um.errors import CheckpointError

    try:
        result = operating.residency(args.dir, args.layer)
    except CheckpointError as exc:
        return _fail(args, str(exc))
    if args.json:
        _emit_json(result)
    else:
        print("\n".join(_residency_lines(result)))
    return EXIT_OK


def cmd_prewarm(args: argparse.Namespace) -> int:
    from ple_um import metrics, operating
    from ple_um.errors import CheckpointError

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
        return _fail(args, str(exc), EXIT_REFUSED, refused=True)
    except (CheckpointError, ValueError) as exc:
        return _fail(args, str(exc))
    if args.json:
        _emit_json(result)
        return EXIT_OK
    before, after = result["before"], result["after"]
    rate = result["read_bytes"] / result["seconds"] / 1e9 if result["seconds"] else 0.0
    print(
        f"prewarmed {_human(result['read_bytes'])} ({100 * result['fraction']:.0f}% of each file) of layer "
        f"{result['layer']} in {result['seconds']:.2f} s ({rate:.2f} GB/s)"
        + (" (forced past the memory limit)" if result["forced"] else "")
    )
    print(
        f"resident: {_human(before['resident_bytes'])} -> {_human(after['resident_bytes'])} of "
        f"{_human(after['bytes'])} ({100 * before['fraction']:.1f}% -> {100 * after['fraction']:.1f}%)"
    )
    return EXIT_OK


def cmd_knobs(args: argparse.Namespace) -> int:
    from ple_um import envs

    rows = envs.describe()
    if args.json:
        _emit_json({"knobs": rows})
        return EXIT_OK
    for r in rows:
        aliases = f" (alias {', '.join(r['aliases'])})" if r["aliases"] else ""
        now = f"; set: {r['set']}" if r["set"] else ""
        print(f"{r['name']}{aliases} = {r['default']!r}{now}\n    {r['doc']}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ple-um", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="verb", required=True)

    b = sub.add_parser("bench", help="compare every lookup path on this machine, side by side")
    b.add_argument(
        "dir", nargs="?", default=None, help="checkpoint dir (default: a cached synthetic FP8 table)"
    )
    b.add_argument("--size", type=_size, default=2 << 30, help="synthetic table size (default 2GiB)")
    b.add_argument("--row-bytes", type=int, default=160, help="synthetic table row width in bytes")
    b.add_argument("--shards", type=int, default=128, help="synthetic table shard count")
    b.add_argument(
        "--rows", type=_rows, default=(16, 1024, 16384, 131072), help="batch sizes, comma-separated"
    )
    b.add_argument("--modes", default=None, help="ple-um modes to run (default: all)")
    b.add_argument("--repeats", type=_positive, default=20, help="timed calls per measurement")
    b.add_argument(
        "--rounds",
        type=_positive,
        default=4,
        help="rounds the timed calls are split into; each round times every path in turn (default 4)",
    )
    b.add_argument("--device", default=None)
    b.add_argument(
        "--processes", type=int, default=0, help="also open the table in N processes and report host memory"
    )
    b.add_argument("--json", default=None, help="write the results as JSON to this file")
    b.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    b.add_argument("--quiet", action="store_true", help="progress lines to stderr")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("probe", help="the device's capabilities and the mode auto would choose")
    pr.add_argument(
        "dir",
        nargs="?",
        default=None,
        help="checkpoint dir: make the chosen mode's first read of its table as an open does (from "
        "the cached verdict, or in a child process)",
    )
    pr.add_argument("--layer", type=int, default=None, help="PLE layer (default: the only one)")
    pr.add_argument("--recheck", action="store_true", help="with DIR: run the first-read child again")
    pr.add_argument("--device", default=None)
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    ins = sub.add_parser("inspect", help="a checkpoint's PLE tables and a full validation verdict")
    ins.add_argument("dir", help="checkpoint directory")
    ins.add_argument("--layer", type=int, default=None, help="PLE layer (default: every layer found)")
    ins.add_argument("--shards", action="store_true", help="list every shard")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=cmd_inspect)

    res = sub.add_parser("residency", help="how much of the table is in the page cache now (mincore)")
    res.add_argument("dir", help="checkpoint directory")
    res.add_argument("--layer", type=int, default=None, help="PLE layer (default: the only one)")
    res.add_argument("--json", action="store_true")
    res.set_defaults(func=cmd_residency)

    pw = sub.add_parser("prewarm", help="read the table into the page cache")
    pw.add_argument("dir", help="checkpoint directory")
    pw.add_argument("--layer", type=int, default=None, help="PLE layer (default: the only one)")
    pw.add_argument(
        "--fraction", type=float, default=1.0, help="prewarm the first F of each file (0 < F <= 1)"
    )
    pw.add_argument("--force", action="store_true", help="prewarm even when larger than MemAvailable")
    pw.add_argument(
        "--max-bytes",
        type=_size,
        default=None,
        help="refuse to read more than this (default: MemAvailable), e.g. 20GiB",
    )
    pw.add_argument("--workers", type=int, default=8, help="parallel readers")
    pw.add_argument("--quiet", action="store_true", help="no progress bar")
    pw.add_argument("--json", action="store_true")
    pw.set_defaults(func=cmd_prewarm)

    kn = sub.add_parser("knobs", help="every environment knob: default, alias, current setting")
    kn.add_argument("--json", action="store_true")
    kn.set_defaults(func=cmd_knobs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
