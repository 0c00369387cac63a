"""The C row copy (``native/``): a lookup's host work, loaded with ctypes.

``ple_lookup_run`` reads the rows of a batch of ids from the mapped shard files into a staging
buffer, in batch order (each id's shard and row worked out in C, as the GPU kernel does), zeros for
ids not owned, and adds to the table's host counters. It is written to run as a CUDA host function
(``host/gather.py`` queues it with ``cuLaunchHostFunc``): no CUDA call, no GIL, no failure; on a
machine without CUDA it is called directly. Each thread prefetches the row 16 positions ahead of
the one it copies (``torch.index_select`` copies row by row, about one miss in flight); big lookups
are split in blocks over a pool of worker threads that stays up between lookups. A table may add a
row cache (``host/row_cache.py``) and a reader of the rows it misses (``host/file_reads.py``).

The C files are compiled at install time into one library inside the package (``setup.py``,
``native_build.py``: hardened, warnings as errors). Where that library is missing (an install
without a compiler), stale (built from other source) or refused (another interface), they are
compiled at run time with the system C compiler (``$CC``, else ``cc`` or ``gcc``: Triton needs one
too) into ``PLE_UM_CACHE_DIR/native/``, and a library found there is loaded only once checked: a
regular file of this user's that no one else can write, in a safe folder (``cache_folder``), whose
bytes are those its build recorded beside it. Every library's interface is checked before use
(``ple_abi_version``, the source digest, the structs' sizes, every symbol). Where no library can
be had, ``load`` says why, and the ``cpu`` mode keeps its synchronous path (``sync_gather.py``).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from ple_um import envs
from ple_um.lookup import native_library
from ple_um.mapping import MappedShards

# abi.c's PLE_ABI_VERSION: the interface the declarations below are written for.
ABI_VERSION = 6
# The functions called through ctypes: name, argument types, result type.
SIGNATURES = (
    ("ple_abi_version", [], ctypes.c_int64),
    ("ple_pool_start", [ctypes.c_int, ctypes.c_long], ctypes.c_int),
    ("ple_pool_wake", [ctypes.c_void_p], None),
    ("ple_lookup_run", [ctypes.c_void_p], None),
    ("ple_dispatch_start", [], ctypes.c_int),
    ("ple_dispatch_post", [ctypes.c_void_p], ctypes.c_int),
    ("ple_struct_sizes", [], ctypes.c_int64),
    ("ple_cache_ways", [], ctypes.c_int64),
    ("ple_cache_set_head", [], ctypes.c_int64),
    ("ple_uring_works", [], ctypes.c_int),
    ("ple_reader_hold", [], None),
    ("ple_reader_release", [], None),
    ("ple_cache_find", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int64),
)
# How long idle workers spin after a lookup before they sleep: long enough to catch a lookup that
# follows at once, short enough that a pool's threads do not burn their cores after every lookup
# (a longer spin gains little back to back: docs/lab/PERF_NOTES.md).
SPIN_US = 50
# At most this many ids a lookup's rows are read by the thread that runs its row copy alone: below
# it the pool's hand-off costs more than it saves (docs/lab/PERF_NOTES.md).
INLINE_ROWS = 2048
# rowcopy.h's counters, in the order of its enum.
COUNTS = (
    "rows",
    "out_of_range",
    "broken",
    "ns",
    "lookups",
    "cache_hits",
    "cache_misses",
    "cache_inserts",
    "cache_evictions",
    "file_reads",
    "read_ns",
    "touches",
)
# rowcopy.h's ways of reading the rows a lookup misses.
READ_STRATEGIES = {"mmap": 0, "uring": 1, "threads": 2}
# Id dtypes the C code reads, as its id_kind.
ID_KINDS = {torch.int64: 0, torch.int32: 1, torch.int16: 2, torch.int8: 3, torch.uint8: 4}

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


class RowsStruct(ctypes.Structure):
    """rowcopy.h's ple_rows_t."""

    _fields_ = [
        ("shards", ctypes.c_int64),
        ("per_shard", ctypes.c_int64),
        ("num_rows", ctypes.c_int64),
        ("lo", ctypes.c_int64),
        ("hi", ctypes.c_int64),
        ("rb", ctypes.c_int64),
        ("bases", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("end", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("reader", ctypes.c_void_p),
    ]


class ReaderStruct(ctypes.Structure):
    """rowcopy.h's ple_reader_t: how the rows a lookup misses are read."""

    _fields_ = [
        ("fds", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("align", ctypes.c_int32),
        ("strategy", ctypes.c_int32),
        ("depth", ctypes.c_int32),
        ("resident_check", ctypes.c_int32),
        ("failed", ctypes.c_void_p),
    ]


# rowcache.c's sets of WAYS slots; a set has a head of CACHE_SET_HEAD bytes (its version, CLOCK's
# hand, its policy word) in an array of its own.
CACHE_WAYS, CACHE_SET_HEAD = 16, 16


class CacheStruct(ctypes.Structure):
    """rowcache.c's struct ple_cache."""

    _fields_ = [
        ("sets", ctypes.c_int64),
        ("rb", ctypes.c_int64),
        ("policy", ctypes.c_int32),
        ("follower", ctypes.c_int32),
        ("tags", ctypes.c_void_p),
        ("heads", ctypes.c_void_p),
        ("data", ctypes.c_void_p),
        ("sketch", ctypes.c_void_p),
        ("sketch_blocks", ctypes.c_int64),
        ("door", ctypes.c_void_p),
        ("door_words", ctypes.c_int64),
        ("clock", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
    ]


class LookupStruct(ctypes.Structure):
    """rowcopy.h's ple_lookup_t: one queued lookup."""

    _fields_ = [
        ("tables", ctypes.c_void_p * 2),
        ("dst", ctypes.c_void_p * 2),
        ("ids", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("counts", ctypes.c_void_p),
        ("live", ctypes.c_void_p),
        ("id_kind", ctypes.c_int32),
        ("touch", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("inline_rows", ctypes.c_int32),
        ("chunk", ctypes.c_int32),
        ("busy", ctypes.c_int32),
        ("seq", ctypes.c_uint32),
        ("ready", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("next", ctypes.c_void_p),
    ]


def _declare(lib: ctypes.CDLL) -> str | None:
    """Declare the library's functions; None when its interface is the one declared here (every
    symbol there, abi.c's version, the structs' sizes, the row cache's slots), else what differs."""
    for name, argtypes, restype in SIGNATURES:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            return f"it has no {name}(): not a row copy of this interface"
        fn.argtypes, fn.restype = argtypes, restype
    if lib.ple_abi_version() != ABI_VERSION:
        return f"interface version {lib.ple_abi_version()}; this ple-um declares version {ABI_VERSION}"
    sizes = lib.ple_struct_sizes()
    declared = (RowsStruct, LookupStruct, ReaderStruct, CacheStruct)
    if [(sizes >> shift) & 0xFFFF for shift in (48, 32, 16, 0)] != [ctypes.sizeof(s) for s in declared]:
        return "the C structs do not match their ctypes declarations"
    if (lib.ple_cache_ways(), lib.ple_cache_set_head()) != (CACHE_WAYS, CACHE_SET_HEAD):
        return "the C row cache's sets do not match CACHE_WAYS and CACHE_SET_HEAD"
    return None


def load(cache_dir: str) -> tuple[ctypes.CDLL | None, str]:
    """The row copy and what it is: the library the install built, else one compiled at run time
    into ``cache_dir`` (once per machine and source); or None and why not."""
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = native_library.find(cache_dir, _declare)
        return _loaded[cache_dir]


def for_open() -> tuple[ctypes.CDLL | None, str]:
    """The row copy a table opened now takes (``load`` under ``PLE_UM_CACHE_DIR``), or None and why
    not (``PLE_UM_ROWCOPY=0`` among the reasons): what ``build_paths`` builds the host path with, and
    what ``ple-um probe DIR`` and ``residency`` describe."""
    if not envs.PLE_UM_ROWCOPY:
        return None, "PLE_UM_ROWCOPY=0"
    return load(envs.PLE_UM_CACHE_DIR)


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of one of the library's functions, for cuLaunchHostFunc."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class Rows:
    """One table's rows as the C code reads them (a ple_rows_t and the arrays it points to): the
    owned rows of ``mapping`` (a table's rows, or an NVFP4 table's block scales), and the row cache
    (``host.row_cache.RowCache``) and reader (``host.file_reads.FileReader``) they are looked up
    and read with, where there are any. The mapping, cache and reader must stay open as long as
    this is used."""

    def __init__(self, mapping: MappedShards, *, cache=None, reader=None) -> None:
        layout = mapping.layout
        parts, rb = layout.parts, layout.row_bytes
        self.bases = np.zeros(parts, dtype=np.uint64)
        self.first = np.zeros(parts, dtype=np.int64)
        self.end = np.zeros(parts, dtype=np.int64)
        for index, owned in mapping.owned.items():
            # The address of local row 0 (it may lie before the mapping: only owned rows are read).
            self.bases[index] = (owned.addr - owned.lo * rb) % (1 << 64)
            self.first[index], self.end[index] = owned.lo, owned.hi
        self.struct = RowsStruct(
            parts,
            layout.rows_per_shard,
            layout.num_rows,
            mapping.row_start,
            mapping.row_end,
            rb,
            self.bases.ctypes.data,
            self.first.ctypes.data,
            self.end.ctypes.data,
            cache.address if cache is not None else None,
            reader.address if reader is not None else None,
        )
        self.cache, self.reader = cache, reader  # kept: the struct points into them
        self.row_bytes = rb
        self.address = ctypes.addressof(self.struct)


class Counts:
    """The host counters lookups add to (rowcopy.h's enum), read without a lock: each is one
    aligned int64 that the C code adds to atomically."""

    def __init__(self) -> None:
        self.array = np.zeros(len(COUNTS), dtype=np.int64)
        self.address = self.array.ctypes.data

    def read(self) -> dict[str, int]:
        return dict(zip(COUNTS, (int(v) for v in self.array.tolist()), strict=True))

    def held_rows(self) -> int:
        """The rows a row cache counting here holds now: its inserts less its evictions."""
        c = self.read()
        return c["cache_inserts"] - c["cache_evictions"]


class Pool:
    """pool.c's worker threads (one pool per process, grown to the most workers any table asked
    for): ``threads`` = the workers plus the thread that runs the lookup."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        self.lib = lib
        self.threads = 1 + (lib.ple_pool_start(threads - 1, SPIN_US * 1000) if threads > 1 else 0)

    def wake(self) -> None:
        """Wake the sleeping workers to spin for a lookup about to come."""
        if self.threads > 1:
            self.lib.ple_pool_wake(None)
