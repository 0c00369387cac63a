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
- **Decided again** while the table serves (``lookup.fit_watch.FitWatch``), from a sample of
  its pages' residency (``SAMPLE_PAGES``, mincore; every page of a small table) and the memory
  left, with hysteresis (``choose``): the kernel gives way to the host path as soon as the table
  does not fit; the host path gives it back only once the table fits with ``1 - FIT_MARGIN`` of
  its size to spare; the touch starts when more than ``TOUCH_FROM`` of the sampled pages are out
  and stops when none is.
This module holds the rule and its measure (``measure``, ``choose``, ``at_open``: what an open
would serve, for the probe); ``fit_watch`` the thread that applies it again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ple_um import envs
from ple_um.access import memory
from ple_um.checkpoint import ShardLayout
from ple_um.errors import KnobError
from ple_um.lookup import rowcopy, sync_gather
from ple_um.lookup.host import misses
from ple_um.lookup.open_tables import OPEN_TABLES, uncovered
from ple_um.mapping import PAGE, MappedRegion, MappedShards
from ple_um.residency import resident_count, resident_pages

SAMPLE_PAGES = 256  # pages sampled per check (a table of at most FULL_SCAN_PAGES: all of them)
FULL_SCAN_PAGES = 1 << 15
FIT_MARGIN = 0.9  # back from the host path only when the table fits in this share of the room
TOUCH_FROM = 1 / 64  # the touch starts when more than this share of the sampled pages are out
SWITCHING_MODES = ("ats", "registered")


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
    mappings: list[MappedShards],
    *,
    pinned: int = 0,
    rng: np.random.Generator | None = None,
    opening: bool = False,
) -> Verdict:
    """Whether the mappings' owned bytes, with those of every other open table of this process
    (``OPEN_TABLES``; a file's bytes that two tables map counted once), fit the memory this process
    may use (``memory.fits``), with the residency and the knob ``PLE_UM_FIT``. The verdict's
    ``owned`` and ``resident`` are the mappings' own, their residency exact without ``rng``, else
    sampled (``resident_bytes``). The other tables' residency is read as a check reads it, sampled
    (with ``rng``, else a generator of seed 0) where they hold more than ``FULL_SCAN_PAGES`` pages,
    at an open too: an open reads a bounded number of their pages, not every page of every table
    open (tables opened one after another would read a number of pages quadratic in their number).
    ``opening``: an open's measure, which counts the tables whose open is under way too (a check
    counts those whose open succeeded: ``OPEN_TABLES.others``). The other tables are taken under
    ``OPEN_TABLES``' lock and their residency read after it (their mappings kept until it is read):
    the opens and closes of other tables do not wait for it."""
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
    with OPEN_TABLES.others(mappings, opening=opening) as others:
        for ms, their_pinned in others:  # a table whose bytes were all counted adds nothing
            if parts := uncovered([r for m in ms for r in m.regions], covered):
                theirs += parts
                tables, all_pinned = tables + 1, all_pinned + their_pinned
        sample = rng if rng is not None else np.random.default_rng(0)
        their_resident, their_exact = resident_bytes(theirs, sample)
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
        verdict = measure(mappings, pinned=owned if mode == "registered" else 0, opening=True)
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
