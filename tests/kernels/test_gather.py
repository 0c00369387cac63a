"""ple_um.kernels (ple_um/kernels/gather.py): the Triton row gather, run on the CPU by the Triton interpreter.

The kernel reads rows through the host addresses of a real MappedShards over real safetensors files
(no mock); every element of every output is compared with the reference reader's bytes, outputs are
poisoned first, and each word size the kernel chooses (8, 4, 2, 1 bytes) is exercised, raw and
dequantized, at every shard boundary, with masked rows and ids outside the table; 16-bit rows at odd
addresses too, put together from bytes. The words a launch read are read from the launch itself
(conftest's ``watch_loads``), and none may be wider than its address's alignment.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from helpers.reference import misalign_checkpoint, write_safetensors

import ple_um
from ple_um.access.capabilities import triton_interpreter
from ple_um.checkpoint import read_layout
from ple_um.kernels import gather_rows
from ple_um.kernels.gather import ROWS_PER_PROGRAM
from ple_um.mapping import MappedShards
from ple_um.synthetic import scale_name, shard_name, shard_rows, write_checkpoint

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    # numpy, running the kernel, warns where the kernel means it: float32 -> float16 overflowing to
    # inf, NaN * scale, the sign bit shifted into int32's top bit.
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

OUT_DTYPES = [None, torch.bfloat16, torch.float16, torch.float32]  # None: raw, the storage dtype
OUT_IDS = ["raw", "bf16", "f16", "f32"]


# -- checkpoints ----------------------------------------------------------------------------------
def write_aligned(path, *, num_rows: int, row_dim: int, dtype: str, shards: int, seed: int):
    """One file whose shard data all lie 8-byte aligned (shards first, the F32 scale last): the
    synthetic writer puts the FP8 scale first, leaving its file's shards 4 mod 8."""
    path.mkdir()
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, rows in enumerate(shard_rows(num_rows, shards)):
        data = rng.integers(0, 256, rows * row_dim, dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] = 0  # finite e4m3 (the exhaustive tests cover NaN)
        tensors[shard_name(1, i)] = (dtype, [rows, row_dim], data.tobytes())
    tensors[scale_name(1)] = ("F32", [], struct.pack("<f", 0.0371))
    write_safetensors(path / "model.safetensors", tensors)
    return read_layout(str(path))


# name: (dtype, num_rows, row_dim, shards, files, the word bits the kernel must read rows in);
# files "aligned": write_aligned; "odd": the synthetic files rewritten by misalign_checkpoint, so
# that rows start at odd bytes (16-bit elements are then put together from bytes).
LAYOUTS = {
    "fp8-rb7-w8": ("fp8", 150, 7, 4, None, 8),
    "fp8-rb6-w16": ("fp8", 150, 6, 4, None, 16),  # the last file's FP8 data lies 4 mod 8
    "bf16-rb6-w16": ("bf16", 150, 3, 4, None, 16),
    "fp8-rb24-w32": ("fp8", 150, 24, 4, None, 32),
    "e5m2-rb12-w32": ("f8_e5m2", 150, 12, 3, 2, 32),
    "f16-rb4-w32": ("f16", 150, 2, 4, None, 32),
    "bf16-rb8-w64": ("bf16", 150, 4, 4, None, 64),
    "f16-rb48-w64": ("f16", 150, 24, 5, 2, 64),
    "fp8-aligned-w64": ("F8_E4M3", 150, 16, 3, "aligned", 64),
    "e5m2-aligned-w64": ("F8_E5M2", 150, 16, 3, "aligned", 64),
    "bf16-odd-w8": ("bf16", 150, 5, 4, "odd", 8),
    "f16-odd-w8": ("f16", 150, 4, 3, "odd", 8),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """``layouts(name)``: the checkpoint of LAYOUTS[name] (fresh random data, written once per module)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"test_kernel layouts: seed {seed}")
    made = {}

    def get(name: str):
        if name not in made:
            dtype, num_rows, row_dim, shards, files, _ = LAYOUTS[name]
            path = tmp_path_factory.mktemp(name)
            if files == "aligned":
                made[name] = write_aligned(
                    path / "ckpt", num_rows=num_rows, row_dim=row_dim, dtype=dtype, shards=shards, seed=seed
                )
            else:
                made[name] = write_checkpoint(
                    path,
                    num_rows=num_rows,
                    row_dim=row_dim,
                    dtype=dtype,
                    shards=shards,
                    files=None if files == "odd" else files,
                    seed=seed,
                )
                if files == "odd":
                    misalign_checkpoint(path)
                    made[name] = read_layout(str(path))
                    assert any(s.offset % 2 for s in made[name].shards)
        return made[name]

    return get


def fill_all_patterns(layout):
    """Overwrite the table in place: element ``e`` (global index) gets bit pattern ``e % 2**bits``,
    so every byte (FP8: -0.0, subnormals, NaN, inf) or 16-bit pattern occurs in every lane. The
    layout read again: a file rewritten after its header was read is not mapped (its identity)."""
    item = layout.dtype.itemsize
    for spec in layout.shards:
        first = spec.index * layout.rows_per_shard * layout.row_dim
        e = np.arange(first, first + spec.rows * layout.row_dim, dtype=np.int64)
        data = (e % 256).astype(np.uint8) if item == 1 else (e % 65536).astype("<u2")
        with open(spec.path, "r+b") as f:
            f.seek(spec.offset)
            f.write(data.tobytes())
    return read_layout(layout.directory, layer=layout.layer)


# -- calling the kernel ---------------------------------------------------------------------------
def owned_alignment(mapping: MappedShards) -> int:
    """Widest power of two <= 8 dividing the row stride and every owned shard's base address."""
    align = 8
    for index in mapping.owned:
        while mapping.shard_base(index) % align or mapping.layout.row_bytes % align:
            align //= 2
    return align


def boundary_ids(layout) -> list[int]:
    """S-1, S, S+1 around each shard start, both table ends and ids outside the table."""
    S = layout.rows_per_shard
    ids = [-(2**40), -3, -1, 0, 1, layout.num_rows - 1, layout.num_rows, layout.num_rows + 1, 2**40]
    for k in range(1, layout.parts + 1):
        ids += [k * S - 1, k * S, k * S + 1]
    return ids


def gather(mapping, ids, out, counters=None, *, scale="table", rows=None, align=None, **kw):
    """gather_rows with the mapping's host bases (what the ats mode passes); returns the counters."""
    layout = mapping.layout
    start, end = rows if rows is not None else (mapping.row_start, mapping.row_end)
    if scale == "table":
        scale = None if layout.scale is None else torch.tensor([layout.scale], dtype=torch.float32)
    counters = torch.zeros(2, dtype=torch.int64) if counters is None else counters
    result = gather_rows(
        torch.tensor(mapping.host_bases(), dtype=torch.int64),
        ids,
        out,
        counters,
        storage=layout.dtype,
        row_start=start,
        row_end=end,
        num_rows=layout.num_rows,
        rows_per_shard=layout.rows_per_shard,
        row_bytes=layout.row_bytes,
        base_align=owned_alignment(mapping) if align is None else align,
        scale=scale if out.dtype != layout.dtype else None,
        **kw,
    )
    assert result is out
    return counters


def oob_count(layout, ids) -> int:
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    return int(((flat < 0) | (flat >= layout.num_rows)).sum())


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_word_size_at_shard_boundaries(layouts, name, out_dtype, rng, check_rows, poison, watch_loads):
    layout = layouts(name)
    out_dtype = out_dtype or layout.dtype
    ids_list = boundary_ids(layout) + rng.integers(-5, layout.num_rows + 5, 200).tolist()
    ids = torch.tensor(ids_list, dtype=torch.int64)[torch.from_numpy(rng.permutation(len(ids_list)))]
    with MappedShards(layout) as mapping:
        out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype))
        counters = gather(mapping, ids, out)
        # The words the launch read the rows in (out is 64-byte aligned: only the table limits
        # them), and no load wider than its address's alignment, which a GPU would fault on.
        assert watch_loads.row_widths(mapping.host_bases(), mapping) == {LAYOUTS[name][-1]}
        assert watch_loads.misaligned() == []
    check_rows(out, layout, ids)
    assert counters.tolist() == [ids.numel(), oob_count(layout, ids)]


@pytest.mark.parametrize("scaled", [True, False], ids=["scale", "no-scale"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize(
    "name", ["fp8-rb7-w8", "fp8-rb6-w16", "e5m2-rb12-w32", "fp8-aligned-w64", "e5m2-aligned-w64"]
)
def test_every_fp8_byte_dequantized_bit_for_bit(
    tmp_path_factory, name, out_dtype, scaled, rng, poison, expected_rows, assert_same_bits
):
    dtype, num_rows, row_dim, shards, files, _ = LAYOUTS[name]
    path = tmp_path_factory.mktemp("bytes")
    if files == "aligned":
        layout = write_aligned(
            path / "c", num_rows=num_rows, row_dim=row_dim, dtype=dtype, shards=shards, seed=1
        )
    else:
        layout = write_checkpoint(
            path, num_rows=num_rows, row_dim=row_dim, dtype=dtype, shards=shards, files=files
        )
    layout = fill_all_patterns(layout)
    out_dtype = out_dtype or layout.dtype
    ids = torch.from_numpy(rng.permutation(layout.num_rows))
    with MappedShards(layout) as mapping:
        out = poison(torch.empty((ids.numel(), row_dim), dtype=out_dtype))
        gather(mapping, ids, out, scale="table" if scaled else None)
    raw = torch.from_numpy(expected_rows(layout, ids).view(torch.uint8).numpy())
    assert set(raw.unique().tolist()) == set(range(256))  # -0.0, subnormals, NaN (and inf) included
    if out_dtype == layout.dtype:
        assert torch.equal(out.view(torch.uint8), raw)
        return
    value = raw.view(layout.dtype).float()
    if scaled:
        value = value * torch.tensor(layout.scale, dtype=torch.float32)
    expect = value.to(out_dtype)
    assert_same_bits(out, expect, raw=False)
    # Spelled out: -0.0 keeps its sign, and the smallest subnormal is exact.
    int_view = torch.int32 if out_dtype == torch.float32 else torch.int16
    neg_zero = {torch.float32: -(2**31), torch.bfloat16: -(2**15), torch.float16: -(2**15)}[out_dtype]
    assert (out.view(int_view)[raw == 0x80] == neg_zero).all()
    tiny = 2.0**-9 if layout.dtype == torch.float8_e4m3fn else 2.0**-16
    tiny_expect = torch.tensor(tiny, dtype=torch.float32)
    if scaled:
        tiny_expect = tiny_expect * torch.tensor(layout.scale, dtype=torch.float32)
    assert (out[raw == 0x01] == tiny_expect.to(out_dtype)).all()


PLACEMENTS = ["aligned", "odd"]  # the synthetic writer's files, or rewritten by misalign_checkpoint


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_16bit_pattern(
    tmp_path_factory, dtype, out_dtype, placement, rng, check_rows, poison, expected_rows, watch_loads
):
    path = tmp_path_factory.mktemp("patterns")
    layout = write_checkpoint(path, num_rows=1030, row_dim=64, dtype=dtype, shards=3)
    if placement == "odd":
        misalign_checkpoint(path)
        layout = read_layout(str(path))
        assert any(s.offset % 2 for s in layout.shards)
    layout = fill_all_patterns(layout)
    out_dtype = out_dtype or layout.dtype
    ids = torch.from_numpy(rng.permutation(layout.num_rows))
    with MappedShards(layout) as mapping:
        out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype))
        gather(mapping, ids, out)
        assert watch_loads.row_widths(mapping.host_bases(), mapping) == {64 if placement == "aligned" else 8}
        assert watch_loads.misaligned() == []
    assert len(expected_rows(layout, ids).view(torch.int16).unique()) == 65536
    check_rows(out, layout, ids)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["raw", "f32"])
@pytest.mark.parametrize(
    "owned",
    [(37, 76), (38, 38), (0, 1), (149, 150), (40, 70), (0, 150), (75, 150)],
    ids=["across-boundaries", "empty", "first-row", "last-row", "inside-one-shard", "all", "tail"],
)
def test_owned_range_only_mapped_and_masked(layouts, owned, out_dtype, check_rows, poison):
    # fp8-rb24-w32: 150 rows in shards of 38 (0..37, 38..75, 76..113, 114..149). Only the owned
    # rows are mapped, so reading any other row would fault: masked rows must never be read.
    layout = layouts("fp8-rb24-w32")
    ids = torch.arange(-3, layout.num_rows + 3)
    with MappedShards(layout, owned) as mapping:
        out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype or layout.dtype))
        counters = gather(mapping, ids, out)
    check_rows(out, layout, ids, rows=owned)
    assert counters.tolist() == [ids.numel(), 6]


@pytest.mark.parametrize(
    ("num_rows", "shards"),
    [(9, 6), (4, 3), (16, 7), (1, 1), (50, 1), (1000, 64)],
    ids=["trailing-empty", "2-2-0", "3x5-1-0", "one-row", "single-shard", "64-shards"],
)
def test_shard_counts(tmp_path, num_rows, shards, rng, check_rows, poison):
    layout = write_checkpoint(
        tmp_path, num_rows=num_rows, row_dim=5, dtype="fp8", shards=shards, seed=int(rng.integers(1 << 30))
    )
    if (num_rows, shards) in ((9, 6), (4, 3), (16, 7), (1000, 64)):
        assert layout.shards[-1].rows == 0
    ids_list = boundary_ids(layout) + list(range(-2, num_rows + 2))
    ids = torch.tensor(ids_list, dtype=torch.int64)
    with MappedShards(layout) as mapping:
        for out_dtype in (layout.dtype, torch.bfloat16):
            out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype))
            counters = gather(mapping, ids, out)
            check_rows(out, layout, ids)
            assert counters.tolist() == [ids.numel(), oob_count(layout, ids)]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_id_dtypes_and_extremes(layouts, id_dtype, rng, check_rows, poison):
    layout = layouts("bf16-rb8-w64")
    info = torch.iinfo(id_dtype)
    ids_list = [info.min, info.min + 1, -1, info.max, info.max - 1, layout.num_rows]
    ids_list += rng.integers(0, layout.num_rows, 50).tolist()
    ids = torch.tensor(ids_list, dtype=id_dtype)
    with MappedShards(layout) as mapping:
        out = poison(torch.empty((ids.numel(), layout.row_dim), dtype=torch.float32))
        counters = gather(mapping, ids, out)
    check_rows(out, layout, ids.to(torch.int64))
    assert counters.tolist() == [ids.numel(), 6]


def test_empty_ids_touch_nothing(layouts, poison):
    layout = layouts("fp8-rb24-w32")
    with MappedShards(layout) as mapping:
        for id_dtype in (torch.int32, torch.int64):
            out = poison(torch.empty((0, layout.row_dim), dtype=torch.bfloat16))
            counters = torch.tensor([7, 3], dtype=torch.int64)
            gather(mapping, torch.empty(0, dtype=id_dtype), out, counters)
            assert counters.tolist() == [7, 3]


@pytest.mark.parametrize("rows_per_program", [1, 4, ROWS_PER_PROGRAM, 64])
def test_program_tails_write_only_their_rows(layouts, rows_per_program, rng, check_rows, poison):
    layout = layouts("e5m2-rb12-w32")
    n = 37  # not a multiple of any block
    ids = torch.from_numpy(rng.integers(-2, layout.num_rows + 2, n))
    for out_dtype in (layout.dtype, torch.float16):
        buf = poison(torch.empty((n + 9, layout.row_dim), dtype=out_dtype))
        with MappedShards(layout) as mapping:
            gather(mapping, ids, buf[:n], rows_per_program=rows_per_program)
        check_rows(buf[:n], layout, ids)
        assert (buf[n:].view(torch.uint8) == 0xAB).all()


def test_counters_accumulate_on_the_device(layouts, rng):
    layout = layouts("f16-rb4-w32")
    counters = torch.zeros(2, dtype=torch.int64)
    with MappedShards(layout) as mapping:
        total, bad = 0, 0
        for n in (1, 16, 17, 100):
            ids = torch.from_numpy(rng.integers(-20, layout.num_rows + 20, n))
            gather(mapping, ids, torch.empty((n, layout.row_dim), dtype=layout.dtype), counters)
            total, bad = total + n, bad + oob_count(layout, ids)
            assert counters.tolist() == [total, bad]


def test_raw_rows_into_an_unaligned_buffer(layouts, rng, check_rows, poison):
    # An out one byte past an 8-aligned address: raw words must shrink to bytes.
    layout = layouts("fp8-aligned-w64")
    n = 40
    ids = torch.from_numpy(rng.integers(-2, layout.num_rows + 2, n))
    buf = poison(torch.empty(n * layout.row_bytes + 2, dtype=torch.uint8))
    out = buf[1 : 1 + n * layout.row_bytes].view(layout.dtype).view(n, layout.row_dim)
    assert out.data_ptr() % 2 == 1
    with MappedShards(layout) as mapping:
        gather(mapping, ids, out)
    check_rows(out, layout, ids)
    assert buf[0] == 0xAB and buf[-1] == 0xAB


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize(
    "name", ["fp8-rb7-w8", "bf16-rb6-w16", "fp8-rb24-w32", "fp8-aligned-w64", "f16-rb48-w64", "bf16-odd-w8"]
)
def test_ats_table_runs_the_kernel(layouts, name, out_dtype, rng, check_rows, watch_loads):
    layout = layouts(name)
    in_int32 = [i for i in boundary_ids(layout) if abs(i) < 2**31]
    ids = torch.tensor(in_int32 + rng.integers(0, layout.num_rows, 40).tolist(), dtype=torch.int32)
    ids = ids[: (ids.numel() // 4) * 4].reshape(4, -1)  # 2-D int32 ids
    with ple_um.open_table(layout.directory, mode="ats", device="cpu") as table:
        assert table.mode == "ats" and table.paths.gpu is not None
        watch_loads.clear()  # the open's self-test launched the kernel too: this reads the lookup's
        out = table.lookup(ids, out_dtype=out_dtype)
        # The table's alignment let the launch read its rows in the words the module expects, and
        # no load was wider than its address's alignment.
        assert watch_loads.row_widths(table.paths.gpu.bases, table.mapping) == {LAYOUTS[name][-1]}
        assert watch_loads.misaligned() == []
        assert out.shape == (*ids.shape, layout.row_dim)
        check_rows(out, layout, ids)
        assert table.stats()["out_of_range"] == oob_count(layout, ids)
