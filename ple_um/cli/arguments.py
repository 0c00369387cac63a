"""The CLI's parser and argument types: each type refuses a bad value naming it and what is
accepted; lists are comma-separated, empty items (``16,``, ``cpu,,device``) ignored alike; help
shows every verb's description and every option's default."""

from __future__ import annotations

import argparse
import os
from functools import partial

from ple_um import units
from ple_um.cli.output import EXIT_INVALID, EXIT_USAGE, CliError, report

MODES = ("ats", "registered", "cpu", "device")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default where it has one worth showing (not None, not a flag's
    False), as the command line would spell it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(default, (list, tuple)):
            return f"{text} (default: {','.join(map(str, default))})"
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse whose errors are the CLI's: one line ``ple-um VERB: error: ...`` on stderr, or
    ``{"error": ...}`` on stdout when --json was given; exit 2 either way."""

    def __init__(self, *args, json_errors: bool = False, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str):
        verb = self.prog.removeprefix("ple-um").strip() or None
        hint = "" if self.json_errors else f" (see {self.prog} --help)"
        raise SystemExit(report(verb, self.json_errors, message + hint, EXIT_USAGE))

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no parser took are refused naming the verb they followed
        (argparse reports them from the top parser, which knows no verb)."""
        found, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = getattr(found, "verb", None)
            prog = f"{self.prog} {verb}" if verb else self.prog
            hint = "" if self.json_errors else f" (see {prog} --help)"
            message = f"unrecognized arguments: {' '.join(extras)}{hint}"
            raise SystemExit(report(verb, self.json_errors, message, EXIT_USAGE))
        return found


def sub_parser_class(json_errors: bool):
    return partial(Parser, json_errors=json_errors)


# -- argument types -------------------------------------------------------------------------------
def items(text: str) -> list[str]:
    """The items of a comma-separated list, stripped; empty ones dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def size(text: str) -> int:
    try:
        return units.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def nonzero_size(text: str) -> int:
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def sizes(text: str) -> tuple[int, ...]:
    """One byte count or several, comma-separated, each at least 1 byte."""
    found = tuple(nonzero_size(x) for x in items(text))
    if not found:
        raise argparse.ArgumentTypeError("no sizes given")
    return found


def whole(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


positive = partial(whole, low=1)
count = partial(whole, low=0)


def rows(text: str) -> tuple[int, ...]:
    found = tuple(positive(x) for x in items(text))
    if not found:
        raise argparse.ArgumentTypeError("no batch sizes given")
    return found


def _number(text: str, low: float, high: float, low_open: bool, expected: str) -> float:
    """``text`` as a float within ``[low, high]`` (above ``low`` where ``low_open``), else the
    ArgumentTypeError ``expected`` followed by ``got 'text'``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (low < value if low_open else low <= value) or not value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
    return value


def fraction(text: str) -> float:
    return _number(text, 0, 1, True, "must be in (0, 1]")


def seconds(text: str) -> float:
    """A duration in seconds, at least 0 and at most a day."""
    return _number(text, 0, 86400, False, "expected seconds from 0 to 86400")


def milliseconds(text: str) -> tuple[float, ...]:
    """Durations in milliseconds, comma-separated, each above 0 and at most 10 s."""
    found = tuple(
        _number(item, 0, 10000, True, "expected milliseconds above 0 and at most 10000")
        for item in items(text)
    )
    if not found:
        raise argparse.ArgumentTypeError("no durations given")
    return found


def modes(text: str) -> tuple[str, ...]:
    """Access modes, any case (as PLE_UM_MODE takes them)."""
    found = tuple(m.lower() for m in items(text))
    if not found:
        raise argparse.ArgumentTypeError(
            f"no mode given: expected a comma-separated list of {', '.join(MODES)}"
        )
    for m in found:
        if m not in MODES:
            raise argparse.ArgumentTypeError(
                f"{m!r} is not a ple-um mode: expected a comma-separated list of {', '.join(MODES)}"
            )
    if len(set(found)) != len(found):
        raise argparse.ArgumentTypeError(f"a mode is named twice in {text!r}")
    return found


class IdsArg(tuple):
    """The id distributions parsed, with ``text``, what was given (a child process parses it again)."""

    text: str


def ids(text: str) -> IdsArg:
    from ple_um.bench.ids import parse_ids

    listed = items(text)
    if not listed:
        raise argparse.ArgumentTypeError("no id distribution given")
    try:
        parsed = IdsArg(parse_ids(",".join(listed)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    parsed.text = ",".join(listed)
    return parsed


def device(text: str) -> str:
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


# -- checks made before a verb works ---------------------------------------------------------------
def checkpoint_dir(path: str) -> str:
    """``path`` as a checkpoint directory, or CliError (exit 1): it does not exist, or is a file."""
    hint = " (--json prints the results, --json-file PATH writes them)" if path.endswith(".json") else ""
    if not os.path.exists(path):
        raise CliError(f"checkpoint directory {path} does not exist{hint}", EXIT_INVALID)
    if not os.path.isdir(path):
        raise CliError(f"checkpoint directory {path} is not a directory{hint}", EXIT_INVALID)
    return path


def one_layer(path: str, layer: int | None) -> None:
    """For the verbs that serve one layer: where --layer is missing and the checkpoint has several,
    or --layer names one it does not have, CliError (exit 2) naming the layers it has and the flag
    (the library's message names its ``layer=``)."""
    from ple_um.checkpoint import find_layers
    from ple_um.errors import CheckpointError

    try:
        layers = find_layers(os.path.abspath(path))
    except CheckpointError:
        return  # the verb reports why the checkpoint cannot be read
    if layer is not None:
        if layers and layer not in layers:
            found = ", ".join(map(str, layers))
            raise CliError(
                f"--layer {layer}: no PLE shards of layer {layer} in {path}; layers with shards: {found}",
                EXIT_USAGE,
            )
        return
    if len(layers) >= 2:
        found = ", ".join(map(str, layers))
        raise CliError(
            f"several PLE layers have shards in {path}: {found}; pass --layer to pick one", EXIT_USAGE
        )


def output_file(flag: str, path: str) -> None:
    """CliError (exit 2) unless ``path`` can be created or replaced as a file."""
    parent = os.path.dirname(os.path.abspath(path))
    if path.endswith(os.sep) or os.path.isdir(path):
        raise CliError(f"{flag} {path}: is a directory; give a file name", EXIT_USAGE)
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path}: its directory does not exist", EXIT_USAGE)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {path}: its directory is not writable", EXIT_USAGE)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"{flag} {path}: the file is not writable", EXIT_USAGE)


def add_common(
    parser: argparse.ArgumentParser, json_help: str = "print the answer as one JSON object"
) -> None:
    """The options every verb takes: -v (also after the verb) and --json."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level"
    )
    parser.add_argument("--json", action="store_true", help=json_help)


def add_layer(parser: argparse.ArgumentParser, default_help: str = "the only one") -> None:
    parser.add_argument("--layer", type=count, default=None, help=f"PLE layer (default: {default_help})")
