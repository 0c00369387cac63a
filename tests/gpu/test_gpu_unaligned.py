"""Tables whose tensors start at odd bytes on a real GPU: BF16, F16, FP8 and NVFP4 tables with odd
header padding and odd-sized tensors ahead of the shards (``misalign_checkpoint``), in the modes a
discrete GPU has (registered, device, cpu), raw and dequantized (NVFP4: decoded, and its packed
rows and block scales), eager into poisoned outputs and replayed in CUDA graphs with new ids, every
element against what the ``safetensors`` package reads of the same files. A GPU faults on a
misaligned load where the Triton interpreter does not (tests/kernels/test_unaligned.py reads the
interpreter's load widths instead), so this is the check the CPU tests cannot make.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.reference import bits_differ, decode_nvfp4, misalign_checkpoint, safetensors_table

import ple_um
from ple_um.checkpoint import read_layout
from ple_um.synthetic import write_checkpoint

MODES = ["registered", "device", "cpu"]
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# 100 003 rows in 16 shards over 4 files (about 16 MB each); NVFP4: 160 values, 80 packed bytes
# and 10 block scales a row.
FORMATS = {"bf16": 80, "f16": 80, "fp8": 160, "nvfp4": 160}


class Reference:
    """A table's rows as the ``safetensors`` package reads its files: raw (NVFP4: packed rows and
    block-scale bytes) and dequantized in float32 (NVFP4: decoded from those bytes)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        st = safetensors_table(layout)
        self.raw = st["rows"]
        if layout.is_nvfp4:
            self.blocks = st["block_scales"].view(torch.uint8)
            self.value = torch.from_numpy(
                decode_nvfp4(self.raw.numpy(), self.blocks.numpy(), st["scale"].item())
            )
        else:
            self.value = self.raw.float() * st["scale"] if "scale" in st else self.raw.float()

    @staticmethod
    def take(values: torch.Tensor, ids) -> torch.Tensor:
        """``values[ids]``, zeros for ids outside the table."""
        ids = torch.as_tensor(ids).reshape(-1)
        inside = (ids >= 0) & (ids < values.shape[0])
        out = torch.zeros((ids.numel(), *values.shape[1:]), dtype=values.dtype)
        out[inside] = values[ids[inside]]
        return out

    def rows(self, ids, dtype: torch.dtype) -> torch.Tensor:
        """What a lookup of ``ids`` into ``dtype`` must return: raw in the storage dtype, else
        dequantized (float32 value cast)."""
        if dtype == self.layout.dtype:
            return self.take(self.raw, ids)
        return self.take(self.value, ids).to(dtype)


@pytest.fixture(scope="module")
def unaligned(tmp_path_factory):
    """``unaligned(name) -> Reference``: the table of FORMATS[name], its files rewritten by
    ``misalign_checkpoint`` (data sections at 7, 1, 2 and 4 mod 8 behind 3, 0, 5 and 1 bytes of
    another tensor), fresh random data, written and read by ``safetensors`` once per module."""
    pytest.importorskip("safetensors", reason="the reference is what the safetensors package reads")
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"unaligned tables seed {seed}")
    made: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in made:
            path = tmp_path_factory.mktemp(f"unaligned-{name}")
            write_checkpoint(
                path, num_rows=100_003, row_dim=FORMATS[name], dtype=name, shards=16, files=4, seed=seed
            )
            misalign_checkpoint(path)
            made[name] = Reference(read_layout(str(path)))
        return made[name]

    return get


def same(got: torch.Tensor, want: torch.Tensor, layout) -> str | None:
    """None when ``got`` has ``want``'s shape, dtype and bits, else why. Raw rows (the storage
    dtype, packed bytes) are compared byte for byte; in dequantized ones a NaN need only be a NaN."""
    raw = want.dtype in (layout.dtype, torch.uint8)
    return bits_differ(got.cpu(), want, raw=raw)


def poisoned(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    out.view(torch.uint8).fill_(0xAB)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_unaligned_rows_equal_what_safetensors_reads(
    unaligned, name, mode, ids_for, rng, device, monkeypatch
):
    ref = unaligned(name)
    layout = ref.layout
    offsets = sorted({s.offset % 8 for s in (*layout.shards, *layout.block_scales)})
    assert any(o % 2 for o in offsets), offsets  # odd: no element wider than a byte lies aligned
    # Every lookup of the GPU modes is the kernel's (the host path is the cpu mode's, tested here too).
    monkeypatch.setenv("PLE_UM_BULK_ROWS", "0")
    with ple_um.open_table(layout.directory, mode=mode, device=device) as table:
        assert table.mode == mode
        for n in (16, 8192):
            ids_np = ids_for(layout, n, rng)
            ids = torch.from_numpy(ids_np).to(device)
            if layout.is_nvfp4:
                packed, blocks = table.lookup_packed(ids)
                assert same(packed, Reference.take(ref.raw, ids_np), layout) is None, n
                assert same(blocks.view(torch.uint8), Reference.take(ref.blocks, ids_np), layout) is None, n
            for dtype in FLOATS if layout.is_nvfp4 else (layout.dtype, *FLOATS):
                out = poisoned((n, layout.row_dim), dtype, device)
                assert table.lookup(ids, out=out) is out
                why = same(out, ref.rows(ids_np, dtype), layout)
                assert why is None, (n, dtype, why)
                got = table.lookup(ids.int(), out_dtype=dtype)  # int32 ids, an allocated output
                why = same(got, ref.rows(ids_np.astype("int32"), dtype), layout)
                assert why is None, (n, dtype, "int32", why)
        assert table.stats()["broken_rows"] == 0
        assert table.capture_safe, table.row_reads
        n = 4096
        static = torch.zeros(n, dtype=torch.int64, device=device)
        buf = poisoned((n, layout.row_dim), torch.bfloat16, device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            table.lookup(static, out=buf)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(static, out=buf)
        for k in range(3):
            fresh = ids_for(layout, n, rng)
            static.copy_(torch.from_numpy(fresh))
            buf.view(torch.uint8).fill_(0xAB)
            graph.replay()
            torch.cuda.synchronize()
            why = same(buf, ref.rows(fresh, torch.bfloat16), layout)
            assert why is None, (k, why)
