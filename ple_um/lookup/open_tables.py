"""The tables this process has open, whose owned rows a table's fit counts with its own
(``lookup.fit.measure``; docs/OPERATING.md, "Decide by fit"): several tables in one process may
each fit alone where together they do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from ple_um.mapping import PAGE, MappedRegion, MappedShards


class OpenTables:
    """The mappings of every open table of this process that serves its rows from host memory (not
    the ``device`` mode), each with the bytes it pins: what ``measure`` counts beside a table's own.
    ``add`` at open (``build_paths``), ``remove`` at close and when the table's paths are dropped.
    A measure holds the lock: a table's entry goes (and then its mappings) only once no measure
    reads them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a drop's removal may run on a thread that measures
        self._tables: dict[int, tuple[list[MappedShards], int]] = {}
        self._next = 0

    def add(self, mappings: list[MappedShards], pinned: int) -> int:
        with self._lock:
            self._next += 1
            self._tables[self._next] = (list(mappings), pinned)
            return self._next

    def remove(self, key: int) -> None:
        with self._lock:
            self._tables.pop(key, None)

    @contextlib.contextmanager
    def others(self, mappings: list[MappedShards]) -> Iterator[list[tuple[list[MappedShards], int]]]:
        """The open tables but the one of ``mappings``, held until the caller is done reading them."""
        with self._lock:
            yield [
                (ms, pinned)
                for ms, pinned in self._tables.values()
                if not any(m is own for m in ms for own in mappings) and not any(m.closed for m in ms)
            ]


OPEN_TABLES = OpenTables()


def uncovered(regions: list[MappedRegion], covered: dict[tuple, list[tuple[int, int]]]) -> list[MappedRegion]:
    """The parts of ``regions`` (each starting on a page of its file) whose file bytes no region
    counted before covers (``covered``: per file, the byte ranges counted; added to): a file's rows
    mapped by two tables are counted once. Each part starts on a page (the residency is a page's):
    the rest of a page that a counted range ends inside is not counted again (under a page per
    overlap)."""
    parts = []
    for r in regions:
        spans = covered.setdefault((r.st_ino, r.st_mtime_ns), [])
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
