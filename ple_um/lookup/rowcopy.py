"""The C row copy (``rowcopy.c``): a lookup's host work, loaded with ctypes.

``ple_lookup_run`` reads the rows of a batch of ids from the mapped shard files into a staging
buffer, in batch order (each id's shard and row worked out in C, as the GPU kernel does), zeros for
ids not owned, and adds to the table's host counters. It is written to run as a CUDA host function
(``host_node.py`` queues it with ``cuLaunchHostFunc``): no CUDA call, no GIL, no failure; on a
machine without CUDA it is called directly. Each thread prefetches the row 16 positions ahead of
the one it copies (``torch.index_select`` copies row by row, about one miss in flight); big lookups
are split in blocks over a pool of worker threads that stays up between lookups (docs/PERF_NOTES.md
rows 12 and 14).

The C file is compiled once per machine with the system C compiler (``$CC``, else ``cc`` or
``gcc``: Triton needs one too) into the cache directory; where none is found or the build fails,
``load`` says why, and the ``cpu`` mode keeps its synchronous path (``cpu_gather.py``).
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
from pathlib import Path

import numpy as np
import torch

from ple_um.mapping import MappedShards

SOURCE = Path(__file__).with_name("rowcopy.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
# How long idle workers spin after a lookup before they sleep (H200 host, PERF_NOTES row 12: 500 us
# gained 0.1-0.2 ms a lookup back to back for 15 threads busy half a millisecond after each one).
SPIN_US = 50
# rowcopy.c's counters, in the order of its enum.
COUNTS = ("rows", "out_of_range", "broken", "ns", "lookups")
# Id dtypes the C code reads, as its id_kind.
ID_KINDS = {torch.int64: 0, torch.int32: 1, torch.int16: 2, torch.int8: 3, torch.uint8: 4}

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


class RowsStruct(ctypes.Structure):
    """rowcopy.c's ple_rows_t."""

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
    ]


class LookupStruct(ctypes.Structure):
    """rowcopy.c's ple_lookup_t: one queued lookup."""

    _fields_ = [
        ("tables", ctypes.c_void_p * 2),
        ("dst", ctypes.c_void_p * 2),
        ("ids", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("counts", ctypes.c_void_p),
        ("id_kind", ctypes.c_int32),
        ("touch", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("inline_rows", ctypes.c_int32),
        ("busy", ctypes.c_int32),
        ("seq", ctypes.c_uint32),
        ("ready", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("next", ctypes.c_void_p),
    ]


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
    lib.ple_pool_start.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.ple_pool_start.restype = ctypes.c_int
    lib.ple_pool_wake.argtypes = [ctypes.c_void_p]
    lib.ple_pool_wake.restype = None
    lib.ple_lookup_run.argtypes = [ctypes.c_void_p]
    lib.ple_lookup_run.restype = None
    lib.ple_dispatch_start.argtypes = []
    lib.ple_dispatch_start.restype = ctypes.c_int
    lib.ple_dispatch_post.argtypes = [ctypes.c_void_p]
    lib.ple_dispatch_post.restype = ctypes.c_int
    lib.ple_struct_sizes.argtypes = []
    lib.ple_struct_sizes.restype = ctypes.c_int64
    sizes = lib.ple_struct_sizes()
    if (sizes >> 32, sizes & 0xFFFFFFFF) != (ctypes.sizeof(RowsStruct), ctypes.sizeof(LookupStruct)):
        return None, f"{target}: the C structs do not match their ctypes declarations"
    return lib, f"C row copy ({target.name}, built with {cc})"


def load(cache_dir: str) -> tuple[ctypes.CDLL | None, str]:
    """The compiled row copy (built once per machine, cached in ``cache_dir``) and what it is, or
    None and why not."""
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = _build(cache_dir)
        return _loaded[cache_dir]


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of one of the library's functions, for cuLaunchHostFunc."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class Rows:
    """One table's rows as the C code reads them (a ple_rows_t and the arrays it points to): the
    owned rows of ``mapping`` (a table's rows, or an NVFP4 table's block scales). The mapping must
    stay open as long as this is used."""

    def __init__(self, mapping: MappedShards) -> None:
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
        )
        self.row_bytes = rb
        self.address = ctypes.addressof(self.struct)


class Counts:
    """The host counters lookups add to (rowcopy.c's enum), read without a lock: each is one
    aligned int64 that the C code adds to atomically."""

    def __init__(self) -> None:
        self.array = np.zeros(len(COUNTS), dtype=np.int64)
        self.address = self.array.ctypes.data

    def read(self) -> dict[str, int]:
        return dict(zip(COUNTS, (int(v) for v in self.array.tolist()), strict=True))


class Pool:
    """rowcopy.c's worker threads (one pool per process, grown to the most workers any table asked
    for): ``threads`` = the workers plus the thread that runs the lookup."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        self.lib = lib
        self.threads = 1 + (lib.ple_pool_start(threads - 1, SPIN_US * 1000) if threads > 1 else 0)

    def wake(self) -> None:
        """Wake the sleeping workers to spin for a lookup about to come."""
        if self.threads > 1:
            self.lib.ple_pool_wake(None)
