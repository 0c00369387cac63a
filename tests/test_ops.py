"""ple_um.ops: the torch custom ops ``ple_um::lookup`` and ``ple_um::lookup_out``: their real and
fake implementations, torch.library.opcheck, and torch.compile(fullgraph=True) over table.lookup.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ple_um
from ple_um.access.capabilities import triton_interpreter

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

MODES = ["ats", "cpu", "device"]


@pytest.fixture
def layout(make_checkpoint, rng):
    return make_checkpoint(num_rows=100, row_dim=8, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30)))


def test_ops_are_registered():
    lookup = torch.ops.ple_um.lookup.default
    lookup_out = torch.ops.ple_um.lookup_out.default
    assert [a.name for a in lookup._schema.arguments] == ["ids", "handle", "out_dtype"]
    assert not any(a.is_write for a in lookup._schema.arguments if a.alias_info is not None)
    (out_arg,) = [a for a in lookup_out._schema.arguments if a.name == "out"]
    assert out_arg.alias_info is not None and out_arg.alias_info.is_write  # mutates out only
    assert [r.type for r in lookup_out._schema.returns] == []


@pytest.mark.parametrize("mode", MODES)
def test_ops_run_the_table(layout, mode, rng, check_rows, poison):
    ids = torch.from_numpy(rng.integers(-3, 103, 37))
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        for dtype in (layout.dtype, torch.bfloat16, torch.float16, torch.float32):
            got = torch.ops.ple_um.lookup(ids, table.handle, dtype)
            assert got.shape == (37, 8) and got.dtype == dtype
            check_rows(got, layout, ids)
            out = poison(torch.empty((37, 8), dtype=dtype))
            assert torch.ops.ple_um.lookup_out(ids, out, table.handle) is None
            check_rows(out, layout, ids)
        assert table.stats()["rows"] == 8 * 37


def test_fake_implementations(layout):
    with ple_um.open_table(layout.directory, mode="ats", device="cpu") as table:
        with FakeTensorMode() as fake:
            ids = fake.from_tensor(torch.zeros(13, dtype=torch.int32))
            for dtype in (layout.dtype, torch.bfloat16, torch.float32):
                y = torch.ops.ple_um.lookup(ids, table.handle, dtype)
                assert isinstance(y, FakeTensor)
                assert (y.shape, y.dtype, y.device) == ((13, 8), dtype, torch.device("cpu"))
            out = fake.from_tensor(torch.empty((13, 8), dtype=torch.float16))
            assert torch.ops.ple_um.lookup_out(ids, out, table.handle) is None
        assert table.stats()["rows"] == 0  # nothing ran


@pytest.mark.parametrize("mode", ["ats", "cpu"])
def test_opcheck(layout, mode, rng):
    ids = torch.from_numpy(rng.integers(-3, 103, 21))
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        # (Not the FP8 storage dtype: opcheck's schema test does arithmetic torch lacks for it on the CPU.)
        for dtype in (torch.bfloat16, torch.float32):
            torch.library.opcheck(torch.ops.ple_um.lookup.default, (ids, table.handle, dtype))
            out = torch.empty((21, 8), dtype=dtype)
            torch.library.opcheck(torch.ops.ple_um.lookup_out.default, (ids, out, table.handle))


def test_compile_fullgraph_matches_eager(layout, rng, check_rows, poison):
    torch._dynamo.reset()
    with ple_um.open_table(layout.directory, mode="ats", device="cpu") as table:

        def step(ids: torch.Tensor, out: torch.Tensor):
            scaled = table.lookup(ids, out_dtype=torch.float32) * 2
            table.lookup(ids, out=out)
            return scaled, table.lookup(ids)

        compiled = torch.compile(step, fullgraph=True)
        rows = 0
        for shape in [(4, 5), (3, 7), (16,)]:
            ids = torch.from_numpy(rng.integers(-3, 103, shape))
            out = poison(torch.empty((*shape, 8), dtype=torch.bfloat16))
            scaled, raw = compiled(ids, out)
            eager_out = poison(torch.empty((*shape, 8), dtype=torch.bfloat16))
            eager_scaled, eager_raw = step(ids, eager_out)
            assert torch.equal(scaled, eager_scaled)
            assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16))
            assert torch.equal(raw.view(torch.uint8), eager_raw.view(torch.uint8))
            check_rows(raw, layout, ids)
            check_rows(out, layout, ids)
            check_rows(scaled / 2, layout, ids)
            rows += 6 * ids.numel()
        stats = table.stats()
        assert (stats["lookups"], stats["rows"]) == (18, rows)  # compiled calls are counted too
    torch._dynamo.reset()


@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_the_ops_check_their_arguments_as_lookup_does(layout, rowcopy, monkeypatch):
    """The ops are public: an out too small for the rows (written past its end before), a dtype
    lookup() refuses, float or 2-D ids all raise, and nothing is written beside out."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ids = torch.arange(50)
        canary = torch.zeros(1 << 12, dtype=torch.uint8)
        small = canary[:50].view(torch.float8_e4m3fn).view(50, 1)
        with pytest.raises(ValueError, match="out has shape"):
            torch.ops.ple_um.lookup_out(ids, small, table.handle)
        assert not canary.any()
        with pytest.raises(TypeError, match="out_dtype must be"):
            torch.ops.ple_um.lookup(ids, table.handle, torch.int32)
        with pytest.raises(TypeError, match="integer tensor"):
            torch.ops.ple_um.lookup(ids.float(), table.handle, torch.bfloat16)
        with pytest.raises(ValueError, match="flat ids"):
            torch.ops.ple_um.lookup(ids.view(5, 10), table.handle, torch.bfloat16)
        out = torch.empty((50, table.row_dim), dtype=torch.bfloat16)
        torch.ops.ple_um.lookup_out(ids, out, table.handle)
        assert torch.equal(out, table.lookup(ids, out_dtype=torch.bfloat16))
    with pytest.raises(ple_um.TableClosedError):
        torch.ops.ple_um.lookup(ids, table.handle, torch.bfloat16)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_one_function_over_several_tables(make_checkpoint, rng, check_rows, dynamic):
    """One compiled function called with several tables: the second table's call recompiles with the
    handle as a symbolic int (automatic dynamic; every int under dynamic=True), which the fake
    implementation must still resolve to its table, with shapes dynamic too."""
    torch._dynamo.reset()
    layouts = [make_checkpoint(num_rows=50, row_dim=8, dtype="fp8", shards=2, seed=s) for s in (1, 2, 3)]
    tables = [ple_um.open_table(each.directory, mode="cpu", device="cpu") for each in layouts]
    try:

        def step(table, ids):
            return table.lookup(ids, out_dtype=torch.float32) * 2

        compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
        for n in (5, 9):
            for each, table in zip(layouts, tables, strict=True):
                ids = torch.from_numpy(rng.integers(-3, 53, n))
                check_rows(compiled(table, ids) / 2, each, ids)
    finally:
        for table in tables:
            table.close()
        torch._dynamo.reset()
