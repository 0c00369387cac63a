"""The `ple-um` command: bench, probe (and the operating verbs). Each verb takes --json."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ple_um import envs


def _size(text: str) -> int:
    return envs._size(text)


def _rows(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


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
        device=args.device,
    )
    result = runner.run(cfg, log=(lambda s: print(s, file=sys.stderr)) if args.quiet else print)
    print(runner.format_table(result, cfg.rows))
    if args.json:
        runner.write_json(result, args.json)
    if args.plot:
        from ple_um.bench.plot import plot

        plot(result, cfg.rows, args.plot)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    import ple_um

    report = ple_um.probe(args.device)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(report.describe())
        for key, value in report.capabilities.items():
            print(f"  {key}: {value}")
    return 0


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
    b.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    b.add_argument("--device", default=None)
    b.add_argument("--json", default=None, help="write the results as JSON to this file")
    b.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    b.add_argument("--quiet", action="store_true", help="progress lines to stderr")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("probe", help="the device's capabilities and the mode auto would choose")
    pr.add_argument("--device", default=None)
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
