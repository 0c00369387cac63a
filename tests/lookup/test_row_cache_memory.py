"""A row cache whose memory cannot be faulted in: MADV_POPULATE_WRITE failing for lack of memory is
a MemoryError saying so (never a write to every page, which would bring the OOM killer instead);
failing because the kernel lacks the advice (EINVAL) falls back to writing each page. The failure is
injected into the C library's madvise (``helpers.populate_fails``)."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers.populate_fails import PopulateFails
from helpers.reference import fds_of, maps_of, reference_rows

import ple_um
from ple_um.errors import ModeUnavailableError
from ple_um.lookup import rowcopy
from ple_um.lookup.host import row_cache
from ple_um.lookup.host.row_cache import RowCache, slots_for
from ple_um.mapping import _libc


@pytest.mark.parametrize("code", [errno.ENOMEM, errno.EFAULT, errno.EAGAIN])
def test_a_row_cache_memory_ran_out_for_is_a_memory_error(monkeypatch, code):
    monkeypatch.setattr(row_cache, "_libc", PopulateFails(code))
    name = errno.errorcode[code]
    with pytest.raises(MemoryError, match=rf"could not be faulted in .*{name}: .*PLE_UM_ROW_CACHE"):
        RowCache(slots_for(1 << 20, 64), 64, rowcopy.Counts())


def test_a_kernel_without_the_advice_gets_each_page_written(monkeypatch):
    monkeypatch.setattr(row_cache, "_libc", PopulateFails(errno.EINVAL))
    cache = RowCache(slots_for(1 << 20, 64), 64, rowcopy.Counts())
    try:
        assert cache.resident_bytes() == cache.nbytes  # every page faulted in, by a write
    finally:
        cache.close()


def test_an_open_whose_row_cache_memory_ran_out_for_raises_and_holds_nothing(
    make_checkpoint, monkeypatch
):
    """A forced mode whose row cache memory ran out for is unavailable, saying why (the MemoryError;
    ``auto`` tries the next mode as for any mode that fails), its files released; without the
    failure the same open serves every row exactly."""
    layout = make_checkpoint(num_rows=2000, row_dim=64, dtype="fp8", shards=4, files=2)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1MiB")
    monkeypatch.setattr(row_cache, "_libc", PopulateFails(errno.ENOMEM))
    with pytest.raises(ModeUnavailableError, match="'cpu' is not available: MemoryError: .*ENOMEM"):
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    assert not fds_of(layout.files) and not maps_of(layout.files)
    monkeypatch.setattr(row_cache, "_libc", _libc)
    ids = torch.arange(-3, layout.num_rows + 3)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert table.stats()["row_cache"]["bytes"] > 0
        got = table.lookup(ids)
        assert torch.equal(got.view(torch.uint8), torch.from_numpy(reference_rows(layout, ids.numpy())))
