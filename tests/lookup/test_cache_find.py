"""``ple_cache_find`` (``native/rowcache.c``): each id's slot in a row cache, or -1, read-only. Driven
through ctypes on a real table's row cache after lookups that fill it and evict from it: every slot
found holds the id's tag and its row's bytes as the files have them, every id not found is in no
slot, and the cache's memory and counters are the same bytes after the find as before it."""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from helpers.reference import reference_rows
from helpers.rowcopy_jobs import make_job

from ple_um.lookup import rowcopy
from ple_um.lookup.host.row_cache import WAYS, RowCache
from ple_um.mapping import MappedShards


def find(lib, cache: RowCache, ids: np.ndarray) -> tuple[int, np.ndarray]:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    slots = np.full(ids.size, -7, dtype=np.int64)  # poisoned: every entry must be written
    found = lib.ple_cache_find(cache.address, ids.ctypes.data, ids.size, slots.ctypes.data)
    return found, slots


def test_find_gives_each_held_rows_slot_and_changes_nothing(make_checkpoint, rng, tmp_path):
    lib, why = rowcopy.load(str(tmp_path / "native"))
    assert lib is not None, why
    layout = make_checkpoint(
        num_rows=3000, row_dim=48, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    owned = (100, 2900)
    rb = layout.row_bytes
    with MappedShards(layout, owned) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(8 * WAYS, rb, counts, policy="lru")  # 128 slots: lookups of 700 ids evict
        try:
            rows = rowcopy.Rows(mapping, cache=cache)
            for _ in range(4):
                ids = torch.from_numpy(rng.integers(0, layout.num_rows, 700))
                out = torch.empty((700, rb), dtype=torch.uint8)  # alive while the job runs
                job = make_job([rows], ids, [out], counts)
                lib.ple_lookup_run(ctypes.addressof(job))
            assert counts.read()["cache_evictions"] > 0
            memory, counted = bytes(cache._memory), counts.read()
            # Every id of the table, ids outside it and outside what a tag holds, in random order.
            ids = rng.permutation(np.concatenate([np.arange(-3, layout.num_rows + 3), [1 << 40, -(1 << 40)]]))
            found, slots = find(lib, cache, ids)
            assert bytes(cache._memory) == memory and counts.read() == counted  # read-only
            tags = np.frombuffer(memory, dtype=np.uint32, count=cache.slots)  # the first array
            held = slots >= 0
            # Each slot that holds a row found once, by its own id; every other id held nowhere.
            assert found == held.sum() == (tags != 0).sum() == cache.slots
            assert np.array_equal(tags[slots[held]], ids[held] + 1) and (slots[~held] == -1).all()
            assert ((ids[held] >= owned[0]) & (ids[held] < owned[1])).all()
            data = np.frombuffer(
                memory, dtype=np.uint8, count=cache.slots * rb, offset=cache.struct.data - cache._base
            )
            got = data.reshape(cache.slots, rb)[slots[held]]
            assert np.array_equal(got, reference_rows(layout, ids[held], owned))
        finally:
            cache.close()
