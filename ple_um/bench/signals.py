"""The signals that end a bench run while a child runs under a memory limit (``memlimit``):
SIGTERM and SIGHUP raised as an interrupt is (``terminate_as_interrupt``), so that the same cleanup
runs; and that cleanup made whole (``DeferredSignals``): held from before a child or a group is made
to after it is gone, a signal acts only where the block lets it through (``let_through``: the run
it is to interrupt), inside the ``try`` whose cleanup releases what was made."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while a child runs under a limit (``terminate_as_interrupt``), raised as an
    interrupt is, so that the same cleanup runs: the child, which leads a session of its own and
    would outlive this process, killed, and its group removed. ``code``: the exit status a shell
    gives a process that signal killed (128 + its number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.code = 128 + signum


# The signals that would end this process without its cleanup while a child runs under a limit.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within: TERMINATING signals raise Terminated where they would kill this process (their
    handler the default; one ignored, as under nohup, or the caller's own, stays); their handlers
    restored after. Python sets handlers in the main thread only: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, _frame):
        raise Terminated(signum)

    saved = {sig: signal.getsignal(sig) for sig in TERMINATING}
    for sig, handler in saved.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, terminated)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# The signals a cleanup holds back until it is done.
DEFERRED = (signal.SIGINT, *TERMINATING)


class DeferredSignals:
    """Within: DEFERRED signals are held (noted, not acted on), so that a second Ctrl-C or a
    SIGTERM does not cut a cleanup short (a child left running, a cgroup left behind), nor come
    between the making of a child or a group and the ``try`` that releases it; an ignored one stays
    ignored. ``let_through()`` lets them act within it. On leaving, their handlers are restored and
    the first one held is raised again (``signal.raise_signal``: its handler acts as it would have,
    the process ends as asked), unless an exception already leaves the block or the ``finally`` it
    runs in: that one is the interrupt on its way already. Python sets handlers in the main thread
    only: elsewhere nothing changes."""

    def __enter__(self) -> DeferredSignals:
        self.held: list[int] = []
        self.saved: dict = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.getsignal(sig) for sig in DEFERRED}
            self._hold_all()
        return self

    def _hold_all(self) -> None:
        for sig, handler in self.saved.items():
            if handler is not signal.SIG_IGN:
                signal.signal(sig, self._hold)

    def _hold(self, signum, _frame) -> None:
        self.held.append(signum)

    @contextlib.contextmanager
    def let_through(self):
        """Within: the signals act as they would outside the block (a wait they are to interrupt,
        put inside the ``try`` that releases what the block made); the first one held before acts
        on entering. On leaving, held again, whatever leaves."""
        try:  # held again even where one comes as soon as the first handler is back
            for sig, handler in self.saved.items():
                signal.signal(sig, handler)
            if self.held:  # the first acts, as on leaving the block
                first, self.held = self.held[0], []
                signal.raise_signal(first)
            yield
        finally:
            self._hold_all()

    def __exit__(self, exc_type, *_exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if self.held and exc_type is None and sys.exc_info()[0] is None:
            signal.raise_signal(self.held[0])
