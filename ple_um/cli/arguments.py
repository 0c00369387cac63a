"""The CLI's parser and argument types: each type refuses a bad value naming it and what is
accepted; lists are comma-separated, empty items (``16,``, ``cpu,,device``) ignored alike; help
shows every verb's description and every option's default."""

from __future__ import annotations

import argparse
import os
from functools import partial

from ple_um import units
from ple_um.access.probe import ALL_MODES as MODES
from ple_um.cli.output import EXIT_INVALID, EXIT_USAGE, CliError, report


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
    ``{"error": ...}`` on stdout when --json was given; exit 2 either way. Options are taken only
    as spelled, never abbreviated: the CLI knows --json by its full name (``main``), so ``--jso``
    taken for it would print answers as JSON and errors as text."""

    def __init__(self, *args, json_errors: bool = False, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str):
        self.refuse(self.prog.removeprefix("ple-um").strip() or None, message)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no parser took are refused naming the verb they followed
        (argparse reports them from the top parser, which knows no verb)."""
        found, extras = self.parse_known_args(args, namespace)
        if extras:
            self.refuse(getattr(found, "verb", None), f"unrecognized arguments: {' '.join(extras)}")
        return found

    def refuse(self, verb: str | None, message: str):
        """Exit 2 with ``message``, said the CLI's way, and where to look for the verb's options."""
        prog = f"ple-um {verb}" if verb else "ple-um"
        hint = "" if self.json_errors else f" (see {prog} --help)"
        raise SystemExit(report(verb, self.json_errors, message + hint, EXIT_USAGE))


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


def listed(convert, none_given: str):
    """An argument type: a comma-separated list of ``convert``'s values, at least one."""

    def parse(text: str) -> tuple:
        found = tuple(convert(item) for item in items(text))
        if not found:
            raise argparse.ArgumentTypeError(none_given)
        return found

    return parse


# One byte count or several, each at least 1 byte.
sizes = listed(nonzero_size, "no sizes given")


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


rows = listed(positive, "no batch sizes given")


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


# Durations in milliseconds, each above 0 and at most 10 s.
milliseconds = listed(
    partial(
        _number, low=0, high=1e4, low_open=True, expected="expected milliseconds above 0 and at most 10000"
    ),
    "no durations given",
)


def _mode(text: str) -> str:
    """An access mode, any case (as PLE_UM_MODE takes it)."""
    if text.lower() not in MODES:
        raise argparse.ArgumentTypeError(
            f"{text.lower()!r} is not a ple-um mode: expected a comma-separated list of {', '.join(MODES)}"
        )
    return text.lower()


def modes(text: str) -> tuple[str, ...]:
    found = listed(_mode, f"no mode given: expected a comma-separated list of {', '.join(MODES)}")(text)
    if len(set(found)) != len(found):
        raise argparse.ArgumentTypeError(f"a mode is named twice in {text!r}")
    return found


def ids(text: str) -> tuple:
    from ple_um.bench.ids import parse_ids

    listed = items(text)
    if not listed:
        raise argparse.ArgumentTypeError("no id distribution given")
    try:
        return parse_ids(",".join(listed))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
def resolved(device: str | None):
    """--device as the torch.device a verb runs on, or CliError (exit 2) saying why this machine
    has no such device (the probe without DIR reports it instead)."""
    from ple_um.access.capabilities import resolve_device

    try:
        return resolve_device(device)
    except ValueError as exc:
        raise CliError(f"--device: {exc}", EXIT_USAGE) from None


def checkpoint_dir(path: str) -> str:
    """``path`` as a checkpoint directory, or CliError (exit 1) saying what is there instead."""
    from ple_um.checkpoint.scan import why_no_directory

    hint = " (--json prints the results, --json-file PATH writes them)" if path.endswith(".json") else ""
    if not os.path.isdir(path):
        raise CliError(f"checkpoint directory {path} {why_no_directory(path)}{hint}", EXIT_INVALID)
    return path


def one_layer(path: str, layer: int | None, engram: bool = False, *, every: bool = False) -> None:
    """For the verbs that serve one layer, ``path`` checked as ``checkpoint_dir`` does; then where
    --layer is missing and the checkpoint has several, or --layer names one it does not have,
    CliError (exit 2) naming the layers it has and the flag (the library's message names its
    ``layer=``). ``engram``: the layers of Engram tables (``bench --model deepseek-v41``);
    ``every``: a verb that takes every layer without --layer (inspect), refused only a --layer
    the checkpoint lacks."""
    from ple_um.checkpoint import find_layers
    from ple_um.errors import CheckpointError

    checkpoint_dir(path)
    try:
        layers = find_layers(os.path.abspath(path), engram=engram)
    except CheckpointError:
        return  # the verb reports why the checkpoint cannot be read
    found = ", ".join(map(str, layers))
    kind, having = ("Engram table", "one") if engram else ("PLE shards", "shards")
    if layer is not None:
        if layers and layer not in layers:
            raise CliError(
                f"--layer {layer}: no {kind} of layer {layer} in {path}; layers with {having}: {found}",
                EXIT_USAGE,
            )
        return
    if len(layers) >= 2 and not every:
        several = (
            f"several Engram tables in {path}: layers"
            if engram
            else f"several PLE layers have shards in {path}:"
        )
        raise CliError(f"{several} {found}; pass --layer to pick one", EXIT_USAGE)


def other_tables(path: str, engram: bool) -> str | None:
    """Where the checkpoint at ``path`` holds no table of the kind a verb reads (``engram``: Engram
    tables, else PLE shards) but holds the other kind, what it holds, for the verb's error; else
    None (a checkpoint of the right kind, or one whose headers cannot be read)."""
    from ple_um.checkpoint import find_layers
    from ple_um.errors import CheckpointError

    where = os.path.abspath(path)
    try:
        if find_layers(where, engram=engram):
            return None
        other = find_layers(where, engram=not engram)
    except CheckpointError:
        return None
    if not other:
        return None
    kind = "a PLE table" if engram else "an Engram table"
    return f"it holds {kind} (layer {', '.join(map(str, other))})"


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


def why_not(device, table_bytes: int | None = None, pinned: bool = True) -> dict[str, str | None]:
    """Each access mode with why this machine cannot run it (None: it can), for a table of
    ``table_bytes`` (None: any size); ``pinned``: whether the pin budget applies."""
    from ple_um.access.capabilities import read_capabilities
    from ple_um.access.probe import pin_budget, reason_if_unsatisfied

    caps, budget = read_capabilities(device), pin_budget() if pinned else None
    return {m: reason_if_unsatisfied(m, caps, table_bytes, budget) for m in MODES}


def add_verb(
    sub, name: str, func, help: str, description: str, knobs, json_help="print the answer as one JSON object"
):
    """A verb's parser, with the options every verb takes: -v (also after the verb) and --json.
    ``knobs``: the environment knobs it reads, checked before it runs (None: every one)."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level"
    )
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.set_defaults(func=func, knobs=knobs)
    return parser


def add_dir(
    parser, help: str = "checkpoint directory", optional: bool = False, layer_default: str = "the only one"
) -> None:
    """DIR (``optional``: a verb that works without one) and --layer."""
    parser.add_argument("dir", help=help, **({"nargs": "?", "default": None} if optional else {}))
    parser.add_argument("--layer", type=count, default=None, help=f"PLE layer (default: {layer_default})")


def add_device(parser) -> None:
    parser.add_argument(
        "--device", type=device, default=None, help="cpu, cuda or cuda:N (default: the current GPU)"
    )
