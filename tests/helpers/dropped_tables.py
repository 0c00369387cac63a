"""The wait for tables dropped without ``close()`` to be released (``ple_um.dropped``), through the
package's own release queue."""

from __future__ import annotations

import threading

from ple_um.dropped import on_drop


class _Marker:
    """An object dropped at once: its release is queued after every release queued before it."""


def drain(timeout: float | None = None) -> bool:
    """Wait until everything dropped before this call is released (the release thread takes them in
    the order they were dropped); False where ``timeout`` passed."""
    done = threading.Event()
    marker = _Marker()
    on_drop(marker, {}, lambda state: done.set(), cuda=False)
    del marker  # the last reference: its finalizer queues the release now
    return done.wait(timeout)
