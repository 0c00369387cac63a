"""An advisory lock between the processes of one machine: an ``flock`` on a file, waited for a
bounded time.

Processes that start at once (tensor-parallel ranks, data-parallel replicas, several servers) use
it to do one at a time what each would otherwise do at the same moment: the first read's child
(``access.verdict_cache``) and the sizing of a row cache (``lookup.host.misses``). The kernel releases
the lock when its holder's file is closed, however the process ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from ple_um import cache_folder

POLL_S = 0.02  # between tries while another process holds the lock


@contextlib.contextmanager
def held(path: str, wait: float) -> Iterator[str | None]:
    """Hold an ``flock`` on ``path`` (made, with its folder, where it is not) while the block runs,
    having waited at most ``wait`` seconds for it. Yields None when it is held, else why not (the
    file cannot be opened, or another process held it all along): the caller goes on without it.
    The folder and the file are trusted only when they are safe (``cache_folder``): a FIFO does
    not block the open, a link is not followed (nor its target made)."""
    try:
        cache_folder.private_folder(os.path.dirname(path) or ".")
        fd = cache_folder.open_private(path, os.O_RDONLY | os.O_CREAT, 0o600)
    except cache_folder.UnsafeCacheError as exc:
        yield f"cannot open {path}: {exc}"
        return
    except OSError as exc:
        yield f"cannot open {path}: {exc.strerror or exc}"
        return
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                why = None
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    why = f"{path} still held by another process after {wait:.0f} s"
                    break
                time.sleep(POLL_S)
        yield why
    finally:
        os.close(fd)  # releases the lock
