"""Reading a checkpoint's files without trusting them: regular files only, opened so that a FIFO
cannot block, read with exact preads whose short reads are errors, JSON side files size-checked
before they are read. Every failure is a CheckpointError naming the file. A file's identity
(``FileIdentity``) is taken from the descriptor its header is read through, so that what is read
later (a scale's bytes, the mapping) can be checked to come from that same file."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from ple_um.errors import CheckpointError


@dataclass(frozen=True)
class FileIdentity:
    """Which file, in which state: device, inode, size and modification time, as ``fstat`` gave them
    for a descriptor. Another file renamed into the path, or the file rewritten or truncated, has
    another identity (a rewrite within one tick of the clock that keeps the size excepted)."""

    st_dev: int
    st_ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differs(self, now: FileIdentity) -> str | None:
        """What differs in ``now`` from this identity, in words, or None."""
        changes = [
            f"{what} {a} -> {b}"
            for what, a, b in (
                ("device", self.st_dev, now.st_dev),
                ("inode", self.st_ino, now.st_ino),
                ("size", self.size, now.size),
                ("mtime_ns", self.mtime_ns, now.mtime_ns),
            )
            if a != b
        ]
        return ", ".join(changes) or None


def check_identity(st: os.stat_result, identity: FileIdentity, path: str, tensor: str | None = None) -> None:
    """CheckpointError naming ``path`` (and ``tensor``, where given) unless ``st`` (the ``fstat`` of a
    descriptor of ``path``) shows the file ``identity`` describes: the one its header was read from,
    not rewritten since."""
    changed = identity.differs(FileIdentity.of(st))
    if changed is not None:
        raise CheckpointError(
            f"the file changed after its header was read ({changed}): replaced, rewritten or truncated "
            "while the checkpoint was being opened; open it again",
            path=path,
            tensor=tensor,
        )


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """An fd of the regular file ``path`` and its ``fstat``; O_NONBLOCK so that a FIFO cannot block
    the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"cannot open: {e.strerror or e}", path=path) from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"cannot stat: {e.strerror or e}", path=path) from e
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError("not a regular file", path=path)
    return fd, st


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


def read_bytes(path: str, offset: int, length: int, identity: FileIdentity) -> bytes:
    """``length`` bytes at absolute ``offset`` of ``path`` (for the few bytes of a scale), from the
    file ``identity`` describes (CheckpointError where another file is there now)."""
    fd, st = open_regular(path)
    try:
        check_identity(st, identity, path)
        return pread_exact(fd, length, offset, path)
    finally:
        os.close(fd)


def read_json_file(path: str, *, what: str, limit: int) -> object:
    """Parse a small JSON side file (the index) of at most ``limit`` bytes, as vLLM reads it (Python's
    json); its size is checked before it is read, and every way it can fail is a CheckpointError."""
    fd, st = open_regular(path)
    try:
        size = st.st_size
        if size > limit:
            raise CheckpointError(f"{what} is {size} bytes, more than the {limit} byte limit", path=path)
        raw = pread_exact(fd, size, 0, path)
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8 (byte {e.start})", path=path) from e
    except RecursionError as e:
        raise CheckpointError(f"{what} JSON is nested too deeply", path=path) from e
    except ValueError as e:  # JSONDecodeError, and int() refusing an absurdly long number
        raise CheckpointError(f"{what} is not valid JSON: {e}", path=path) from e
