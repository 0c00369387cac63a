"""What the open path checks and measures once a mode is built, through the table's own lookups.

- ``self_test``: sample rows (both ends of every owned shard, then random ones) gathered through
  the mode's lookup path must equal the bytes read from the files; a mode that fails it is rejected.
- ``calibrate_bulk``: in the ``ats`` and ``registered`` modes, the batch size from which the host
  path is faster than the kernel, measured on random owned ids (``PLE_UM_BULK_ROWS=auto``).
- ``read_file_rows``: rows read with ``pread`` through descriptors of its own, the reference both
  the self-test and the first-read child compare with (``rows_differ``).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from ple_um.checkpoint import ShardLayout
from ple_um.errors import CheckpointError
from ple_um.mapping import MappedShards

# Batch sizes the calibration times, largest first: it stops at the first the host path loses.
CALIBRATION_SIZES = (262144, 131072, 65536, 32768, 16384, 4096)
CALIBRATION_REPEATS = 3  # timed calls of each path at each size, after one warm-up


def read_file_rows(layout: ShardLayout, ids, window: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 [len(ids), row_bytes]: each id's row read with pread from its file (zeros for ids
    outside ``window``, when given). A short read is a CheckpointError naming the file."""
    ids = [int(i) for i in ids]
    out = np.zeros((len(ids), layout.row_bytes), dtype=np.uint8)
    S, rb = layout.rows_per_shard, layout.row_bytes
    fds: dict[str, int] = {}
    try:
        for k, i in enumerate(ids):
            if window is not None and not window[0] <= i < window[1]:
                continue
            spec = layout.shards[i // S]
            fd = fds.get(spec.path)
            if fd is None:
                fd = fds[spec.path] = os.open(spec.path, os.O_RDONLY | os.O_NONBLOCK)
            data = os.pread(fd, rb, spec.offset + (i - i // S * S) * rb)
            if len(data) != rb:
                raise CheckpointError(f"short read of row {i}", path=spec.path, tensor=spec.tensor)
            out[k] = np.frombuffer(data, dtype=np.uint8)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def sample_ids(mapping: MappedShards, count: int) -> np.ndarray:
    """Owned ids for the self-test: both ends of every owned shard, then random ones (sorted,
    unique; the same ones at every open of the same rows)."""
    S = mapping.layout.rows_per_shard
    ends = []
    for index, owned in sorted(mapping.owned.items()):
        ends += [index * S + owned.lo, index * S + owned.hi - 1]
    rng = np.random.default_rng(0)
    rand = rng.integers(mapping.row_start, mapping.row_end, size=max(0, count - len(ends)))
    return np.unique(np.concatenate([np.array(ends[:count], dtype=np.int64), rand]))


def self_test(paths, mapping: MappedShards, count: int) -> str | None:
    """Gather ``count`` sample rows of ``mapping`` through the lookup ``paths`` (``LookupPaths.route``)
    and compare them with the files; None when equal, else what differed. A table with block scales
    compares them too. The rows read count like a lookup's (the open zeroes the counters after its
    checks)."""
    if count <= 0 or not mapping.owned:
        return None  # self-test disabled (PLE_UM_SELF_TEST_ROWS=0) or nothing owned
    layout = mapping.layout
    ids_np = sample_ids(mapping, count)
    ids = torch.from_numpy(ids_np).to(paths.device)
    if not layout.has_block_scales:
        raw = torch.empty((ids_np.size, layout.row_dim), dtype=layout.dtype, device=paths.device)
        got = paths.route(ids, raw).view(torch.uint8).reshape(ids_np.size, -1)
    else:  # NVFP4, MXFP8: the packed rows and the block scales, side by side
        got = torch.cat(paths.packed(ids), dim=1)
    why = rows_differ(layout, ids_np, got.cpu().numpy())
    return None if why is None else f"self-test: {why}"


def rows_differ(
    layout: ShardLayout, ids: np.ndarray, got: np.ndarray, window=None, how: str = ""
) -> str | None:
    """None when ``got`` (uint8, a row a id: its bytes, then its block scales' where the table has
    them) holds what the files do (zeros for ids outside ``window``, when given), else how many of
    the sample rows (read ``how``) differ and the first that does."""
    parts = [layout, layout.scale_layout()] if layout.has_block_scales else [layout]
    expect = np.concatenate([read_file_rows(part, ids, window) for part in parts], axis=1)
    if np.array_equal(got, expect):
        return None
    bad = np.flatnonzero((got != expect).any(axis=1))
    return f"{bad.size} of {ids.size} sample rows{how} differ from the file (first: row {int(ids[bad[0]])})"


def calibrate_bulk(paths, rows: tuple[int, int]) -> dict:
    """Time the kernel and the host path of ``paths`` on random ids of the owned ``rows``, largest
    batch first, and set ``paths.bulk_rows`` to the smallest size from which the host path wins at
    every size measured (None when it does not win at the largest). Returns the medians, in seconds."""
    device, layout = paths.device, paths.layout
    rng = np.random.default_rng(1)
    start, end = rows
    paths.bulk_rows = None
    measured = {}

    def batches(n: int, count: int) -> list[torch.Tensor]:
        return [torch.from_numpy(rng.integers(start, end, size=n)).to(device) for _ in range(count)]

    dtype = torch.bfloat16 if layout.has_block_scales else layout.dtype  # NVFP4, MXFP8: decoded rows
    out = torch.empty((CALIBRATION_SIZES[0], layout.row_dim), dtype=dtype, device=device)
    for batch in batches(CALIBRATION_SIZES[0], 2):  # buffers allocated and the pool started before timing
        paths.host.gather(batch, out[: batch.numel()])
    for n in CALIBRATION_SIZES:
        times = {"gpu": [], "bulk": []}
        for name, path in (("gpu", paths.gpu), ("bulk", paths.host)):
            for k, batch in enumerate(batches(n, CALIBRATION_REPEATS + 1)):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                path.gather(batch, out[:n])
                torch.cuda.synchronize(device)
                if k:  # the first call of each is a warm-up
                    times[name].append(time.perf_counter() - t0)
        measured[n] = {name: float(np.median(t)) for name, t in times.items()}
        if measured[n]["bulk"] >= measured[n]["gpu"]:
            break
        paths.bulk_rows = n
    paths.reset_counts()
    return measured
