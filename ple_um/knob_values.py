"""A knob and the kinds of value it takes (``ple_um.envs`` declares the knobs): each kind a parser that
reads the text of an environment variable and returns its value, or raises ValueError saying what it
takes, in words a user reads (``Knob`` adds the variable's name)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ple_um import cache_folder
from ple_um.errors import KnobError

OFF = ("0", "false", "no", "off", "")  # what turns a boolean off, and a list of modes too


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in OFF:
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def modes_list(*allowed: str) -> Callable[[str], tuple[str, ...]]:
    """Comma-separated names out of ``allowed`` (each once, in order); off/none = none."""

    def parse(text: str) -> tuple[str, ...]:
        value = text.strip().lower()
        if value in (*OFF, "none"):
            return ()
        modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
        if any(m not in allowed for m in modes):
            raise ValueError(f"expected off or a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return modes

    return parse


def ranged(
    convert: Callable[[str], Any], low: float, high: float, expected: str, *, above_low: bool = False
) -> Callable[[str], Any]:
    """A number that ``convert`` (int, float) reads, in [low, high] (``above_low``: in (low, high]):
    NaN and the infinities are out of range, and an int knob never wraps a C int. ``expected``
    says what is taken."""

    def parse(text: str):
        try:
            value = convert(text.strip())
        except (ValueError, OverflowError):
            value = None
        if value is None or not low <= value <= high or (above_low and value == low):
            raise ValueError(f"expected {expected}, got {text!r}")
        return value

    return parse


def count(low: int, high: int) -> Callable[[str], int]:
    return ranged(int, low, high, f"a whole number from {low} to {high}")


seconds_or_off = ranged(float, 0, 86400, "a number of seconds from 0 (off) to 86400")
positive_seconds = ranged(float, 0, 86400, "a number of seconds above 0, at most 86400", above_low=True)
fraction = ranged(float, 0, 1, "a fraction from 0 to 1")


def auto_or(parse: Callable[[str], Any], expected: str) -> Callable[[str], Any]:
    """``auto``, or a value ``parse`` takes; a refusal says both (``expected``: what ``parse`` takes)."""

    def parse_auto(text: str):
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return parse(text)
        except ValueError:
            raise ValueError(f"expected auto or {expected}, got {text!r}") from None

    return parse_auto


def cache_directory(text: str) -> str:
    """A folder ple-um may trust with what it caches: one that is there is a folder (not a link)
    owned by this user that no one else can write; one that is not there can be made
    (``cache_folder``). A leading ``~`` is the home folder, where no shell expanded it. The value
    is made absolute and normal: the folder checked is the one every use joins its names to (a
    trailing ``/`` or ``/.`` would have the check's lstat follow a link, and ``link/..`` the uses)."""
    if not text.strip():
        raise ValueError("expected a directory, got an empty value")
    path = os.path.abspath(os.path.expanduser(text))
    why = cache_folder.why_unusable(path)
    if why is not None:
        raise ValueError(f"expected a folder of this user's that no one else can write: {why}")
    return path


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    aliases: tuple[str, ...] = ()
    check_default: bool = False  # the default goes through ``parse`` too (it names a path to check)

    def raw(self) -> tuple[str, str] | None:
        """(variable name, text) of the first of name and aliases that is set, or None."""
        for var in (self.name, *self.aliases):
            text = os.environ.get(var)
            if text is not None:
                return var, text
        return None

    def value(self) -> Any:
        found = self.raw()
        if found is None:
            default = self.default() if callable(self.default) else self.default
            if not self.check_default:
                return default
            try:
                return self.parse(default)
            except ValueError as exc:
                why = f"{self.name} is unset and its default {default!r} cannot be used: {exc}"
                raise KnobError(why) from None
        var, text = found
        try:
            return self.parse(text)
        except ValueError as exc:
            alias = "" if var == self.name else f" (an alias of {self.name})"
            raise KnobError(f"environment variable {var}={text!r}{alias}: {exc}") from None

    def problem(self) -> str | None:
        """Why the value set for this knob is not taken (the KnobError's message), or None."""
        try:
            self.value()
        except KnobError as exc:
            return str(exc)
        return None
