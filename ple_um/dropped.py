"""Objects dropped without ``close()`` (a ``MappedTable``): what they held is released all the same.

A finalizer runs wherever the last reference goes: in any thread, inside a CUDA graph capture, in a
lookup path's own worker thread, with a lock held. So the finalizer only queues what the object
held (``SimpleQueue.put`` is safe there); the release runs later on a daemon thread of this
module's own, which is none of the lookup paths' threads and captures nothing. There a CUDA
table's wait for its device runs in CUDA's relaxed capture mode for that thread, so that it never
breaks, nor is refused by, a capture another thread makes meanwhile.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable

from ple_um.lookup.streams import relaxed_capture_mode

logger = logging.getLogger(__name__)

_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_LOCK = threading.Lock()
_thread: threading.Thread | None = None
_pid: int | None = None


def on_drop(owner: object, state: dict, release: Callable[[dict], None], *, cuda: bool) -> weakref.finalize:
    """Have ``release(state)`` run once ``owner`` is garbage, on the release thread (``cuda``: in
    the relaxed capture mode). ``state`` must not refer to ``owner`` (it would never be garbage).
    The caller detaches the returned finalizer when it releases ``state`` itself (``close()``)."""
    _start()
    finalizer = weakref.finalize(owner, _QUEUE.put, (state, release, cuda))
    finalizer.atexit = False  # at exit the process lets go of everything at once
    return finalizer


def _start() -> None:
    global _thread, _pid
    with _LOCK:
        if _thread is not None and _pid == os.getpid():
            return
        thread = threading.Thread(target=_run, name="ple-um-dropped", daemon=True)
        thread.start()  # kept once it runs: one that could not start is started at the next call
        _thread, _pid = thread, os.getpid()  # a forked child has the queue but not the thread


def _run() -> None:
    while True:
        item = _QUEUE.get()
        state, release, cuda = item
        del item
        try:
            if cuda:
                with relaxed_capture_mode(on_failure=_no_relaxed_mode):
                    release(state)
            else:
                release(state)
        except Exception as exc:  # noqa: BLE001 - the thread must go on for the next one
            logger.error(
                "ple-um: releasing a table dropped without close() failed: %s: %s", type(exc).__name__, exc
            )
        finally:
            del state, release


def _no_relaxed_mode(exc: BaseException) -> None:
    logger.warning("ple-um: releasing a dropped table in the current capture mode (%s)", exc)
