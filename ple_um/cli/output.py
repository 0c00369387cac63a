"""How the CLI answers: its exit codes, its one kind of error line, and its writes to stdout.

Every error of every verb is said one way: ``ple-um VERB: error: MESSAGE`` on stderr, or
``{"error": MESSAGE, ...}`` on stdout under --json, with the exit code of its kind.
"""

from __future__ import annotations

import json
import sys

EXIT_OK = 0
# The checkpoint is invalid or cannot be read, or an output (stdout, --json-file, --plot) cannot be
# written.
EXIT_INVALID = 1
# Bad arguments: the command line, an environment knob, a mode forced where it cannot work.
EXIT_USAGE = 2
# Refused: the work would not fit (prewarm: more than the memory it may fill; bench: a table larger
# than the free disk or the file-size limit, a run larger than the memory).
EXIT_REFUSED = 3
# The run could not measure what was asked (a mode asked for that failed to open, a memory limit
# whose child gave no figures): the figures it did take are written, and the error says what is missing.
EXIT_INCOMPLETE = 4
# An interrupt (Ctrl-C), as a shell reports a command killed by SIGINT.
EXIT_INTERRUPTED = 130
# What a shell reports for a command killed by SIGPIPE (Python ignores the signal and raises instead).
EXIT_BROKEN_PIPE = 141


class CliError(Exception):
    """An error a verb reports and exits with: its message, exit code, and extra JSON fields."""

    def __init__(self, message: str, code: int = EXIT_INVALID, **extra) -> None:
        super().__init__(message)
        self.message, self.code, self.extra = message, code, extra


class OutputError(OSError):
    """stdout could not be written (a full disk, a closed file other than a pipe)."""


def emit(*lines: str) -> None:
    """Lines of the verb's answer on stdout (none: an empty line)."""
    try:
        print("\n".join(lines))
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(exc.errno, exc.strerror) from None


def emit_json(data: dict) -> None:
    emit(json.dumps(data, indent=1, default=str))


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def report(verb: str | None, json_mode: bool, message: str, code: int, **extra) -> int:
    """Say an error the CLI's one way and return its exit code. Under --json the object goes to
    stdout, unless stdout is what failed: then the line goes to stderr."""
    prog = f"ple-um {verb}" if verb else "ple-um"
    if json_mode and code != EXIT_BROKEN_PIPE:
        try:
            print(json.dumps({"error": message, **extra}, indent=1, default=str), flush=True)
            return code
        except OSError:
            pass
    to_stderr(f"{prog}: error: {message}")
    return code
