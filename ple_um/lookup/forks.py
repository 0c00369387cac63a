"""Locks made anew in a forked child: a thread of the parent that held one (a fit check, the stats
reporter reading the counts) does not exist in the child, which would wait for it for ever."""

from __future__ import annotations

import os
import weakref

_RENEWED: weakref.WeakSet = weakref.WeakSet()


def renew_in_forked_children(owner) -> None:
    """Call ``owner._forked()`` in every child forked while ``owner`` lives."""
    _RENEWED.add(owner)


def _forked() -> None:
    for owner in list(_RENEWED):
        owner._forked()


os.register_at_fork(after_in_child=_forked)
