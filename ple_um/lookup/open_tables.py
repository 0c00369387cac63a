"""The tables this process has open, whose owned rows a table's fit counts with its own
(``lookup.fit.measure``; docs/OPERATING.md, "Decide by fit"): several tables in one process may
each fit alone where together they do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

from ple_um.mapping import PAGE, MappedRegion, MappedShards


class OpenTables:
    """The mappings of every open table of this process that serves its rows from host memory (not
    the ``device`` mode), each with the bytes it pins: what ``measure`` counts beside a table's own.
    ``add`` at open, before the open measures its own fit (``build_paths``: of two tables opened at
    once, the one that measures last counts the other), ``opened`` once that open has succeeded;
    ``remove`` at close, when the table's paths are dropped, and when its open fails. An entry whose
    open has not succeeded yet is counted by other opens (``others(..., opening=True)``), not by
    the checks of the tables that serve: an open that fails moves no serving table's path, nor
    makes it build a row cache. ``others`` hands out the entries under the lock and reads their
    residency after it, without it (mincore over big tables is slow); a table's ``remove`` waits
    for those readings to end before its mappings go."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[list[MappedShards], int]] = {}
        self._opening: set[int] = set()  # the entries whose open has not succeeded yet
        self._next = 0
        self._forked()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """A lock and no reading: at open, and in a forked child, where the threads that held the
        parent's lock or read its entries do not exist (their readings would be waited for ever)."""
        # Reentrant: a drop's removal (a finalizer) may run on a thread that holds it.
        self._lock = threading.RLock()
        self._read = threading.Condition(self._lock)  # a reading of an entry ended
        self._readers: dict[int, list[int]] = {}  # per entry, the threads reading its mappings

    def add(self, mappings: list[MappedShards], pinned: int) -> int:
        with self._lock:
            self._next += 1
            self._tables[self._next] = (list(mappings), pinned)
            self._opening.add(self._next)
            return self._next

    def opened(self, key: int) -> None:
        """The open of entry ``key`` succeeded: the checks of the tables that serve count it too."""
        with self._lock:
            self._opening.discard(key)

    def remove(self, key: int) -> None:
        """The entry ``key`` no longer counted, once no other thread reads its mappings (``others``):
        its caller unmaps them next. A reading on this very thread (a finalizer that runs inside
        it) is not waited for: it ends once the finalizer returns."""
        me = threading.get_ident()
        with self._lock:
            self._tables.pop(key, None)
            self._opening.discard(key)
            while any(t != me for t in self._readers.get(key, ())):
                self._read.wait()

    @contextlib.contextmanager
    def others(
        self, mappings: list[MappedShards], *, opening: bool = False
    ) -> Iterator[list[tuple[list[MappedShards], int]]]:
        """The open tables but the one of ``mappings``, taken under the lock (``opening``: for an
        open's measure, those whose open is under way too); their mappings stay mapped until the
        caller is done reading them (their ``remove`` waits), the lock not held meanwhile."""
        me = threading.get_ident()
        with self._lock:
            entries = list(self._tables.items())
            taken = [
                (key, ms, pinned)
                for key, (ms, pinned) in entries
                if not any(m is own for m in ms for own in mappings)
                and not any(m.closed for m in ms)
                and (opening or key not in self._opening)
            ]
            for key, _, _ in taken:
                self._readers.setdefault(key, []).append(me)
        try:
            yield [(ms, pinned) for _, ms, pinned in taken]
        finally:
            with self._lock:
                for key, _, _ in taken:
                    readers = self._readers[key]
                    readers.remove(me)
                    if not readers:
                        del self._readers[key]
                self._read.notify_all()


OPEN_TABLES = OpenTables()


def uncovered(regions: list[MappedRegion], covered: dict[tuple, list[tuple[int, int]]]) -> list[MappedRegion]:
    """The parts of ``regions`` (each starting on a page of its file) whose file bytes no region
    counted before covers (``covered``: per file, the byte ranges counted; added to): a file's rows
    mapped by two tables are counted once. A file is its device, inode and modification time: two
    filesystems may each hold a file of the same inode number. Each part starts on a page (the
    residency is a page's): the rest of a page that a counted range ends inside is not counted
    again (under a page per overlap)."""
    parts = []
    for r in regions:
        spans = covered.setdefault((r.st_dev, r.st_ino, r.st_mtime_ns), [])
        begin, end = r.file_offset, r.file_offset + r.length
        at = begin
        for lo, hi in sorted(spans) + [(end, end)]:
            if lo > at:
                first = begin + -(-(at - begin) // PAGE) * PAGE
                stop = min(lo, end)
                if stop > first:
                    parts.append(
                        dataclasses.replace(
                            r, addr=r.addr + first - begin, file_offset=first, length=stop - first
                        )
                    )
            at = max(at, hi)
            if at >= end:
                break
        spans.append((begin, end))
    return parts
