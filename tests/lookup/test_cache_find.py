"""``ple_cache_find`` (``native/rowcache.c``): each id's slot in a row cache, or -1, read-only. Driven
through ctypes on a real table's row cache after lookups that fill it and evict from it: every slot
found holds the id's tag and its row's bytes as the files have them, every id not found is in no
slot, and the cache's memory and counters are the same bytes after the find as before it."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from helpers.reference import reference_rows
from helpers.rowcopy_jobs import make_job, open_library

from ple_um.lookup import native_build, rowcopy
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


def test_find_hashes_each_id_once(make_checkpoint, rng, tmp_path):
    """The find asks for each id's set some ids ahead and then looks in it: one hash an id
    (``ple_cache_hash``, counted in a build of this test alone, ``-DPLE_TEST_COUNT_HASHES``), for
    fewer ids than it looks ahead and for more; each slot found holds its id's tag, and no slot
    holds an id not found."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the counting variant with")
    defines = ("-DPLE_TEST_COUNT_HASHES",)
    out = str(tmp_path / "rowcopy-count-hashes.so")
    done = subprocess.run(
        native_build.command(cc, out, werror=True, extra=defines), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counting, why = open_library(out, defines=defines)
    assert counting is not None, why
    counting.ple_test_hashes.restype = ctypes.c_int64
    shipped, why = rowcopy.load(str(tmp_path / "native"))
    assert shipped is not None, why
    layout = make_checkpoint(
        num_rows=3000, row_dim=48, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    with MappedShards(layout) as mapping:
        counts = rowcopy.Counts()
        cache = RowCache(8 * WAYS, layout.row_bytes, counts, policy="lru")
        try:
            rows = rowcopy.Rows(mapping, cache=cache)
            ids = torch.from_numpy(rng.integers(0, layout.num_rows, 500))
            out_rows = torch.empty((500, layout.row_bytes), dtype=torch.uint8)
            job = make_job([rows], ids, [out_rows], counts)
            shipped.ple_lookup_run(ctypes.addressof(job))  # fills the cache
            for n in (0, 1, 5, 16, 17, 700):
                ids = rng.integers(-2, layout.num_rows + 2, n)
                before = counting.ple_test_hashes()
                found, slots = find(counting, cache, ids)
                assert counting.ple_test_hashes() - before == n
                tags = np.frombuffer(bytes(cache._memory), dtype=np.uint32, count=cache.slots)
                held = slots >= 0
                assert found == held.sum() and np.array_equal(tags[slots[held]], ids[held] + 1)
                assert (slots[~held] == -1).all() and not np.isin(ids[~held] + 1, tags).any()
        finally:
            cache.close()
