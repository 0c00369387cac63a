"""LookupPaths: the lookup paths one access mode serves through, and when each serves.

Two paths, each owning its buffers, its dequantization and its counting:
- the kernel (``GpuGather``: the ``ats``, ``registered`` and ``device`` modes), which reads each row
  through the per-shard bases ``access.build.ModeAccess`` made;
- the host path: the C row copy (``HostGather``: stream-ordered, capture-safe), or where the C row
  copy cannot be built the ``cpu`` mode's synchronous gather (``SyncGather``: not capture-safe).

The ``cpu`` mode has only the host path. A GPU mode has the kernel, plus the host path for its big
lookups (at least ``bulk_rows`` ids: the crossover the open measures, ``PLE_UM_BULK_ROWS``), for
every lookup while the table's owned rows do not fit the memory this process may use
(``decode_on_host``), and, in the ``ats`` mode while a table that fits is not all in memory, for a
page touch queued before each kernel (``PLE_UM_ATS_PREFETCH``). ``lookup.fit`` decides which at
open and again while the table serves (``serving``); ``LookupPaths.route`` sends each lookup
down the one that serves it. Under ``auto`` a captured kernel lookup holds the touch whatever was
decided then, a touch that runs only while ``touch_live`` says so when it runs: replays of a graph
captured while the table was resident touch once it is evicted; and such a capture checks the fit
first where the last check is stale, so that a graph captured right after the memory ran short
captures the host path. Every path reports the same
counts (``read_counts``), so the table adds them up without asking which path it holds.

Before it is routed, a lookup's arguments are checked (``check_args``: ``lookup``, ``lookup_packed``
and the torch ops), each failure a TypeError or ValueError saying what to pass.
"""

from __future__ import annotations

import functools
import threading
import weakref

import numpy as np
import torch

from ple_um.checkpoint import ShardLayout
from ple_um.lookup import fit, fit_watch, forks, open_tables
from ple_um.lookup.counts import path_counts
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.lookup.host.gather import HostGather, warm_row_cache
from ple_um.lookup.sync_gather import SyncGather

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
PackedRows = tuple[torch.Tensor, torch.Tensor]  # NVFP4, MXFP8: raw rows and their block scales
_ID_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8))
# The id dtypes in words: torch's wide unsigned ones (uint16, uint32, uint64) are integers too.
_ID_WORDS = "an integer tensor of int64, int32, int16, int8 or uint8"


def check_ids(ids) -> None:
    """TypeError unless ``ids`` is a tensor of an integer dtype a lookup takes."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, not {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"ids must be {_ID_WORDS}, got {ids.dtype}")


def check_range(ids: torch.Tensor, num_rows: int) -> None:
    """A strict lookup's (and prefetch's) IndexError where an id of ``ids`` is outside the table,
    compared at its value (the row count in a narrow id dtype wraps: 300 as uint8 is 44)."""
    wide = ids.long()
    bad = ((wide < 0) | (wide >= num_rows)).sum().item()
    if bad:
        raise IndexError(f"{bad} ids outside [0, {num_rows}) (strict lookup)")


def check_args(table, ids, out: torch.Tensor | None, out_dtype) -> torch.dtype | None:
    """The argument checks of every lookup of ``table`` (``lookup`` and the torch ops); the out
    dtype."""
    check_ids(ids)
    if out is not None:
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out is {out.dtype} but out_dtype is {out_dtype}: pass one of them")
        out_dtype = out.dtype
        if out_dtype not in table.out_dtypes:
            _refuse_dtype(table, out_dtype)
        if out.shape != (*ids.shape, table.row_dim):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*ids.shape, table.row_dim)}")
        if out.device != table.device:
            raise ValueError(f"out is on {out.device}, the table on {table.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    elif (out_dtype is not None and out_dtype not in table.out_dtypes) or (
        out_dtype is None and table.scale_mapping is not None
    ):
        _refuse_dtype(table, out_dtype)
    return out_dtype


def _refuse_dtype(table, out_dtype) -> None:
    if table.scale_mapping is not None:
        raise TypeError(
            f"an {table.layout.dtype_name} table decodes its rows: pass out_dtype (bf16, f16 or f32) "
            "or a float out=, or use lookup_packed() for the raw bytes and block scales"
        )
    raise TypeError(f"out_dtype must be {table.dtype} (raw) or one of bf16, f16, f32; got {out_dtype}")


class LookupPaths:
    """The paths of one built mode, for ``layout``'s owned rows on ``device``. ``gpu``: the kernel,
    or None (cpu mode); ``host``: the host path, or None; ``bulk_rows``: GPU-mode lookups of at
    least this many ids take the host path (None: never); ``decode_on_host``: every lookup takes the
    host path; ``touch_pages``: a page touch on the host path is queued before each kernel;
    ``touch_live``: under ``PLE_UM_ATS_PREFETCH=auto`` in the ats mode on a GPU, the word (one
    int32, read by the touch's row copy when it runs) saying whether a kernel's pages are to be
    touched now, else None; ``capture_checks``: a lookup captured on the kernel first has the fit
    checked again (``FitWatch.check_at_capture``; where there is a ``touch_live`` word and fit
    checks, whose captures are told apart already); ``serving``: which of them and why
    (``fit.Serving``), kept by ``fit`` (``fit_watch.FitWatch``, or None where nothing is decided again);
    ``capture_safe``: every lookup is stream-ordered work; ``row_reads``: how rows are read, in
    words, for the open's log line. A host path replaced (``adopt``) stays until ``close``: graphs
    captured through it still run it."""

    def __init__(
        self,
        layout: ShardLayout,
        device: torch.device,
        gpu: GpuGather | None,
        host: HostGather | SyncGather | None,
        row_reads: str,
    ) -> None:
        self.layout, self.device = layout, device
        self.gpu = gpu
        self.host = host
        self.row_reads = row_reads
        self.bulk_rows: int | None = None
        self.touch_pages = False
        self.decode_on_host = gpu is None
        self.serving = fit.Serving("host" if gpu is None else "kernel", False, "")
        self.touch_live: np.ndarray | None = None
        self.fit: fit_watch.FitWatch | None = None
        self.capture_checks = False
        self.capture_safe = not isinstance(host, SyncGather)
        self._retired: list[HostGather] = []
        self._forked()
        forks.renew_in_forked_children(self)
        self._open_table = None  # its entry in open_tables.OPEN_TABLES: removed at close, or when dropped
        self._fit_key: int | None = None

    def _forked(self) -> None:
        """``adopt``'s lock: at open, and anew in a forked child, where a parent's thread that held
        it (the stats reporter reading the counts) does not exist and the child's close takes it."""
        self._lock = threading.Lock()

    def count_in_fits(self, key: int) -> None:
        """Own the table's entry ``key`` in ``open_tables.OPEN_TABLES`` (its mappings counted in the
        fit of every table of this process): removed at ``close``, or when these paths are dropped."""
        self._open_table = weakref.finalize(self, open_tables.OPEN_TABLES.remove, key)
        self._fit_key = key

    def opened(self) -> None:
        """The table's open succeeded: the checks of the other tables count it from now on
        (``OpenTables.opened``; other opens counted it from ``count_in_fits``)."""
        if self._fit_key is not None:
            open_tables.OPEN_TABLES.opened(self._fit_key)

    def set_serving(self, serving: fit.Serving) -> None:
        """Make ``serving`` what the next lookup takes: one flag each, read once per lookup (a
        lookup already queued keeps its path; the host path is in place before its flag)."""
        assert serving.path == "kernel" or self.host is not None, "the host path serves only where it exists"
        self.serving = serving
        self.touch_pages = serving.touch and self.host is not None
        self.decode_on_host = serving.path == "host"
        if self.touch_live is not None:  # graphs captured on the kernel run it also on the host path
            self.touch_live[0] = serving.touch or self.decode_on_host

    def route(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The one routing of a lookup: contiguous ``ids`` on the table's device into contiguous ``out``
        (the kernel reads both by address, the host path flat): the host path while ``decode_on_host``
        (``lookup.fit``) or for ``bulk_rows`` ids or more; with ``touch_pages`` a page touch first,
        and with ``touch_live`` one in every capture (run while its word says so). With
        ``capture_checks`` a capture on the kernel checks the fit first, and takes the host path
        where the check switched to it."""
        n = ids.numel()
        if not self.decode_on_host and (self.bulk_rows is None or n < self.bulk_rows):
            live = (self.touch_live is not None or self.capture_checks) and self._live_capture()
            if live and self.capture_checks:  # may switch this and later lookups to the host path
                self.fit.check_at_capture()
            if not self.decode_on_host:
                if self.touch_pages or live and self.touch_live is not None:
                    self.touch(ids.view(-1))
                return self.gpu.gather(ids, out)
        self.host.gather(ids.view(-1), out.view(n, out.shape[-1]))
        return out

    def packed(self, ids: torch.Tensor) -> PackedRows:
        """NVFP4, MXFP8: the raw rows and block scales of flat ``ids`` (uint8 [n, row_bytes], [n, D/B])."""
        n, layout = ids.numel(), self.layout
        packed = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=self.device)
        scales = torch.empty((n, layout.row_dim // layout.block_size), dtype=torch.uint8, device=self.device)
        (self.host if self.decode_on_host else self.gpu).gather_packed(ids, packed, scales)
        return packed, scales

    def _live_capture(self) -> bool:
        """With a ``touch_live`` word: whether this lookup is captured with the host path there to
        hold the touch (asked only where there is a word: no cost to the other modes' kernel)."""
        return self.host is not None and torch.cuda.is_current_stream_capturing()

    def touch(self, ids: torch.Tensor) -> None:
        """Queue the page touch of flat ``ids``' rows on the host path (before the kernel's lookup),
        through ``touch_live`` where there is one."""
        self.host.touch(ids, live=self.touch_live)

    def adopt(self, host: HostGather) -> None:
        """Serve the next lookups on the host path through ``host`` (one with a row cache the old
        one lacked); the old one stays until ``close``."""
        with self._lock:
            if self.host is not None:
                self._retired.append(self.host)
            self.host = host
            self.row_reads = f"{self.row_reads}; since: {host.row_reads}"

    def _hosts(self) -> list:
        """Every host path, each once: read under ``adopt``'s lock, so that a reading of the counts
        (the stats reporter's thread) never finds the one replaced both retired and serving."""
        with self._lock:
            return [h for h in (*self._retired, self.host) if h is not None]

    @property
    def counts_on_host(self) -> bool:
        """Whether lookups are counted on the host as they are made (the synchronous path), rather
        than in counters the paths add to where they run (read by the stats reporter)."""
        return isinstance(self.host, SyncGather)

    @property
    def row_copy(self) -> HostGather | None:
        """The C row copy's host path, or None."""
        return self.host if isinstance(self.host, HostGather) else None

    def prefetch_touch(self):
        """What a prefetch's threads do with its ids: None, fault in their pages (the kernel reads
        them through the mapping, or the host path copies resident rows from it); while every
        lookup takes the host path and it has a row cache, read the rows the cache lacks into it
        (``warm_row_cache``: the page touch would fill the page cache, which the reads of the
        cache's misses pass by)."""
        host = self.row_copy
        if self.decode_on_host and host is not None and host.rows.cache is not None:
            return functools.partial(warm_row_cache, host)
        return None

    def row_cache_stats(self) -> dict | None:
        """The host path's row cache (``RowSources.stats``), or None where it has none."""
        host = self.row_copy
        return host.sources.stats() if host is not None else None

    def file_reader_stats(self) -> dict:
        """``file_reader``: how the host path reads misses from the files (``RowSources.file_reader``),
        or None; ``file_reader_fallback``: why by reader threads though io_uring was planned (a ring
        failed: ``RowSources.fallback``), or None."""
        host = self.row_copy
        sources = host.sources if host is not None else None
        return {
            "file_reader": sources.file_reader() if sources is not None else None,
            "file_reader_fallback": sources.fallback() if sources is not None else None,
        }

    def read_counts(self) -> dict:
        """The paths' counts added up (``counts.path_counts``' keys). Device counters are read on
        the current stream."""
        total = path_counts()
        for path in (self.gpu, *self._hosts()):
            if path is None:
                continue
            counts = path.read_counts()
            for key in ("rows", "out_of_range", "broken", "lookups", "file_reads", "file_read_seconds"):
                total[key] += counts[key]
            for key, seconds in counts["phase_seconds"].items():
                total["phase_seconds"][key] += seconds
        return total

    def reset_counts(self) -> None:
        for path in (self.gpu, *self._hosts()):
            if path is not None:
                path.reset_counts()

    def serving_stats(self) -> dict:
        """What serves the decode-sized lookups (``fit.Serving.as_dict``, with the page touches the
        host paths ran: eager and replayed), and the fit checks made."""
        touches = sum(h.counts.read()["touches"] for h in self._hosts() if isinstance(h, HostGather))
        return {
            **self.serving.as_dict(touches),
            "checks": self.fit.checks if self.fit is not None else 0,
        }

    def close(self) -> None:
        """Stop the fit checks, then release the host paths (their threads' work done, their
        buffers). The kernel holds nothing that needs releasing but device tensors."""
        if self._open_table is not None:  # no fit measures the mappings once they are released
            self._open_table()
        if self.fit is not None:
            self.fit.close()
        for host in reversed(self._hosts()):
            host.close()
        self._retired = []
        self.host = self.gpu = None
