"""Driving the C row copy directly through ctypes, as the CUDA driver runs a host node: a job
struct for one lookup, ids that cross every shard boundary, a forked child to run one in, and the
reader threads running in this process."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

import numpy as np

from ple_um.lookup import native_library, rowcopy
from ple_um.mapping import PAGE
from ple_um.residency import mincore


def open_library(path: str, defines: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str | None]:
    """The row copy at ``path`` (a test's own build: the sanitized one, the publish-first cache),
    once its interface is checked as the package checks its own, built with the ``-D`` flags
    ``defines``; else None and why not."""
    return native_library.open_library(path, rowcopy._declare, defines=defines)


def make_job(
    tables, ids, dsts, counts, *, threads=1, inline_rows=2048, touch=False, live=None
) -> rowcopy.LookupStruct:
    """A job struct for one lookup of ``ids`` (its busy flag up, as a caller queues it); ``live``:
    a touch's word (a one-int32 array), read when the job runs."""
    job = rowcopy.LookupStruct()
    job.tables[0] = tables[0].address
    job.tables[1] = tables[1].address if len(tables) > 1 else None
    for k, dst in enumerate(dsts):
        job.dst[k] = dst.data_ptr()
    job.ids, job.n = ids.data_ptr(), ids.numel()
    job.counts = counts.address
    job.id_kind = rowcopy.ID_KINDS[ids.dtype]
    job.touch, job.threads, job.inline_rows, job.busy = int(touch), threads, inline_rows, 1
    job.live = live.ctypes.data if live is not None else None
    return job


def rows_in_memory(mapping, ids) -> list[bool]:
    """Per id of ``ids`` (global, owned by ``mapping``, a MappedShards of one file): whether the first
    and the last page of its row are in the page cache (mincore)."""
    (region,) = mapping.regions
    present = mincore(region.addr, region.length, region.path)
    layout, inside = mapping.layout, []
    for i in ids.tolist():
        shard, local = divmod(i, layout.rows_per_shard)
        at = mapping.shard_base(shard) - region.addr + local * layout.row_bytes
        inside.append(bool(present[at // PAGE] and present[(at + layout.row_bytes - 1) // PAGE]))
    return inside


def boundary_ids(layout, rng, n: int, owned) -> np.ndarray:
    """Random ids with every shard boundary, ids outside the table and outside ``owned``, shuffled."""
    S, N = layout.rows_per_shard, layout.num_rows
    extra = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)] + [-5, -1, N, N + 3, 1 << 40]
    extra += [owned[0] - 1, owned[0], owned[1] - 1, owned[1]]
    ids = np.concatenate([extra, rng.integers(-10, N + 10, max(0, n - len(extra)))])
    return rng.permutation(ids).astype(np.int64)


def in_forked_child(fn) -> int:
    """Run fn() in a forked child (killed after 20 s, so a hang fails the test); its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)
            code = 0 if fn() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


def reader_threads() -> int:
    """This process's reader threads (reader.c names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("ple-um-reader")
