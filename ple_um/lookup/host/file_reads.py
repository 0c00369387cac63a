"""FileReader: how the C row copy reads the rows a lookup finds missing, many at a time.

A row that is in neither the row cache nor the page cache costs one storage round trip. Faulted in
through the mapping, a lookup's misses are read one after another; here they are read with up to
``depth`` reads in flight (``native/reader.c``): through io_uring where the kernel allows it
(``uring``), else by a pool of reader threads issuing preads (``threads``); ``mmap`` keeps the
faults. With ``direct`` the reads are O_DIRECT (whole aligned blocks, the row copied out), so the
rows read into the row cache do not also hold a page each in the page cache; a filesystem that
refuses O_DIRECT (tmpfs, some FUSE mounts) gets plain reads.

The reader owns descriptors of its own, opened on the mapping's own files (``/proc/self/fd``: the
same inode as the mapping, even after the path was replaced), and closes them in ``close()``.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ple_um.lookup import rowcopy
from ple_um.mapping import MappedShards

STRATEGIES = ("auto", "uring", "threads", "mmap")
_ALIGNMENTS = (512, 4096)


def _direct_alignment(fd: int, size: int) -> int | None:
    """The block size an O_DIRECT descriptor reads in (the smallest that reads back), or None."""
    buf = mmap.mmap(-1, 2 * 4096)
    try:
        view = memoryview(buf)
        for align in _ALIGNMENTS:
            if size < 2 * align:
                continue
            try:
                if os.preadv(fd, [view[:align]], align) == align:
                    return align
            except OSError:
                continue
        return None
    finally:
        view.release()
        buf.close()


def choose_strategy(lib: ctypes.CDLL, asked: str) -> tuple[str, str]:
    """(strategy, why) for the knob's value ``asked``: auto is uring where a ring can be made."""
    uring = bool(lib.ple_uring_works())
    if asked == "auto":
        return ("uring", "io_uring") if uring else ("threads", "reader threads (no io_uring here)")
    if asked == "uring" and not uring:
        return "threads", "reader threads (io_uring asked for, but no ring can be made here)"
    return asked, {"uring": "io_uring", "threads": "reader threads", "mmap": "page faults"}[asked]


class FileReader:
    """The reads of ``mapping``'s owned rows (a table's rows, or an NVFP4 table's block scales):
    ``strategy`` (uring, threads, mmap), ``direct`` (O_DIRECT where the files allow it), ``depth``
    reads in flight per reading thread, ``resident_check``: without a row cache, rows whose pages
    are resident are copied from the mapping and only the others read."""

    def __init__(
        self, mapping: MappedShards, *, strategy: str, direct: bool, depth: int, resident_check: bool = False
    ) -> None:
        layout = mapping.layout
        self.strategy, self.depth = strategy, depth
        self.fds = np.full(layout.parts, -1, dtype=np.int32)
        self.offsets = np.zeros(layout.parts, dtype=np.int64)
        self._open: list[int] = []
        self.align = 0
        try:
            by_region: dict[int, int] = {}
            aligns = set()
            for index, owned in mapping.owned.items():
                region = mapping.regions[owned.region]
                if owned.region not in by_region:
                    fd, align = self._reopen(region.fd, region.st_size, direct)
                    by_region[owned.region] = fd
                    aligns.add(align)
                self.fds[index] = by_region[owned.region]
                self.offsets[index] = layout.shards[index].offset
            # Every file read the same way: O_DIRECT with the widest block any needs, or plainly.
            if direct and aligns and None not in aligns:
                self.align = max(aligns)
            elif direct:
                self._reopen_all_plain(mapping, by_region)
        except BaseException:
            self.close()
            raise
        self.direct = self.align > 0
        self.struct = rowcopy.ReaderStruct(
            self.fds.ctypes.data,
            self.offsets.ctypes.data,
            self.align,
            rowcopy.READ_STRATEGIES[strategy],
            depth,
            int(resident_check),
        )
        self.address = ctypes.addressof(self.struct)

    def _reopen(self, fd: int, size: int, direct: bool) -> tuple[int, int | None]:
        """A descriptor of our own on the file behind ``fd`` (O_DIRECT if asked and it reads), and
        the O_DIRECT block size (None: plain)."""
        path = f"/proc/self/fd/{fd}"
        if direct:
            try:
                mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError:
                mine = None
            if mine is not None:
                self._open.append(mine)
                align = _direct_alignment(mine, size)
                if align is not None:
                    return mine, align
        mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._open.append(mine)
        return mine, None

    def _reopen_all_plain(self, mapping: MappedShards, by_region: dict[int, int]) -> None:
        """Some file refuses O_DIRECT: every file is read plainly (one kind of read per table)."""
        plain = {}
        for region_index in by_region:
            fd = os.open(f"/proc/self/fd/{mapping.regions[region_index].fd}", os.O_RDONLY | os.O_CLOEXEC)
            self._open.append(fd)
            plain[region_index] = fd
        for index, owned in mapping.owned.items():
            self.fds[index] = plain[owned.region]

    def describe(self) -> str:
        kind = f"O_DIRECT, {self.align}-byte blocks" if self.direct else "through the page cache"
        return f"{self.strategy} ({kind}), {self.depth} in flight"

    def close(self) -> None:
        """Close the descriptors (the caller has made sure no row copy reads through them)."""
        for fd in self._open:
            os.close(fd)
        self._open = []
