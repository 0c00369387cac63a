"""Safetensors headers, parsed by hand: we need each tensor's absolute byte range in its file.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``), then the
data section; offsets are relative to its first byte, ``8 + N``. Every length in the file is
untrusted: the header length is checked against the file size and a 100 MB cap before anything is
read, and only the header (never tensor data) is read.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
import struct
from dataclasses import dataclass

from ple_um.errors import CheckpointError

# The safetensors package refuses larger headers too (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
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


def _check_entry(name: str, meta: object, path: str, data_start: int, data_size: int) -> TensorEntry | str:
    """The entry ``meta`` describes, or what is wrong with it."""
    if not isinstance(meta, dict):
        return f"header entry is a JSON {_json_kind(meta)}, expected an object"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
    if missing:
        return f"header entry lacks {', '.join(missing)}"
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        return f"dtype is {_short(dtype)}, expected a string"
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return f"shape is {_short(shape)}, expected a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        return f"data_offsets is {_short(offsets)}, expected [start, end] of non-negative integers"
    start, end = offsets
    if end < start:
        return f"data_offsets {_short(offsets)} end before they start"
    if end > data_size:
        return (
            f"data_offsets {_short(offsets)} lie past the end of the data section ({data_size} bytes): "
            "file truncated or offsets wrong"
        )
    bits = DTYPE_BITS.get(dtype)
    # An unknown dtype is judged by whoever uses the tensor; its size cannot be checked here.
    if bits is not None:
        need_bits = math.prod(shape) * bits
        if need_bits != (end - start) * 8:
            # A product of many JSON integers can be too long to print; end - start never is.
            if need_bits >= 8 << 64:
                need = "more than 2**64"
            else:
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
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def _short(value: object) -> str:
    """A bounded repr for messages: cut in depth and length, never recursing deeply."""
    return _REPR.repr(value)


def read_header(path: str, *, strict: bool = True) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``path``; read no tensor data.

    A header that cannot be read at all (file unreadable or too short, length beyond the file or
    the cap, not UTF-8, not JSON, not an object) raises CheckpointError. Problems of single
    entries (missing or mistyped fields, offsets outside the data section, a size that does not
    match shape and dtype, overlapping tensors) raise the first one when ``strict``; otherwise the
    unsound entries are left out and their problems returned in ``problems``.
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
    header = _decode_json(raw, path, what="header")
    if not isinstance(header, dict):
        raise CheckpointError(f"header is a JSON {_json_kind(header)}, expected an object", path=path)

    data_start = 8 + length
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    problems: list[CheckpointError] = []

    def problem(message: str, name: str) -> None:
        error = CheckpointError(message, path=path, tensor=name)
        if strict:
            raise error
        problems.append(error)

    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entry = _check_entry(name, meta, path, data_start, data_size)
        if isinstance(entry, str):
            problem(entry, name)
        else:
            tensors[name] = entry

    # Overlap: sweep the non-empty ranges by start; each must begin at or after the furthest end so far.
    ranges = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    furthest_end, furthest_name = -1, ""
    overlapping: set[str] = set()
    for start, end, name in ranges:
        if start < furthest_end:
            problem(f"data overlaps tensor {furthest_name} (bytes {start}..{min(end, furthest_end)})", name)
            overlapping.update((name, furthest_name))
        if end > furthest_end:
            furthest_end, furthest_name = end, name
    for name in overlapping:
        del tensors[name]

    return SafetensorsHeader(
        path=path, file_size=file_size, header_length=length, tensors=tensors, problems=tuple(problems)
    )


def _decode_json(raw: bytes, path: str, *, what: str) -> object:
    """``raw`` as UTF-8 JSON; every way it can fail becomes a CheckpointError naming ``path``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8 (byte {e.start})", path=path) from e
    try:
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
