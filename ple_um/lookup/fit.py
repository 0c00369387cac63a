"""Which path serves a table's decode-sized lookups, decided by whether its owned rows fit the
memory this process may use, and decided again while it serves.

The rule (docs/OPERATING.md, "Memory"):
- **Fit** (``access.memory.fits``): the whole table within MemAvailable (plus its pinned bytes),
  and its bytes not yet in memory within each memory cgroup's room; counted with the owned rows of
  every other table this process has open (``OPEN_TABLES``), a file's bytes once. ``PLE_UM_FIT``
  forces it.
- **A table that does not fit** is served on the host path: the C row copy with a row cache (hot
  rows held at row granularity) and the reader of misses (many reads in flight), every lookup, as
  the ``cpu`` mode does; in the ``ats`` and ``registered`` modes the kernel no longer serves
  decode-sized lookups, and no page is touched for them.
- **A table that fits** is served as before: the kernel, with no row cache; in the ``ats`` mode a
  page touch is queued before each kernel while the table is not all in memory
  (``PLE_UM_ATS_PREFETCH=auto``), so that the GPU never takes its faults one at a time.
- **Decided again** every ``PLE_UM_FIT_CHECK_SEC`` seconds by ``FitWatch`` (one thread a table):
  the residency of a sample of the table's pages (``SAMPLE_PAGES``, mincore; every page of a small
  table) and the memory left. With hysteresis: the kernel gives way to the host path as soon as
  the table does not fit; the host path gives it back only once the table fits with
  ``1 - FIT_MARGIN`` of its size to spare; the touch starts when more than ``TOUCH_FROM`` of the
  sampled pages are out and stops when none is. A switch is a flag the next lookup reads: work
  already queued on a stream stays ordered before it, and a graph captured before keeps what it
  captured (every path a table ever had stays alive until it closes). The touch alone also
  reaches such graphs: under ``auto`` a captured kernel lookup always holds a touch that runs
  only while its table's word says so (``LookupPaths.touch_live``). Such a capture also checks
  first where the last check is older than ``CAPTURE_CHECK_AGE`` (``FitWatch.check_at_capture``):
  an engine captures its graphs right after its KV cache took the memory, and a graph captured
  then on the host path reaches the row cache at every replay.
Where the host path that serves a table that stopped fitting has no row cache (the table fit at
open), ``FitWatch`` builds one on its own thread (a new host path, sized from the memory left
then) and switches once it is ready; the old path stays for the graphs that captured it. A row
cache built while little memory was left (under ``auto``, or an explicit ``PLE_UM_ROW_CACHE`` cut
to the memory left) is built again the same way once the memory left gives one of
``REGROW_FACTOR`` times its slots, or of its ceiling where that is less (what the owned rows need,
or the explicit size), at most once in ``REGROW_AFTER_S`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ple_um import envs
from ple_um.access import memory
from ple_um.checkpoint import ShardLayout
from ple_um.errors import KnobError
from ple_um.lookup import rowcopy, sync_gather
from ple_um.lookup.host import misses
from ple_um.lookup.open_tables import OPEN_TABLES, uncovered
from ple_um.mapping import PAGE, RESIDENT_SLACK, MappedRegion, MappedShards
from ple_um.residency import resident_count, resident_pages
from ple_um.ticker import Ticker

logger = logging.getLogger(__name__)

SAMPLE_PAGES = 256  # pages sampled per check (a table of at most FULL_SCAN_PAGES: all of them)
FULL_SCAN_PAGES = 1 << 15
FIT_MARGIN = 0.9  # back from the host path only when the table fits in this share of the room
TOUCH_FROM = 1 / 64  # the touch starts when more than this share of the sampled pages are out
SWITCHING_MODES = ("ats", "registered")
# A lookup captured on the kernel checks again first where the last check is older than this
# (``FitWatch.check_at_capture``): the first capture after the memory changed sees it.
CAPTURE_CHECK_AGE = 0.1
# A serving row cache is built again, bigger, where the memory left now gives one of at least this
# many times its slots (or its ceiling, where that is less), at most once in REGROW_AFTER_S seconds
# (``FitWatch``): the caches it replaces stay until the table closes (graphs captured through
# them), together less than twice the newest.
REGROW_FACTOR = 2
REGROW_AFTER_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """One measure: ``owned`` bytes, ``resident`` of them in memory (estimated from a sample
    unless ``exact``), whether they ``fits`` (and ``fits_with_margin``), ``why`` in words."""

    owned: int
    resident: int
    fits: bool
    fits_with_margin: bool
    why: str
    exact: bool

    @property
    def share(self) -> float:
        return self.resident / self.owned if self.owned else 1.0


@dataclass
class Serving:
    """What serves the decode-sized lookups now: ``path`` (kernel or host), ``touch`` (a page touch
    before each kernel), ``why`` in words, ``switches`` since open."""

    path: str
    touch: bool
    why: str
    switches: int = 0

    def as_dict(self, touches: int) -> dict:
        return {
            "path": self.path,
            "page_touch": self.touch,
            "page_touches": touches,
            "why": self.why,
            "switches": self.switches,
        }


def resident_bytes(regions: list[MappedRegion], rng: np.random.Generator | None = None) -> tuple[int, bool]:
    """Bytes of the mapped regions in memory now, and whether the figure is exact: every page's
    residency for at most ``FULL_SCAN_PAGES`` pages (or without ``rng``), else ``SAMPLE_PAGES``
    pages drawn at random (one mincore call each), scaled up."""
    pages = np.array([-(-r.length // PAGE) for r in regions], dtype=np.int64)
    total = int(pages.sum())
    if rng is None or total <= FULL_SCAN_PAGES:
        return sum(min(resident_count(r) * PAGE, r.length) for r in regions), True
    ends = np.cumsum(pages)
    picks = np.sort(rng.integers(0, total, SAMPLE_PAGES))
    which = np.searchsorted(ends, picks, side="right")
    found = 0
    for k, page in zip(which.tolist(), picks.tolist(), strict=True):
        found += int(resident_pages(regions[k], page - (int(ends[k]) - int(pages[k])), 1)[0])
    mapped = sum(r.length for r in regions)
    return int(mapped * found / SAMPLE_PAGES), False


def measure(
    mappings: list[MappedShards], *, pinned: int = 0, rng: np.random.Generator | None = None
) -> Verdict:
    """Whether the mappings' owned bytes, with those of every other open table of this process
    (``OPEN_TABLES``; a file's bytes that two tables map counted once), fit the memory this process
    may use (``memory.fits``), with the residency (exact without ``rng``, else sampled) and the
    knob ``PLE_UM_FIT``. The verdict's ``owned`` and ``resident`` are the mappings' own. The other
    tables are taken under ``OPEN_TABLES``' lock and their residency read after it (their mappings
    kept until it is read): the opens and closes of other tables do not wait for it."""
    own = [r for m in mappings for r in m.regions]
    owned = sum(r.length for r in own)
    resident, exact = resident_bytes(own, rng)
    knob = envs.PLE_UM_FIT
    if knob != "auto":
        fits = knob == "fits"
        return Verdict(owned, resident, fits, fits, f"PLE_UM_FIT={knob}", exact)
    covered: dict[tuple, list[tuple[int, int]]] = {}
    uncovered(own, covered)
    theirs: list[MappedRegion] = []
    tables, all_pinned = 1, pinned
    with OPEN_TABLES.others(mappings) as others:
        for ms, their_pinned in others:  # a table whose bytes were all counted adds nothing
            if parts := uncovered([r for m in ms for r in m.regions], covered):
                theirs += parts
                tables, all_pinned = tables + 1, all_pinned + their_pinned
        their_resident, their_exact = resident_bytes(theirs, rng)
    all_owned, all_resident = owned + sum(r.length for r in theirs), resident + their_resident
    what = f"the owned rows of this process's {tables} open tables" if tables > 1 else "the owned rows"
    fits, why = memory.fits(all_owned, all_resident, all_pinned, what=what)
    margin = fits and memory.fits(all_owned + int(owned / FIT_MARGIN) - owned, all_resident, all_pinned)[0]
    return Verdict(owned, resident, fits, margin, why, exact and their_exact)


def choose(now: Serving | None, verdict: Verdict, *, touch_knob: str, touch_here: bool) -> Serving:
    """What serves next (``now``: what serves now; None at open). ``touch_knob``:
    ``PLE_UM_ATS_PREFETCH``; ``touch_here``: its ``auto`` touches in this mode on this device."""
    switches = now.switches if now is not None else 0
    on_host = now is not None and now.path == "host"
    if on_host and verdict.fits_with_margin or not on_host and verdict.fits:
        if touch_knob != "auto" or not touch_here:
            touch = touch_knob == "on"
        elif now is None:
            touch = verdict.resident < verdict.owned
        else:  # hysteresis, also where every page was counted: a few pages out come back at a touch
            touch = now.touch and verdict.resident < verdict.owned or 1 - verdict.share > TOUCH_FROM
        why = f"{verdict.why}: the kernel" + (", a page touch before it (not all in memory)" if touch else "")
        return Serving("kernel", touch, why, switches + int(on_host))
    if on_host:
        return now
    # The caller adds what the host path has (``host_words``): it is built after this choice.
    return Serving("host", False, f"{verdict.why}: the host path", switches + int(now is not None))


def host_words(host) -> str:
    """What host path ``host`` (a ``HostGather``) reads rows with: its row cache, or none, and its
    reader of misses, as ``misses.plan`` said when it was built."""
    return host.misses.why if host.misses is not None else "no row cache, rows copied from the mapping"


class FitWatch(Ticker):
    """Decides again, every ``interval`` seconds on a thread of its own, what serves ``paths``'
    decode-sized lookups (``LookupPaths``: ``serving``, ``decode_on_host``, ``touch_pages``,
    ``adopt``). ``host_for(spills)`` builds a host path (a row cache when ``spills``), or None
    where none can be built. ``close()`` stops the thread and waits for it; idempotent."""

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
        self._lock = threading.Lock()  # one check at a time (the thread's, a caller's)

    def tick_failed(self, exc: Exception) -> None:
        # A failed check keeps what serves.
        logger.warning("ple-um: the fit check failed (%s: %s); the path stays", type(exc).__name__, exc)

    def check(self) -> bool:
        """One check now: measure, choose, switch. Where the host path is to serve a table that does
        not fit and it has no row cache (or there is no host path), one is built first, and the
        switch waits for it; where the one it would build gains nothing (no room for a row cache),
        none is built. Whether what serves changed."""
        with self._lock:
            if self.stopped.is_set():
                return False
            self.checks += 1
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
            if nxt.path == "host" and (
                wanted and self._could_gain(host, verdict) or cached and self._regrow_due(host)
            ):
                # Built while the table serves: an explicit PLE_UM_ROW_CACHE past the memory left
                # is cut to it (no open is there to refuse it), said once, in the switch's why.
                built = self.host_for(True, cut=True)
                self.built_at = time.monotonic()
                if built is not None and host is not None and not self._gains(built, host):
                    # The memory left moved since ``_could_gain``: the host path there is goes on
                    # serving (one adopted each check would hold its files and buffers until the
                    # table closes).
                    built.close()
                    built = None
                if built is not None:
                    paths.adopt(built)
                    if nxt is now:  # the host path served already (the cpu mode, a GPU mode on it):
                        # another one serves now, with what it gained; counted and said as a switch.
                        nxt = Serving("host", False, f"{verdict.why}: the host path", now.switches + 1)
            if nxt.path == "host" and paths.row_copy is None:
                nxt = Serving(
                    now.path, now.touch, f"{verdict.why}, but no host path can be built here", now.switches
                )
            elif nxt.path == "host" and nxt is not now:
                nxt = Serving("host", False, f"{nxt.why}, {host_words(paths.row_copy)}", nxt.switches)
            elif nxt.path == "host":  # the same host path serves on: its why says what holds now
                where = "the cpu mode's host path" if cpu else "the host path"
                why = f"{verdict.why}: {where}, {host_words(paths.row_copy)}"
                nxt = Serving("host", False, why, now.switches)
            if (nxt.path, nxt.touch, nxt.switches) == (now.path, now.touch, now.switches):
                # What serves is unchanged: its why follows this check's figures, quietly (no log
                # line: the figures move at every check).
                if nxt.why != now.why:
                    paths.set_serving(nxt)
                return False
            paths.set_serving(nxt)
            logger.info("ple-um: decode-sized lookups of %s: %s", self.mappings[0].layout.directory, nxt.why)
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
        call (``build_paths`` prepared the device at open), so the capture stays intact."""
        if self.interval > 0 and time.monotonic() - self.checked_at >= CAPTURE_CHECK_AGE:
            self.check()

    def close(self) -> None:
        super().close()
        with self._lock:  # a check another thread runs has finished
            pass


def no_host_path(serving: Serving, verdict: Verdict, why: str) -> Serving:
    """What a GPU mode's open serves with where ``serving`` was chosen (``choose``) but no host path
    can be built (``why``: the C row copy cannot be had): the kernel, with no page touch (the touch
    is the host path's work), saying what was given up."""
    if serving.path == "host":
        said = f"{verdict.why}, but there is no host path here: {why}"
    elif serving.touch:
        said = f"{verdict.why}: the kernel, no page touch before it (no host path here: {why})"
    else:
        return serving
    return Serving("kernel", False, said, serving.switches)


# What ``at_open``'s fit counts (the probe's process has no table open), said beside it.
AT_OPEN_COUNTS = (
    "this table alone: an open counts it with every other table its own process has open, "
    "never another process's (those show only as the memory they hold: MemAvailable, a cgroup's usage)"
)


def at_open(layout: ShardLayout, mode: str, *, cuda: bool) -> Serving:
    """What an open of ``layout``'s table in ``mode`` would serve its decode-sized lookups with now
    (``ple-um probe DIR``): its files mapped, not read, to measure the fit, of the table alone where
    this process has no other open (``AT_OPEN_COUNTS``); the C row copy loaded
    as the open loads it (``rowcopy.for_open``: without it, no row cache and, in a GPU mode, no host
    path)."""
    if mode == "device":
        return Serving("kernel", False, "the device mode: the rows are in GPU memory")
    lib, no_lib = rowcopy.for_open()
    with contextlib.ExitStack() as stack:
        mappings = [stack.enter_context(MappedShards(layout))]
        if layout.has_block_scales:
            mappings.append(stack.enter_context(MappedShards(layout.scale_layout())))
        owned = sum(m.mapped_bytes for m in mappings)
        verdict = measure(mappings, pinned=owned if mode == "registered" else 0)
        scales = mappings[1] if len(mappings) > 1 else None
        if lib is None:  # the cpu mode's synchronous path: no row cache
            cache = f"no row cache: {sync_gather.row_reads(no_lib)}"
        else:
            try:  # a host path's row cache as the open would size it (misses.plan)
                cache = misses.row_cache(mappings[0], scales, spills=not verdict.fits)[2]
            except KnobError as exc:  # a size past the memory left
                cache = f"an open now would be refused: {exc}"
    if mode == "cpu":
        return Serving("host", False, f"{verdict.why}: the cpu mode's host path, {cache}")
    knob, here = touch_setting(mode, cuda=cuda)
    serving = choose(None, verdict, touch_knob=knob, touch_here=here)
    if lib is None:
        return no_host_path(serving, verdict, no_lib)
    return Serving("host", False, f"{serving.why}, {cache}") if serving.path == "host" else serving


def touch_setting(mode: str, *, cuda: bool) -> tuple[str, bool]:
    """``PLE_UM_ATS_PREFETCH`` as it applies to ``mode`` on a CUDA device or not, and whether its
    ``auto`` touches there (the ats mode on a GPU). The touch serves a GPU: on the CPU (the
    interpreter) the kernel reads the mapping itself."""
    return (envs.PLE_UM_ATS_PREFETCH if cuda else "off"), mode == "ats" and cuda
