"""``FitWatch``: the rule of ``lookup.fit`` applied again while a table serves, every
``PLE_UM_FIT_CHECK_SEC`` seconds on a thread of the table's (docs/OPERATING.md, "Memory").

A switch is a flag the next lookup reads: work already queued on a stream stays ordered before it,
and a graph captured before keeps what it captured (every path a table ever had stays alive until
it closes). The touch alone also reaches such graphs: under ``auto`` a captured kernel lookup
always holds a touch that runs only while its table's word says so (``LookupPaths.touch_live``).
Such a capture also checks first where the last check is older than ``CAPTURE_CHECK_AGE``
(``FitWatch.check_at_capture``): an engine captures its graphs right after its KV cache took the
memory, and a graph captured then on the host path reaches the row cache at every replay.
Where the host path that serves a table that stopped fitting has no row cache (the table fit at
open), ``FitWatch`` builds one (a new host path, sized from the memory left then) and switches
once it is ready; the old path stays for the graphs that captured it. A row cache built while
little memory was left (under ``auto``, or an explicit ``PLE_UM_ROW_CACHE`` cut to the memory
left) is built again the same way once the memory left gives one of ``REGROW_FACTOR`` times its
slots, or of its ceiling where that is less (what the owned rows need, or the explicit size), at
most once in ``REGROW_AFTER_S`` seconds. A build runs outside the check's lock (it may wait
minutes for the sizing lock and fault in the cache): a close, or another check, does not wait
for it; one closed meanwhile drops what it built.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from ple_um import envs
from ple_um.lookup import forks
from ple_um.lookup.fit import Serving, Verdict, choose, host_words, measure
from ple_um.lookup.host import misses
from ple_um.mapping import RESIDENT_SLACK, MappedShards
from ple_um.ticker import Ticker

logger = logging.getLogger(__name__)

# A lookup captured on the kernel checks again first where the last check is older than this
# (``FitWatch.check_at_capture``): the first capture after the memory changed sees it.
CAPTURE_CHECK_AGE = 0.1
# A serving row cache is built again, bigger, where the memory left now gives one of at least this
# many times its slots (or its ceiling, where that is less), at most once in REGROW_AFTER_S seconds
# (``FitWatch``): the caches it replaces stay until the table closes (graphs captured through
# them), together less than twice the newest.
REGROW_FACTOR = 2
REGROW_AFTER_S = 60.0
# A table's failed checks, and its page touch started or stopped, are each logged at most once in
# this many seconds, with how many lines were left out since (a check fails at every interval
# while its cause lasts; a sampled share near ``TOUCH_FROM`` may flip the touch at many checks).
SAY_EVERY_S = 60.0


class Said:
    """Log lines of each kind at most once in ``every`` seconds, the next one said saying how many
    were left out before it. Called under its owner's lock."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._left: dict[str, int] = {}

    def log(self, kind: str, level: int, msg: str, *args) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` was logged less than ``every`` ago; whether
        it was."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._left[kind] = self._left.get(kind, 0) + 1
            return False
        self._last[kind] = now
        if left := self._left.pop(kind, 0):
            msg, args = f"{msg} (%d more like it in the last %.0f s left out)", (*args, left, now - last)
        logger.log(level, msg, *args)
        return True


class FitWatch(Ticker):
    """Decides again, every ``interval`` seconds on a thread of its own, what serves ``paths``'
    decode-sized lookups (``LookupPaths``: ``serving``, ``decode_on_host``, ``touch_pages``,
    ``adopt``). ``host_for(spills)`` builds a host path (a row cache when ``spills``), or None
    where none can be built. ``close()`` stops the thread and waits for it, and for a check another
    thread makes, but not for a host path being built (dropped once built); idempotent. In a
    forked child, which has none of its parent's threads, the checks stop, a check can still be
    made (``check``) and ``close`` waits for nothing of the parent's."""

    thread_name = "ple-um-fit"

    def __init__(
        self,
        paths,
        mappings: list[MappedShards],
        *,
        interval: float,
        pinned: int,
        touch_knob: str,
        touch_here: bool,
        host_for: Callable[[bool], object | None],
        seed: int = 0,
    ) -> None:
        super().__init__(interval)
        self.paths, self.mappings, self.pinned = paths, mappings, pinned
        self.touch_knob, self.touch_here, self.host_for = touch_knob, touch_here, host_for
        self.rng = np.random.default_rng(seed)
        self.checks = 0
        self.checked_at = time.monotonic()  # the open measured the fit just now
        self.built_at = self.checked_at  # the last host path built (the open's)
        self.said = Said(SAY_EVERY_S)
        self._forked()
        forks.renew_in_forked_children(self)

    def _forked(self) -> None:
        """The check's lock, and no build under way: at open, and in a forked child, where the
        thread that held the lock or built a host path does not exist (its lock would be waited
        for ever, its build never adopted)."""
        self._lock = threading.Lock()  # one check's measure, choice and switch at a time
        self._builder: int | None = None  # the thread building a host path now, if any
        self._thread = None  # a parent's check thread: not in a child (a fresh watch: not yet)
        stopped, self.stopped = self.stopped, threading.Event()  # its own lock, too, anew
        if stopped.is_set():
            self.stopped.set()

    def tick_failed(self, exc: Exception) -> None:
        # A failed check keeps what serves; one that failed because the table closed meanwhile is
        # not said.
        with self._lock:
            if not self.stopped.is_set():
                self.said.log(
                    "failed",
                    logging.WARNING,
                    "ple-um: the fit check of %s failed (%s: %s); the path stays",
                    self.mappings[0].layout.directory,
                    type(exc).__name__,
                    exc,
                )

    def check(self) -> bool:
        """One check now: measure, choose, switch. Where the host path is to serve a table that does
        not fit and it has no row cache (or there is no host path), one is built first, and the
        switch waits for it; where the one it would build gains nothing (no room for a row cache),
        none is built. The build runs outside the lock; a check made meanwhile that would build
        one too leaves what serves as it is (the build under way switches), and one that would not
        switches as it finds. A build that ends where what serves changed meanwhile, or the watch
        closed, is dropped (the next check decides again). Whether what serves changed."""
        with self._lock:
            if self.stopped.is_set():
                return False
            self.checks += 1
            now, verdict, nxt, build = self._decide()
            if not build:
                return self._switch(now, verdict, nxt, None)
            if self._builder is not None:  # another thread builds the host path this switch waits for
                return False
            self._builder = threading.get_ident()
            host = self.paths.row_copy
        try:
            # Built while the table serves: an explicit PLE_UM_ROW_CACHE past the memory left is cut
            # to it (no open is there to refuse it), said once, in the switch's why.
            built = self.host_for(True, cut=True)
        except BaseException:
            with self._lock:
                self._builder = None
            raise
        with self._lock:
            self._builder = None
            if built is not None:
                self.built_at = time.monotonic()
            if self.stopped.is_set() or _key(self.paths.serving) != _key(now):
                gone, changed = built, False  # the next check (if any) decides again
            else:
                # The memory left moved since ``_could_gain``: the host path there is goes on
                # serving (one adopted each check would hold its files and buffers until the
                # table closes).
                keep = built is None or host is None or self._gains(built, host)
                gone = None if keep else built
                changed = self._switch(now, verdict, nxt, built if keep else None)
        if gone is not None:
            gone.close()
        return changed

    def _decide(self) -> tuple[Serving, Verdict, Serving, bool]:
        """Measure and choose (under the lock): what serves now, the verdict, what is to serve next,
        and whether a host path is to be built first."""
        paths = self.paths
        now = paths.serving
        verdict = measure(self.mappings, pinned=self.pinned, rng=self.rng)
        self.checked_at = time.monotonic()
        cpu = paths.gpu is None  # the cpu mode: always the host path; it can only gain a row cache
        nxt = now if cpu else choose(now, verdict, touch_knob=self.touch_knob, touch_here=self.touch_here)
        host = paths.row_copy
        knob = envs.PLE_UM_ROW_CACHE
        # auto: a row cache while the table does not fit; a size: that cache, fit or not.
        cache_wanted = not verdict.fits if knob == "auto" else int(knob) > 0
        wanted = host is None or cache_wanted and host.rows.cache is None
        cached = cache_wanted and host is not None and host.rows.cache is not None
        build = nxt.path == "host" and (
            wanted and self._could_gain(host, verdict) or cached and self._regrow_due(host)
        )
        return now, verdict, nxt, build

    def _switch(self, now: Serving, verdict: Verdict, nxt: Serving, built) -> bool:
        """Adopt ``built`` (a host path built for this switch, or None) and make ``nxt`` serve, with
        the words of what the host path has (under the lock). Whether what serves changed."""
        paths = self.paths
        if built is not None:
            paths.adopt(built)
            if nxt is now:  # the host path served already (the cpu mode, a GPU mode on it):
                # another one serves now, with what it gained; counted and said as a switch.
                nxt = Serving("host", False, f"{verdict.why}: the host path", now.switches + 1)
        if nxt.path == "host" and paths.row_copy is None:
            why = f"{verdict.why}, but no host path can be built here"
            nxt = Serving(now.path, now.touch, why, now.switches)
        elif nxt.path == "host" and nxt is not now:
            nxt = Serving("host", False, f"{nxt.why}, {host_words(paths.row_copy)}", nxt.switches)
        elif nxt.path == "host":  # the same host path serves on: its why says what holds now
            where = "the cpu mode's host path" if paths.gpu is None else "the host path"
            why = f"{verdict.why}: {where}, {host_words(paths.row_copy)}"
            nxt = Serving("host", False, why, now.switches)
        if _key(nxt) == _key(now):
            # What serves is unchanged: its why follows this check's figures, quietly (no log
            # line: the figures move at every check).
            if nxt.why != now.why:
                paths.set_serving(nxt)
            return False
        paths.set_serving(nxt)
        where = self.mappings[0].layout.directory
        if (nxt.path, nxt.switches) != (now.path, now.switches):  # a switch of path: always said
            logger.info("ple-um: decode-sized lookups of %s: %s", where, nxt.why)
        else:  # the touch alone, started or stopped
            self.said.log("touch", logging.INFO, "ple-um: decode-sized lookups of %s: %s", where, nxt.why)
        return True

    def _could_gain(self, host, verdict: Verdict) -> bool:
        """Whether a host path built now could have what ``host`` (None: there is none) lacks
        (``_gains``), told without building one (its reader's descriptors, an O_DIRECT probe, the
        sizing lock): a row cache where the memory left holds one set of slots
        (``misses.row_cache``, as the build would size it), or a reader of misses where ``host``
        has none and the build's plan would give one (``misses.reads_misses``)."""
        if host is None:
            return True
        if self._slots_now():
            return True
        resident = verdict.resident >= (1 - RESIDENT_SLACK) * verdict.owned
        return host.rows.reader is None and misses.reads_misses(cache=False, resident=resident)

    def _regrow_due(self, host) -> bool:
        """Whether ``host``'s row cache is to be built again, bigger: the last build at least
        ``REGROW_AFTER_S`` ago, and the memory left now gives a cache of ``_regrow_to`` its slots
        (``misses.row_cache``, as the build sizes it)."""
        if time.monotonic() - self.built_at < REGROW_AFTER_S:
            return False
        return self._slots_now() >= self._regrow_to(host.misses.slots)

    def _regrow_to(self, slots: int) -> int:
        """The slots a row cache of ``slots`` is built again with at least: ``REGROW_FACTOR`` times
        them, or its ceiling where less (``misses.row_cache_ceiling``: the owned rows' need, or an
        explicit ``PLE_UM_ROW_CACHE`` a cut cache grows back to); never past it: the regrowths end."""
        scales = self.mappings[1] if len(self.mappings) > 1 else None
        ceiling = misses.row_cache_ceiling(self.mappings[0], scales)
        return max(slots + 1, min(REGROW_FACTOR * slots, ceiling))

    def _gains(self, built, host) -> bool:
        """Whether host path ``built`` has what ``host`` lacks: a row cache (or one of ``_regrow_to``
        its slots), or a reader of misses (a table resident at open has none: its pages lost since
        would be faulted in one at a time)."""
        if built.rows.cache is not None:
            return host.rows.cache is None or built.misses.slots >= self._regrow_to(host.misses.slots)
        return built.rows.reader is not None and host.rows.reader is None

    def _slots_now(self) -> int:
        """The slots of the row cache a check would build now (``misses.row_cache``, sized from the
        memory left as the build sizes it, an explicit size cut to it); 0: no room for one."""
        scales = self.mappings[1] if len(self.mappings) > 1 else None
        return misses.row_cache(self.mappings[0], scales, spills=True, cut=True)[1]

    tick = check  # the thread's check is the one a caller can make now

    def check_at_capture(self) -> None:
        """A check now, on the capturing thread, where checks run at all (a positive interval) and
        the last one is older than ``CAPTURE_CHECK_AGE``: a graph keeps the path it captured, and
        an engine captures its graphs once, right after its KV cache took the memory a table fit
        in (vLLM at start-up), sooner than the thread's next check. What it builds makes no CUDA
        call (``build_paths`` prepared the device at open), so the capture stays intact. A host
        path the thread is building already is not waited for: the capture keeps what serves. A
        check that fails (a row cache that memory ran out for) is the thread's failed check: said,
        and the capture's lookup served by what serves, never failed by it."""
        if self.interval > 0 and time.monotonic() - self.checked_at >= CAPTURE_CHECK_AGE:
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - said by tick_failed; the lookup goes on
                self.tick_failed(exc)

    def close(self) -> None:
        with self._lock:  # a check another thread runs has measured, chosen and switched
            self.stopped.set()
            builder = self._builder
        if self._thread is not None and self._thread.ident == builder:
            self._thread = None  # its build is dropped once done (``check``): not waited for
        super().close()


def _key(serving: Serving) -> tuple[str, bool, int]:
    """What serves, without its words: a check that changed only the ``why`` changed nothing."""
    return serving.path, serving.touch, serving.switches
