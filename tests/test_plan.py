"""The bulk path's plan made by kernels/plan.py (under the Triton interpreter, on CPU tensors): every
id placed exactly once, in its file's run, with its row number in that file; and the whole
bulk gather (CpuGather.gather_bulk over a real mapping: by id, planned, index_select) equal to
the reference rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ple_um.kernels import plan_bins, plan_gather
from ple_um.lookup.cpu_gather import CpuGather
from ple_um.mapping import MappedShards


def mixed_ids(layout, rng, n: int, rows=None) -> np.ndarray:
    """Random ids with every shard boundary, ids outside the table and (with rows) outside the
    owned range, shuffled."""
    S, N = layout.rows_per_shard, layout.num_rows
    extra = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)] + [-5, -1, N, N + 3]
    if rows is not None:
        extra += [rows[0] - 1, rows[0], rows[1] - 1, rows[1]]
    ids = np.concatenate([extra, rng.integers(-10, N + 10, max(0, n - len(extra)))])
    return rng.permutation(ids)


@pytest.mark.parametrize("rows", [None, "partial"])
@pytest.mark.parametrize("files", [1, 3])
def test_plan_places_every_id_once(make_checkpoint, rng, rows, files):
    layout = make_checkpoint(
        num_rows=700, row_dim=8, dtype="fp8", shards=9, files=files, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    owned_rows = (S + 3, 7 * S - 2) if rows == "partial" else (0, layout.num_rows)
    with MappedShards(layout, owned_rows) as mapping:
        gather = CpuGather(mapping, torch.device("cpu"), threads=2, chunk=64, slots=1)
        try:
            ids_np = mixed_ids(layout, rng, 3000, owned_rows if rows else None)
            ids = torch.from_numpy(ids_np)
            counters = torch.zeros(2, dtype=torch.int64)
            space_of_shard, row0 = gather._maps(ids.device)
            bins = plan_bins(len(gather.spaces))
            plan, order = plan_gather(
                ids,
                space_of_shard,
                row0,
                counters,
                bins=bins,
                row_start=owned_rows[0],
                row_end=owned_rows[1],
                num_rows=layout.num_rows,
                rows_per_shard=S,
            )
        finally:
            gather.close()
        n = ids_np.size
        in_table = (ids_np >= 0) & (ids_np < layout.num_rows)
        owned = in_table & (ids_np >= owned_rows[0]) & (ids_np < owned_rows[1])
        assert counters.tolist() == [n, int((~in_table).sum())]
        counts = plan[:bins].numpy()
        assert counts.sum() == n and counts[0] == (~owned).sum()
        order_np = order.numpy()
        assert np.array_equal(np.sort(order_np), np.arange(n))  # a permutation: each id once
        # Each bin's run holds exactly its file's ids, each with its row number in that file.
        shard = np.where(owned, ids_np // S, 0)
        space = np.where(owned, gather.space_of_shard[shard], -1)
        want_row = gather.row0_of_shard[shard] + ids_np - shard * S
        got_rows = plan[bins:].numpy()
        start = 0
        for b, count in enumerate(counts):
            placed = order_np[start : start + count]
            assert np.all(space[placed] == b - 1)
            if b:
                assert np.array_equal(got_rows[start : start + count], want_row[placed])
            start += count


@pytest.mark.parametrize("reads", ["C by id", "C planned", "index_select"])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_gather_bulk_equals_reference(make_checkpoint, rng, check_rows, poison, dtype, reads):
    layout = make_checkpoint(
        num_rows=5000, row_dim=10, dtype="fp8", shards=12, files=4, seed=int(rng.integers(1 << 30))
    )
    S = layout.rows_per_shard
    for rows in [(0, layout.num_rows), (2 * S - 1, 9 * S + 7), (0, 0)]:
        with MappedShards(layout, rows) as mapping:
            gather = CpuGather(
                mapping, torch.device("cpu"), threads=2, chunk=64, slots=1, row_copy=reads != "index_select"
            )
            gather.read_by_id = reads == "C by id"
            try:
                assert (gather.rowcopy is not None) == (reads != "index_select"), gather.row_reads
                assert gather._by_id() == (reads == "C by id")
                ids = torch.from_numpy(mixed_ids(layout, rng, 4000, rows).astype(dtype))
                out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=layout.dtype))
                counters = torch.zeros(2, dtype=torch.int64)
                assert gather.gather_bulk(ids, out.view(torch.uint8), counters) is not None
                check_rows(out, layout, ids, rows=rows)
                bad = int(((ids < 0) | (ids >= layout.num_rows)).sum())
                assert counters.tolist() == [ids.numel(), bad]
            finally:
                gather.close()


def test_chunks_cover_each_segment_and_cut_the_tail():
    from ple_um.lookup.cpu_gather import _chunks, _segments

    segments = _segments([3, 0, 10, 0, 25, 0, 0, 0])  # 3 ids not owned, then spaces 1 and 3
    assert segments == [(1, 0, 10), (3, 10, 35)]
    assert _chunks(segments, step=8, tail=4) == [
        (1, 0, 8),
        (1, 8, 10),
        (3, 10, 18),
        (3, 18, 26),
        (3, 26, 34),
        (3, 34, 35),
    ]
    assert _chunks(segments, step=16, tail=4) == [(1, 0, 10), (3, 10, 26), (3, 26, 31), (3, 31, 35)]
    assert _chunks([], 8, 4) == []
    assert _chunks([(0, 0, 3)], 8, 4) == [(0, 0, 3)]
