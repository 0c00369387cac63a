"""NVFP4 tables end to end: the decode kernel under the Triton interpreter (ats and device modes on
the CPU) and the cpu mode's torch decoder, each against the independent NumPy decoder of
tests/helpers/reference.py, bit for bit, on real files; packed rows and block scales against the bytes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.reference import reference_nvfp4, reference_rows
from torch._subclasses.fake_tensor import FakeTensorMode

import ple_um

MODES = ("ats", "device", "cpu")
OUT = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    from ple_um.synthetic import write_checkpoint

    # 1 200 rows of 64 values: 38 400 packed bytes and 4 800 scale bytes, so every byte value of
    # both occurs; 7 shards, the last shorter.
    return write_checkpoint(
        tmp_path_factory.mktemp("nvfp4"), num_rows=1200, row_dim=64, dtype="nvfp4", shards=7
    )


def _ids(layout, rng, n, rows=None):
    S = layout.rows_per_shard
    edges = [v for i in range(layout.parts) for v in (i * S - 1, i * S, i * S + 1)]
    extra = [-7, -1, layout.num_rows, layout.num_rows + 3]
    if rows is not None:
        extra += [rows[0] - 1, rows[0], rows[1] - 1, rows[1]]
    ids = np.concatenate([edges, extra, rng.integers(0, layout.num_rows, n)]).astype(np.int64)
    rng.shuffle(ids)
    return ids


def test_every_byte_value_is_in_the_table(nvfp4):
    packed = reference_rows(nvfp4, np.arange(nvfp4.num_rows))
    scales = reference_rows(nvfp4.scale_layout(), np.arange(nvfp4.num_rows))
    assert np.unique(packed).size == 256
    assert np.unique(scales).size >= 250  # every finite E4M3 code (the writer leaves out NaN)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [None, (150, 1003)])
def test_decoded_rows_equal_the_numpy_decoder(nvfp4, mode, rows, rng):
    ids = _ids(nvfp4, rng, 300, rows)
    with ple_um.open_table(nvfp4.directory, mode=mode, rows=rows, device="cpu") as table:
        assert table.mode == mode and table.dtype == torch.uint8 and table.row_dim == 64
        for out_dtype in OUT:
            got = table.lookup(torch.from_numpy(ids), out_dtype=out_dtype)
            want = reference_nvfp4(nvfp4, ids, rows=rows, out_dtype=out_dtype)
            assert got.shape == (ids.size, 64) and got.dtype == out_dtype
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (mode, rows, out_dtype)
        oob = int(((ids < 0) | (ids >= nvfp4.num_rows)).sum())
        stats = table.stats()
        assert stats["rows"] == 3 * ids.size and stats["out_of_range"] == 3 * oob


@pytest.mark.parametrize("mode", MODES)
def test_out_buffer_2d_int32_ids_and_poison(nvfp4, mode, rng):
    ids = rng.integers(-3, nvfp4.num_rows + 3, size=(5, 40)).astype(np.int32)
    with ple_um.open_table(nvfp4.directory, mode=mode, device="cpu") as table:
        out = torch.full((5, 40, 64), float("nan"), dtype=torch.bfloat16)
        assert table.lookup(torch.from_numpy(ids), out=out) is out
        want = reference_nvfp4(nvfp4, ids, out_dtype=torch.bfloat16)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("mode", MODES)
def test_lookup_packed_gives_the_file_bytes(nvfp4, mode, rng):
    rows = (100, 1100)
    ids = _ids(nvfp4, rng, 200, rows)
    with ple_um.open_table(nvfp4.directory, mode=mode, rows=rows, device="cpu") as table:
        packed, scales = table.lookup_packed(torch.from_numpy(ids))
        assert packed.dtype == torch.uint8 and packed.shape == (ids.size, 32)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (ids.size, 4)
        assert np.array_equal(packed.numpy(), reference_rows(nvfp4, ids, rows=rows))
        assert np.array_equal(
            scales.view(torch.uint8).numpy(), reference_rows(nvfp4.scale_layout(), ids, rows=rows)
        )


def test_lookup_packed_of_no_ids_and_of_a_list(nvfp4):
    with ple_um.open_table(nvfp4.directory, mode="cpu", device="cpu") as table:
        packed, scales = table.lookup_packed(torch.empty((0, 3), dtype=torch.int64))
        assert packed.shape == (0, 3, 32) and scales.shape == (0, 3, 4)
        with pytest.raises(TypeError, match="torch.Tensor, not list"):
            table.lookup_packed([1])


@pytest.mark.parametrize("mode", MODES)
def test_strict_lookup_packed_raises_for_ids_outside_the_table(nvfp4, mode):
    """A strict table's lookup_packed raises lookup's IndexError (nothing read or counted); strict=False
    on the call gives zeros for those ids, counted, and the file's bytes for the others."""
    ids = torch.tensor([0, 5, nvfp4.num_rows, -1, nvfp4.num_rows - 1])
    with ple_um.open_table(nvfp4.directory, mode=mode, device="cpu", strict=True) as table:
        for bad in (ids, ids.to(torch.int32).view(5, 1)):
            with pytest.raises(IndexError, match=rf"2 ids outside \[0, {nvfp4.num_rows}\)"):
                table.lookup_packed(bad)
        stats = table.stats()
        assert stats["rows"] == 0 and stats["out_of_range"] == 0
        packed, scales = table.lookup_packed(ids, strict=False)
        assert np.array_equal(packed.numpy(), reference_rows(nvfp4, ids.numpy()))
        assert np.array_equal(
            scales.view(torch.uint8).numpy(), reference_rows(nvfp4.scale_layout(), ids.numpy())
        )
        assert table.stats()["out_of_range"] == 2
    with ple_um.open_table(nvfp4.directory, mode="cpu", device="cpu") as table:
        with pytest.raises(IndexError, match="1 ids outside"):
            table.lookup_packed(torch.tensor([3, nvfp4.num_rows]), strict=True)


def test_raw_lookup_of_an_nvfp4_table_is_refused(nvfp4):
    with ple_um.open_table(nvfp4.directory, mode="cpu", device="cpu") as table:
        with pytest.raises(TypeError, match="NVFP4"):
            table.lookup(torch.arange(4))
        with pytest.raises(TypeError, match="NVFP4"):
            table.lookup(torch.arange(4), out_dtype=torch.uint8)


def test_lookup_packed_is_only_for_nvfp4(make_checkpoint):
    layout = make_checkpoint()
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        with pytest.raises(TypeError, match="NVFP4"):
            table.lookup_packed(torch.arange(3))


def test_ids_on_another_device_are_refused_alike_during_a_capture(nvfp4, monkeypatch):
    """``lookup`` and ``lookup_packed`` copy ids from another device to the table's, but not while a
    CUDA graph is captured (the copy cannot be captured): both refuse them then with the one
    ValueError naming both devices. The capture is injected (``torch.cuda.is_current_stream_capturing``
    set once the table is open), and the ids on a CUDA device are a FakeTensor: torch's tensor of a
    device, without its memory; of no ids, so that a lookup that took them would read nothing."""
    with FakeTensorMode():
        ids = torch.empty((0, 3), dtype=torch.int64, device="cuda")
    refused = re.escape("ids are on cuda:0 but the table is on cpu (cannot copy during capture)")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with ple_um.open_table(nvfp4.directory, mode="cpu", device="cpu") as table:
        capturing[0] = True
        with pytest.raises(ValueError, match=refused):
            table.lookup(ids, out_dtype=torch.float32)
        with pytest.raises(ValueError, match=refused):
            table.lookup_packed(ids)
        capturing[0] = False
        assert table.stats()["lookups"] == 0


def test_bulk_sized_cpu_lookup(nvfp4, rng, monkeypatch):
    """20 000 ids: a big lookup of the cpu mode's host path feeds the decoder."""
    monkeypatch.setenv("PLE_UM_CPU_THREADS", "2")
    ids = rng.integers(-5, nvfp4.num_rows + 5, 20000)
    with ple_um.open_table(nvfp4.directory, mode="cpu", device="cpu") as table:
        got = table.lookup(torch.from_numpy(ids), out_dtype=torch.float32)
    assert torch.equal(got, reference_nvfp4(nvfp4, ids, out_dtype=torch.float32))


ROW_0_DIFFERS = r"self-test: 1 of \d+ sample rows differ from the file \(first: row 0\)"


def test_self_test_covers_both_tensors(nvfp4):
    # The device mode's copies are tensors the test can change: a wrong byte in either the packed
    # rows or the block scales of row 0 (which every self-test samples) must be reported.
    with ple_um.open_table(nvfp4.directory, mode="device", device="cpu") as table:
        assert table.stats()["rows"] == 0  # the self-test at open is not counted
        assert table.self_test(64) is None
        assert table.stats()["mapped_bytes"] > table.mapping.mapped_bytes  # the block scales too
        for copy in table.access.device_copies:  # the rows, then the block scales
            copy[0] ^= 0x10
            why = table.self_test(64)
            assert why is not None and re.fullmatch(ROW_0_DIFFERS, why), why
            copy[0] ^= 0x10
            assert table.self_test(64) is None


def test_operating_counts_the_block_scales(nvfp4):
    from ple_um import operating

    described = operating.describe_layout(nvfp4)
    assert sum(f["bytes"] for f in described["files"]) == nvfp4.nbytes
    assert operating.residency(nvfp4.directory)["total"]["bytes"] == nvfp4.nbytes
