"""Reliability: bad ids give their documented result in every mode that runs here.

The modes: cpu (the host gather: the C row copy where it builds, called directly on the CPU
device; lookups of a few ids and of 20 000, those also on the synchronous path), ats and device
(the kernel under the Triton interpreter), ats serving a table over its memory (its host path, with
a row cache) and registered (the kernel reading through injected
"device pointers": see tests/reliability/test_reliability.py). The documented results (README, DESIGN.md):

- ids outside ``[0, num_rows)``: zero rows, counted in ``stats()["out_of_range"]``; IndexError
  when strict (nothing counted then);
- ids inside the table but outside the owned range ``rows=``: zero rows, not counted;
- a tensor of a non-integer dtype, or no tensor: TypeError, nothing counted;
- non-contiguous ids: copied (the caller's tensor is left as it was);
- empty ids: an empty result of shape ``ids.shape + (row_dim,)``;
- ids on another device: copied to the table's (outside a CUDA graph capture).

tests/test_table.py and tests/lookup/test_host_paths.py already cover ids a little outside the table,
every id dtype, float/bool/uint16 ids and strict lookups; tests/kernels/test_gather.py the kernel
with int32/int64 extremes; tests/gpu/test_gpu_memcheck.py runs the same cases on a GPU under
compute-sanitizer memcheck.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ple_um
from ple_um.access.capabilities import triton_interpreter

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

# ats-spilled: the ats mode serving a table over its memory (PLE_UM_FIT=spills): every lookup on its
# host path, with a row cache, as on a GX10 whose table does not fit.
MODES = ["cpu", "ats", "ats-spilled", "device", "registered"]
ID_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
N = 120  # rows of the table
OWNED = (20, 61)  # an owned range that starts and ends inside shards (S = 24)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """FP8, 120 rows of 10 in 5 shards of 24 over 4 files (the last one's data 4 mod 8)."""
    from ple_um.synthetic import write_checkpoint

    seed = int(np.random.SeedSequence().entropy % (1 << 30))
    print(f"test_reliability_ids layout: seed {seed}")
    path = tmp_path_factory.mktemp("ids") / "ckpt"
    return write_checkpoint(path, num_rows=N, row_dim=10, dtype="fp8", shards=5, seed=seed)


@pytest.fixture
def open_in(machine, layout, monkeypatch):
    """``open_in(mode, **kw)``: the table in ``mode`` on the CPU; registered through the injected H200;
    ats-spilled: ats, its decode-sized lookups on the host path."""

    def open_(mode: str, **kwargs):
        if mode == "registered":
            machine()
        if mode == "ats-spilled":
            monkeypatch.setenv("PLE_UM_FIT", "spills")
            table = ple_um.open_table(layout.directory, mode="ats", device="cpu", **kwargs)
            assert table.stats()["serving"]["path"] == "host" and table.stats()["row_cache"] is not None
            return table
        return ple_um.open_table(layout.directory, mode=mode, device="cpu", **kwargs)

    return open_


def outside(ids: torch.Tensor) -> int:
    wide = ids.to(torch.int64)
    return int(((wide < 0) | (wide >= N)).sum())


def bad_ids(dtype: torch.dtype, rng) -> torch.Tensor:
    """Every kind of id ``dtype`` can hold: its extremes, -1, the table's and the owned range's
    edges, every shard boundary, and random ones inside and outside; shuffled."""
    info = torch.iinfo(dtype)
    values = [info.min, info.min + 1, info.max, info.max - 1, -1, 0, N - 1, N, N + 7, 255, 256]
    values += [OWNED[0] - 1, OWNED[0], OWNED[1] - 1, OWNED[1]]
    values += [k * 24 + d for k in range(6) for d in (-1, 0, 1)]
    if dtype == torch.int64:
        values += [-(2**40), 2**62, -(2**62), 2**40]
    if dtype in (torch.int64, torch.int32):
        values += [-(2**31), 2**31 - 1, 2**20]
    values += rng.integers(-5, N + 5, 40).tolist()
    values = [v for v in values if info.min <= v <= info.max]
    return torch.tensor(rng.permutation(np.array(values, dtype=np.int64)).tolist(), dtype=dtype)


@pytest.mark.parametrize("rows", [None, OWNED], ids=["all", "owned"])
@pytest.mark.parametrize("mode", MODES)
def test_ids_outside_the_table_and_the_owned_range(open_in, layout, mode, rows, rng, check_rows, poison):
    with open_in(mode, rows=rows) as table:
        counted_rows = counted_bad = 0
        for dtype in ID_DTYPES:
            ids = bad_ids(dtype, rng)
            wide = ids.to(torch.int64)
            for out_dtype in (layout.dtype, torch.bfloat16):
                out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype))
                assert table.lookup(ids, out=out) is out
                check_rows(out, layout, wide, rows=rows)
                check_rows(table.lookup(ids.reshape(1, -1), out_dtype=out_dtype)[0], layout, wide, rows=rows)
                counted_rows += 2 * ids.numel()
                counted_bad += 2 * outside(ids)
            stats = table.stats()
            assert (stats["rows"], stats["out_of_range"]) == (counted_rows, counted_bad), dtype
            # Strict: IndexError naming the count, raised before anything is read or counted.
            if outside(ids):
                with pytest.raises(IndexError, match=rf"{outside(ids)} ids outside \[0, {N}\)"):
                    table.lookup(ids, strict=True)
                stats = table.stats()
                assert (stats["rows"], stats["out_of_range"]) == (counted_rows, counted_bad)
        # Ids only outside the owned range are served as zeros and not counted as bad.
        if rows is not None:
            ids = torch.tensor([0, OWNED[0] - 1, OWNED[1], N - 1])
            out = table.lookup(ids, out_dtype=torch.float32, strict=True)
            assert not out.any()
            assert table.stats()["out_of_range"] == counted_bad


@pytest.mark.parametrize("rowcopy", ["1", "0"])
@pytest.mark.parametrize("rows", [None, OWNED], ids=["all", "owned"])
def test_bad_ids_on_the_cpu_bulk_path(open_in, layout, rows, rng, check_rows, poison, monkeypatch, rowcopy):
    # 20 000 ids: the C copy's pool, or the synchronous path's chunks (PLE_UM_ROWCOPY=0).
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    with open_in("cpu", rows=rows) as table:
        for dtype in (torch.int64, torch.int32, torch.uint8):
            parts = [bad_ids(dtype, rng) for _ in range(300)]
            ids = torch.cat(parts)[:20000]
            assert ids.numel() == 20000
            before = table.stats()
            for out_dtype in (layout.dtype, torch.float16):
                out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype))
                table.lookup(ids, out=out)
                check_rows(out, layout, ids.to(torch.int64), rows=rows)
            after = table.stats()
            assert after["rows"] - before["rows"] == 2 * ids.numel()
            assert after["out_of_range"] - before["out_of_range"] == 2 * outside(ids)
        # Only bad ids, and only ids outside the owned range: all zeros.
        for ids in (torch.full((20000,), -1), torch.full((20000,), N), torch.full((20000,), 2**62)):
            assert not table.lookup(ids, out_dtype=torch.float32).any()


@pytest.mark.parametrize("mode", MODES)
def test_non_integer_ids_are_type_errors(open_in, mode):
    # float, bool and uint16 ids are in test_table.py::test_non_integer_ids; here the rest.
    with open_in(mode) as table:
        for dtype in (
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.float8_e4m3fn,
            torch.complex64,
            torch.uint32,
            torch.uint64,
        ):
            ids = torch.zeros(3, dtype=dtype)
            with pytest.raises(TypeError, match="integer tensor"):
                table.lookup(ids)
            with pytest.raises(TypeError, match="integer tensor"):
                table.lookup(ids, out=torch.empty((3, table.row_dim), dtype=torch.float32))
        for ids in (None, (1, 2), range(3), np.arange(3), 1.5):
            with pytest.raises(TypeError, match="torch.Tensor"):
                table.lookup(ids)
        stats = table.stats()
        assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (0, 0, 0)


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_ids_are_copied(open_in, layout, mode, rng, check_rows):
    base = torch.from_numpy(rng.integers(-3, N + 3, (12, 10)))
    keep = base.clone()
    views = {
        "transposed": base.t(),
        "every third": base[:, ::3],
        "column": base[:, 4],
        "expanded (stride 0)": base[0, :4].unsqueeze(0).expand(5, 4),
        "overlapping windows": base.reshape(-1).unfold(0, 8, 3),
        "int32 transposed": base.to(torch.int32).t(),
    }
    with open_in(mode) as table:
        for name, ids in views.items():
            assert not ids.is_contiguous(), name
            got = table.lookup(ids, out_dtype=torch.float32)
            assert got.shape == (*ids.shape, layout.row_dim), name
            check_rows(got, layout, ids.contiguous().to(torch.int64))
        assert torch.equal(base, keep)  # the caller's ids were not touched


@pytest.mark.parametrize("mode", MODES)
def test_empty_ids(open_in, layout, mode, poison):
    with open_in(mode) as table:
        for shape in ((0,), (3, 0), (0, 5), (2, 0, 4)):
            for dtype in ID_DTYPES:
                ids = torch.empty(shape, dtype=dtype)
                for out_dtype in (None, torch.bfloat16):
                    got = table.lookup(ids, out_dtype=out_dtype, strict=True)
                    assert got.shape == (*shape, layout.row_dim) and got.numel() == 0
                out = torch.empty((*shape, layout.row_dim), dtype=torch.float32)
                assert table.lookup(ids, out=out) is out
        stats = table.stats()
        assert (stats["rows"], stats["out_of_range"]) == (0, 0)
        # A bad lookup leaves the table serving.
        assert table.lookup(torch.tensor([N]), out_dtype=torch.float32).abs().sum() == 0


@pytest.mark.parametrize("mode", MODES)
def test_ids_on_another_device(open_in, layout, mode, check_rows):
    # On a CPU-only host the only other device is "meta", whose tensors hold no data: torch refuses
    # the copy (its own error, before anything is read or counted). On a GPU host, CPU ids for a
    # CUDA table are copied to the GPU (not run here).
    with open_in(mode) as table:
        ids = torch.tensor([1, 2, N], device="meta")
        with pytest.raises((NotImplementedError, RuntimeError, ValueError)):
            table.lookup(ids)
        stats = table.stats()
        assert (stats["rows"], stats["out_of_range"]) == (0, 0)
        ids = torch.tensor([1, 2, N])
        check_rows(table.lookup(ids), layout, ids)
