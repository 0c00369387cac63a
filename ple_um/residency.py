"""Which pages of a mapped file range are in the page cache, read in bounded windows.

``mincore`` over a whole mapping takes one byte a page at once, and arithmetic on that vector ten
times more (a 2 TiB table: 5 GiB); here it is asked a window of ``RESIDENCY_WINDOW`` pages at a
time, and a window whose file range has no cached page at all (``cachestat``, Linux 6.5+, walks
only the cached pages) is not asked: a huge sparse table costs bounded memory and little time.
A region is anything with ``addr``, ``length``, ``fd``, ``file_offset`` and ``path`` (the
``MappedRegion`` of ``ple_um.mapping``). ``evict_pages`` is the one way ple-um, its tools and its
tests drop a file's pages from memory; ``mincore`` the one way they ask which pages are in it
(``resident_bytes``: of any address range, in the same windows); ``file_mappings`` the one way
the package reads which files this process maps (/proc/self/maps).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

PAGE = mmap.PAGESIZE
# Pages per window (1 GiB of a mapping, a 256 KiB vector).
RESIDENCY_WINDOW = 1 << 18

# The C library's calls on memory ranges: mapping.py adds mmap and munmap to the same handle.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_SYS_CACHESTAT = 451  # the same number on x86_64 and in the generic table (aarch64)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _pages(region) -> int:
    return (region.length + PAGE - 1) // PAGE


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of the file's bytes ``[offset, offset + length)`` in the page cache, by cachestat,
    which walks only the cached pages (mincore looks up each page). None where the call fails (a
    kernel before 6.5, a seccomp filter): the caller asks mincore."""
    if length <= 0:
        return 0
    stat_range, out = _CachestatRange(offset, length), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(stat_range), ctypes.byref(out), 0) != 0:
        return None
    return int(out.nr_cache)


def errno_text() -> str:
    """The C library's last error (``use_errno``) as "ENOMEM: Cannot allocate memory"."""
    code = ctypes.get_errno()
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"


def mincore(addr: int, length: int, where: str) -> np.ndarray:
    """uint8, one per page of ``[addr, addr + length)`` (``addr`` page-aligned, inside a live
    mapping): 1 where the page is in the page cache; OSError naming ``where`` where mincore fails."""
    vec = np.zeros(max(0, (length + PAGE - 1) // PAGE), dtype=np.uint8)
    if length > 0 and _libc.mincore(addr, length, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed on {where}: {errno_text()}")
    return vec & 1


def resident_pages(region, first: int = 0, count: int | None = None) -> np.ndarray:
    """uint8, one per page of pages ``[first, first + count)`` of the mapping (default: to its end):
    1 where the page is in the page cache (mincore); OSError naming the file where mincore fails."""
    count = _pages(region) - first if count is None else min(count, _pages(region) - first)
    length = min(count * PAGE, region.length - first * PAGE) if count > 0 else 0
    return mincore(region.addr + first * PAGE, length, region.path)


def _cached(region, first: int) -> int | None:
    length = min(RESIDENCY_WINDOW * PAGE, region.length - first * PAGE)
    return cached_pages(region.fd, region.file_offset + first * PAGE, length)


def _windows(region) -> Iterator[tuple[int, np.ndarray]]:
    for first in range(0, _pages(region), RESIDENCY_WINDOW):
        if _cached(region, first) == 0:  # nothing there: no page to look up
            yield first, np.zeros(min(RESIDENCY_WINDOW, _pages(region) - first), dtype=np.uint8)
        else:
            yield first, resident_pages(region, first, RESIDENCY_WINDOW)


def evict_file_pages(path: str, offset: int = 0, length: int = 0, write_back: bool = True) -> None:
    """Drop the file's bytes ``[offset, offset + length)`` (``length`` 0: to its end) from the page
    cache with POSIX_FADV_DONTNEED, which drops only clean pages no process maps (``evict_pages``
    unmaps this process's first). ``write_back``: the whole file written back first (fsync), for a
    file just written, whose dirty pages would stay; a file system without fsync (squashfs, erofs,
    iso9660: EINVAL, EROFS) has no dirty page, and its pages are dropped all the same. A request: a
    file system whose files are their page cache (tmpfs) keeps them. OSError where the file cannot
    be opened or written back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if write_back:
            try:
                os.fsync(fd)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EROFS):
                    raise
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class FileMapping(NamedTuple):
    """One mapping of a file by this process (a line of /proc/self/maps): a region ``evict_pages``
    empties."""

    addr: int
    length: int
    path: str
    offset: int  # of ``addr`` in the file


def file_mappings() -> list[FileMapping]:
    """This process's mappings of files that are there, read afresh from /proc/self/maps at each
    call (anonymous and pseudo mappings, and those of deleted files, left out). OSError where the
    map cannot be read (not Linux)."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(" (deleted)"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append(FileMapping(start, end - start, fields[5], int(fields[2], 16)))
    return found


def evict_pages(files: Iterable[str], regions: Iterable = (), write_back: bool = True) -> None:
    """Every page of ``files`` out of this process and the page cache: each of ``regions`` (this
    process's mappings of them: anything with ``addr``, ``length`` and ``path``) emptied with
    MADV_DONTNEED, so that its pages are no longer mapped here and the next read faults them in,
    then each file's pages dropped (``evict_file_pages``, ``write_back`` as there). OSError naming
    the file where madvise fails."""
    for region in regions:
        if _libc.madvise(region.addr, region.length, mmap.MADV_DONTNEED) != 0:
            why = f"madvise(MADV_DONTNEED) failed on {region.path}: {errno_text()}"
            raise OSError(ctypes.get_errno(), why)
    for path in files:
        evict_file_pages(path, write_back=write_back)


def resident_bytes(addr: int, length: int, where: str | None = None) -> int:
    """Bytes of ``[addr, addr + length)`` (inside a live mapping) whose pages are in the page cache,
    asked of mincore a window of ``RESIDENCY_WINDOW`` pages at a time (bounded memory however long
    the range); pages the range only partly covers count for the part it covers. OSError naming
    ``where`` (else the address) where mincore fails."""
    where = where or f"the range at {addr:#x}"
    end, total = addr + length, 0
    for start in range(addr - addr % PAGE, end, RESIDENCY_WINDOW * PAGE):
        stop = min(start + RESIDENCY_WINDOW * PAGE, end)
        present = mincore(start, stop - start, where)
        # The first page may start before addr, the last end after the range.
        total += int(np.count_nonzero(present)) * PAGE
        total -= int(present[0]) * max(0, addr - start) + int(present[-1]) * (-stop % PAGE)
    return total


def resident_count(region) -> int:
    """Pages of the mapping in the page cache, a window at a time (cachestat, else mincore)."""
    total = 0
    for first in range(0, _pages(region), RESIDENCY_WINDOW):
        cached = _cached(region, first)
        if cached is None:
            cached = int(np.count_nonzero(resident_pages(region, first, RESIDENCY_WINDOW)))
        total += cached
    return total


def resident_runs(region) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The runs of resident pages, a window at a time: int64 arrays of their first pages and of the
    pages after their last (a run that crosses a window's edge comes out once, whole)."""
    open_at = None  # the first page of a run still going at the last window's end
    for first, pages in _windows(region):
        steps = np.diff(pages.view(np.int8), prepend=np.int8(open_at is not None))
        starts = np.flatnonzero(steps == 1) + first
        ends = np.flatnonzero(steps == -1) + first
        if open_at is not None:
            starts = np.concatenate(([open_at], starts))
        open_at = int(starts[-1]) if pages[-1] else None
        yield (starts[:-1], ends) if open_at is not None else (starts, ends)
    if open_at is not None:
        yield np.array([open_at]), np.array([_pages(region)])


def longest_runs(region, most: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``most`` longest runs of resident pages (first pages, pages after the last), longest
    first, then in page order; no more than ``most`` runs kept from one window to the next."""
    starts = ends = np.zeros(0, dtype=np.int64)
    for s, e in resident_runs(region):
        starts, ends = np.concatenate((starts, s)), np.concatenate((ends, e))
        if starts.size > most:
            keep = np.lexsort((starts, starts - ends))[:most]
            starts, ends = starts[keep], ends[keep]
    order = np.lexsort((starts, starts - ends))[:most]
    return starts[order], ends[order]
