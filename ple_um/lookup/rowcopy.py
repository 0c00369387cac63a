"""RowCopy: the host bulk gather's row reads, in C (``rowcopy.c``), loaded with ctypes.

``torch.index_select`` copies one row at a time through a generic copy routine, so each thread has
about one row's misses in flight. The C copy prefetches the row 16 positions ahead of the one it
copies, and one job reads all of a lookup's rows while the calling thread queues each finished
chunk's copy to the device. On the H200 host (16 GiB table, fresh random rows; docs/PERF_NOTES.md
row 12) it reads 131 072 rows of one file in 375-532 us against 570-811 us, and a bulk lookup of
131 072 rows takes 1.40-1.60 ms against 1.62-2.16 ms.

A job takes its rows either as row numbers grouped by row space (``job``: a plan made first) or
as the lookup's global ids in batch order (``gather``: each id's shard and row worked out in C,
the rows landing where they belong). The second needs no plan and nothing put back in place:
131 072 rows in 1.13-1.42 ms against 1.39-1.59 ms for the planned job (PERF_NOTES row 14).

The C file is compiled once per machine with the system C compiler (``$CC``, else ``cc`` or
``gcc``: Triton needs one too) into the cache directory; where none is found or the build fails,
``load`` says why and the bulk gather keeps ``torch.index_select``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("rowcopy.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
# rowcopy.c's limits on one job.
MAX_SEGMENTS = 4096
MAX_BLOCKS = 65536
# Rows prefetched ahead of the one being copied, rows per claimed block, and how long idle workers
# spin before they sleep (H200 host, PERF_NOTES row 12: 16 and 32 ahead alike, none 1.3-1.5x
# slower; blocks of 1 024 slower than 256 at 32 768 rows; 500 us of spin gained 0.1-0.2 ms a
# lookup back to back for 15 threads busy half a millisecond after each one: not kept).
AHEAD = 16
BLOCK_ROWS = 256
SPIN_US = 50

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


class RowCopyError(RuntimeError):
    """The C row copy was given row numbers outside their tables (a broken plan)."""


def _build(cache_dir: str) -> tuple[ctypes.CDLL | None, str]:
    source = SOURCE.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler found ($CC, cc, gcc)"
    tag = hashlib.sha256(source + " ".join((cc, *FLAGS, platform.machine())).encode()).hexdigest()[:16]
    target = Path(cache_dir) / "native" / f"rowcopy-{tag}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                done = subprocess.run(
                    [cc, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True, timeout=120
                )
                if done.returncode != 0:
                    return None, f"compiling {SOURCE} with {cc} failed: {done.stderr.strip()[-500:]}"
                os.replace(built, target)  # atomic: another process may build the same file at once
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"compiling {SOURCE} with {cc} into {target.parent} failed: {exc}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.ple_pool_start.argtypes = [c_int, ctypes.c_long]
    lib.ple_pool_start.restype = c_int
    lib.ple_job_begin.argtypes = [ptr, ptr, ptr, c_int, i64, ptr, ptr, c_int, i64, c_int]
    lib.ple_job_begin.restype = c_int
    lib.ple_job_begin_ids.argtypes = [
        ptr,
        ptr,
        ptr,
        c_int,
        i64,
        i64,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        c_int,
        i64,
        c_int,
    ]
    lib.ple_job_begin_ids.restype = c_int
    lib.ple_pool_wake.argtypes = []
    lib.ple_pool_wake.restype = None
    lib.ple_job_wait.argtypes = [i64]
    lib.ple_job_wait.restype = None
    lib.ple_job_end.argtypes = []
    lib.ple_job_end.restype = ctypes.c_longlong  # -1: this thread was not inside a job
    return lib, f"C row copy ({target.name}, built with {cc})"


def load(cache_dir: str) -> tuple[ctypes.CDLL | None, str]:
    """The compiled row copy (built once per machine, cached in ``cache_dir``) and what it is, or
    None and why not."""
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = _build(cache_dir)
        return _loaded[cache_dir]


def _check_space(space: torch.Tensor, row_bytes: int, what: str) -> None:
    """A row space the C copy reads: a 2-D uint8 host tensor of contiguous ``row_bytes`` B rows."""
    if space.dim() != 2 or space.dtype != torch.uint8 or space.device.type != "cpu":
        raise ValueError(f"{what}: row space must be a 2-D uint8 host tensor")
    if space.shape[1] != row_bytes or space.stride() != (row_bytes, 1):
        raise ValueError(
            f"{what}: row space {tuple(space.shape)} does not hold contiguous {row_bytes} B rows"
        )


def _check_index(index: torch.Tensor, n: int, name: str, what: str) -> None:
    """``n`` contiguous int64 ``what`` (row numbers, ids) on the host, else ValueError."""
    if (
        index.dtype != torch.int64
        or index.device.type != "cpu"
        or not index.is_contiguous()
        or index.numel() != n
    ):
        raise ValueError(f"{name} must be {n} contiguous int64 {what} on the host")


def _check_out(out: torch.Tensor) -> int:
    """Rows of ``out``, a contiguous 2-D uint8 host tensor (else ValueError)."""
    if out.dim() != 2 or out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous 2-D uint8 host tensor, got {tuple(out.shape)} {out.dtype}"
        )
    return out.shape[0]


class ShardSpaces:
    """Where each shard's rows lie, for jobs by id: shard s's local row r is row ``row0[s] + r``
    of the row space ``spaces[s]`` (a 2-D uint8 host tensor of ``row_bytes`` B rows; None: the
    shard is not mapped). The row spaces must stay alive as long as this."""

    def __init__(
        self, spaces: list[torch.Tensor | None], row0: list[int], per_shard: int, row_bytes: int
    ) -> None:
        if not 1 <= len(spaces) <= MAX_SEGMENTS or len(row0) != len(spaces):
            raise ValueError(f"a job by id takes 1 to {MAX_SEGMENTS} shards, got {len(spaces)}")
        if not (1 <= per_shard < 1 << 63 and 1 <= row_bytes < 1 << 63):
            raise ValueError(f"rows per shard ({per_shard}) and row bytes ({row_bytes}) must be positive")
        self.count, self.per_shard, self.row_bytes = len(spaces), per_shard, row_bytes
        self.spaces = tuple(spaces)  # kept (a copy of the list): the addresses below point into them
        self.bases = np.zeros(self.count, dtype=np.uint64)
        self.limits = np.zeros(self.count, dtype=np.int64)
        # Copied into a contiguous array of its own: the C side reads `count` int64s in a row.
        self.row0 = np.array(row0, dtype=np.int64, order="C", copy=True)
        if self.row0.shape != (self.count,):
            raise ValueError(f"row0 must hold one row per shard ({self.count}), got shape {self.row0.shape}")
        for s, space in enumerate(self.spaces):
            if space is not None:
                _check_space(space, row_bytes, f"shard {s}")
                self.bases[s], self.limits[s] = space.data_ptr(), space.shape[0]


class RowCopy:
    """Reads rows of 2-D uint8 row tables (the mapped files' row spaces) into a 2-D uint8 host
    tensor: with ``threads`` > 1, rowcopy.c's thread pool (one per process, grown to the most
    workers asked for) and the calling thread; with 1, the calling thread alone."""

    def __init__(
        self, lib: ctypes.CDLL, threads: int, *, ahead: int = AHEAD, block: int = BLOCK_ROWS
    ) -> None:
        self.lib = lib
        self.ahead = max(0, ahead)
        self.block = max(1, block)
        self.threads = 1 + (lib.ple_pool_start(threads - 1, SPIN_US * 1000) if threads > 1 else 0)

    def wake(self) -> None:
        """Wake the pool's sleeping workers to spin for a job about to come (call it before the
        work that precedes the job, so that their wake-up overlaps that work)."""
        if self.threads > 1:
            self.lib.ple_pool_wake()

    @contextmanager
    def job(
        self, segments: list[tuple[torch.Tensor, int, int]], rows: torch.Tensor, out: torch.Tensor
    ) -> Iterator[Callable[[int], None]]:
        """``out[i] = space[rows[i]]`` for each (space, start, end) segment and i in [start, end);
        the segments lie back to back from 0 to ``len(out)``. Yields ``wait(upto)``, which returns
        once rows [0, upto) are in (the calling thread copies rows meanwhile); every row is in when
        the block exits. One job at a time in the process: a second one waits for it; one inside
        another in the same thread raises RuntimeError.

        A row number outside its space is not read: its row is zeroed and RowCopyError raised at
        the end (the caller's plan puts every row in its space; this guards against a broken one)."""
        n = _check_out(out)
        rb = out.shape[1]
        _check_index(rows, n, "rows", "row numbers")
        if not segments or len(segments) > MAX_SEGMENTS:
            raise ValueError(f"a job takes 1 to {MAX_SEGMENTS} segments, got {len(segments)}")
        bases = np.empty(len(segments), dtype=np.uint64)
        limits = np.empty(len(segments), dtype=np.int64)
        ends = np.empty(len(segments), dtype=np.int64)
        for s, (space, start, end) in enumerate(segments):
            _check_space(space, rb, f"segment {s}")
            if start != (segments[s - 1][2] if s else 0) or end < start:
                raise ValueError(f"segment {s}: [{start}, {end}) does not follow the segment before it")
            bases[s], limits[s], ends[s] = space.data_ptr(), space.shape[0], end
        if ends[-1] != n:
            raise ValueError(f"segments cover {int(ends[-1])} rows, out has {n}")
        block = max(self.block, -(-n // MAX_BLOCKS))
        with self._posted(
            lambda: self.lib.ple_job_begin(
                bases.ctypes.data,
                limits.ctypes.data,
                ends.ctypes.data,
                len(segments),
                rb,
                rows.data_ptr(),
                out.data_ptr(),
                self.ahead,
                block,
                int(self.threads == 1),
            ),
            f"{len(segments)} segments, {n} rows, blocks of {block}",
            "row numbers outside their row spaces",
        ) as wait:
            yield wait

    @contextmanager
    def gather(
        self, shards: ShardSpaces, ids: torch.Tensor, out: torch.Tensor, *, owned: tuple[int, int]
    ) -> Iterator[Callable[[int], None]]:
        """``out[i]`` = the row of global id ``ids[i]`` (in batch order, no plan), zeros for ids
        outside ``owned`` = [start, end); as ``job`` otherwise. An owned id whose row lies outside
        its shard's row space (a broken ``shards``) is zeroed and RowCopyError raised at the end."""
        n = _check_out(out)
        _check_index(ids, n, "ids", "ids")
        if out.shape[1] != shards.row_bytes:
            raise ValueError(f"out has {out.shape[1]} B rows, the shards {shards.row_bytes} B")
        start, end = owned
        if not 0 <= start <= end < 1 << 63:
            raise ValueError(f"owned range [{start}, {end}) is not a range of ids")
        block = max(self.block, -(-n // MAX_BLOCKS))
        with self._posted(
            lambda: self.lib.ple_job_begin_ids(
                shards.bases.ctypes.data,
                shards.limits.ctypes.data,
                shards.row0.ctypes.data,
                shards.count,
                shards.per_shard,
                start,
                end,
                shards.row_bytes,
                ids.data_ptr(),
                n,
                out.data_ptr(),
                self.ahead,
                block,
                int(self.threads == 1),
            ),
            f"{shards.count} shards, {n} ids, blocks of {block}",
            "owned ids outside their shards' row spaces",
        ) as wait:
            yield wait

    @contextmanager
    def _posted(self, begin: Callable[[], int], what: str, bad_rows: str) -> Iterator[Callable[[int], None]]:
        """Run ``begin`` (a ple_job_begin*), yield the wait, end the job whatever happens."""
        bad, begun = -1, None
        try:
            # Begun inside the try: an exception raised as begin returns (a signal) still ends the
            # job (ple_job_end does nothing unless this thread is inside one).
            begun = begin()
            if begun == -2:
                raise RuntimeError("this thread is inside a row copy job already (jobs do not nest)")
            if begun != 0:
                raise ValueError(f"rowcopy refused the job ({what})")
            yield self.lib.ple_job_wait
        finally:
            if begun is None or begun == 0:  # not when refused: a refused begin took nothing
                bad = self.lib.ple_job_end()
        if bad > 0:
            raise RowCopyError(f"{bad} {bad_rows} (zeroed, not read)")

    def copy(self, space: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = space[rows[i]]`` for every row of ``out``."""
        with self.job([(space, 0, out.shape[0] if out.dim() == 2 else -1)], rows, out):
            pass
