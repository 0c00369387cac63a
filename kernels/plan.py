"""Plan of a CPU bulk gather, made on the device: the ids grouped by the row space (mapped file)
that holds them, with each id's row number in that space, so that the host reads each file's rows
with one indexing call and the ids never leave the device.

Two launches and no sort. The first counts the ids of each bin (bin 0: ids not owned, which are
not read; bin 1 + s: row space s) and counts the lookup in the table's counters, as the gather
kernel does. The second gives every id a place in its bin's run (the bins' exclusive prefix sum
plus an atomic cursor per bin) and writes its row number and its position in the batch there.
Within a bin the order is whatever the atomics give; every id still gets exactly one place, so
the rows put back by position are the same whatever the order.

Where the C row copy reads rows by id (each id's file and row worked out on the host, in batch
order), no plan is needed: ``count_lookup`` only counts the lookup on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple_um.kernels.gather import _locate

# Ids per program of the counting pass; the placing pass keeps its [rows, bins] tile near this.
COUNT_ROWS = 1024
PLACE_TILE = 4096


@triton.jit
def _bin_of(space_ptr, owned, shard):
    """Bin of each id: 0 when not owned, else 1 + the row space of its shard."""
    space = tl.load(space_ptr + shard, mask=owned, other=-1)
    return tl.where(owned, space + 1, 0)


@triton.jit
def _count_kernel(
    ids_ptr,
    counters_ptr,  # int64 [2]: the table's counters (rows looked up, ids outside the table)
    space_ptr,  # int64 [parts]: row space of each shard (-1: not owned)
    bins_ptr,  # int64 [BINS]: ids per bin, zeroed by the caller
    n,
    row_start,
    row_end,
    num_rows,
    rows_per_shard,
    ROWS: tl.constexpr,
):
    rows, in_batch, owned, shard, local = _locate(
        ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS
    )
    tl.atomic_add(bins_ptr + _bin_of(space_ptr, owned, shard), 1, mask=in_batch)


@triton.jit
def _place_kernel(
    ids_ptr,
    scratch_ptr,  # int64 [2]: counters of this second pass over the ids, thrown away
    space_ptr,
    row0_ptr,  # int64 [parts]: row, in its space, of each shard's local row 0
    bins_ptr,  # int64 [BINS]: ids per bin, from the counting pass
    cursor_ptr,  # int64 [BINS]: ids placed so far per bin, zeroed by the caller
    plan_ptr,  # int64 [BINS + n]: the bins' counts, then the row numbers grouped by bin
    order_ptr,  # int64 [n]: position in the batch of each placed id
    n,
    row_start,
    row_end,
    num_rows,
    rows_per_shard,
    ROWS: tl.constexpr,
    BINS: tl.constexpr,
):
    rows, in_batch, owned, shard, local = _locate(
        ids_ptr, scratch_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS
    )
    b = _bin_of(space_ptr, owned, shard)
    row = tl.load(row0_ptr + shard, mask=owned, other=0) + local
    bins = tl.arange(0, BINS)
    counts = tl.load(bins_ptr + bins)
    starts = tl.cumsum(counts, 0) - counts
    start = tl.sum(tl.where(bins[None, :] == b[:, None], starts[None, :], 0), axis=1)
    pos = start + tl.atomic_add(cursor_ptr + b, 1, mask=in_batch)
    tl.store(plan_ptr + BINS + pos, row, mask=in_batch)
    tl.store(order_ptr + pos, rows, mask=in_batch)
    tl.store(plan_ptr + bins, counts, mask=(bins >= 0) & (tl.program_id(0) == 0))


@triton.jit
def _count_lookup_kernel(
    ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS: tl.constexpr
):
    _locate(ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS)


def count_lookup(
    ids: torch.Tensor,
    counters: torch.Tensor,
    *,
    row_start: int,
    row_end: int,
    num_rows: int,
    rows_per_shard: int,
) -> None:
    """Count a lookup of flat ``ids`` in ``counters`` on the device, as the gather kernel and the
    plan do, for a bulk gather that reads the rows by id on the host (no plan). No host sync."""
    n = ids.numel()
    if n:
        _count_lookup_kernel[(triton.cdiv(n, COUNT_ROWS),)](
            ids, counters, n, row_start, row_end, num_rows, rows_per_shard, ROWS=COUNT_ROWS
        )


def plan_bins(spaces: int) -> int:
    """Bins of a plan over ``spaces`` row spaces: a power of two above ``spaces``."""
    return 1 << spaces.bit_length()


def plan_gather(
    ids: torch.Tensor,
    space_of_shard: torch.Tensor,
    row0_of_shard: torch.Tensor,
    counters: torch.Tensor,
    *,
    bins: int,
    row_start: int,
    row_end: int,
    num_rows: int,
    rows_per_shard: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan, order) of flat ``ids`` on the device: ``plan[:bins]`` the ids per bin,
    ``plan[bins:]`` the row numbers grouped by bin, ``order`` each placed id's position in the
    batch. Counts the lookup in ``counters``. No host sync."""
    n = ids.numel()
    device = ids.device
    plan = torch.empty(bins + n, dtype=torch.int64, device=device)
    order = torch.empty(n, dtype=torch.int64, device=device)
    work = torch.zeros(2 * bins + 2, dtype=torch.int64, device=device)
    counts, cursor, scratch = work[:bins], work[bins : 2 * bins], work[2 * bins :]
    layout = (n, row_start, row_end, num_rows, rows_per_shard)
    _count_kernel[(triton.cdiv(n, COUNT_ROWS),)](
        ids, counters, space_of_shard, counts, *layout, ROWS=COUNT_ROWS
    )
    place_rows = max(16, min(1024, PLACE_TILE // bins))
    _place_kernel[(triton.cdiv(n, place_rows),)](
        ids,
        scratch,
        space_of_shard,
        row0_of_shard,
        counts,
        cursor,
        plan,
        order,
        *layout,
        ROWS=place_rows,
        BINS=bins,
    )
    return plan, order
