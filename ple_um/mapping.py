"""MappedShards: the read-only mmaps of the files that hold a table's owned rows.

One mapping per run of a file's owned shard ranges (ranges with no unowned rows between them,
widened to whole pages; ``_runs`` says why), opened
``PROT_READ`` + ``MAP_SHARED``: the pages are the page cache's, shared by every process that maps
the same file, and nobody can write them through us. The object owns the file descriptors and the
address ranges and releases both in ``close()`` (the llama.cpp ``llama_mmap`` idea). Prefetch,
advice and residency (``ple_um.residency``: mincore and cachestat in bounded windows) are explicit
methods. Failures carry the errno text and the file name.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ple_um import residency
from ple_um.checkpoint import FileIdentity, ShardLayout, check_identity
from ple_um.errors import CheckpointError, TableClosedError

logger = logging.getLogger(__name__)

PAGE = residency.PAGE
MADV_POPULATE_READ = 22  # Linux 5.14+ (Python's mmap names it from 3.13)
_ADVICE = {"normal": mmap.MADV_NORMAL, "random": mmap.MADV_RANDOM, "willneed": mmap.MADV_WILLNEED}
# The share of a table's bytes that may be out of the page cache for it to count as resident at
# open (no row cache with the defaults): one reclaimed page must not send a table that fits in
# memory to a row cache whose misses bypass the page cache that holds the rest.
RESIDENT_SLACK = 0.01

_libc = residency._libc  # mincore and madvise (the row cache's madvise too)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class MappedRegion:
    """One file's mapping: ``length`` bytes at ``addr`` showing the file from ``file_offset``."""

    path: str
    fd: int
    addr: int
    length: int
    file_offset: int
    st_size: int
    st_ino: int
    st_mtime_ns: int
    st_dev: int  # the filesystem's: an inode number is one filesystem's

    def array(self) -> np.ndarray:
        """A uint8 view of the whole mapping (read-only memory: a write through it faults)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.addr))


@dataclass(frozen=True)
class OwnedShard:
    """The owned part of shard ``index``: local rows ``[lo, hi)`` lying at host address ``addr``."""

    index: int
    lo: int
    hi: int
    addr: int  # host address of local row lo
    region: int  # index into MappedShards.regions

    @property
    def rows(self) -> int:
        return self.hi - self.lo


class MappedShards:
    """The mmaps of one table's owned rows; owns the fds and the mappings."""

    def __init__(self, layout: ShardLayout, rows: tuple[int, int] | None = None) -> None:
        self.layout = layout
        start, end = (0, layout.num_rows) if rows is None else rows
        self.row_start, self.row_end = max(0, start), min(layout.num_rows, end)
        self.regions: list[MappedRegion] = []
        self.owned: dict[int, OwnedShard] = {}
        self._closed = False
        try:
            self._map()
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------
    def _map(self) -> None:
        for path, runs in self._runs().items():
            for run in runs:
                begin = min(off + lo * self.layout.row_bytes for _, off, lo, _, _ in run)
                end = max(off + hi * self.layout.row_bytes for _, off, _, hi, _ in run)
                identity = self.layout.shards[run[0][0]].identity  # one header read per file
                tensors = [(off + hi * self.layout.row_bytes, tensor) for _, off, _, hi, tensor in run]
                region = self._map_file(path, begin, end, identity, tensors)
                self.regions.append(region)
                for index, off, lo, hi, _ in run:
                    addr = region.addr + (off + lo * self.layout.row_bytes - region.file_offset)
                    self.owned[index] = OwnedShard(index, lo, hi, addr, len(self.regions) - 1)

    def _runs(self) -> dict[str, list[list[tuple[int, int, int, int, str]]]]:
        """Per file, its owned shard ranges ``(index, offset, lo, hi, tensor)`` (local rows
        ``[lo, hi)``) in runs to map one each, in file order: a run ends where the bytes up to the
        next owned range hold rows this mapping does not own. A file's tensors lie in name order
        (shard_1, shard_10, ..., shard_2), so a tensor-parallel rank's shards lie apart, other
        ranks' rows between them: one mapping over them all would map, register, prewarm and count
        those too. Other bytes between two ranges (unrelated tensors, an NVFP4 shard's block scales)
        are mapped over, as they always were: they are never looked up."""
        rb = self.layout.row_bytes
        owned: dict[str, list[tuple[int, int, int, int, str]]] = {}
        foreign: dict[str, list[tuple[int, int]]] = {}  # per file: byte ranges of rows not owned
        for spec in self.layout.shards:
            first = self.layout.shard_start(spec.index)
            lo = min(max(self.row_start - first, 0), spec.rows)
            hi = max(min(self.row_end - first, spec.rows), lo)
            if hi > lo:
                owned.setdefault(spec.path, []).append((spec.index, spec.offset, lo, hi, spec.tensor))
            ranges = (
                (spec.offset, spec.offset + lo * rb),
                (spec.offset + hi * rb, spec.offset + spec.rows * rb),
            )
            foreign.setdefault(spec.path, []).extend((a, b) for a, b in ranges if b > a)
        runs: dict[str, list[list[tuple[int, int, int, int, str]]]] = {}
        for path, ranges in owned.items():
            ranges.sort(key=lambda r: r[1] + r[2] * rb)
            others = foreign[path]
            split: list[list[tuple[int, int, int, int, str]]] = []
            for item in ranges:
                begin = item[1] + item[2] * rb
                if split:
                    _, off, _, hi, _ = split[-1][-1]
                    gap = (off + hi * rb, begin)
                    if not any(a < gap[1] and gap[0] < b for a, b in others):
                        split[-1].append(item)
                        continue
                split.append([item])
            runs[path] = split
        return runs

    def _map_file(
        self, path: str, begin: int, end: int, identity: FileIdentity, tensors: list[tuple[int, str]]
    ) -> MappedRegion:
        """Map bytes ``[begin, end)`` of ``path``, the file ``identity`` describes: the descriptor
        mapped is checked to be the file whose header was read (another file renamed into its
        place, or the file rewritten, in between is a CheckpointError, never a mapping of other
        bytes under the old header's offsets). Its errors name ``path`` and a tensor of ``tensors``
        (its owned tensors, each with the end of its owned bytes): the first, or for a file too short
        the one that ends last."""
        tensor = tensors[0][1]
        try:
            fd = os.open(
                path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
            )  # a FIFO put in its place must not block
        except OSError as exc:
            raise CheckpointError(
                f"cannot open shard file: {exc.strerror}", path=path, tensor=tensor
            ) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("shard file is not a regular file", path=path, tensor=tensor)
            check_identity(st, identity, path, tensor)
            if st.st_size < end:
                raise CheckpointError(
                    f"file is {st.st_size} bytes but the table needs bytes up to {end} "
                    "(truncated or replaced since its header was read)",
                    path=path,
                    tensor=max(tensors)[1],
                )
            aligned = begin - begin % PAGE
            length = end - aligned
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, aligned)
            if addr in (None, _MAP_FAILED):
                raise CheckpointError(
                    f"mmap of {length} bytes failed: {residency.errno_text()}", path=path, tensor=tensor
                )
        except BaseException:
            os.close(fd)
            raise
        return MappedRegion(path, fd, addr, length, aligned, st.st_size, st.st_ino, st.st_mtime_ns, st.st_dev)

    # -- addresses ------------------------------------------------------------------------
    def shard_base(self, index: int) -> int:
        """Host address of the shard's local row 0 (may lie before the mapping; only owned rows
        are ever read), or 0 for a shard with no owned rows."""
        owned = self.owned.get(index)
        if owned is None:
            return 0
        return owned.addr - owned.lo * self.layout.row_bytes

    def host_bases(self) -> list[int]:
        return [self.shard_base(i) for i in range(self.layout.parts)]

    def shard_rows(self, index: int) -> np.ndarray:
        """The owned rows of a shard as a uint8 array [rows, row_bytes] over the mapping."""
        owned = self.owned[index]
        rb = self.layout.row_bytes
        region = self.regions[owned.region]
        start = owned.addr - region.addr
        flat = region.array()[start : start + owned.rows * rb]
        return flat.reshape(owned.rows, rb)

    @property
    def mapped_bytes(self) -> int:
        return sum(r.length for r in self.regions)

    @property
    def owned_bytes(self) -> int:
        return sum(o.rows for o in self.owned.values()) * self.layout.row_bytes

    # -- advice, prefetch, residency -------------------------------------------------------
    def advise(self, kind: str) -> None:
        """madvise every mapping: 'random' (no readahead), 'normal' or 'willneed'."""
        self._check_open()
        for r in self.regions:
            if _libc.madvise(r.addr, r.length, _ADVICE[kind]) != 0:
                logger.warning("madvise(%s) failed on %s: %s", kind, r.path, residency.errno_text())

    def populate(self, fraction: float = 1.0, workers: int = 8, progress=None) -> int:
        """Bring the first ``fraction`` of each mapping into the page cache; returns bytes asked for.

        MADV_POPULATE_READ where the kernel has it, else parallel reads through the fds."""
        self._check_open()
        chunk = 64 << 20
        jobs = []
        for r in self.regions:
            want = int(r.length * max(0.0, min(1.0, fraction)))
            jobs += [(r, off, min(chunk, want - off)) for off in range(0, want, chunk)]

        def one(job: tuple[MappedRegion, int, int]) -> int:
            r, off, n = job
            if _libc.madvise(r.addr + off, n, MADV_POPULATE_READ) != 0:
                os.pread(r.fd, n, r.file_offset + off)
            return n

        total = 0
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for n in pool.map(one, jobs):
                total += n
                if progress is not None:
                    progress(n)
        return total

    def map_resident(self, most_runs: int = 1 << 16) -> int:
        """Map into this process the pages of the mappings that are already in the page cache
        (``MADV_POPULATE_READ`` over resident runs only: nothing is read from disk, only page-table
        entries are made), so that a host gather takes no minor fault on them: a fault per page
        first touched costs a small lookup more than its copies (docs/lab/PERF_NOTES.md). At most
        ``most_runs`` runs per mapping, longest first. Returns the bytes mapped; 0 where the kernel lacks
        MADV_POPULATE_READ (Linux < 5.14)."""
        self._check_open()
        total = 0
        for r in self.regions:
            try:
                starts, ends = residency.longest_runs(r, most_runs)
            except OSError as exc:
                logger.debug("%s", exc)
                continue
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
                length = min(b * PAGE, r.length) - a * PAGE
                if _libc.madvise(r.addr + a * PAGE, length, MADV_POPULATE_READ) != 0:
                    logger.debug("MADV_POPULATE_READ failed on %s: %s", r.path, residency.errno_text())
                    return total
                total += length
        return total

    def resident(self, slack: float = RESIDENT_SLACK) -> bool:
        """Whether the mappings are in the page cache now (mincore), all but at most ``slack`` of
        their bytes: the few pages the kernel has reclaimed come back at their first touch, so such
        a table is served as a resident one."""
        found = self.residency()
        return sum(r for _, r, _ in found) >= (1 - slack) * sum(m for _, _, m in found)

    def touch_rows(self, ids: np.ndarray) -> int:
        """Fault in the pages of the given owned global rows (first and last byte of each row);
        a prefetch hint. Returns the number of rows touched."""
        self._check_open()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= self.row_start) & (ids < self.row_end)]
        if ids.size == 0:
            return 0
        S, rb = self.layout.rows_per_shard, self.layout.row_bytes
        shard = ids // S
        for index in np.unique(shard).tolist():
            owned = self.owned.get(int(index))
            if owned is None:
                continue
            local = ids[shard == index] - index * S - owned.lo
            region = self.regions[owned.region]
            view = region.array()
            start = owned.addr - region.addr
            # Reading one byte of each end of the row faults in every page it spans (rows are
            # far smaller than a page).
            int(view[start + local * rb].sum()) + int(view[start + local * rb + rb - 1].sum())
        return int(ids.size)

    def residency(self) -> list[tuple[str, int, int]]:
        """(path, resident bytes, mapped bytes) of each mapping, by mincore."""
        self._check_open()
        out = []
        for r in self.regions:
            resident = residency.resident_count(r)
            out.append((r.path, min(resident * PAGE, r.length), r.length))
        return out

    def changed_files(self) -> list[str]:
        """Files whose device, inode, size or mtime on disk differ from what was mapped (replaced or
        truncated since open; ``FileIdentity``, as ``checkpoint.replaced_files`` compares them): what
        can be detected without reading the data. Each file once, however many runs of it are mapped."""
        changed: dict[str, None] = {}
        for r in self.regions:
            try:
                st = os.stat(r.path)
            except OSError:
                changed[r.path] = None
                continue
            mapped = FileIdentity(r.st_dev, r.st_ino, r.st_size, r.st_mtime_ns)
            if mapped.differs(FileIdentity.of(st)):
                changed[r.path] = None
            elif os.fstat(r.fd).st_size < r.file_offset + r.length:
                changed[r.path] = None
        return list(changed)

    # -- life -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TableClosedError("the mapping is closed")

    def close(self) -> None:
        """Unmap and close every fd, in reverse order; idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in reversed(self.regions):
            if _libc.munmap(r.addr, r.length) != 0:
                logger.warning("munmap failed on %s: %s", r.path, residency.errno_text())
            os.close(r.fd)
        self.regions.clear()
        self.owned.clear()

    def __enter__(self) -> MappedShards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
