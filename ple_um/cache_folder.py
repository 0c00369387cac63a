"""The cache folder (``PLE_UM_CACHE_DIR``) trusted only when it is safe, and its files opened only
when they are what they should be.

What ple-um keeps there decides what runs and how: the compiled row copy (``native/``), the
first-read verdicts that let an open skip its child-process check (``first-read/``), the locks
that put the ranks of one deployment in line. A folder anyone else can write lets them plant a
library that runs as this user, or a verdict that skips a check; a file that is a FIFO, a device
or a link makes an open hang, read without end, or create a file where the link points. So:

- the folder and its subfolders are made 0700 and are used only when they are folders (not links)
  owned by this user that no one else can write (``private_folder``);
- a file in them is opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only when it is a regular
  file owned by this user that no one else can write (``open_private``); a read is bounded
  (``read_private``); a write replaces the file whole (``write_private``); a lock is an ``flock``
  on such a file, waited for a bounded time (``locked``), whose descriptor a forked child closes.

Each check that fails raises ``UnsafeCacheError`` saying what is wrong; the callers then ignore
what they found (a verdict is rechecked, a library rebuilt, a lock gone without) and say so. The
folders above the cache folder are the user's choice and are not checked. docs/OPERATING.md says
how several users share a machine (one cache folder each).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Iterator

POLL_S = 0.02  # between tries for a lock another process holds


class _Descriptor:
    """A lock's descriptor while ``locked`` runs (-1 once closed): closed by its block, or in a
    forked child by ``_forked``, never by both."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


# The descriptors of this process's locks (``locked``), waited for or held.
_OPEN_LOCKS: set[_Descriptor] = set()


def _forked() -> None:
    """In a forked child: close the copies of the parent's lock descriptors. An ``flock`` belongs
    to the open file, which the copy shares: kept, it would hold the parent's lock after the parent
    lets it go, for as long as the child lives (every other process, and the parent's next sizing,
    would wait its bound out), and the child's own ``locked`` would wait for the copy it holds. The
    thread that held it is not in the child; closing the copy leaves the parent's lock held."""
    for each in list(_OPEN_LOCKS):
        with contextlib.suppress(OSError):
            each.close()
    _OPEN_LOCKS.clear()


os.register_at_fork(after_in_child=_forked)  # here: the cache folder is below lookup.forks' layer


class UnsafeCacheError(OSError):
    """A cache folder or file that is not what ple-um may trust (the message says why)."""


_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFREG: "a regular file",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def _why_unsafe(st: os.stat_result, kind: str) -> str | None:
    """Why a file of ``st`` cannot be trusted as a ``kind`` ("folder" or "regular file"), or None."""
    found = _KINDS.get(stat.S_IFMT(st.st_mode), "an unknown kind of file")
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if found != f"a {kind}":
        return f"is not a {kind} ({found})"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"can be written by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def why_unusable(path: str) -> str | None:
    """Why ``path`` cannot be a cache folder (it exists and is not a safe folder, or it cannot be
    made because a file is in the way), or None: the knob's check, which makes nothing."""
    try:
        st = os.lstat(os.path.normpath(path))  # "link/" and "link/." would follow the link
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            return f"{parent} is not a folder, so {path} cannot be made"
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    why = _why_unsafe(st, "folder")
    return None if why is None else f"{path} {why}"


def check_folder(path: str) -> None:
    """Raise UnsafeCacheError unless ``path`` is a folder (not a link) owned by this user that no
    one else can write (FileNotFoundError where it is not there); makes nothing."""
    try:
        st = os.lstat(os.path.normpath(path))  # "link/" and "link/." would follow the link
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafeCacheError(f"cannot use the cache folder {path}: {exc.strerror or exc}") from None
    why = _why_unsafe(st, "folder")
    if why is not None:
        raise UnsafeCacheError(f"the cache folder {path} {why}")


def private_folder(path: str) -> str:
    """``path``, made (0700, with its missing parents) where it is not, once checked to be a
    folder, not a link, owned by this user and written by no one else; else UnsafeCacheError."""
    missing = []
    at = os.path.abspath(path)
    while not os.path.lexists(at):
        missing.append(at)
        at = os.path.dirname(at)
    try:
        for folder in reversed(missing):  # each made 0700 (os.makedirs gives parents the umask's mode)
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:  # made by another process meanwhile: checked below like any
                pass
    except OSError as exc:
        raise UnsafeCacheError(f"cannot make the cache folder {path}: {exc.strerror or exc}") from None
    check_folder(path)
    return path


def open_private(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of ``path`` (a file in a cache folder), opened without following a link and
    without blocking (a FIFO does not hang the open), once checked to be a regular file owned by
    this user and written by no one else; else UnsafeCacheError (FileNotFoundError where it is not
    there and ``flags`` has no O_CREAT)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the last part of the path is a symbolic link
            raise UnsafeCacheError(f"{path} is a symbolic link") from None
        raise UnsafeCacheError(f"{path}: {exc.strerror or exc}") from None
    why = _why_unsafe(os.fstat(fd), "regular file")
    if why is not None:
        os.close(fd)
        raise UnsafeCacheError(f"{path} {why}")
    return fd


def read_private(path: str, limit: int) -> bytes:
    """The bytes of ``path`` (``open_private``), at most ``limit`` of them: a longer file raises
    UnsafeCacheError, having read no more than ``limit + 1`` bytes."""
    fd = open_private(path)
    try:
        parts, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) > limit:
        raise UnsafeCacheError(f"{path} is larger than the {limit} bytes it may be")
    return data


def write_private(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically: written to a temporary file of mode 0600 in the same
    folder (made or checked by ``private_folder``), synced, renamed over the old one, so that a
    reader sees the old file or the new one, never a part. OSError (UnsafeCacheError for a folder
    that is not safe) where it cannot; the temporary file is gone then."""
    fd, tmp = tempfile.mkstemp(dir=private_folder(os.path.dirname(path)), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: str, wait: float) -> Iterator[str | None]:
    """Hold an ``flock`` on ``path`` (``open_private``; made, with its folder, where it is not) while
    the block runs, having waited at most ``wait`` seconds for it: an advisory lock between the
    processes of one machine. Processes that start at once (tensor-parallel ranks, data-parallel
    replicas, several servers) take turns with it at what each would otherwise do at the same moment:
    the first read's child (``access.first_read``) and the sizing of a row cache
    (``lookup.host.misses``). Yields None when it is held, else why not (the file cannot be opened,
    or another process held it all along): the caller goes on without it. The kernel releases the
    lock when its holder's file is closed, however the process ends; a forked child closes its copy
    of the descriptor (``_forked``), so that the lock is the parent's alone."""
    try:
        private_folder(os.path.dirname(path) or ".")
        held = _Descriptor(open_private(path, os.O_RDONLY | os.O_CREAT, 0o600))
    except OSError as exc:  # UnsafeCacheError among them, whose message says why
        yield f"cannot open {path}: {exc.strerror or exc}"
        return
    _OPEN_LOCKS.add(held)
    try:
        got = flock_within(held.fd, wait)
        yield None if got else f"{path} still held by another process after {wait:.0f} s"
    finally:
        _OPEN_LOCKS.discard(held)
        held.close()  # releases the lock


def flock_within(fd: int, wait: float) -> bool:
    """An exclusive ``flock`` on ``fd`` (a file's or a folder's), waited for at most ``wait``
    seconds: whether it is held now."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
