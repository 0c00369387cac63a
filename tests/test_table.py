"""ple_um.table: open_table and MappedTable, the public contract of docs/DESIGN.md, on the CPU.

The ats and device modes run the real kernel and self-test under the Triton interpreter (the host is
the device); the cpu mode runs the CPU gather. Every lookup is compared element by element with
the reference reader, into poisoned outputs where the test provides them.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from helpers.reference import drop_page_cache, maps_of

import ple_um
from ple_um import opening, ops
from ple_um.access.capabilities import triton_interpreter
from ple_um.checkpoint import read_layout
from ple_um.errors import KnobError
from ple_um.mapping import PAGE
from ple_um.synthetic import scale_value, write_checkpoint
from ple_um.table import MappedTable

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

MODES = ["ats", "cpu", "device"]  # what a CPU host offers under the interpreter
ID_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def all_ids(layout) -> torch.Tensor:
    return torch.arange(-3, layout.num_rows + 3)


def swap_data(layout, path: str) -> None:
    """Replace ``path`` by a copy whose shard data differ (a new inode: a mapping keeps the old)."""
    data = bytearray(open(path, "rb").read())
    for spec in layout.shards:
        if spec.path == path:
            for k in range(spec.offset, spec.offset + spec.rows * layout.row_bytes):
                data[k] ^= 0x01
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


# -- opening --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "BF16", "F16"])
@pytest.mark.parametrize("mode", MODES)
def test_attributes(make_checkpoint, mode, dtype):
    layout = make_checkpoint(num_rows=9, row_dim=6, dtype=dtype, shards=4, seed=5)
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        assert isinstance(table, MappedTable)
        assert table.mode == mode == table.report.mode
        assert isinstance(table.report, ple_um.ProbeReport)
        assert set(table.report.reasons) == {"ats", "registered", "cpu", "device"} - {mode}
        assert (table.num_rows, table.row_dim, table.dtype) == (9, 6, layout.dtype)
        assert table.scale == (scale_value(5) if dtype.startswith("F8") else None)
        assert table.capture_safe is True  # every mode's lookup is stream-ordered work here
        assert table.device == torch.device("cpu")
        assert table.rows == (0, 9)
        stats = table.stats()
        assert (stats["mode"], stats["lookups"], stats["rows"], stats["out_of_range"]) == (mode, 0, 0, 0)
        assert stats["device_bytes"] == (9 * layout.row_bytes if mode == "device" else 0)
        assert stats["pinned_bytes"] == 0
        assert stats["mapped_bytes"] == table.mapping.mapped_bytes > 0
        assert mode in repr(table)


def test_auto_picks_ats_on_an_interpreter_host_and_cpu_without(layout, monkeypatch, check_rows):
    with ple_um.open_table(layout.directory) as table:  # device=None: the CPU here
        assert table.device == torch.device("cpu")
        assert table.mode == "ats"
        assert table.report.reasons["registered"] == "no CUDA device"
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    monkeypatch.delenv("TRITON_INTERPRET")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu"
        assert table.report.reasons["ats"] == "no CUDA device"
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))


def test_mode_knob(layout, monkeypatch):
    monkeypatch.setenv("PLE_UM_MODE", "device")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "device"
    with ple_um.open_table(layout.directory, mode="cpu") as table:  # the argument wins
        assert table.mode == "cpu"
    monkeypatch.setenv("PLE_UM_MODE", "registered")
    with pytest.raises(ple_um.ModeUnavailableError, match="no CUDA device"):
        ple_um.open_table(layout.directory)


def test_registered_mode_needs_cuda(layout):
    before = len(ops._TABLES)
    with pytest.raises(ple_um.ModeUnavailableError, match="no CUDA device") as info:
        ple_um.open_table(layout.directory, mode="registered", device="cpu")
    assert info.value.mode == "registered"
    assert not maps_of(layout.files) and len(ops._TABLES) == before  # nothing left behind


def test_unknown_mode(layout):
    with pytest.raises(ValueError, match="unknown access mode"):
        ple_um.open_table(layout.directory, mode="gpu")


def test_layer_selection(tmp_path, check_rows):
    # Layer 1 in one file, layer 2 in two others; no index: the reader globs *.safetensors.
    one = write_checkpoint(tmp_path / "one", num_rows=30, row_dim=4, dtype="bf16", shards=2, files=1, seed=1)
    write_checkpoint(tmp_path / "two", num_rows=50, row_dim=8, dtype="fp8", shards=3, files=2, layer=2)
    both = tmp_path / "both"
    both.mkdir()
    for part in (one.directory, str(tmp_path / "two")):
        for name in os.listdir(part):
            if name.endswith(".safetensors"):
                shutil.copy(os.path.join(part, name), both / name)
    with pytest.raises(ple_um.CheckpointError, match="1, 2"):
        ple_um.open_table(both, mode="cpu")
    with pytest.raises(ple_um.CheckpointError, match="layers with shards: 1, 2"):
        ple_um.open_table(both, layer=3, mode="cpu")
    for layer, (rows, dim) in ((1, (30, 4)), (2, (50, 8))):
        with ple_um.open_table(both, layer=layer, mode="ats") as table:
            assert (table.num_rows, table.row_dim) == (rows, dim)
            ids = torch.arange(rows)
            check_rows(table.lookup(ids), read_layout(str(both), layer), ids)
    with ple_um.open_table(tmp_path / "one", layer=None, mode="cpu") as table:  # the only layer
        assert table.layout.layer == 1


@pytest.mark.parametrize("rows", [(5, 3), (-1, 3), (0, 121), (0.0, 10), ("0", 10), (None, 10)])
def test_bad_rows(layout, rows):
    with pytest.raises(ValueError, match="rows="):
        ple_um.open_table(layout.directory, rows=rows, mode="cpu")
    assert not maps_of(layout.files)


WRONG_TYPES = [
    ("layer", "1", "layer='1' (str): expected a layer number (an int), or None for the only layer"),
    ("layer", 1.0, "layer=1.0 (float): expected a layer number (an int)"),
    ("layer", True, "layer=True (bool): expected a layer number (an int)"),  # not layer 1
    (
        "mode",
        None,
        "mode=None (NoneType): expected a mode's name (a str: auto, ats, registered, cpu, device)",
    ),
    ("device", 0.0, "device=0.0 (float): expected a torch.device, a str (cpu, cuda, cuda:N), a CUDA index"),
    ("device", True, "device=True (bool): expected a torch.device"),  # not cuda:1
    ("strict", "no", "strict='no' (str): expected a bool, or None for PLE_UM_STRICT"),  # not strict
    ("strict", 1, "strict=1 (int): expected a bool"),
    ("path", None, "path=None (NoneType): expected a checkpoint directory (a str or os.PathLike)"),
    ("path", b"/x", "path=b'/x' (bytes): expected a checkpoint directory"),
]


@pytest.mark.parametrize(("name", "value", "expected"), WRONG_TYPES)
def test_an_argument_of_a_wrong_type_is_named_with_what_to_pass(layout, name, value, expected):
    """open_table and probe check their arguments' types before anything is read: a TypeError
    naming the argument, its value and what it takes, nothing mapped; never a bare TypeError from
    deep inside, nor a value that a wrong type turns into another (layer True is no layer 1)."""
    given = {"path": layout.directory, "mode": "cpu", "device": "cpu", name: value}
    with pytest.raises(TypeError, match=re.escape(expected)):
        ple_um.open_table(given.pop("path"), **given)
    assert not maps_of(layout.files)
    if name != "strict" and value is not None:  # probe takes no strict, and no path to probe the machine
        given = {"path": layout.directory, "mode": "cpu", "device": "cpu", name: value}
        with pytest.raises(TypeError, match=re.escape(expected)):
            ple_um.probe(given.pop("device"), **given)


def test_bad_checkpoints_raise_checkpoint_error(tmp_path):
    from helpers.reference import write_safetensors

    from ple_um.synthetic import shard_name

    cases = {}
    cases["missing"] = tmp_path / "missing"
    (tmp_path / "empty").mkdir()
    cases["empty"] = tmp_path / "empty"
    # FP8 without its scale.
    noscale = tmp_path / "noscale"
    noscale.mkdir()
    write_safetensors(
        noscale / "model.safetensors",
        {shard_name(1, i): ("F8_E4M3", [4, 4], bytes(16)) for i in range(2)},
    )
    cases["noscale"] = noscale
    for name, path in cases.items():
        with pytest.raises(ple_um.CheckpointError) as info:
            ple_um.open_table(path, mode="cpu")
        assert isinstance(info.value, ValueError), name


# -- lookups --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_lookup_shapes_and_dtypes(layout, mode, rng, check_rows):
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        for shape in [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (2, 0)]:
            for id_dtype in ID_DTYPES:
                info = torch.iinfo(id_dtype)
                ids = torch.from_numpy(np.asarray(rng.integers(max(info.min, -4), min(info.max, 130), shape)))
                ids = ids.to(id_dtype)
                y = table.lookup(ids)
                assert y.shape == (*shape, layout.row_dim) and y.dtype == layout.dtype
                assert y.device == torch.device("cpu")
                check_rows(y, layout, ids.to(torch.int64))
        ids = torch.from_numpy(rng.integers(-4, 130, (4, 6)))
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32, layout.dtype):
            y = table.lookup(ids, out_dtype=out_dtype)
            assert y.shape == (4, 6, layout.row_dim) and y.dtype == out_dtype
            check_rows(y, layout, ids)
        # Non-contiguous ids.
        wide = torch.from_numpy(rng.integers(0, 120, (6, 8)))
        check_rows(table.lookup(wide.t()), layout, wide.t().contiguous())
        check_rows(table.lookup(wide[:, ::3]), layout, wide[:, ::3].contiguous())


@pytest.mark.parametrize("dtype", ["F8_E5M2", "BF16", "F16"])
@pytest.mark.parametrize("mode", MODES)
def test_every_dtype_dequantizes(make_checkpoint, mode, dtype, rng, check_rows):
    layout = make_checkpoint(num_rows=50, row_dim=3, dtype=dtype, shards=3, seed=int(rng.integers(1 << 30)))
    ids = torch.from_numpy(rng.integers(-2, 52, 64))
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        for out_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
            check_rows(table.lookup(ids, out_dtype=out_dtype), layout, ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [(20, 61), (0, 24), (119, 120), (50, 50)])
def test_owned_rows(layout, mode, rows, check_rows):
    ids = all_ids(layout)
    with ple_um.open_table(layout.directory, rows=rows, mode=mode, device="cpu") as table:
        assert table.rows == rows
        for out_dtype in (None, torch.float32):
            check_rows(table.lookup(ids, out_dtype=out_dtype), layout, ids, rows=rows)
        stats = table.stats()
        assert (stats["rows"], stats["out_of_range"]) == (2 * ids.numel(), 12)
        assert stats["mapped_bytes"] <= (rows[1] - rows[0]) * layout.row_bytes + 2 * PAGE * len(layout.files)
        if rows[0] == rows[1]:
            assert stats["mapped_bytes"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_out_buffers(layout, mode, rng, check_rows, poison):
    ids = torch.from_numpy(rng.integers(-3, 123, (5, 7)))
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        for dtype in (layout.dtype, torch.bfloat16, torch.float16, torch.float32):
            out = poison(torch.empty((5, 7, layout.row_dim), dtype=dtype))
            ptr = out.data_ptr()
            got = table.lookup(ids, out=out)
            assert got is out and out.data_ptr() == ptr
            check_rows(out, layout, ids)
        # A contiguous slice of a larger buffer: only the slice is written.
        buf = poison(torch.empty((40, layout.row_dim), dtype=torch.float16))
        table.lookup(ids.reshape(-1)[:30], out=buf[5:35])
        check_rows(buf[5:35], layout, ids.reshape(-1)[:30])
        assert (buf[:5].view(torch.uint8) == 0xAB).all() and (buf[35:].view(torch.uint8) == 0xAB).all()
        assert table.stats()["lookups"] == 5


@pytest.mark.parametrize("mode", MODES)
def test_bad_out_buffers_and_dtypes(layout, mode):
    ids = torch.arange(6).reshape(2, 3)
    d = layout.row_dim
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        with pytest.raises(ValueError, match="shape"):
            table.lookup(ids, out=torch.empty((6, d), dtype=torch.float32))
        with pytest.raises(ValueError, match="shape"):
            table.lookup(ids, out=torch.empty((2, 3, d + 1), dtype=torch.float32))
        with pytest.raises(ValueError, match="contiguous"):
            table.lookup(ids, out=torch.empty((d, 3, 2), dtype=torch.float32).permute(2, 1, 0))
        with pytest.raises(ValueError, match="meta"):
            table.lookup(ids, out=torch.empty((2, 3, d), dtype=torch.float32, device="meta"))
        for dtype in (torch.int32, torch.uint8, torch.float64, torch.float8_e5m2):
            with pytest.raises(TypeError, match="out_dtype"):
                table.lookup(ids, out=torch.empty((2, 3, d), dtype=dtype))
            with pytest.raises(TypeError, match="out_dtype"):
                table.lookup(ids, out_dtype=dtype)
        assert table.stats()["lookups"] == 0 and table.stats()["rows"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_out_and_out_dtype_must_agree(layout, mode):
    """out= picks the dtype; an out_dtype that says otherwise is refused (it was once ignored, and
    the caller got the out's dtype back), before anything is written or counted."""
    ids = torch.randint(0, layout.num_rows, (2, 3))
    d = layout.row_dim
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        out = torch.full((2, 3, d), 7.0, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="out is torch.bfloat16 but out_dtype is torch.float32"):
            table.lookup(ids, out=out, out_dtype=torch.float32)
        assert (out == 7.0).all()
        assert table.stats()["lookups"] == 0
        assert table.lookup(ids, out=out, out_dtype=torch.bfloat16) is out
        assert torch.equal(out, table.lookup(ids, out_dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", MODES)
def test_non_integer_ids(layout, mode):
    """A lookup and a prefetch refuse the same ids with the same TypeError: a prefetch does not
    truncate float ids (1.7 would prefetch row 1) nor take what a lookup refuses."""
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        floats, bools = torch.tensor([1.7, 2.0]), torch.tensor([True, False])
        wide = [torch.tensor([1], dtype=dtype) for dtype in (torch.uint16, torch.uint32, torch.uint64)]
        for call in (table.lookup, table.prefetch):
            for ids in (floats, bools, *wide):
                # The dtypes taken named: a uint32 tensor of hashed ids is an integer tensor too.
                taken = "an integer tensor of int64, int32, int16, int8 or uint8"
                with pytest.raises(TypeError, match=f"{taken}, got {ids.dtype}$"):
                    call(ids)
            for ids in ([1, 2], np.array([1, 2]), 3):
                with pytest.raises(TypeError, match="torch.Tensor"):
                    call(ids)
        assert table.stats()["lookups"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_strict(layout, mode, monkeypatch, check_rows):
    ids = torch.tensor([0, 5, 119])
    bad = torch.tensor([0, 120, -1, 7])
    with ple_um.open_table(layout.directory, mode=mode, device="cpu", strict=True, rows=(10, 50)) as table:
        check_rows(table.lookup(ids), layout, ids, rows=(10, 50))  # outside the owned range: no error
        with pytest.raises(IndexError, match=r"2 ids outside \[0, 120\)"):
            table.lookup(bad)
        with pytest.raises(IndexError):
            table.lookup(bad, out=torch.empty((4, layout.row_dim), dtype=torch.float32))
        check_rows(table.lookup(bad, strict=False), layout, bad, rows=(10, 50))
        assert table.stats()["out_of_range"] == 2
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        table.lookup(bad)
        with pytest.raises(IndexError):
            table.lookup(bad, strict=True)
    monkeypatch.setenv("PLE_UM_STRICT", "1")
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        with pytest.raises(IndexError):
            table.lookup(bad)


@pytest.mark.parametrize("mode", MODES)
def test_prefetch_checks_ids_as_a_lookup_does(layout, mode):
    """A strict table's prefetch refuses the ids its lookup refuses, with the same IndexError (it
    took them silently); ids past 2**31 are never narrowed to a row of the table (as int32 they are
    row 5): passed over where not strict. The prefetcher itself takes int64 ids and casts nothing."""
    bad = torch.tensor([0, 120, -1, 7])
    far = torch.tensor([2**31 + 5, 2**32 + 5], dtype=torch.int64)
    hinted = 0 if mode == "device" else 2  # rows 0 and 7; the device mode needs no prefetch
    with ple_um.open_table(layout.directory, mode=mode, device="cpu", strict=True) as table:
        for ids in (bad, far):
            with pytest.raises(IndexError, match=r"2 ids outside \[0, 120\) \(strict lookup\)$"):
                table.prefetch(ids)
            with pytest.raises(IndexError, match=r"2 ids outside \[0, 120\)"):
                table.lookup(ids)
        assert table.prefetch(bad, strict=False).result(timeout=60) == hinted
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        assert table.prefetch(far).result(timeout=60) == 0
        assert table.prefetch(bad).result(timeout=60) == hinted
        with pytest.raises(IndexError, match=r"2 ids outside"):
            table.prefetch(bad, strict=True)
        prefetcher = table.access.prefetcher
        if prefetcher is not None:
            for ids in (np.array([1.7, 2.0]), np.array([5], dtype=np.uint64), [1, 2], torch.tensor([1])):
                with pytest.raises(TypeError, match="PagePrefetcher.submit takes an int64 array of ids"):
                    prefetcher.submit(ids)
            assert prefetcher.submit(np.array([3, 3, 4, 200], dtype=np.int64)).result(timeout=60) == 2
        assert table.stats()["rows"] == 0  # a prefetch is not a lookup


@pytest.mark.parametrize("mode", MODES)
def test_strict_takes_narrow_ids_at_their_values(make_checkpoint, mode, check_rows):
    # A table of 300 rows: uint8 255 is a row, int8 -1 is not; no id is compared with the row
    # count cast to its dtype (300 as uint8 is 44, as int8 is 44 too).
    layout = make_checkpoint(num_rows=300, row_dim=4, dtype="fp8", shards=3, seed=11)
    with ple_um.open_table(layout.directory, mode=mode, device="cpu", strict=True) as table:
        for ids in (
            torch.tensor([0, 255, 44, 45], dtype=torch.uint8),
            torch.tensor([0, 127, 45], dtype=torch.int8),
        ):
            check_rows(table.lookup(ids), layout, ids.to(torch.int64))
        with pytest.raises(IndexError, match=r"1 ids outside \[0, 300\)"):
            table.lookup(torch.tensor([5, -1, 100], dtype=torch.int8))
        assert table.stats()["out_of_range"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_stats_count_exactly_the_rows_looked_up(layout, mode, rng):
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        assert table.stats()["rows"] == 0  # the self-test is not a lookup
        lookups = rows = oob = 0
        for shape in [(17,), (3, 4), (0,), (1,), (40,)]:
            ids = torch.from_numpy(rng.integers(-10, 130, shape))
            table.lookup(ids, out_dtype=torch.float32 if lookups % 2 else None)
            lookups, rows = lookups + 1, rows + ids.numel()
            oob += int(((ids < 0) | (ids >= 120)).sum())
            stats = table.stats()
            assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (lookups, rows, oob)
            assert stats["bytes"] == rows * layout.row_bytes
        if mode == "cpu":
            assert set(stats["phase_seconds"]) == {"gather", "stage", "wait"}
            assert sum(stats["phase_seconds"].values()) > 0


# -- life -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_close(layout, mode):
    table = ple_um.open_table(layout.directory, mode=mode, device="cpu")
    handle = table.handle
    assert maps_of(layout.files) and handle in ops._TABLES
    table.close()
    assert table.closed and "closed" in repr(table)
    assert not maps_of(layout.files) and handle not in ops._TABLES
    table.close()  # idempotent
    for call in (
        lambda: table.lookup(torch.tensor([1])),
        lambda: table.lookup(torch.tensor([1]), out=torch.empty((1, layout.row_dim), dtype=torch.float32)),
        lambda: table.stats(),
        lambda: table.prefetch(torch.tensor([1])),
        lambda: table.self_test(8),
    ):
        with pytest.raises(ple_um.TableClosedError):
            call()
    with pytest.raises(ple_um.TableClosedError):
        torch.ops.ple_um.lookup(torch.tensor([1]), handle, layout.dtype)


@pytest.mark.parametrize("mode", MODES)
def test_context_manager(layout, mode):
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        assert not table.closed
    assert table.closed and not maps_of(layout.files)
    with pytest.raises(RuntimeError, match="boom"):
        with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
            raise RuntimeError("boom")
    assert table.closed


@pytest.mark.parametrize("mode", ["ats", "device"])
def test_self_test_compares_with_the_files(layout, mode):
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        assert table.stats()["rows"] == 0  # the self-test at open is not counted
        table.lookup(torch.arange(16))
        assert table.self_test(64) is None
        assert table.self_test(1) is None
        # Called later it reads rows like a lookup and counts them: the counters only ever grow
        # (a reset here once lost the 16 rows and made the stats line's rates negative).
        assert table.stats()["rows"] >= 16 + 1
        # Replace a file under the open table (a new inode): the mapping (or the device copy) keeps
        # the old bytes, the self-test reads the new ones through the path.
        swap_data(layout, layout.files[-1])
        assert table.mapping.changed_files() == [layout.files[-1]]
        why = table.self_test(64)
        assert why is not None and why.startswith("self-test:") and "differ from the file" in why


def test_self_test_of_no_rows(layout, monkeypatch, check_rows):
    # PLE_UM_SELF_TEST_ROWS=0 turns the self-test off; it once rejected every GPU mode instead
    # (an empty sample reshaped to (0, -1)).
    monkeypatch.setenv("PLE_UM_SELF_TEST_ROWS", "0")
    with ple_um.open_table(layout.directory, mode="ats", device="cpu") as table:
        assert table.self_test(0) is None
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats"


@pytest.fixture
def swap_during_open(monkeypatch):
    """``swap_during_open(layout, path)``: the file at ``path`` is replaced right after the first
    access mode is built (after the mapping, before the self-test), as a concurrent re-download would."""

    def arm(layout, path):
        build = opening.build_paths
        swapped = []

        def build_then_swap(access, *args, **kwargs):
            paths = build(access, *args, **kwargs)
            if not swapped:
                swapped.append(access.mode)
                swap_data(layout, path)
            return paths

        monkeypatch.setattr(opening, "build_paths", build_then_swap)
        return swapped

    return arm


@pytest.mark.parametrize("mode", ["ats", "device"])
def test_forced_mode_whose_self_test_fails_is_unavailable(layout, mode, swap_during_open):
    before = len(ops._TABLES)
    swap_during_open(layout, layout.files[0])
    with pytest.raises(ple_um.ModeUnavailableError, match="self-test") as info:
        ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert info.value.mode == mode
    assert not maps_of(layout.files) and len(ops._TABLES) == before  # nothing left behind


def test_auto_falls_through_a_failed_self_test(layout, swap_during_open, check_rows):
    swapped = swap_during_open(layout, layout.files[1])
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert swapped == ["ats"]
        assert table.mode == "cpu"
        assert table.report.reasons["ats"].startswith("self-test:")
        assert table.report.reasons["registered"] == "no CUDA device"
        # The rows of the untouched files still read as the files say.
        ids = torch.arange(0, 24)  # shard 0, in the first file
        check_rows(table.lookup(ids), layout, ids)


@pytest.mark.parametrize("mode", ["auto", "cpu"])
def test_a_knob_refused_while_a_mode_is_built_releases_what_it_built(layout, monkeypatch, mode):
    """A KnobError raised while a mode is built (a row cache past the memory left, say) reaches the
    caller as it is, not as a rejected mode, once what was built is released: the mode's prefetcher
    stopped, the files unmapped, no handle left in the ops' registry."""
    built = []

    def refused(access, *args, **kwargs):
        built.append(access)
        raise KnobError("PLE_UM_ROW_CACHE='1GiB' does not fit (injected)")

    before = len(ops._TABLES)
    monkeypatch.setattr(opening, "build_paths", refused)
    with pytest.raises(KnobError, match="injected"):
        ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert [access.mode for access in built] == ["ats" if mode == "auto" else "cpu"]  # no other mode tried
    assert built[0].prefetcher is None  # released: ModeAccess.close stopped it
    assert not maps_of(layout.files) and len(ops._TABLES) == before


def test_resident_pages_are_mapped_before_the_self_test(layout, monkeypatch):
    """The cpu mode's C row copy: the resident pages are mapped (PLE_UM_MAP_RESIDENT) before the
    self-test reads through the host path (and, on a GPU, before the crossover is measured), so
    that the open's checks take no minor faults that serving will not."""
    from ple_um import verify
    from ple_um.access.build import ModeAccess

    calls = []
    map_resident, self_test = ModeAccess.map_resident, verify.self_test
    monkeypatch.setattr(ModeAccess, "map_resident", lambda a: calls.append("map") or map_resident(a))
    monkeypatch.setattr(verify, "self_test", lambda *a, **k: calls.append("self-test") or self_test(*a, **k))
    monkeypatch.setenv("PLE_UM_MAP_RESIDENT", "1")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert table.paths.row_copy is not None  # the C row copy's host path: what maps them
        assert table.access.mapped_resident > 0
    assert calls == ["map", "self-test"]


def test_prewarm_populates(make_checkpoint, monkeypatch):
    layout = make_checkpoint(num_rows=1024, row_dim=256, dtype="fp8", shards=2, files=1)
    monkeypatch.setenv("PLE_UM_PREWARM", "1")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        ((_, resident, mapped),) = table.mapping.residency()
        assert resident == mapped == table.stats()["mapped_bytes"]


@pytest.mark.parametrize("mode", ["ats", "cpu"])
def test_prefetch_makes_pages_resident(make_checkpoint, mode, monkeypatch, rng):
    # 2048 rows of 512 bytes in one file: 8 rows a page. The self-test reads one row (row 0). No
    # row cache: with one, the cpu mode's prefetch reads the rows into it instead (test_cold_rows).
    layout = make_checkpoint(num_rows=2048, row_dim=512, dtype="fp8", shards=4, files=1)
    monkeypatch.setenv("PLE_UM_SELF_TEST_ROWS", "1")
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")
    drop_page_cache(layout)
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        drop_page_cache(layout)
        before = sum(r for _, r, _ in table.mapping.residency())
        if before > 4 * PAGE:
            pytest.skip("the page cache keeps these files resident (tmpfs?): residency cannot be observed")
        ids = torch.from_numpy(rng.choice(np.arange(1024, 2048), 10, replace=False))
        future = table.prefetch(torch.cat([ids, torch.tensor([-1, 5000])]))
        assert isinstance(future, Future)
        assert future.result(timeout=60) == 10
        after = sum(r for _, r, _ in table.mapping.residency())
        spec = layout.shards[3]  # rows 1536.. ; shards lie in order in the file
        pages = {(spec.offset + (int(i) - 1536) * layout.row_bytes) // PAGE for i in ids}
        assert after >= before + len(pages) * PAGE
        assert table.stats()["rows"] == 0  # a prefetch is not a lookup


def test_prefetch_in_device_mode_is_a_no_op(layout):
    with ple_um.open_table(layout.directory, mode="device", device="cpu") as table:
        future = table.prefetch(torch.arange(10))
        assert isinstance(future, Future) and future.result(timeout=5) == 0


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("PLE_UM_CPU_THREADS", "abc", "a whole number from 1 to 1024"),
        ("PLE_UM_CPU_THREADS", "4294967297", "a whole number from 1 to 1024"),
        ("PLE_UM_MADVISE", "bogus", "one of auto, random, normal, none"),
        ("PLE_UM_SELF_TEST_ROWS", "x", "a whole number from 0 to"),
        ("PLE_UM_PIN_FRACTION", "inf", "a fraction from 0 to 1"),
        ("PLE_UM_PIN_FRACTION", "-1", "a fraction from 0 to 1"),
        ("PLE_UM_STATS_SEC", "inf", "a number of seconds from 0 (off) to 86400"),
        ("PLE_UM_METRICS_SEC", "nan", "a number of seconds from 0 (off) to 86400"),
        ("PLE_UM_CACHE_DIR", " ", "a directory"),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "cpu"])
def test_a_bad_knob_is_an_error_at_open_naming_it(layout, monkeypatch, mode, var, value, expected):
    """Not a rejected mode (a bare StopIteration once every mode was), not a silent fallback, not a
    crash in a thread later: KnobError at open, naming the variable and what it takes."""
    from ple_um.errors import KnobError

    monkeypatch.setenv(var, value)
    with pytest.raises(KnobError, match=re.escape(f"{var}={value!r}: expected {expected}")):
        ple_um.open_table(layout.directory, mode=mode, device="cpu")


@pytest.mark.parametrize(
    ("device", "expected"), [("meta", "served on cpu or cuda"), ("cpu:3", "one CPU device")]
)
def test_a_device_that_cannot_serve_is_refused_at_open(layout, device, expected):
    with pytest.raises(ValueError, match=expected):
        ple_um.open_table(layout.directory, mode="cpu", device=device)


def test_an_explicit_mode_ignores_a_stale_mode_knob(layout, monkeypatch):
    """PLE_UM_MODE is read only when the mode is auto: a stale value does not stop mode="cpu"."""
    from ple_um.errors import KnobError

    monkeypatch.setenv("PLE_UM_MODE", "host")
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert table.mode == "cpu"
    with pytest.raises(KnobError, match="PLE_UM_MODE='host'"):
        ple_um.open_table(layout.directory, device="cpu")
