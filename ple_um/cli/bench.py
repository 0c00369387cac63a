"""`ple-um bench`: its options, everything checked before it starts (it takes minutes, its table
gigabytes), and the run with its report, JSON and plot."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import fields

from ple_um.bench import config
from ple_um.bench.config import (
    COLD_ROWS,
    DEFAULT_ROWS,
    MODELS,
    PREFILL_TOKENS,
    REPEATS,
    ROUNDS,
    ROW_BYTES,
    SERVING_STEPS,
    SHARDS,
    SIZE,
    STEP_MS,
    WARMUP_S,
    Config,
)
from ple_um.cli import arguments as a
from ple_um.cli.output import (
    EXIT_INCOMPLETE,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
    emit,
    emit_json,
    to_stderr,
)

DESCRIPTION = """\
Compare every lookup path this machine can run, side by side, on one table: ple-um's modes, the
seeds' CPU gather (vllm_ple_mmap, the CPU-gather vLLM patch that came before ple-um), vLLM's
pinned-host copy on a GPU, each against plain torch.index_select over the table resident in GPU
memory (host memory without a GPU). Without DIR it writes a synthetic FP8 table shaped like
Qwen3.8-Flash-Next's once into PLE_UM_CACHE_DIR (--model deepseek-v41: an Engram table shaped like
DeepSeek-V4.1's, against plain torch and vLLM's stock pinned Engram storage); a table that does not
fit the free disk, or a run that does not fit the memory, is refused before anything is written
(exit 3)."""


def _listing(values) -> str:
    """Figures as the command line takes them: ``5,20,50``."""
    return ",".join(f"{v:g}" for v in values)


def add_parser(sub) -> None:
    """The bench's options, each named as the Config field it sets (``Config``: the run they ask
    for, its defaults and the options that do not go together)."""
    help = "compare every lookup path on this machine, side by side"
    json_help = "print the results as one JSON object on stdout (progress and the report go to stderr)"
    b = a.add_verb(sub, "bench", run, help, DESCRIPTION, knobs=None, json_help=json_help)
    a.add_dir(b, "checkpoint dir (default: a cached synthetic FP8 table)", optional=True)
    b.add_argument(
        "--model",
        choices=MODELS,
        default=Config.model,
        help="the table's kind: a PLE table (Qwen3.8-Flash-Next's) or an Engram table (DeepSeek-V4.1's: "
        "FP8 rows of 256 values, 8 E8M0 scale bytes each, one unsplit tensor), DIR's or synthetic",
    )
    b.add_argument(
        "--size", type=a.nonzero_size, default=None, help=f"synthetic table size (default: {SIZE >> 30}GiB)"
    )
    for flag, what, default in (
        ("--row-bytes", "row width in bytes", ROW_BYTES),
        ("--shards", "shard count", SHARDS),
    ):
        b.add_argument(
            flag, type=a.positive, default=None, help=f"synthetic PLE table {what} (default: {default})"
        )
    b.add_argument(
        "--rows",
        type=a.rows,
        default=None,
        help=f"batch sizes, comma-separated (default: {_listing(DEFAULT_ROWS)}; with --memory-limit "
        f"{_listing(COLD_ROWS)})",
    )
    b.add_argument(
        "--modes",
        type=a.modes,
        default=None,
        help=f"ple-um modes to run, comma-separated: some of {', '.join(a.MODES)} (default: every mode on a "
        "GPU, cpu without one)",
    )
    b.add_argument(
        "--ids",
        type=a.ids,
        default="uniform",
        help="id distributions, comma-separated: uniform, zipf:S[:NGRAMS] (n-grams drawn Zipf(S), "
        "1.01 <= S <= 10, from a space of NGRAMS n-grams, 2 to 2^40, 2^40 unless given, e.g. 64M; "
        "hashed onto rows), trace[:FILE] (real traffic: the shipped sample or FILE, replayed as decode "
        "steps and prefill chunks; docs/TRAFFIC.md), e.g. uniform,zipf:1.1,trace",
    )
    b.add_argument(
        "--repeats",
        type=a.positive,
        default=None,
        help=f"timed calls per measurement (default {REPEATS}; with --serving: timed steps per "
        f"figure, default {SERVING_STEPS})",
    )
    b.add_argument(
        "--rounds",
        type=a.positive,
        default=None,
        help="rounds the timed calls are split into; each times every path in turn (default: "
        f"{ROUNDS}; not with --memory-limit or --serving)",
    )
    a.add_device(b)
    b.add_argument(
        "--processes",
        type=a.count,
        default=Config.processes,
        help="N >= 1: also open the table in N processes, one after the other, and report the host memory "
        "taken once the first, the first two, ... are open (0: off; not with --memory-limit or --serving)",
    )
    b.add_argument("--json-file", default=None, metavar="PATH", help="write the results as JSON to PATH")
    b.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="write a plot of the lookup times to FILE, its format from the extension: .png, .pdf, .svg, ... "
        "(pip install 'ple-um[plot]')",
    )
    _add_steady_options(b)
    b.add_argument("--quiet", action="store_true", help="progress lines to stderr, stdout the report alone")


def _add_steady_options(b) -> None:
    """The options of the bench's steady states: under memory limits, and the serving loop."""
    b.add_argument(
        "--memory-limit",
        dest="memory_limits",
        type=a.sizes,
        default=None,
        metavar="SIZE[,SIZE...]",
        help="the bench for tables larger than memory: for each limit, ple-um's cpu and ats lookups in a "
        "child process held to that many bytes by a memory cgroup (page cache included), cold and in the "
        "steady state, beside the storage's ceiling measured in the same run; --plot draws time against "
        "the limit",
    )
    b.add_argument(
        "--warmup",
        dest="warmup_s",
        type=a.seconds,
        default=None,
        metavar="SECONDS",
        help="with --memory-limit or --serving: seconds of lookups (of steps) before the steady state is "
        f"timed, so that the row cache and the page cache fill as a server's would (default {WARMUP_S:g}; at "
        "least 10 calls)",
    )
    b.add_argument(
        "--serving",
        action="store_true",
        help="the serving loop (needs a CUDA device): a decode step of fixed GPU work (--step-ms) whose "
        f"lookups ({Config.decode_tokens} tokens x {Config.heads} rows, and a prefill chunk of "
        f"--prefill-tokens x {Config.heads} rows, fresh ids every step) "
        "are forked onto a side stream at its start and joined at its end, the whole step one CUDA graph; "
        "each step time against the same loop with the table resident in GPU memory and with no lookup, "
        "with the row cache's hit rates; with --memory-limit also under each limit. --modes picks the "
        "modes served (default cpu); --plot draws grouped bars",
    )
    b.add_argument(
        "--step-ms",
        type=a.milliseconds,
        default=None,
        metavar="MS[,MS...]",
        help="with --serving: the GPU work of a step in milliseconds, a figure each "
        f"(default {_listing(STEP_MS)})",
    )
    b.add_argument(
        "--prefill-tokens",
        type=a.count,
        default=None,
        metavar="N",
        help=f"with --serving: the tokens of the prefill chunk looked up every step beside the decode "
        f"step's, {Config.heads} rows each (default {PREFILL_TOKENS}; 0: decode steps only)",
    )


def _check_outputs(args: argparse.Namespace) -> None:
    if args.plot:
        a.output_file("--plot", args.plot)
        try:
            from ple_um.bench.plot import check_writable_format

            check_writable_format(args.plot)
        except ImportError:
            raise CliError(
                "--plot needs matplotlib, which is not installed: pip install 'ple-um[plot]'", EXIT_USAGE
            ) from None
        except ValueError as exc:
            raise CliError(f"--plot {exc}", EXIT_USAGE) from None
    if args.json_file:
        a.output_file("--json-file", args.json_file)
        if args.plot and os.path.abspath(args.plot) == os.path.abspath(args.json_file):
            raise CliError("--plot and --json-file name the same file", EXIT_USAGE)


def _config(args: argparse.Namespace) -> Config:
    """The run the options ask for: every option that names a Config field, DIR and the command
    line; options that do not go together refused (exit 2), a mode that holds the table in memory
    under --memory-limit too."""
    from ple_um.bench.cold import COLD_MODES

    given = {f.name: getattr(args, f.name) for f in fields(Config) if hasattr(args, f.name)}
    command = shlex.join(["ple-um", *getattr(args, "argv", sys.argv[1:])])
    try:
        cfg = Config(**given, directory=args.dir, command=command)
    except config.BenchUsageError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    held = [m for m in cfg.modes or () if m not in COLD_MODES]
    if cfg.memory_limits and held:
        raise CliError(
            "--memory-limit runs only the modes that read the table where it lies "
            f"({', '.join(COLD_MODES)}): --modes {','.join(held)} holds it in memory",
            EXIT_USAGE,
        )
    return cfg


def _layout(cfg: Config):
    """DIR's table checked and its layout read; None for the synthetic table (not written yet).
    A DIR that holds the other model's tables (an Engram table benched as a PLE one, or the other
    way round) is refused naming the --model that reads it (exit 2), not as a broken checkpoint."""
    from ple_um.errors import CheckpointError

    if cfg.directory is None:
        return None
    a.one_layer(cfg.directory, cfg.layer, engram=cfg.engram)
    try:
        return config.bench_layout(cfg)
    except CheckpointError as exc:
        held = a.other_tables(cfg.directory, cfg.engram)
        if held is None:
            raise
        model = config.PLE_MODEL if cfg.engram else config.ENGRAM_MODEL
        raise CliError(f"{exc}: {held}: give --model {model}", EXIT_USAGE) from None


def _check_modes(cfg: Config, device, table_bytes: int) -> None:
    """Every mode --modes names must run here: one that cannot would measure nothing (exit 2,
    naming it, why, and the modes this machine can run)."""
    if not cfg.modes:
        return
    # Under --memory-limit the table is never pinned: the pin budget does not apply.
    limited = bool(cfg.memory_limits)
    why = a.why_not(device, None if limited else table_bytes, pinned=not limited)
    refused = [f"{m} ({why[m]})" for m in cfg.modes if why[m] is not None]
    if refused:
        usable = ", ".join(m for m, reason in why.items() if reason is None)
        raise CliError(
            f"--modes: this machine cannot run {'; '.join(refused)}; it can run: {usable}", EXIT_USAGE
        )


def _check_machine(cfg: Config, layout) -> None:
    """The device, a mode forced by PLE_UM_MODE, the modes asked for, and whether the run fits this
    machine (``sizing.check_fits``: exit 3 where it does not)."""
    import torch

    import ple_um
    from ple_um.bench import sizing

    device = a.resolved(cfg.device)
    table_bytes = cfg.table_bytes(layout)
    ple_um.probe(device, table_bytes=table_bytes)  # ModeUnavailableError: a mode forced where it cannot work
    _check_modes(cfg, device, table_bytes)
    cuda = device.type == "cuda"
    if cfg.serving and not cuda:
        raise CliError(
            f"--serving times a decode loop captured in CUDA graphs: {device} is not a CUDA device"
            + ("" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)"),
            EXIT_USAGE,
        )
    gpu_free = torch.cuda.mem_get_info(device)[0] if cuda else None
    try:
        sizing.check_fits(cfg, layout, cuda, gpu_free)
    except sizing.BenchRefused as exc:
        raise CliError(str(exc), EXIT_REFUSED, refused=True) from None


def unmeasured(result: dict, modes: tuple[str, ...] | None) -> list[str]:
    """What a finished run was asked for and has no figures of, each with why: the open figures
    (start-up, --processes), a mode named by --modes that was skipped, a memory limit whose child
    gave no figures, a mode its child skipped or whose steady state failed, a serving configuration
    that failed."""
    missing = []
    if "skipped" in result.get("startup", {}):
        missing.append(f"start-up: {result['startup']['skipped']}")
    for kind, entry in result.get("processes", {}).items():
        if "skipped" in entry:
            missing.append(f"{kind} processes: {entry['skipped']}")
    for name, entry in result.get("lookup", {}).items():
        if modes and name.removeprefix("ple-um ") in modes and "skipped" in entry:
            missing.append(f"{name}: {entry['skipped']}")
    for name, entry in result.get("configs", {}).items():  # the serving loop's
        for what in ("skipped", "failed"):
            if what in entry:
                missing.append(f"{name}: {entry[what]}")
    for mode, why in result.get("left_out", {}).items():
        missing.append(f"ple-um {mode}: {why}")
    for entry in result.get("limits", {}).values():
        where = f"under {entry['how']}"
        if "failed" in entry:
            missing.append(f"{where}: {entry['failed']}")
        for mode, runs in entry.get("modes", {}).items():
            if "skipped" in runs:
                missing.append(f"ple-um {mode} {where}: {runs['skipped']}")
            if "steady_failed" in runs:
                missing.append(f"ple-um {mode} {where}: {runs['steady_failed']}")
    return missing


def _write(args: argparse.Namespace, result: dict, say, missing: list[str]) -> None:
    """The JSON and the plot, each written whole or not at all, one whatever became of the other;
    then where they went. Under --json the results go to stdout unless ``missing``
    (``unmeasured``): the error carries them."""
    from ple_um.bench import plot, report

    written, failed = [], []
    for flag, path, what, write in (
        ("--json-file", args.json_file, "results (JSON)", report.write_json),
        ("--plot", args.plot, "plot", plot.draw),
    ):
        if not path:
            continue
        try:
            write(result, path)
            written.append(f"{what}: {os.path.abspath(path)}")
        except (OSError, ValueError) as exc:
            failed.append(f"{flag} {path}: {getattr(exc, 'strerror', None) or exc}")
    if failed:
        # The results go with the error (under --json in its object), so that no run is lost.
        for line in written:
            say(line)
        raise CliError(f"the results could not be written: {'; '.join(failed)}", EXIT_INVALID, results=result)
    if args.json and not missing:
        emit_json(result)
    for line in written or [
        "results: not written to a file (--json-file PATH writes them, --plot FILE plots them)"
    ]:
        say(line)


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    cfg = _config(args)
    layout = _layout(cfg)
    _check_machine(cfg, layout)
    # Under --json, stdout holds the JSON object alone: progress lines and the report go to stderr.
    say = to_stderr if args.json else emit
    log = to_stderr if args.quiet or args.json else emit
    from ple_um.bench import cold, report, runner, serving

    result = {"serving": serving, "memory-limit": cold}.get(cfg.kind, runner).run(cfg, log=log)
    say(report.format_report(result))
    missing = unmeasured(result, cfg.modes)
    _write(args, result, say, missing)
    if missing:
        raise CliError(
            "the run could not measure what was asked: " + "; ".join(missing), EXIT_INCOMPLETE, results=result
        )
    return EXIT_OK
