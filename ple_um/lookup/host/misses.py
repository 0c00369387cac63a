"""What the host path does about rows that are not in memory: the row cache and the reads of misses.

``plan`` reads the knobs and the table's state at open:
- ``PLE_UM_ROW_CACHE``: ``auto`` (the default) keeps a row cache when the table's owned rows do not
  fit the memory this process may use (the caller's decision, ``lookup.fit``), of
  ``PLE_UM_ROW_CACHE_FRACTION`` of the memory this process can still take
  (``access.memory.available``: MemAvailable, and the memory cgroup's room), at most what the
  table's owned rows need; a table that fits gets none, in the page cache or not; a size
  (``4GiB``) sets it (at most what the owned rows need; refused when it does not fit the memory
  this process can still take; cut to it where a fit check builds the cache, then built again
  toward the size: ``row_cache_ceiling``); ``0`` keeps none.
- ``PLE_UM_FILE_READS``: how misses are read (``host/file_reads.py``): ``auto`` is io_uring where a
  ring can be made, else reader threads; ``mmap`` faults them in through the mapping.
- ``PLE_UM_DIRECT_READS``: ``auto`` reads misses with O_DIRECT when there is a row cache (the rows
  then live in the cache, not also in the page cache), through the page cache otherwise.
A table that fits and is fully resident at open gets neither: its lookups copy straight from the
mapping, and the pages it loses later are faulted back in (a table that fits but is not resident:
no cache, its misses read through the page cache, which keeps them). ``RowSources`` builds what the
plan says for a table's rows (and a block-scaled table's block scales) and owns it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ple_um import cache_folder, envs
from ple_um.access import memory
from ple_um.errors import KnobError
from ple_um.lookup import rowcopy
from ple_um.lookup.host.file_reads import FileReader, choose_strategy
from ple_um.lookup.host.row_cache import SLOT_OVERHEAD, RowCache, slots_for
from ple_um.mapping import MappedShards
from ple_um.units import format_bytes

log = logging.getLogger(__name__)
# How long an open waits for another process's row cache to be sized and faulted in before it sizes
# its own without waiting (a cache of tens of GiB faults in within seconds).
SIZING_WAIT_S = 120.0


@dataclass(frozen=True)
class MissPlan:
    """``cache_bytes`` of row cache (0: none) in ``slots`` slots (``row_cache.slots_for``; a
    block-scaled table's block scales in a second cache of as many) with ``policy``; misses read by
    ``strategy`` (uring, threads, mmap), O_DIRECT when ``direct``, ``depth`` in flight;
    ``resident_check``: without a cache, only rows whose pages are not resident are read. ``why``:
    in words."""

    cache_bytes: int
    slots: int
    policy: str
    strategy: str
    direct: bool
    depth: int
    resident_check: bool
    why: str

    @property
    def reads(self) -> bool:
        return self.strategy != "mmap"


@contextlib.contextmanager
def one_sizing_at_a_time(wait_s: float = SIZING_WAIT_S) -> Iterator[None]:
    """Held while a row cache is sized from the memory left and faulted in. Processes that open
    tables at once (data-parallel replicas, tensor-parallel ranks, several servers under one
    memory limit) then size theirs one after another, each from the memory the ones before it left,
    instead of all from the same room, which together they would take several times over (the
    limit's OOM killer ends one of them). The lock is ``PLE_UM_CACHE_DIR/row-cache.lock``
    (``cache_folder.locked``): the processes of one user's deployment share it. Where it cannot be had
    (no such file can be made, or another process holds it past ``wait_s``), the cache is sized
    without it, and a warning says so."""
    path = os.path.join(envs.PLE_UM_CACHE_DIR, "row-cache.lock")
    with cache_folder.locked(path, wait_s) as why:
        if why is not None:
            log.warning("row cache sized without its lock (%s): processes opening at once may oversize", why)
        yield


def _sized(asked: int, owned: int, *, cut: bool) -> tuple[int, str]:
    """An explicit ``PLE_UM_ROW_CACHE``: at most what the owned rows need (more would hold nothing
    more), and the words for it. KnobError when that does not fit the memory this process can still
    take: the cache is faulted in at open, so a size past it would end the process, not the open.
    ``cut``: no open to refuse (a fit check builds it while the table serves): cut to the share
    ``PLE_UM_ROW_CACHE=auto`` would take of that memory, and said so."""
    cache = min(asked, owned)
    room = memory.available()
    if cache <= room:
        said = f"a row cache of {format_bytes(cache)}" if cache else "no row cache (PLE_UM_ROW_CACHE=0)"
        return cache, said
    var, text = envs.KNOBS["PLE_UM_ROW_CACHE"].raw() or ("PLE_UM_ROW_CACHE", str(asked))
    if not cut:
        raise KnobError(
            f"environment variable {var}={text!r}: a row cache of {format_bytes(cache)} does not fit the "
            f"{format_bytes(room)} this process can still take (MemAvailable and its memory cgroup's "
            "room); set a smaller size, auto, or 0"
        )
    past = f"{var}={text!r} asks {format_bytes(cache)}, past the {format_bytes(room)} this process can take"
    cache = int(room * envs.PLE_UM_ROW_CACHE_FRACTION)
    return cache, f"a row cache of {format_bytes(cache)} ({past}: PLE_UM_ROW_CACHE_FRACTION of it)"


def row_cache(
    mapping: MappedShards, scale_mapping: MappedShards | None, *, spills: bool, cut: bool = False
) -> tuple[int, int, str]:
    """The row cache ``plan`` gives this table's host path: its bytes, its slots (both 0: none) and
    the words for it (``PLE_UM_ROW_CACHE``: ``auto`` by ``spills``, or a size, ``_sized``, whose
    KnobError it raises). A size too small for one set of slots is no row cache. ``ple-um probe
    DIR`` (``fit.at_open``) says what an open would build from it."""
    knob = envs.PLE_UM_ROW_CACHE
    row_bytes, scales, owned = _row_cache_terms(mapping, scale_mapping)
    if knob == "auto":
        if not spills:
            return 0, 0, "no row cache (the owned rows fit in memory)"
        cache = min(int(memory.available() * envs.PLE_UM_ROW_CACHE_FRACTION), owned)
        said = f"a row cache of {format_bytes(cache)} (the owned rows do not fit in memory)"
    else:
        cache, said = _sized(int(knob), owned, cut=cut)
    slots = slots_for(cache, row_bytes, block_scales=scales)
    if slots == 0 and (cache or knob == "auto"):  # no memory left, or too little for a set
        return 0, 0, f"no row cache ({format_bytes(cache)} holds not one set of rows)"
    return cache, slots, said


def _row_cache_terms(mapping: MappedShards, scale_mapping: MappedShards | None) -> tuple[int, int, int]:
    """A row's bytes, its block scales' bytes, and the bytes of a cache holding every owned row:
    the rows, the slots' words, the block scales."""
    row_bytes = mapping.layout.row_bytes
    scales = scale_mapping.layout.row_bytes if scale_mapping is not None else 0
    return row_bytes, scales, mapping.owned_bytes // row_bytes * (row_bytes + SLOT_OVERHEAD + scales)


def row_cache_ceiling(mapping: MappedShards, scale_mapping: MappedShards | None) -> int:
    """The slots of the largest row cache ``row_cache`` gives this table whatever the memory left:
    what the owned rows need, or an explicit ``PLE_UM_ROW_CACHE`` (at most that). A cache cut to the
    memory left is built again toward it (``fit_watch.FitWatch``)."""
    knob = envs.PLE_UM_ROW_CACHE
    row_bytes, scales, owned = _row_cache_terms(mapping, scale_mapping)
    cache = owned if knob == "auto" else min(int(knob), owned)
    return slots_for(cache, row_bytes, block_scales=scales)


def reads_misses(*, cache: bool, resident: bool) -> bool:
    """Whether ``plan`` gives a host path a reader of misses, told without planning: not where
    misses are faulted in (``PLE_UM_FILE_READS=mmap``), nor under ``auto`` for a table resident
    with no row cache (``plan`` is None there: its lookups copy from the mapping)."""
    knob = envs.PLE_UM_FILE_READS
    return knob != "mmap" and (cache or not resident or knob != "auto")


def plan(
    lib, mapping: MappedShards, scale_mapping: MappedShards | None, *, spills: bool, cut: bool = False
) -> MissPlan | None:
    """The plan for this table's host path, or None: rows copied from the mapping as they are.
    ``spills``: the owned rows do not fit the memory this process may use (``lookup.fit``); ``cut``:
    built while the table serves, an explicit size past the memory left cut to it (``_sized``)."""
    if not mapping.owned:
        return None
    reads_knob = envs.PLE_UM_FILE_READS
    resident = all(m.resident() for m in (mapping, scale_mapping) if m is not None)
    cache, slots, said = row_cache(mapping, scale_mapping, spills=spills, cut=cut)
    if cache == 0 and resident and reads_knob == "auto":  # reads_misses says so
        return None
    strategy, how = choose_strategy(lib, reads_knob)
    direct_knob = envs.PLE_UM_DIRECT_READS
    direct = strategy != "mmap" and (direct_knob == "on" or (direct_knob == "auto" and cache > 0))
    why = f"{said}; misses read by {how}" + (", O_DIRECT where the files allow it" if direct else "")
    return MissPlan(
        cache_bytes=cache,
        slots=slots,
        policy=envs.PLE_UM_ROW_CACHE_POLICY,
        strategy=strategy,
        direct=direct,
        depth=envs.PLE_UM_READ_DEPTH,
        resident_check=cache == 0,
        why=why,
    )


class RowSources:
    """The C code's view of a table's rows and of a block-scaled table's block scales
    (``rowcopy.Rows``), each with the row cache and reader ``plan`` gives it (a block-scaled table's
    cache split into two of as many slots, the block scales' following the rows' admission and
    counted apart: a lookup asks both for each id). Owns the caches and readers (which hold
    ``lib``'s reader threads); ``close()`` once no row copy can use them."""

    def __init__(
        self, mapping: MappedShards, scale_mapping: MappedShards | None, plan, counts, lib=None
    ) -> None:
        self.plan, self.counts, self.lib = plan, counts, lib
        self._owned: list[RowCache | FileReader] = []
        self.readers: list[FileReader] = []
        try:
            # A block-scaled table's block scales: a cache of as many slots follows the rows'.
            slots = plan.slots if plan is not None else 0
            self.rows = self._sources(mapping, slots, counts)
            self.block_scales = (
                self._sources(scale_mapping, slots, rowcopy.Counts(), follows=self.rows.cache)
                if scale_mapping is not None
                else None
            )
        except BaseException:
            self.close()
            raise

    def _sources(self, mapping: MappedShards, slots: int, counts, follows=None) -> rowcopy.Rows:
        plan = self.plan
        if plan is None:
            return rowcopy.Rows(mapping)
        cache = reader = None
        if slots:
            cache = RowCache(slots, mapping.layout.row_bytes, counts, policy=plan.policy, follows=follows)
            self._owned.append(cache)
        if plan.reads:
            reader = FileReader(
                mapping,
                strategy=plan.strategy,
                direct=plan.direct,
                depth=plan.depth,
                resident_check=plan.resident_check,
                lib=self.lib,
            )
            self._owned.append(reader)
            self.readers.append(reader)
        return rowcopy.Rows(mapping, cache=cache, reader=reader)

    def file_reader(self) -> str | None:
        """How misses are read from the files (``FileReader.reading``: uring, or threads, also once
        a ring failed), or None where they are faulted in through the mapping."""
        reader = self.rows.reader
        return reader.reading if reader is not None and reader.strategy != "mmap" else None

    def fallback(self) -> str | None:
        """Why misses are read by the reader threads though io_uring was planned (a ring failed:
        ``FileReader.fallback``, logged once), or None."""
        for reader in self.readers:
            if (why := reader.fallback()) is not None:
                return why
        return None

    def note_fallback(self) -> None:
        """Log a ring's failure (once) if one happened since: called at each lookup, so that the
        log says it though nobody reads ``stats()``."""
        for reader in self.readers:
            if reader.failed[0] and not reader.said:
                reader.fallback()

    def stats(self) -> dict | None:
        """The row cache's hits, misses, evictions and rows (of the rows' cache: the block scales'
        are for the same ids), bytes and resident_bytes (both caches); None where there is no row
        cache. The reads of misses are the path's counts (``file_reads``), cache or not."""
        if self.rows.cache is None:
            return None
        total = self.rows.cache.stats()
        if self.block_scales is not None and self.block_scales.cache is not None:
            total["bytes"] += self.block_scales.cache.nbytes
            total["resident_bytes"] += self.block_scales.cache.resident_bytes()
        return total

    def close(self) -> None:
        """Release the caches and readers, last made first. Idempotent."""
        for resource in reversed(self._owned):
            resource.close()
        self._owned, self.readers = [], []
