"""The `ple-um` command: bench, probe, inspect, residency, prewarm, knobs. Each verb takes --json
and -v, and checks its arguments and the environment knobs it reads before it starts any work.

Exit codes: 0 done; 1 the checkpoint is invalid or cannot be read, or an output cannot be written;
2 bad arguments (the command line, an environment knob, a mode forced where it cannot work);
3 refused, nothing done (prewarm: larger than the memory it may fill; bench: a table larger than
the free disk or the file-size limit, a run larger than the memory, a memory limit smaller than its
child process); 4 the run could not measure what was asked (its figures are written, the error says
what is missing); 130 interrupted (143, 129: bench ended by SIGTERM, SIGHUP while a child runs
under a memory limit, cleaned up as for an interrupt); 141 stdout was closed early (``| head``),
quietly. Errors are one line ``ple-um VERB: error: ...`` on stderr, or ``{"error": ...}`` on stdout
under --json.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial

from ple_um.bench.signals import Terminated
from ple_um.cli import bench, checkpoint, machine
from ple_um.cli.arguments import Parser, other_tables, why_not
from ple_um.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
    OutputError,
    report,
)
from ple_um.version import __version__

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    p = Parser(prog="ple-um", description=__doc__, json_errors=json_errors)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (also after the verb)")
    p.add_argument("--version", action="version", version=f"ple-um {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=partial(Parser, json_errors=json_errors))
    bench.add_parser(sub)
    machine.add_parsers(sub)
    checkpoint.add_parsers(sub)
    return p


def _forced_mode(args: argparse.Namespace, exc) -> str:
    """A forced mode this machine cannot run: who forced it, why not, and the modes it can run."""
    from ple_um import envs

    usable = [m for m, why in why_not(getattr(args, "device", None)).items() if why is None]
    forced = envs.KNOBS["PLE_UM_MODE"].raw()
    who = f"{forced[0]}={forced[1]}: " if forced else ""
    return f"{who}{exc}; this machine can run: {', '.join(usable)}"


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit has nothing to fail on."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _dispatch(args: argparse.Namespace) -> int:
    from ple_um import envs
    from ple_um.errors import CheckpointError, KnobError, ModeUnavailableError

    try:
        if args.knobs != ():  # the knobs this verb reads (None: every one), checked before any work
            envs.check(only=args.knobs)
        code = args.func(args)
        sys.stdout.flush()  # so that a reader gone early (`| head`) or a full disk shows here, not at exit
        return code
    except KnobError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except CheckpointError as exc:  # DIR's table (a synthetic one is written valid)
        # A verb of PLE tables given a checkpoint of Engram tables alone: the wrong verb, not a
        # broken checkpoint (bench, which reads either, says which --model reads it).
        directory = getattr(args, "dir", None)
        if directory is not None and args.verb != "bench":
            held = other_tables(directory, engram=False)
            if held is not None:
                raise CliError(f"{exc}: {held}; `ple-um {args.verb}` reads PLE tables", EXIT_USAGE) from None
        raise CliError(str(exc), EXIT_INVALID) from None
    except ModeUnavailableError as exc:
        raise CliError(_forced_mode(args, exc), EXIT_USAGE) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    json_mode = "--json" in argv
    args = build_parser(json_errors=json_mode).parse_args(argv)
    args.argv = argv
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return _dispatch(args)
    except CliError as exc:
        return report(args.verb, json_mode, exc.message, exc.code, **exc.extra)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except OutputError as exc:
        _quiet_stdout()
        return report(args.verb, False, f"cannot write to stdout: {exc.strerror}", EXIT_INVALID)
    except Terminated as exc:  # SIGTERM or SIGHUP while a bench child ran: cleaned up as an interrupt
        return report(args.verb, False, str(exc), exc.code)
    except KeyboardInterrupt:
        return report(args.verb, False, "interrupted", EXIT_INTERRUPTED)
    except OSError as exc:  # a file the work reads or writes, named by the OS
        where = f" ({exc.filename})" if exc.filename else ""
        return report(args.verb, json_mode, f"{exc.strerror or exc}{where}", EXIT_INVALID)


if __name__ == "__main__":
    sys.exit(main())
