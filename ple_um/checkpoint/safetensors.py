"""Safetensors headers, parsed by hand: we need each tensor's absolute byte range in its file.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``), then the
data section; offsets are relative to its first byte, ``8 + N``. Every length in the file is
untrusted: the header length is checked against the file size and a 100 MB cap before anything is
read, and only the header (never tensor data) is read.

A header is held to the rules of the ``safetensors`` package (0.8, the loader stock vLLM uses), so
that ple-um serves no file vLLM would refuse: its JSON parser's (serde_json's) limits, the dtypes it
knows, sizes that fit 64 bits, and tensors that cover the data section exactly, one after the other
from its first byte to its last. docs/CHECKPOINTS.md lists every rule and where ple-um departs from
one (16-bit data at an odd offset: accepted here, as safetensors accepts it).
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import stat
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ple_um.errors import CheckpointError

# The safetensors package refuses larger headers too (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# JSON nested deeper than this is refused before it is parsed (the header's deeper nesting past
# MAX_JSON_DEPTH is a problem of its entry, found after parsing); Python's parser recurses once a
# level, within the recursion limit left to it by its callers.
MAX_JSON_NESTING = 512
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)
# serde_json, the JSON parser of safetensors, refuses arrays and objects nested deeper than this
# (the header object itself is level 1).
MAX_JSON_DEPTH = 127
# Shapes and offsets are 64-bit unsigned integers in safetensors, and so is every size computed
# from them: a larger number, or a size that overflows, makes it refuse the file.
U64_MAX = (1 << 64) - 1
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")

# Bits per element of every dtype safetensors 0.8 knows; it refuses a header naming any other.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 8, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 40


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``start``/``end`` are absolute offsets in ``path``."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int
    end: int
    path: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one file: the sound entries, and what was wrong with the others."""

    path: str
    file_size: int
    header_length: int  # N, the JSON's length in bytes
    tensors: dict[str, TensorEntry]  # the entries that passed every check, by name
    problems: tuple[CheckpointError, ...]  # one per unsound entry (left out of ``tensors``)

    @property
    def data_start(self) -> int:
        return 8 + self.header_length


def _open_regular(path: str) -> int:
    """An fd of the regular file ``path``; O_NONBLOCK so that a FIFO cannot block the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"cannot open: {e.strerror or e}", path=path) from e
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"cannot stat: {e.strerror or e}", path=path) from e
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError("not a regular file", path=path)
    return fd


def _pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    """Exactly ``length`` bytes at ``offset``; the file shrinking meanwhile is an error."""
    chunks = []
    got = 0
    while got < length:
        try:
            chunk = os.pread(fd, length - got, offset + got)
        except OSError as e:
            raise CheckpointError(f"cannot read: {e.strerror or e}", path=path) from e
        if not chunk:
            raise CheckpointError(
                f"file ends at byte {offset + got}, expected {length} bytes at offset {offset}", path=path
            )
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_bytes(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes at absolute ``offset`` of ``path`` (for the few bytes of a scale)."""
    fd = _open_regular(path)
    try:
        return _pread_exact(fd, length, offset, path)
    finally:
        os.close(fd)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _u64_list(value: object) -> bool:
    """Whether ``value`` is a list of integers in [0, 2**64), as safetensors reads shapes and offsets."""
    return (
        isinstance(value, list)
        and all(type(x) is int for x in value)
        and (not value or (min(value) >= 0 and max(value) <= U64_MAX))
    )


class _RepeatedKeys(dict):
    """A JSON object that names a key more than once: the last value of each key (what json.loads
    and safetensors keep), with every (key, value) pair in ``pairs``, since safetensors still parses
    the values it drops, and refuses some repeated keys."""

    pairs: list[tuple[str, object]]


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    repeated = _RepeatedKeys(result)
    repeated.pairs = pairs
    return repeated


def _json_int(text: str) -> int | float:
    # serde_json reads -0 as the float -0.0, which no shape or offset may be.
    return -0.0 if text == "-0" else int(text)


def _items(obj: dict) -> Iterable[tuple[str, object]]:
    """Every (key, value) pair of a JSON object as the text had them, repeated keys included."""
    return obj.pairs if isinstance(obj, _RepeatedKeys) else obj.items()


def _repeated(obj: object) -> list[str]:
    """The keys ``obj`` (a JSON object) names more than once, in order of first appearance."""
    if not isinstance(obj, _RepeatedKeys):
        return []
    seen: dict[str, int] = {}
    for key, _ in obj.pairs:
        seen[key] = seen.get(key, 0) + 1
    return [key for key, count in seen.items() if count > 1]


def _json_problem(value: object, level: int, escapes: bool) -> str | None:
    """What serde_json, the JSON parser of safetensors, refuses in ``value`` (at nesting ``level``)
    that Python's json accepted: NaN, infinities and numbers beyond float64, nesting deeper than
    MAX_JSON_DEPTH, and (only where the text has ``\\u`` escapes) unpaired UTF-16 surrogates."""
    if type(value) is dict and all(
        _u64_list(child) if type(child) is list else type(child) is str and not escapes
        for child in value.values()
    ):
        return None  # a tensor entry as writers write it: nothing serde_json could refuse
    stack = [(value, level)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if escapes and not item.isascii() and _has_surrogate(item):
                return f"string {_short(item)} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"
        elif isinstance(item, float):
            # The largest double itself is refused too: serde_json's limit lies within one rounding
            # step of it, and refusing one more value than it does is the safe side.
            if not abs(item) < sys.float_info.max:
                return f"number {item} is NaN, infinite or beyond the float64 range"
        elif _is_int(item):
            if not -(1 << 63) <= item <= U64_MAX and not abs(item) < sys.float_info.max:
                return f"integer {_short(item)} is beyond the float64 range"
        elif isinstance(item, (dict, list)):
            if at > MAX_JSON_DEPTH:
                return f"JSON nested {at} levels deep; safetensors' parser stops at {MAX_JSON_DEPTH}"
            if isinstance(item, dict):
                for key, child in _items(item):
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


def _entry_format(meta: object) -> str | None:
    """What safetensors' header parser refuses in one tensor entry, before any size is computed."""
    if not isinstance(meta, dict):
        return f"header entry is a JSON {_json_kind(meta)}, expected an object"
    missing = [k for k in ENTRY_FIELDS if k not in meta]
    if missing:
        return f"header entry lacks {', '.join(missing)}"
    repeated = [k for k in _repeated(meta) if k in ENTRY_FIELDS]
    if repeated:
        return f"header entry repeats {', '.join(repeated)}"
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        return f"dtype is {_short(dtype)}, expected a string"
    if dtype not in DTYPE_BITS:
        return f"unknown dtype {_short(dtype)}: safetensors knows only {', '.join(DTYPE_BITS)}"
    if not _u64_list(shape):
        return f"shape is {_short(shape)}, expected a list of integers in [0, 2**64)"
    if not (_u64_list(offsets) and len(offsets) == 2):
        return f"data_offsets is {_short(offsets)}, expected [start, end] of integers in [0, 2**64)"
    return None


def _span(meta: object) -> tuple[int, int] | None:
    """The data section bytes ``[start, end)`` an entry claims, when its data_offsets are well formed."""
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    if _u64_list(offsets) and len(offsets) == 2:
        start, end = offsets
        if start <= end:
            return start, end
    return None


def _check_entry(name: str, meta: object, path: str, data_start: int, data_size: int) -> TensorEntry | str:
    """The entry ``meta`` describes, or what is wrong with it."""
    wrong = _entry_format(meta)
    if wrong is not None:
        return wrong
    assert isinstance(meta, dict)
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    start, end = offsets
    if end < start:
        return f"data_offsets {_short(offsets)} end before they start"
    if end > data_size:
        return (
            f"data_offsets {_short(offsets)} lie past the end of the data section ({data_size} bytes): "
            "file truncated or offsets wrong"
        )
    # safetensors multiplies the dimensions in order, then by the bits per element, in 64 bits, and
    # refuses the file at the first overflow (so [0, 2**40, 2**40] is empty, [2**40, 2**40, 0] is not).
    elements = 1
    for dim in shape:
        elements *= dim
        if elements > U64_MAX:
            break
    need_bits = elements * DTYPE_BITS[dtype]
    if elements > U64_MAX or need_bits > U64_MAX:
        return f"shape {_short(shape)} of {dtype} overflows the 64-bit size safetensors computes"
    if need_bits != (end - start) * 8:
        need = str(need_bits // 8) if need_bits % 8 == 0 else str(need_bits / 8)
        return f"data_offsets hold {end - start} bytes but shape {_short(shape)} of {dtype} needs {need}"
    return TensorEntry(
        name=name, dtype=dtype, shape=tuple(shape), start=data_start + start, end=data_start + end, path=path
    )


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    return {list: "array", str: "string"}.get(type(value), type(value).__name__)


def _short(value: object) -> str:
    """A bounded repr for messages: cut in depth and length, never recursing deeply."""
    return _REPR.repr(value)


def read_header(path: str, *, strict: bool = True) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``path``; read no tensor data.

    A header that cannot be read at all (file unreadable or too short, length beyond the file or
    the cap, not UTF-8, not JSON, not an object) raises CheckpointError. Every other departure
    from what safetensors accepts (JSON it refuses, a malformed ``__metadata__`` or entry, offsets
    outside the data section, a size that does not match shape and dtype, overlapping tensors,
    bytes of the data section no tensor covers) raises the first one when ``strict``; otherwise
    the problems are returned in ``problems``, and the entries that are unsound themselves (or
    overlap another) are left out of ``tensors``.
    """
    fd = _open_regular(path)
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise CheckpointError(f"file is {file_size} bytes, too short for a safetensors header", path=path)
        (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
        # Both limits are checked before anything of that length is read or allocated.
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"header length {length} exceeds the {MAX_HEADER_BYTES} byte limit", path=path
            )
        if length > file_size - 8:
            raise CheckpointError(
                f"header length {length} is larger than the file ({file_size} bytes): file truncated "
                "or not safetensors",
                path=path,
            )
        raw = _pread_exact(fd, length, 8, path)
    finally:
        os.close(fd)
    header = _decode_json(raw, path, what="header", header=True)
    if not isinstance(header, dict):
        raise CheckpointError(f"header is a JSON {_json_kind(header)}, expected an object", path=path)

    data_start = 8 + length
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    problems: list[CheckpointError] = []

    def problem(message: str, name: str | None) -> None:
        error = CheckpointError(message, path=path, tensor=name)
        if strict:
            raise error
        problems.append(error)

    escapes = b"\\u" in raw
    pairs = _items(header)
    for key, value in pairs:
        wrong = _json_problem(value, 2, escapes)
        if wrong is None and escapes:
            wrong = _json_problem(key, 1, escapes)
        if wrong is not None and key == "__metadata__":
            problem(f"__metadata__: {wrong}", None)
        elif wrong is not None:
            problem(wrong, key)

    repeated = set(_repeated(header))
    if "__metadata__" in repeated:
        problem("header repeats __metadata__ (safetensors refuses that)", None)
    if "__metadata__" in header:
        metadata = header["__metadata__"]
        if metadata is not None and not isinstance(metadata, dict):
            problem(f"__metadata__ is a JSON {_json_kind(metadata)}, expected an object of strings", None)
        elif metadata is not None:
            for key, value in _items(metadata):
                if not isinstance(value, str):
                    problem(
                        f"__metadata__ value of {_short(key)} is a JSON {_json_kind(value)}, not a string",
                        None,
                    )
                    break

    # A repeated tensor name: safetensors keeps the last entry, but parses (and refuses) the others.
    if repeated - {"__metadata__"}:
        last_at = {key: at for at, (key, _) in enumerate(pairs)}
        reported = set()
        for at, (key, value) in enumerate(pairs):
            if key == "__metadata__" or last_at[key] == at or key in reported:
                continue
            wrong = _entry_format(value)
            if wrong is not None:
                problem(
                    f"the header names this tensor more than once; an earlier entry is wrong: {wrong}", key
                )
                reported.add(key)

    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entry = _check_entry(name, meta, path, data_start, data_size)
        if isinstance(entry, str):
            problem(entry, name)
            span = _span(meta)
            if span is not None:
                spans.append((*span, name))
        else:
            tensors[name] = entry
            spans.append((entry.start - data_start, entry.end - data_start, name))

    # Coverage, as safetensors checks it: in order of (start, end), each tensor begins where the one
    # before it ends (the first at byte 0), and the last one ends where the file does. A header
    # length one short (a pad space dropped) leaves the JSON sound but moves every tensor one byte:
    # only the last rule sees it.
    cursor, last = 0, None
    conflicting: set[str] = set()
    for start, end, name in sorted(spans):
        if start < cursor:
            if start == end:
                problem(f"empty tensor at byte {start} lies inside the data of tensor {last}", name)
            else:
                problem(f"data overlaps tensor {last} (bytes {start}..{min(end, cursor)})", name)
            conflicting.update((name, last))
        elif start > cursor and last is None:
            problem(
                f"the first {start} bytes of the data section belong to no tensor (this one is first)", name
            )
        elif start > cursor:
            problem(
                f"a hole: {start - cursor} bytes between tensor {last} and this one belong to no tensor", name
            )
        if end >= cursor:
            cursor, last = end, name
    if cursor < data_size and last is None:
        problem(f"the header lists no tensor, but the data section holds {data_size} bytes", None)
    elif cursor < data_size:
        problem(
            f"the data section has {data_size - cursor} bytes after the end of the last tensor: the header "
            "length is wrong (a shifted header) or bytes were appended",
            last,
        )
    for name in conflicting:
        tensors.pop(name, None)

    return SafetensorsHeader(
        path=path, file_size=file_size, header_length=length, tensors=tensors, problems=tuple(problems)
    )


def _nesting(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings not counted).
    Checked before parsing, so that how deep is too deep does not depend on how deep the Python
    stack already is where the parser runs (its recursion limit counts those frames too)."""
    bare = _JSON_STRING.sub(b"", raw)
    if not bare:
        return 0
    step = np.frombuffer(bare, dtype=np.uint8)
    depth = np.cumsum(np.isin(step, _OPENERS).astype(np.int64) - np.isin(step, _CLOSERS).astype(np.int64))
    return int(depth.max(initial=0))


def _decode_json(raw: bytes, path: str, *, what: str, header: bool = False) -> object:
    """``raw`` as UTF-8 JSON; every way it can fail becomes a CheckpointError naming ``path``.

    ``header``: parse as read_header needs, objects with repeated keys marked (_RepeatedKeys) and
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


def read_json_file(path: str, *, what: str, limit: int = MAX_HEADER_BYTES) -> object:
    """Parse a small JSON side file (the index); its size is checked before it is read."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{what} is {size} bytes, more than the {limit} byte limit", path=path)
        raw = _pread_exact(fd, size, 0, path)
    finally:
        os.close(fd)
    return _decode_json(raw, path, what=what)
