"""Safetensors headers, parsed by hand: we need each tensor's absolute byte range in its file.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``), then the
data section; offsets are relative to its first byte, ``8 + N``. Every length in the file is
untrusted: the header length is checked against the file size and a 100 MB cap before anything is
read, and only the header (never tensor data) is read.

A header is held to the rules of the ``safetensors`` package (0.8, the loader stock vLLM uses), so
that ple-um serves no file vLLM would refuse: its JSON parser's (serde_json's) limits
(``header_json``), the dtypes it knows, sizes that fit 64 bits, and tensors that cover the data
section exactly, one after the other from its first byte to its last. docs/CHECKPOINTS.md lists
every rule and where ple-um departs from one (16-bit data at an odd offset: accepted here, as
safetensors accepts it).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

from ple_um.checkpoint.files import FileIdentity, open_regular, pread_exact
from ple_um.checkpoint.header_json import (
    U64_MAX,
    decode_json,
    items,
    json_kind,
    json_problem,
    repeated,
    short,
    u64_list,
)
from ple_um.checkpoint.problems import Problems
from ple_um.errors import CheckpointError

# The safetensors package refuses larger headers too (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``start``/``end`` are absolute offsets in ``path``."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int
    end: int
    path: str
    identity: FileIdentity  # of the file the header was read from

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
    identity: FileIdentity  # of the descriptor the header was read through

    @property
    def data_start(self) -> int:
        return 8 + self.header_length


def _entry_format(meta: object) -> str | None:
    """What safetensors' header parser refuses in one tensor entry, before any size is computed."""
    if not isinstance(meta, dict):
        return f"header entry is a JSON {json_kind(meta)}, expected an object"
    missing = [k for k in ENTRY_FIELDS if k not in meta]
    if missing:
        return f"header entry lacks {', '.join(missing)}"
    twice = [k for k in repeated(meta) if k in ENTRY_FIELDS]
    if twice:
        return f"header entry repeats {', '.join(twice)}"
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        return f"dtype is {short(dtype)}, expected a string"
    if dtype not in DTYPE_BITS:
        return f"unknown dtype {short(dtype)}: safetensors knows only {', '.join(DTYPE_BITS)}"
    if not u64_list(shape):
        return f"shape is {short(shape)}, expected a list of integers in [0, 2**64)"
    if not (u64_list(offsets) and len(offsets) == 2):
        return f"data_offsets is {short(offsets)}, expected [start, end] of integers in [0, 2**64)"
    return None


def _span(meta: object) -> tuple[int, int] | None:
    """The data section bytes ``[start, end)`` an entry claims, when its data_offsets are well formed."""
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    if u64_list(offsets) and len(offsets) == 2:
        start, end = offsets
        if start <= end:
            return start, end
    return None


def _check_entry(
    name: str, meta: object, path: str, data_start: int, data_size: int, identity: FileIdentity
) -> TensorEntry | str:
    """The entry ``meta`` describes, or what is wrong with it."""
    wrong = _entry_format(meta)
    if wrong is not None:
        return wrong
    assert isinstance(meta, dict)
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    start, end = offsets
    if end < start:
        return f"data_offsets {short(offsets)} end before they start"
    if end > data_size:
        return (
            f"data_offsets {short(offsets)} lie past the end of the data section ({data_size} bytes): "
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
        return f"shape {short(shape)} of {dtype} overflows the 64-bit size safetensors computes"
    if need_bits != (end - start) * 8:
        need = str(need_bits // 8) if need_bits % 8 == 0 else str(need_bits / 8)
        return f"data_offsets hold {end - start} bytes but shape {short(shape)} of {dtype} needs {need}"
    return TensorEntry(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        start=data_start + start,
        end=data_start + end,
        path=path,
        identity=identity,
    )


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
    identity, length, raw = _read_raw(path)
    file_size = identity.size
    header = decode_json(raw, path, what="header", header=True)
    if not isinstance(header, dict):
        raise CheckpointError(f"header is a JSON {json_kind(header)}, expected an object", path=path)

    data_start = 8 + length
    data_size = file_size - data_start
    problems = Problems(strict)
    _check_json(header, b"\\u" in raw, path, problems)
    _check_metadata(header, path, problems)
    _check_repeated_entries(header, path, problems)

    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entry = _check_entry(name, meta, path, data_start, data_size, identity)
        if isinstance(entry, str):
            problems.report(entry, path=path, tensor=name)
            span = _span(meta)
            if span is not None:
                spans.append((*span, name))
        else:
            tensors[name] = entry
            spans.append((entry.start - data_start, entry.end - data_start, name))
    for name in _check_coverage(spans, data_size, path, problems):
        tensors.pop(name, None)

    return SafetensorsHeader(
        path=path,
        file_size=file_size,
        header_length=length,
        tensors=tensors,
        problems=tuple(problems.found),
        identity=identity,
    )


def _read_raw(path: str) -> tuple[FileIdentity, int, bytes]:
    """The file's identity (its size among them), its header length ``N`` and the ``N`` bytes of
    the header, both limits on ``N`` checked before anything of that length is read or allocated."""
    fd = open_regular(path)
    try:
        identity = FileIdentity.of(os.fstat(fd))
        file_size = identity.size
        if file_size < 8:
            raise CheckpointError(f"file is {file_size} bytes, too short for a safetensors header", path=path)
        (length,) = struct.unpack("<Q", pread_exact(fd, 8, 0, path))
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
        return identity, length, pread_exact(fd, length, 8, path)
    finally:
        os.close(fd)


def _check_json(header: dict, escapes: bool, path: str, problems: Problems) -> None:
    """Report the JSON serde_json refuses, entry by entry (``escapes``: the text has ``\\u``)."""
    for key, value in items(header):
        wrong = json_problem(value, 2, escapes)
        if wrong is None and escapes:
            wrong = json_problem(key, 1, escapes)
        if wrong is not None and key == "__metadata__":
            problems.report(f"__metadata__: {wrong}", path=path)
        elif wrong is not None:
            problems.report(wrong, path=path, tensor=key)


def _check_metadata(header: dict, path: str, problems: Problems) -> None:
    """safetensors reads ``__metadata__`` once, as null or an object of strings."""
    if "__metadata__" in repeated(header):
        problems.report("header repeats __metadata__ (safetensors refuses that)", path=path)
    if "__metadata__" not in header:
        return
    metadata = header["__metadata__"]
    if metadata is not None and not isinstance(metadata, dict):
        problems.report(
            f"__metadata__ is a JSON {json_kind(metadata)}, expected an object of strings", path=path
        )
    elif metadata is not None:
        for key, value in items(metadata):
            if not isinstance(value, str):
                problems.report(
                    f"__metadata__ value of {short(key)} is a JSON {json_kind(value)}, not a string",
                    path=path,
                )
                break


def _check_repeated_entries(header: dict, path: str, problems: Problems) -> None:
    """A repeated tensor name: safetensors keeps the last entry, but parses (and refuses) the others."""
    if not set(repeated(header)) - {"__metadata__"}:
        return
    pairs = list(items(header))
    last_at = {key: at for at, (key, _) in enumerate(pairs)}
    reported = set()
    for at, (key, value) in enumerate(pairs):
        if key == "__metadata__" or last_at[key] == at or key in reported:
            continue
        wrong = _entry_format(value)
        if wrong is not None:
            problems.report(
                f"the header names this tensor more than once; an earlier entry is wrong: {wrong}",
                path=path,
                tensor=key,
            )
            reported.add(key)


def _check_coverage(
    spans: list[tuple[int, int, str]], data_size: int, path: str, problems: Problems
) -> set[str]:
    """Coverage, as safetensors checks it: in order of (start, end), each tensor begins where the one
    before it ends (the first at byte 0), and the last one ends where the file does. A header length
    one short (a pad space dropped) leaves the JSON sound but moves every tensor one byte: only the
    last rule sees it. Returns the tensors that overlap another."""
    cursor, last = 0, None
    conflicting: set[str] = set()
    for start, end, name in sorted(spans):
        if start < cursor:
            if start == end:
                problems.report(
                    f"empty tensor at byte {start} lies inside the data of tensor {last}",
                    path=path,
                    tensor=name,
                )
            else:
                problems.report(
                    f"data overlaps tensor {last} (bytes {start}..{min(end, cursor)})", path=path, tensor=name
                )
            conflicting.update((name, last))
        elif start > cursor and last is None:
            problems.report(
                f"the first {start} bytes of the data section belong to no tensor (this one is first)",
                path=path,
                tensor=name,
            )
        elif start > cursor:
            problems.report(
                f"a hole: {start - cursor} bytes between tensor {last} and this one belong to no tensor",
                path=path,
                tensor=name,
            )
        if end >= cursor:
            cursor, last = end, name
    if cursor < data_size and last is None:
        problems.report(
            f"the header lists no tensor, but the data section holds {data_size} bytes", path=path
        )
    elif cursor < data_size:
        problems.report(
            f"the data section has {data_size - cursor} bytes after the end of the last tensor: the header "
            "length is wrong (a shifted header) or bytes were appended",
            path=path,
            tensor=last,
        )
    return conflicting
