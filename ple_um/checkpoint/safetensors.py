"""Safetensors headers: the ``safetensors`` package judges each one, ple-um reads each tensor's
absolute byte range in its file from the header it accepted.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``), then the
data section; offsets are relative to its first byte, ``8 + N``. Every length in the file is
untrusted: the header length is checked against the file size and a 100 MB cap before anything is
read, and only the header (never tensor data) is read, through the descriptor the file's identity
is taken from.

The verdict is the package's (the loader stock vLLM uses), so that ple-um serves no file vLLM
would refuse: the header bytes ple-um read are handed to ``safetensors.safe_open`` in a stand-in file
as long as the real one, its data section a hole (an in-memory file, else a sparse temporary file,
opened by the package through Linux's /proc/self/fd), so that the package judges exactly those
bytes, never opens the checkpoint's file itself and reads no tensor data. Its refusal becomes a
CheckpointError naming the file, and the tensor at fault where one is. A header that places a tensor
past the end of the file is refused before the package is asked (the package refuses it too), so
that no stand-in is ever longer than the real file. A machine where no stand-in can be made or
mapped raises HostError, which blames no file. docs/CHECKPOINTS.md lists the rules the package
applies.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import safetensors

from ple_um.checkpoint.files import FileIdentity, open_regular, pread_exact
from ple_um.errors import CheckpointError, HostError

# The safetensors package refuses larger headers too (its MAX_HEADER_SIZE); checked here before
# anything of that length is read or allocated.
MAX_HEADER_BYTES = 100_000_000

_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 8, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 40

# The package's messages (from 0.6 on) that lead to the tensor at fault: one it names, JSON it
# refuses, a data section that does not end where the last tensor does.
_NAMED = re.compile(r"invalid offset for tensor `(.*)`\Z", re.DOTALL)
_JSON = "invalid JSON in header"
_COVERAGE = "incomplete metadata"
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# Where the package opens the stand-in file by its descriptor.
_PROC_FD = "/proc/self/fd"


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


@dataclass(frozen=True)
class SafetensorsHeader:
    """The header of one file the ``safetensors`` package accepts, its tensors by name."""

    path: str
    tensors: dict[str, TensorEntry]


def read_header(path: str) -> SafetensorsHeader:
    """The header of the safetensors file ``path``, read without reading tensor data.

    CheckpointError naming ``path`` (and the tensor at fault, where there is one) when the file
    cannot be read, its header length is beyond the file or the cap, a tensor lies past its end, or
    the ``safetensors`` package refuses its header. HostError when this machine cannot hand the
    header to the package (see _verdict) or map a stand-in as long as the file.
    """
    identity, raw = _read_raw(path)
    try:
        header, unread = json.loads(raw[8:].decode("utf-8")), None
    except (ValueError, RecursionError) as e:
        header, unread = None, e  # the package judges it
    if isinstance(header, dict):
        _check_end(header, raw, identity.size, path)
    try:
        why = _verdict(raw, identity.size)
        if why is not None:
            raise _refusal(why, raw, identity.size, path)
    except MemoryError as e:  # safe_open maps the stand-in, as long as the file, whole
        raise HostError(
            f"cannot check the safetensors header of {path}: mapping {identity.size} bytes (the file's "
            "size) exceeds this process's address space; raise its limit (ulimit -v)"
        ) from e
    # The package accepted the header: it is UTF-8 JSON of an object whose entries are sound,
    # nested at most 127 levels, so that Python's json read the same tensors from it (the last
    # entry of a repeated name, as the package keeps) unless the caller was already near Python's
    # recursion limit.
    if unread is not None:
        message = "header nested too deeply for Python's json at this depth"
        raise CheckpointError(message, path=path) from unread
    data_start = len(raw)
    tensors = {
        name: TensorEntry(
            name=name,
            dtype=meta["dtype"],
            shape=tuple(meta["shape"]),
            start=data_start + meta["data_offsets"][0],
            end=data_start + meta["data_offsets"][1],
            path=path,
            identity=identity,
        )
        for name, meta in header.items()
        if name != "__metadata__"
    }
    return SafetensorsHeader(path, tensors)


def _read_raw(path: str) -> tuple[FileIdentity, bytes]:
    """The file's identity (its size among them) and its first ``8 + N`` bytes (the length field and
    the header), both limits on ``N`` checked before anything of that length is read or allocated."""
    fd, st = open_regular(path)
    try:
        identity = FileIdentity.of(st)
        file_size = identity.size
        if file_size < 8:
            raise CheckpointError(f"file is {file_size} bytes, too short for a safetensors header", path=path)
        prefix = pread_exact(fd, 8, 0, path)
        (length,) = struct.unpack("<Q", prefix)
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
        return identity, prefix + pread_exact(fd, length, 8, path)
    finally:
        os.close(fd)


def _verdict(raw: bytes, file_size: int) -> str | None:
    """What the ``safetensors`` package says of a file of ``file_size`` bytes that begins with
    ``raw`` (the length field and the header): None when it accepts it, else its reason.

    The package is given a stand-in file holding ``raw``, as long as the real one, the rest a hole
    that takes no space: it reads only the header, and the data section's length. HostError when
    no stand-in can be made or opened (no memfd and no temporary file, no /proc)."""
    try:
        fd = _stand_in()
        try:
            os.ftruncate(fd, file_size)
            done = 0
            while done < len(raw):
                done += os.pwrite(fd, raw[done:], done)
            try:
                with safetensors.safe_open(f"{_PROC_FD}/{fd}", framework="numpy"):
                    return None
            except safetensors.SafetensorError as e:
                return str(e).removeprefix("Error while deserializing header: ")
        finally:
            os.close(fd)
    except OSError as e:
        raise HostError(
            f"cannot hand a safetensors header to the package: a stand-in file of {file_size} bytes, "
            f"opened through {_PROC_FD}, failed: {e}"
        ) from e


def _stand_in() -> int:
    """A descriptor of a new empty file: in memory, else (a Python built without memfd_create, a
    kernel or sandbox refusing it) a temporary one, unnamed, whose holes take no disk."""
    try:
        return os.memfd_create("ple-um-safetensors-header")
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:
            return os.dup(f.fileno())


def _check_end(header: dict, raw: bytes, file_size: int, path: str) -> None:
    """Refuse a header (as Python's json reads it) whose entries place a tensor past the end of the
    file, naming the one that ends last. The package refuses it too (its data section must end where
    the last tensor does); refused first, no stand-in is asked to be longer than the real file."""
    ends = [
        (meta["data_offsets"][1], name)
        for name, meta in header.items()
        if name != "__metadata__"
        and isinstance(meta, dict)
        and isinstance(meta.get("data_offsets"), list)
        and len(meta["data_offsets"]) == 2
        and type(meta["data_offsets"][1]) is int
    ]
    end, tensor = max(ends, default=(0, None))
    short = end - (file_size - len(raw))
    if short > 0:
        raise CheckpointError(
            f"header places tensor data past the end of the file ({file_size} bytes): the file ends "
            f"{short} bytes before the last tensor does; file truncated or offsets wrong; its entry: "
            f"{_REPR.repr(header[tensor])}",
            path=path,
            tensor=tensor,
        )


def _refusal(why: str, raw: bytes, file_size: int, path: str) -> CheckpointError:
    """The package's refusal ``why`` as a CheckpointError naming the file and the tensor at fault:
    for JSON it refuses, the entry that makes it refuse; the last tensor when bytes follow it; for
    offsets out of place or a size that does not fit shape and dtype, the first (in offset order,
    then by name) it refuses. serde_json's own position is no guide: it reports an entry's fault at
    the header's end."""
    message = f"safetensors {safetensors.__version__} refuses the header: {why}"
    # Among entries with the same offsets, the tensor the package names follows its hash map's
    # order, which changes from run to run; the one named here is found in a fixed order instead.
    named = _NAMED.search(why)
    if why.startswith(_JSON):
        tensor = _json_fault(raw[8:].decode("utf-8"))
        return CheckpointError(message, path=path, tensor=None if tensor == "__metadata__" else tensor)
    try:  # parsed by the package: the fault is in the offsets or sizes of its entries
        header = json.loads(raw[8:].decode("utf-8"))
        entries = sorted(
            (tuple(meta["data_offsets"]), name) for name, meta in header.items() if name != "__metadata__"
        )
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError):
        return CheckpointError(message, path=path)  # not UTF-8: no entry to name
    if not entries:
        return CheckpointError(message, path=path)
    order = [name for _, name in entries]
    if why.startswith(_COVERAGE):  # never short: _past_end refuses that first
        tensor = max(entries, key=lambda e: (e[0][1], e[0][0], e[1]))[1]
        extra = file_size - len(raw) - _end(header, tensor)
        message += (
            f": {extra} bytes after the end of the last tensor; the header length is wrong (a shifted "
            "header) or bytes were appended"
        )
    else:
        # The first k tensors cover their data section: refused exactly when one of them is at fault.
        at = _first(len(order), lambda k: _judge({n: header[n] for n in order[:k]}, order[k - 1]))
        tensor = order[at]
        if named is not None:
            head = message[: len(message) - len(why) + named.start()]
            message = f"{head}invalid offset for tensor `{tensor}`"
            return CheckpointError(message, path=path, tensor=tensor)
    return CheckpointError(f"{message}; its entry: {_REPR.repr(header[tensor])}", path=path, tensor=tensor)


def _end(header: dict, name: str) -> int:
    return header[name]["data_offsets"][1]


def _judge(header: dict, last: str) -> bool:
    """Whether the package refuses ``header`` on a data section that ends where tensor ``last`` does;
    written compact, so that the stand-in is no longer than the real file."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return _verdict(struct.pack("<Q", len(text)) + text, 8 + len(text) + _end(header, last)) is not None


def _first(count: int, refused: Callable[[int], bool]) -> int:
    """The index of the item at fault, by bisection: ``refused(k)`` says whether the first ``k`` of
    ``count`` items hold it (all of them do)."""
    good, bad = 0, count
    while bad - good > 1:
        k = (good + bad) // 2
        good, bad = (good, k) if refused(k) else (k, bad)
    return bad - 1


def _json_fault(text: str) -> str | None:
    """The top-level key whose entry makes the package refuse the header's JSON, None where no entry
    does (the header is not an object, or is cut between entries). The entries are read with
    Python's json; the first one it cannot read, when the package takes all before it, is at fault."""
    entries, unread = _entries(text)

    def refused(k: int) -> bool:
        part = ("{" + ", ".join(entry for _, entry in entries[:k]) + "}").encode()
        why = _verdict(struct.pack("<Q", len(part)) + part, 8 + len(part))
        return why is not None and why.startswith(_JSON)

    if entries and refused(len(entries)):
        return entries[_first(len(entries), refused)][0]
    return unread


def _entries(text: str) -> tuple[list[tuple[str, str]], str | None]:
    """The top-level entries of a header as (key, its text ``"key": value``) as far as Python's json
    reads them, and the key of the entry it could not read (None when it read them all, or when the
    header is no object)."""
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        return _WHITESPACE.match(text, i).end()

    entries: list[tuple[str, str]] = []
    i = skip(0)
    if not text.startswith("{", i):
        return entries, None
    i = skip(i + 1)
    while not text.startswith("}", i):
        start, key = i, None
        try:
            key, i = decoder.raw_decode(text, start)
            i = skip(i)
            if not isinstance(key, str) or not text.startswith(":", i):
                raise ValueError("no key and colon")
            _, i = decoder.raw_decode(text, skip(i + 1))
        except (ValueError, RecursionError):
            return entries, key if isinstance(key, str) else None
        entries.append((key, text[start:i]))
        i = skip(i)
        if not text.startswith(",", i):
            break
        i = skip(i + 1)
    return entries, None
