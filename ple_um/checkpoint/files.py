"""Reading a checkpoint's files without trusting them: regular files only, opened so that a FIFO
cannot block, read with exact preads whose short reads are errors, JSON side files size-checked
before they are read. Every failure is a CheckpointError naming the file."""

from __future__ import annotations

import os
import stat

from ple_um.checkpoint.header_json import decode_json
from ple_um.errors import CheckpointError


def open_regular(path: str) -> int:
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


def pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
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
    fd = open_regular(path)
    try:
        return pread_exact(fd, length, offset, path)
    finally:
        os.close(fd)


def read_json_file(path: str, *, what: str, limit: int) -> object:
    """Parse a small JSON side file (the index) of at most ``limit`` bytes; its size is checked
    before it is read."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{what} is {size} bytes, more than the {limit} byte limit", path=path)
        raw = pread_exact(fd, size, 0, path)
    finally:
        os.close(fd)
    return decode_json(raw, path, what=what)
