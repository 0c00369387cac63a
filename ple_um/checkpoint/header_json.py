"""A safetensors header's JSON, held to the rules of the parser the ``safetensors`` package uses
(serde_json): what Python's ``json`` accepts and serde_json refuses is found here, so that ple-um
refuses it too.

Python's parser is called with two changes: an object that repeats a key keeps every pair
(``RepeatedKeys``), since safetensors still parses the values it drops, and ``-0`` is read as the
float serde_json makes of it. Nesting is measured before parsing, so that how deep is too deep does
not depend on how deep the Python stack already is where the parser runs.
"""

from __future__ import annotations

import json
import reprlib
import sys
from collections.abc import Iterable

import numpy as np

from ple_um.errors import CheckpointError

# JSON nested deeper than this is refused before it is parsed (the header's deeper nesting past
# MAX_JSON_DEPTH is a problem of its entry, found after parsing); Python's parser recurses once a
# level, within the recursion limit left to it by its callers.
MAX_JSON_NESTING = 512
# The nesting scan reads the text in windows of this many bytes: its memory is a few times this
# (int64 arrays of one window), whatever the text's length.
_SCAN_WINDOW = 1 << 20
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
# serde_json, the JSON parser of safetensors, refuses arrays and objects nested deeper than this
# (the header object itself is level 1).
MAX_JSON_DEPTH = 127
# Shapes and offsets are 64-bit unsigned integers in safetensors, and so is every size computed
# from them: a larger number, or a size that overflows, makes it refuse the file.
U64_MAX = (1 << 64) - 1

_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 8, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 40


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def u64_list(value: object) -> bool:
    """Whether ``value`` is a list of integers in [0, 2**64), as safetensors reads shapes and offsets."""
    return (
        isinstance(value, list)
        and all(type(x) is int for x in value)
        and (not value or (min(value) >= 0 and max(value) <= U64_MAX))
    )


class RepeatedKeys(dict):
    """A JSON object that names a key more than once: the last value of each key (what json.loads
    and safetensors keep), with every (key, value) pair in ``pairs``, since safetensors still parses
    the values it drops, and refuses some repeated keys."""

    pairs: list[tuple[str, object]]


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    repeated = RepeatedKeys(result)
    repeated.pairs = pairs
    return repeated


def _json_int(text: str) -> int | float:
    # serde_json reads -0 as the float -0.0, which no shape or offset may be.
    return -0.0 if text == "-0" else int(text)


def items(obj: dict) -> Iterable[tuple[str, object]]:
    """Every (key, value) pair of a JSON object as the text had them, repeated keys included."""
    return obj.pairs if isinstance(obj, RepeatedKeys) else obj.items()


def repeated(obj: object) -> list[str]:
    """The keys ``obj`` (a JSON object) names more than once, in order of first appearance."""
    if not isinstance(obj, RepeatedKeys):
        return []
    seen: dict[str, int] = {}
    for key, _ in obj.pairs:
        seen[key] = seen.get(key, 0) + 1
    return [key for key, count in seen.items() if count > 1]


def json_problem(value: object, level: int, escapes: bool) -> str | None:
    """What serde_json, the JSON parser of safetensors, refuses in ``value`` (at nesting ``level``)
    that Python's json accepted: NaN, infinities and numbers beyond float64, nesting deeper than
    MAX_JSON_DEPTH, and (only where the text has ``\\u`` escapes) unpaired UTF-16 surrogates."""
    if type(value) is dict and all(
        u64_list(child) if type(child) is list else type(child) is str and not escapes
        for child in value.values()
    ):
        return None  # a tensor entry as writers write it: nothing serde_json could refuse
    stack = [(value, level)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if escapes and not item.isascii() and _has_surrogate(item):
                return f"string {short(item)} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"
        elif isinstance(item, float):
            # The largest double itself is refused too: serde_json's limit lies within one rounding
            # step of it, and refusing one more value than it does is the safe side.
            if not abs(item) < sys.float_info.max:
                return f"number {item} is NaN, infinite or beyond the float64 range"
        elif _is_int(item):
            if not -(1 << 63) <= item <= U64_MAX and not abs(item) < sys.float_info.max:
                return f"integer {short(item)} is beyond the float64 range"
        elif isinstance(item, (dict, list)):
            if at > MAX_JSON_DEPTH:
                return f"JSON nested {at} levels deep; safetensors' parser stops at {MAX_JSON_DEPTH}"
            if isinstance(item, dict):
                for key, child in items(item):
                    stack.append((key, at))
                    stack.append((child, at + 1))
            elif not all(type(x) is int for x in item) or (
                item and not -(1 << 63) <= min(item) <= max(item) <= U64_MAX
            ):  # integers that fit 64 bits (a shape, offsets) need no look
                stack.extend((child, at + 1) for child in item)
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def json_kind(value: object) -> str:
    """The JSON name of a parsed value's type, for messages: object, array, string, number, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    return {list: "array", str: "string"}.get(type(value), type(value).__name__)


def short(value: object) -> str:
    """A bounded repr for messages: cut in depth and length, never recursing deeply."""
    return _REPR.repr(value)


def _nesting(raw: bytes, window: int = _SCAN_WINDOW) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings not counted).
    Checked before parsing, so that how deep is too deep does not depend on how deep the Python
    stack already is where the parser runs (its recursion limit counts those frames too).

    One pass over windows of ``window`` bytes: time linear in the length, memory bounded by
    the window, however long a string or a run of brackets is. A string is what JSON makes one: it
    opens at a quote and closes at the next quote not escaped by an odd run of backslashes. Text that
    is not JSON gets the verdict it had when strings were cut out by a regular expression (that
    regular expression's memory grew with a string's length): a quote outside a string opens one
    even after a backslash, and a string that never closes is not one (its brackets count)."""
    scan = _NestingScan()
    for start in range(0, len(raw), window):
        scan.window(np.frombuffer(raw, dtype=np.uint8, count=min(window, len(raw) - start), offset=start))
    if scan.inside:  # a string that never closes: from its quote on, every bracket counts
        depth = scan.open_depth
        for start in range(scan.open_at + 1, len(raw), window):
            part = np.frombuffer(raw, dtype=np.uint8, count=min(window, len(raw) - start), offset=start)
            steps = _steps(part)
            if steps.any():
                walk = np.cumsum(steps, dtype=np.int64) + depth
                scan.deepest = max(scan.deepest, int(walk.max()))
                depth = int(walk[-1])
    return scan.deepest


class _NestingScan:
    """The state ``_nesting`` carries from one window to the next."""

    def __init__(self) -> None:
        self.base = 0  # offset of the current window in the text
        self.depth = 0  # nesting after the bytes scanned (brackets outside strings only)
        self.deepest = 0
        self.inside = False  # within a string after the bytes scanned
        self.odd_run = False  # the bytes scanned end with an odd run of backslashes
        self.open_at = -1  # offset of the quote that opened the string we are in
        self.open_depth = 0  # the nesting there

    def window(self, b: np.ndarray) -> None:
        quotes = np.flatnonzero(b == _QUOTE)
        steps = _steps(b)
        if quotes.size:
            self._quoted(b, quotes, steps)
        elif not self.inside and steps.any():  # no quote: outside a string for the whole window
            self._walk(np.cumsum(steps, dtype=np.int64))
        self.odd_run = self._ends_odd(b)
        self.base += b.size

    def _quoted(self, b: np.ndarray, quotes: np.ndarray, steps: np.ndarray) -> None:
        # A quote not escaped flips in/out of a string; an escaped one leaves us inside a string (it
        # opens one where we are outside, as the regular expression had it, and is text where inside).
        inside_after = self._inside_after(self._escaped(b, quotes))
        states = np.concatenate(([self.inside], inside_after))  # after the window's first k quotes
        at = np.flatnonzero(steps)
        walk = np.cumsum(np.where(states[np.searchsorted(quotes, at)], 0, steps[at]), dtype=np.int64)
        openers = np.flatnonzero(~states[:-1] & inside_after)
        if openers.size:
            last = int(quotes[openers[-1]])
            self.open_at = self.base + last
            below = int(np.searchsorted(at, last)) - 1  # the last bracket before that quote
            self.open_depth = self.depth + (int(walk[below]) if below >= 0 else 0)
        self.inside = bool(inside_after[-1])
        if walk.size:
            self._walk(walk)

    def _walk(self, walk: np.ndarray) -> None:
        """Take in the nesting after each counted bracket of a window (relative to its start)."""
        self.deepest = max(self.deepest, self.depth + int(walk.max()))
        self.depth += int(walk[-1])

    def _escaped(self, b: np.ndarray, quotes: np.ndarray) -> np.ndarray:
        """Per quote of the window: whether an odd run of backslashes ends just before it."""
        slash = b == _BACKSLASH
        if not slash.any():
            return (quotes == 0) & self.odd_run
        index = np.arange(b.size, dtype=np.int64)
        # The last byte that is not a backslash, at or before each byte (a run carried over from the
        # previous window counts as if it started one byte before this one when odd).
        rest = np.maximum.accumulate(np.where(slash, -1 - int(self.odd_run), index))
        odd = slash & ((index - rest) % 2 == 1)  # the byte ends an odd run of backslashes
        before = quotes - 1
        return np.where(before >= 0, odd[np.maximum(before, 0)], self.odd_run)

    def _ends_odd(self, b: np.ndarray) -> bool:
        """Whether the text scanned, up to the end of window ``b``, ends with an odd run of backslashes."""
        other = b[::-1] != _BACKSLASH
        if other.any():
            return bool(int(np.argmax(other)) % 2)
        return bool((b.size + self.odd_run) % 2)

    def _inside_after(self, escaped: np.ndarray) -> np.ndarray:
        """Per quote of the window: whether we are inside a string after it."""
        flips = np.cumsum(~escaped)
        if not escaped.any():
            return (flips + int(self.inside)) % 2 == 1
        order = np.arange(escaped.size)
        last_set = np.maximum.accumulate(np.where(escaped, order, -1))  # the last escaped quote
        since = flips - np.where(last_set >= 0, flips[np.maximum(last_set, 0)], 0)
        return np.where(last_set >= 0, since % 2 == 0, (flips + int(self.inside)) % 2 == 1)


def _steps(b: np.ndarray) -> np.ndarray:
    """int8 per byte: +1 for ``[`` or ``{``, -1 for ``]`` or ``}``, else 0 (``[`` | 32 is ``{``)."""
    folded = b | 32
    return (folded == ord("{")).view(np.int8) - (folded == ord("}")).view(np.int8)


def decode_json(raw: bytes, path: str, *, what: str, header: bool = False) -> object:
    """``raw`` as UTF-8 JSON; every way it can fail becomes a CheckpointError naming ``path``.

    ``header``: parse as read_header needs, objects with repeated keys marked (RepeatedKeys) and
    ``-0`` read as serde_json reads it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8 (byte {e.start})", path=path) from e
    if _nesting(raw) > MAX_JSON_NESTING:
        raise CheckpointError(f"{what} JSON is nested too deeply", path=path)
    try:
        if header:
            return json.loads(text, object_pairs_hook=_json_object, parse_int=_json_int)
        return json.loads(text)
    except RecursionError as e:
        raise CheckpointError(f"{what} JSON is nested too deeply", path=path) from e
    except ValueError as e:  # JSONDecodeError, and int() refusing an absurdly long number
        raise CheckpointError(f"{what} is not valid JSON: {e}", path=path) from e
