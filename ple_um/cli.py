"""The `ple-um` command: bench, probe, inspect, residency, prewarm, knobs. Each verb takes --json.

Exit codes: 0 done; 1 the checkpoint is invalid or cannot be read; 2 bad arguments (the command
line, an environment knob, a mode forced where it cannot work); 3 prewarm refused (the table is
larger than the memory it may fill); 141 stdout was closed early (``| head``), quietly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from functools import partial

from ple_um import envs, units
from ple_um.units import format_bytes

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
# What a shell reports for a command killed by SIGPIPE (Python ignores the signal and raises instead).
EXIT_BROKEN_PIPE = 141
MODES = ("ats", "registered", "cpu", "device")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are the CLI's: one line ``ple-um VERB: error: ...`` on stderr, or
    ``{"error": ...}`` on stdout when --json was given; exit 2 either way."""

    def __init__(self, *args, json_errors: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str):
        if self.json_errors:
            _emit_json({"error": message})
        else:
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


# -- argument types: each refuses a bad value naming it and what is accepted -------------------
def _size(text: str) -> int:
    try:
        return units.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _table_size(text: str) -> int:
    value = _size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


_positive = partial(_int, low=1)
_count = partial(_int, low=0)


def _rows(text: str) -> tuple[int, ...]:
    rows = tuple(_positive(x) for x in text.split(",") if x.strip())
    if not rows:
        raise argparse.ArgumentTypeError("no batch sizes given")
    return rows


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    for m in modes:
        if m not in MODES:
            raise argparse.ArgumentTypeError(
                f"{m!r} is not a ple-um mode: expected a comma-separated list of {', '.join(MODES)}"
            )
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode is named twice in {text!r}")
    return modes


def _ids(text: str):
    from ple_um.bench.ids import parse_ids

    try:
        return parse_ids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device(text: str) -> str:
    """A device name of a kind ple-um serves. Whether this machine has it is the verb's question:
    the probe reports it, the bench refuses it."""
    import torch

    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: expected cpu, cuda or cuda:N")
    return text


# -- output ---------------------------------------------------------------------------------------
def _emit_json(data: dict) -> None:
    print(json.dumps(data, indent=1, default=str))


def _fail(args: argparse.Namespace, message: str, code: int = EXIT_INVALID, **extra) -> int:
    """Report an error: a JSON object with "error" under --json, else a line on stderr."""
    if args.json:
        _emit_json({"error": message, **extra})
    else:
        print(f"ple-um {args.verb}: error: {message}", file=sys.stderr)
    return code


# -- verbs ----------------------------------------------------------------------------------------
def _bench_refusal(args: argparse.Namespace) -> str | None:
    """Why the bench cannot run as asked, found before it starts (it takes minutes), or None."""
    from ple_um.access.capabilities import resolve_device

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib, which is not installed: pip install 'ple-um[plot]'"
    for flag, path in (("--json-file", args.json_file), ("--plot", args.plot)):
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if path.endswith(os.sep) or os.path.isdir(path):
            return f"{flag} {path}: is a directory; give a file name"
        if not os.path.isdir(parent):
            return f"{flag} {path}: its directory does not exist"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{flag} {path}: its directory is not writable"
    if args.dir is not None and not os.path.isdir(args.dir):
        hint = (
            " (--json prints the results, --json-file PATH writes them)" if args.dir.endswith(".json") else ""
        )
        return f"checkpoint directory {args.dir} does not exist{hint}"
    if args.dir is None:
        rows = args.size // args.row_bytes
        if rows < 1:
            return (
                f"--size {args.size} B holds no row of {args.row_bytes} B (--row-bytes): give at least that"
            )
        if args.shards > rows:
            return f"--shards {args.shards} is more than the {rows} rows of --size {args.size} B"
    try:
        resolve_device(args.device)
    except ValueError as exc:
        return f"--device: {exc}"
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    from ple_um.bench import runner
    from ple_um.errors import CheckpointError

    refusal = _bench_refusal(args)
    if refusal is not None:
        return _fail(args, refusal, EXIT_USAGE)
    cfg = runner.Config(
        directory=args.dir,
        size=args.size,
        row_bytes=args.row_bytes,
        shards=args.shards,
        rows=args.rows,
        modes=args.modes,
        ids=args.ids,
        repeats=args.repeats,
        rounds=args.rounds,
        device=args.device,
        processes=args.processes,
    )
    # Under --json, stdout holds the JSON object alone: progress lines and the table go to stderr.
    to_stderr = lambda line: print(line, file=sys.stderr)
    try:
        result = runner.run(cfg, log=to_stderr if args.quiet or args.json else print)
    except CheckpointError as exc:  # the directory's table (the synthetic one is written valid)
        return _fail(args, str(exc))
    (to_stderr if args.json else print)(runner.format_table(result, cfg.rows))
    if args.json:
        _emit_json(result)
    if args.json_file:
        runner.write_json(result, args.json_file)
    if args.plot:
        from ple_um.bench.plot import plot

        plot(result, cfg.rows, args.plot)
    return EXIT_OK


def cmd_probe(args: argparse.Namespace) -> int:
    import ple_um
    from ple_um.errors import CheckpointError, ModeUnavailableError

    if args.recheck and args.dir is None:
        return _fail(args, "--recheck needs DIR: the check reads the table's own files", EXIT_USAGE)
    try:
        report = ple_um.probe(args.device, path=args.dir, layer=args.layer, recheck=args.recheck)
    except CheckpointError as exc:
        return _fail(args, str(exc))
    except ModeUnavailableError as exc:
        if not exc.reason.startswith("FirstReadRejected"):
            raise  # a mode forced where the machine cannot run it: bad input, exit 2 (main)
        return _fail(args, str(exc))  # the forced mode's first read failed here: exit 1
    if args.json:
        _emit_json(report.as_dict())
    else:
        print(report.describe())
        print("capabilities:")
        for key, value in report.capabilities.items():
            print(f"  {key}: {value}")
        if report.pin_budget is not None:
            print(f"pin budget: {format_bytes(report.pin_budget)}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ple_um import operating

    result = operating.inspect(args.dir, args.layer)
    if args.json:
        _emit_json(result)
        return EXIT_OK if result["valid"] else EXIT_INVALID
    layers, where = result["layers"], result["directory"]
    if layers is not None:
        found = ", ".join(map(str, layers)) or "none"
    elif os.path.isdir(where):
        found = "cannot tell (headers unreadable)"
    else:
        found = "none: " + ("not a directory" if os.path.exists(where) else "the directory does not exist")
    print(f"checkpoint: {result['directory']}")
    print(f"PLE layers with shards: {found}")
    for t in result["tables"]:
        scale = "none (16-bit table)" if t["scale"] is None else f"{t['scale']:.8g} ({t['scale_tensor']})"
        print(
            f"layer {t['layer']}: {t['rows']} rows x {t['row_dim']} {t['dtype']} "
            f"({t['row_bytes']} B/row) = {format_bytes(t['bytes'])} ({t['bytes']} B)"
        )
        print(
            f"  {t['parts']} shards of {t['rows_per_shard']} rows (ceil layout) in {len(t['files'])} files; "
            f"scale {scale}"
        )
        for f in t["files"]:
            if not f["shards"]:  # an NVFP4 table's block scales in a file of their own
                print(f"  {f['file']}: block scales, {format_bytes(f['bytes'])}")
                continue
            first, last = f["shards"][0], f["shards"][-1]
            span = f"shard {first}" if first == last else f"shards {first}-{last}"
            print(f"  {f['file']}: {span}, {format_bytes(f['bytes'])}")
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


def _one_layer(args: argparse.Namespace) -> int | None:
    """For the verbs that serve one layer: where --layer is missing and the checkpoint has several,
    exit 2 naming them and the flag (the library's message names its ``layer=`` argument)."""
    from ple_um.checkpoint import find_layers
    from ple_um.errors import CheckpointError

    if args.layer is not None:
        return None
    try:
        layers = find_layers(os.path.abspath(args.dir))
    except CheckpointError:
        return None  # the verb reports why the checkpoint cannot be read
    if len(layers) < 2:
        return None
    found = ", ".join(map(str, layers))
    return _fail(
        args, f"several PLE layers have shards in {args.dir}: {found}; pass --layer to pick one", EXIT_USAGE
    )


def _residency_lines(r: dict) -> list[str]:
    lines = ["| shard | file | bytes | resident | % |", "| --- | --- | --- | --- | --- |"]
    for s in r["shards"]:
        lines.append(
            f"| {s['index']} | {s['file']} | {format_bytes(s['bytes'])} | "
            f"{format_bytes(s['resident_bytes'])} | {100 * s['fraction']:.1f} |"
        )
    t = r["total"]
    lines.append(
        f"total: {format_bytes(t['resident_bytes'])} of {format_bytes(t['bytes'])} resident "
        f"({100 * t['fraction']:.1f}%), layer {r['layer']}, {r['directory']}"
    )
    return lines


def cmd_residency(args: argparse.Namespace) -> int:
    from ple_um import operating
    from ple_um.errors import CheckpointError

    refused = _one_layer(args)
    if refused is not None:
        return refused
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

    refused = _one_layer(args)
    if refused is not None:
        return refused
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
    except CheckpointError as exc:
        return _fail(args, str(exc))
    if args.json:
        _emit_json(result)
        return EXIT_OK
    before, after = result["before"], result["after"]
    rate = result["read_bytes"] / result["seconds"] / 1e9 if result["seconds"] else 0.0
    print(
        f"prewarmed {format_bytes(result['read_bytes'])} ({100 * result['fraction']:.0f}% of each file) "
        f"of layer {result['layer']} in {result['seconds']:.2f} s ({rate:.2f} GB/s)"
        + (" (forced past the memory limit)" if result["forced"] else "")
    )
    print(
        f"resident: {format_bytes(before['resident_bytes'])} -> {format_bytes(after['resident_bytes'])} of "
        f"{format_bytes(after['bytes'])} ({100 * before['fraction']:.1f}% -> {100 * after['fraction']:.1f}%)"
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


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    p = _Parser(prog="ple-um", description=__doc__, json_errors=json_errors)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=partial(_Parser, json_errors=json_errors))

    b = sub.add_parser("bench", help="compare every lookup path on this machine, side by side")
    b.add_argument(
        "dir", nargs="?", default=None, help="checkpoint dir (default: a cached synthetic FP8 table)"
    )
    b.add_argument("--size", type=_table_size, default=2 << 30, help="synthetic table size (default 2GiB)")
    b.add_argument("--row-bytes", type=_positive, default=160, help="synthetic table row width in bytes")
    b.add_argument("--shards", type=_positive, default=128, help="synthetic table shard count")
    b.add_argument(
        "--rows", type=_rows, default=(16, 1024, 16384, 131072), help="batch sizes, comma-separated"
    )
    b.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help=f"ple-um modes to run, comma-separated: some of {', '.join(MODES)}",
    )
    b.add_argument(
        "--ids",
        type=_ids,
        default="uniform",
        help="id distributions, comma-separated: uniform (default), zipf:S (n-grams drawn Zipf(S), "
        "1.01 <= S <= 10, hashed onto rows), trace[:FILE] (real traffic: the shipped sample or FILE, "
        "replayed as decode steps and prefill chunks; docs/TRAFFIC.md), e.g. uniform,zipf:1.1,trace",
    )
    b.add_argument("--repeats", type=_positive, default=20, help="timed calls per measurement")
    b.add_argument(
        "--rounds",
        type=_positive,
        default=4,
        help="rounds the timed calls are split into; each round times every path in turn (default 4)",
    )
    b.add_argument(
        "--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: the current GPU)"
    )
    b.add_argument(
        "--processes",
        type=_count,
        default=0,
        help="N >= 1: also open the table in N processes, one after the other, and report the host "
        "memory each takes (default 0: off)",
    )
    b.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON object on stdout (progress and the table go to stderr)",
    )
    b.add_argument("--json-file", default=None, metavar="PATH", help="write the results as JSON to PATH")
    b.add_argument(
        "--plot", default=None, metavar="PNG", help="write a PNG plot (pip install 'ple-um[plot]')"
    )
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
    pr.add_argument(
        "--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: the current GPU)"
    )
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
        "--fraction", type=_fraction, default=1.0, help="prewarm the first F of each file (0 < F <= 1)"
    )
    pw.add_argument("--force", action="store_true", help="prewarm even when larger than MemAvailable")
    pw.add_argument(
        "--max-bytes",
        type=_size,
        default=None,
        help="refuse to read more than this (default: MemAvailable), e.g. 20GiB",
    )
    pw.add_argument("--workers", type=_positive, default=8, help="parallel readers")
    pw.add_argument("--quiet", action="store_true", help="no progress bar")
    pw.add_argument("--json", action="store_true")
    pw.set_defaults(func=cmd_prewarm)

    kn = sub.add_parser("knobs", help="every environment knob: default, alias, current setting")
    kn.add_argument("--json", action="store_true")
    kn.set_defaults(func=cmd_knobs)
    return p


def _forced_mode(args: argparse.Namespace, exc) -> str:
    """A forced mode this machine cannot run: who forced it, why not, and the modes it can run."""
    from ple_um.access.capabilities import read_capabilities
    from ple_um.access.probe import ALL_MODES, pin_budget, reason_if_unsatisfied

    caps = read_capabilities(getattr(args, "device", None))
    usable = [m for m in ALL_MODES if reason_if_unsatisfied(m, caps, None, pin_budget()) is None]
    forced = envs.KNOBS["PLE_UM_MODE"].raw()
    who = f"{forced[0]}={forced[1]}: " if forced else ""
    return f"{who}{exc}; this machine can run: {', '.join(usable)}"


def main(argv: list[str] | None = None) -> int:
    from ple_um.errors import KnobError, ModeUnavailableError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(json_errors="--json" in argv).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        code = args.func(args)
        sys.stdout.flush()  # so that a reader gone early (`| head`) shows here, not at exit
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's own flush at exit finds no pipe to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KnobError as exc:
        return _fail(args, str(exc), EXIT_USAGE)
    except ModeUnavailableError as exc:
        return _fail(args, _forced_mode(args, exc), EXIT_USAGE)
    return code


if __name__ == "__main__":
    sys.exit(main())
