"""Ticker: a daemon thread that calls ``tick()`` every ``interval`` seconds until it is closed (the
fit check's, ``lookup.fit_watch.FitWatch``; the stats reporter's, ``metrics.reporter.StatsReporter``)."""

from __future__ import annotations

import threading
from typing import TypeVar

_T = TypeVar("_T", bound="Ticker")


class Ticker:
    """Calls ``tick()`` every ``interval`` seconds on a daemon thread named ``thread_name``, from
    ``start()`` (once; a non-positive interval starts nothing) until ``close()`` (idempotent; it
    waits for the thread unless the thread itself calls it). A ``tick()`` that raises is handed to
    ``tick_failed(exc)`` and the thread goes on: it must outlive any one failure. Subclasses define
    both."""

    thread_name = "ple-um-ticker"

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> object:
        raise NotImplementedError

    def tick_failed(self, exc: Exception) -> None:
        raise NotImplementedError

    def start(self: _T) -> _T:
        if self._thread is None and self.interval > 0:
            thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            thread.start()  # kept once it runs: a thread that could not start is not joined at close
            self._thread = thread
        return self

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - handed to tick_failed; the thread goes on
                self.tick_failed(exc)

    def close(self) -> None:
        self.stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
