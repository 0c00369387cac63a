"""Tables whose tensor data start at any byte: served exactly in every mode.

The safetensors format does not require a tensor to start at a multiple of its element size; the
``safetensors`` package reads such files (``safe_open``), so a checkpoint laid out that way must be
served too. Each checkpoint here is a synthetic one rewritten by ``misalign_checkpoint``: headers
padded to odd lengths and odd-sized tensors ahead of the shards, so BF16, F16 and FP8 rows and
NVFP4 packed rows and block scales start at odd bytes. Every lookup, raw and dequantized, into a
poisoned output, is compared with what the ``safetensors`` package reads from the same files
(the kernel alone on every 16-bit pattern at odd addresses: tests/kernels/test_gather.py).

The cpu mode runs the host gather; ats and device run the kernel under the Triton interpreter,
registered through the injected registration of tests/helpers/machines.py. The interpreter does not
fault on a misaligned load as a GPU does, so the kernel's loads are read from the launch
(``watch_loads``): none may be misaligned. tests/gpu/test_gpu_unaligned.py runs the same kind
of tables on a GPU.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from helpers.machines import H200
from helpers.reference import decode_nvfp4, misalign_checkpoint, safetensors_table

import ple_um
from ple_um.access.capabilities import triton_interpreter
from ple_um.checkpoint import read_layout
from ple_um.errors import CheckpointError
from ple_um.synthetic import write_checkpoint

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

MODES = ["cpu", "ats", "device", "registered"]
FLOAT_OUT = [torch.bfloat16, torch.float16, torch.float32]
# dtype: row_dim (NVFP4: 48 values, 24 packed bytes and 3 block scales a row)
TABLES = {"bf16": 6, "f16": 6, "fp8": 5, "nvfp4": 48}


@pytest.fixture(scope="module")
def unaligned(tmp_path_factory):
    """``unaligned(dtype)``: 53 rows in 5 shards over 4 files, rewritten so that the data sections
    start at 7, 1, 2 and 4 mod 8 with 3, 0, 5 and 1 bytes ahead of the first shard (fresh random
    data, written once per module)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"test_unaligned tables: seed {seed}")
    made = {}

    def get(dtype: str):
        if dtype not in made:
            path = tmp_path_factory.mktemp(dtype)
            write_checkpoint(
                path, num_rows=53, row_dim=TABLES[dtype], dtype=dtype, shards=5, files=4, seed=seed
            )
            misalign_checkpoint(path)
            made[dtype] = read_layout(str(path))
        return made[dtype]

    return get


def lookup_ids(layout, rng) -> torch.Tensor:
    """Every row, each shard's first and last, ids outside the table, duplicates; shuffled."""
    S = layout.rows_per_shard
    ids = list(range(layout.num_rows)) + [-(2**40), -3, -1, layout.num_rows, layout.num_rows + 5]
    ids += [v for i in range(layout.parts) for v in (i * S, i * S + S - 1)]
    ids += rng.integers(0, layout.num_rows, 20).tolist()
    return torch.tensor(ids, dtype=torch.int64)[torch.from_numpy(rng.permutation(len(ids)))]


def expected(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``values[ids]``, zeros for ids outside the table."""
    inside = (ids >= 0) & (ids < values.shape[0])
    out = torch.zeros((ids.numel(), *values.shape[1:]), dtype=values.dtype)
    out[inside] = values[ids[inside]]
    return out


def open_in(mode: str, layout, machine):
    if mode == "registered":
        machine(H200)
    return ple_um.open_table(layout.directory, mode=mode, device="cpu")


def test_the_tables_do_lie_unaligned(unaligned):
    for dtype in TABLES:
        layout = unaligned(dtype)
        offsets = [s.offset for s in (*layout.shards, *layout.block_scales) if s.rows]
        assert any(off % 2 for off in offsets), (dtype, offsets)  # odd: no 16-bit element aligned
        assert {off % 8 for off in offsets} - {0}, (dtype, offsets)
        if dtype in ("bf16", "f16"):
            assert any(off % 4 == 2 for off in offsets), (dtype, offsets)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "fp8"])
def test_rows_equal_what_safetensors_reads(
    unaligned, dtype, mode, machine, rng, poison, watch_loads, assert_same_bits
):
    layout = unaligned(dtype)
    st = safetensors_table(layout)
    ids = lookup_ids(layout, rng)
    raw = expected(st["rows"], ids)
    value = st["rows"].float() * st["scale"] if "scale" in st else st["rows"].float()
    with open_in(mode, layout, machine) as table:
        assert table.mode == mode
        watch_loads.clear()  # the open's self-test launched the kernel too: this reads the lookups'
        out = table.lookup(ids, out=poison(torch.empty((ids.numel(), layout.row_dim), dtype=layout.dtype)))
        assert_same_bits(out, raw)
        for out_dtype in FLOAT_OUT:
            got = table.lookup(ids, out=poison(torch.empty((ids.numel(), layout.row_dim), dtype=out_dtype)))
            assert_same_bits(got, expected(value.to(out_dtype), ids))
        assert table.stats()["out_of_range"] == 4 * int(((ids < 0) | (ids >= layout.num_rows)).sum())
        if table.paths.gpu is not None:
            assert watch_loads.misaligned() == []
            if mode != "device":  # the device copy's rows start at multiples of row_bytes
                # Rows starting at odd bytes are read a byte at a time, raw and dequantized.
                assert watch_loads.row_widths(table.paths.gpu.bases, table.mapping) == {8}


@pytest.mark.parametrize("mode", MODES)
def test_nvfp4_equals_what_safetensors_reads(unaligned, mode, machine, rng, watch_loads, assert_same_bits):
    layout = unaligned("nvfp4")
    st = safetensors_table(layout)
    ids = lookup_ids(layout, rng)
    packed = expected(st["rows"], ids)
    scales = expected(st["block_scales"].view(torch.uint8), ids)
    decoded = torch.from_numpy(decode_nvfp4(packed.numpy(), scales.numpy(), st["scale"].item()))
    with open_in(mode, layout, machine) as table:
        assert table.mode == mode
        watch_loads.clear()
        for out_dtype in FLOAT_OUT:
            out = torch.full((ids.numel(), layout.row_dim), float("nan"), dtype=out_dtype)
            assert table.lookup(ids, out=out) is out
            assert_same_bits(out, decoded.to(out_dtype))
        got_packed, got_scales = table.lookup_packed(ids)
        assert_same_bits(got_packed, packed)
        assert_same_bits(got_scales.view(torch.uint8), scales)
        if table.paths.gpu is not None:
            assert watch_loads.misaligned() == []


# -- what stays refused: offsets out of range and overlaps, at odd offsets too -----------------------
def rewrite_header(path: str, change) -> None:
    """Apply ``change(header)`` to the JSON header of ``path`` and write it back, its length and the
    data kept (the header is re-padded with spaces to its old length, so the data do not move)."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    assert len(raw) <= length, "the changed header must fit in the old one"
    with open(path, "wb") as f:
        f.write(blob[:8] + raw + b" " * (length - len(raw)) + blob[8 + length :])


@pytest.mark.parametrize("case", ["past the end", "overlapping"])
@pytest.mark.parametrize("dtype", ["bf16", "nvfp4"])
def test_broken_offsets_are_still_refused_with_file_and_tensor(tmp_path, dtype, case):
    # The third file (shards 0-1, 2, 3, 4 in four files): a 5-byte tensor, then shard 3 (and its
    # block scales for NVFP4), all at odd offsets. Each break leaves the rest of the data covered,
    # so the break is the only fault.
    write_checkpoint(tmp_path, num_rows=53, row_dim=TABLES[dtype], dtype=dtype, shards=5, files=4)
    misalign_checkpoint(tmp_path)
    path = read_layout(str(tmp_path)).shards[3].path
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    lead, after, last = names[0], names[1], names[-1]
    assert header[lead]["shape"] == [5] and header[after]["data_offsets"][0] == 5

    def change(header):
        if case == "past the end":  # the last tensor one row longer than the file holds
            rows, width = header[last]["shape"]
            a, b = header[last]["data_offsets"]
            header[last]["shape"] = [rows + 1, width]
            header[last]["data_offsets"] = [a, b + (b - a) // rows]
        else:  # the odd-sized tensor three bytes longer, over the start of the next one
            header[lead]["shape"] = [8]
            header[lead]["data_offsets"] = [0, 8]

    rewrite_header(path, change)
    named = last if case == "past the end" else after
    for mode in ("cpu", "ats"):
        with pytest.raises(CheckpointError) as info:
            ple_um.open_table(tmp_path, mode=mode, device="cpu")
        assert (info.value.path, info.value.tensor) == (path, named), str(info.value)
