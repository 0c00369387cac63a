"""FileReader: how the C row copy reads the rows a lookup finds missing, many at a time.

A row that is in neither the row cache nor the page cache costs one storage round trip. Faulted in
through the mapping, a lookup's misses are read one after another; here they are read with up to
``depth`` reads in flight (``native/reader.c``): through io_uring where the kernel allows it
(``uring``), else by a pool of reader threads issuing preads (``threads``); ``mmap`` keeps the
faults. With ``direct`` the reads are O_DIRECT (whole aligned blocks, the row copied out), so the
rows read into the row cache do not also hold a page each in the page cache; a filesystem that
refuses O_DIRECT (tmpfs, some FUSE mounts) gets plain reads.

A ring that fails (``io_uring_setup`` or ``io_uring_enter`` refused: ENOMEM, EAGAIN or EBUSY that
does not pass, ...) hands what is left of its lookup to the reader threads, which read the table's
misses from then on; ``fallback()`` says why, and logs it once.

The reader owns descriptors of its own, opened on the mapping's own files (``/proc/self/fd``: the
same inode as the mapping, even after the path was replaced), and closes them in ``close()``; given
the library, it holds the reader threads while it is open (the last reader closed stops them).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

import numpy as np

from ple_um.lookup import rowcopy
from ple_um.mapping import MappedShards

log = logging.getLogger(__name__)

_ALIGNMENTS = (512, 4096)
# rowcopy.h's RING_*: the call a table's ring failed in.
RING_CALLS = {1: "io_uring_setup", 2: "io_uring_enter", 3: "its read buffers"}
_said = threading.Lock()


def _direct_alignment(fd: int, size: int) -> int | None:
    """The block size an O_DIRECT descriptor reads in (the smallest that reads back), or None."""
    with mmap.mmap(-1, 2 * 4096) as buf, memoryview(buf) as view:  # released before the map closes
        for align in _ALIGNMENTS:
            if size < 2 * align:
                continue
            try:
                with view[:align] as part:
                    if os.preadv(fd, [part], align) == align:
                        return align
            except OSError:
                continue
        return None


def choose_strategy(lib: ctypes.CDLL, asked: str) -> tuple[str, str]:
    """(strategy, why) for the knob's value ``asked``: auto is uring where a ring can be made."""
    uring = bool(lib.ple_uring_works())
    if asked == "auto":
        return ("uring", "io_uring") if uring else ("threads", "reader threads (no io_uring here)")
    if asked == "uring" and not uring:
        return "threads", "reader threads (io_uring asked for, but no ring can be made here)"
    return asked, {"uring": "io_uring", "threads": "reader threads", "mmap": "page faults"}[asked]


class FileReader:
    """The reads of ``mapping``'s owned rows (a table's rows, or a block-scaled table's block
    scales): ``strategy`` (uring, threads, mmap), ``direct`` (O_DIRECT where the files allow it),
    ``depth`` reads in flight per reading thread, ``resident_check``: without a row cache, rows
    whose pages are resident are copied from the mapping and only the others read. ``lib``: the row
    copy whose reader threads this reader holds while it is open (None: it holds none)."""

    def __init__(
        self,
        mapping: MappedShards,
        *,
        strategy: str,
        direct: bool,
        depth: int,
        resident_check: bool = False,
        lib: ctypes.CDLL | None = None,
    ) -> None:
        layout = mapping.layout
        self.strategy, self.depth = strategy, depth
        self.where = layout.directory
        self.fds = np.full(layout.parts, -1, dtype=np.int32)
        self.offsets = np.zeros(layout.parts, dtype=np.int64)
        self.failed = np.zeros(1, dtype=np.int32)  # reader.c: where the ring failed (call << 16 | errno)
        self.said = False  # the failure logged
        self._open: list[int] = []
        self._lib = None
        self.align = 0
        try:
            # region index -> (our descriptor of its file, its O_DIRECT block size or None)
            by_region: dict[int, tuple[int, int | None]] = {}
            tensor: dict[int, str] = {}  # region index -> a shard it holds, for the errors
            for index, owned in mapping.owned.items():
                r = owned.region
                if r not in by_region:
                    tensor[r] = layout.shards[index].tensor
                    by_region[r] = self._reopen(mapping.regions[r], direct, tensor[r])
            # Every file read the same way: O_DIRECT with the widest block any needs, or plainly
            # (some file refuses O_DIRECT: every file reopened plainly, one kind of read per table).
            aligns = {align for _, align in by_region.values()}
            if direct and aligns and None not in aligns:
                self.align = max(aligns)
            elif direct:  # the O_DIRECT descriptors closed, their files reopened plainly
                for r, (fd, align) in by_region.items():
                    if align is not None:
                        by_region[r] = self._reopen(mapping.regions[r], False, tensor[r])
                        self._open.remove(fd)
                        os.close(fd)
            for index, owned in mapping.owned.items():
                self.fds[index] = by_region[owned.region][0]
                self.offsets[index] = layout.shards[index].offset
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
            self.failed.ctypes.data,
        )
        self.address = ctypes.addressof(self.struct)
        if lib is not None:
            lib.ple_reader_hold()
            self._lib = lib

    def _reopen(self, region, direct: bool, tensor: str) -> tuple[int, int | None]:
        """A descriptor of our own on the file of ``region`` (O_DIRECT if asked and it reads), and
        the O_DIRECT block size (None: plain). An O_DIRECT descriptor that does not read is closed.
        Where the file cannot be reopened, OSError naming it and ``tensor`` (one of the shards it
        holds), not the /proc path it was reopened through."""
        path = f"/proc/self/fd/{region.fd}"
        if direct:
            try:
                mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError:
                mine = None
            if mine is not None:
                self._open.append(mine)
                align = _direct_alignment(mine, region.st_size)
                if align is not None:
                    return mine, align
                self._open.remove(mine)
                os.close(mine)
        try:
            mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            why = f"reopening the mapped file of {tensor} for the reads of misses failed: {exc.strerror}"
            raise OSError(exc.errno, why, region.path) from exc
        self._open.append(mine)
        return mine, None

    @property
    def reading(self) -> str:
        """How misses are read now: ``strategy``, or ``threads`` once the ring failed."""
        return "threads" if self.failed[0] else self.strategy

    def fallback(self) -> str | None:
        """Why the misses are read by the reader threads rather than io_uring (the call the ring
        failed in, and its error), or None where it did not fail. Logged once, when first seen."""
        code = int(self.failed[0])
        if code == 0:
            return None
        call, err = RING_CALLS.get(code >> 16, f"call {code >> 16}"), code & 0xFFFF
        what = f"{errno.errorcode.get(err, err)}, {os.strerror(err)}" if err else "nothing done"
        why = f"io_uring failed ({call}: {what}); misses read by reader threads from then on"
        with _said:
            said, self.said = self.said, True
        if not said:
            log.warning("ple-um: reading %s: %s", self.where, why)
        return why

    def close(self) -> None:
        """Close the descriptors and let go of the reader threads (the caller has made sure no row
        copy reads through them). Idempotent."""
        for fd in self._open:
            os.close(fd)
        self._open = []
        if self._lib is not None:
            self._lib, lib = None, self._lib
            lib.ple_reader_release()
