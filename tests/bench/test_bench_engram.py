"""The bench's contenders on a DeepSeek-V4.1 Engram (MXFP8) table, on the CPU: the torch anchor
and vLLM's stock pinned storage (vLLM's own kernel, and the stand-in where vLLM is missing, each
run by the Triton interpreter over the host copies), every element against the rows decoded from
the files, outputs poisoned first, the table's first and last rows and duplicates included; the
synthetic Engram table the bench writes and reads back. No times are asserted."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.mxfp8 import reference_mxfp8
from helpers.vllm_engram import as_on_a_gpu, engram_module

from ple_um.access.capabilities import triton_interpreter
from ple_um.bench import config, sizing
from ple_um.bench.contenders import ENGRAM_STAND_IN, TorchResident, VllmEngramPinned, describe
from ple_um.bench.timing import DecodeStep, lookup_call
from ple_um.synthetic_engram import write_engram_checkpoint

CPU = torch.device("cpu")
interpreter = pytest.mark.skipif(
    not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"
)


@pytest.fixture(scope="module")
def engram(tmp_path_factory):
    """An Engram table of 3001 rows (fresh random data) at model layer 14."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"Engram bench table seed {seed}")
    path = tmp_path_factory.mktemp("engram")
    return write_engram_checkpoint(path, tables={14: 3001}, seed=seed)[14]


def _ids(layout, rng, n: int = 300) -> torch.Tensor:
    edges = [0, 1, layout.num_rows - 1, 7, 7, layout.num_rows - 1]
    return torch.tensor(edges + rng.integers(0, layout.num_rows, n).tolist())


def _check(impl, layout, rng) -> None:
    """Two lookups by ``impl`` into one poisoned bf16 output equal the rows decoded from the files."""
    for _ in range(2):
        ids = _ids(layout, rng)
        out = torch.full((ids.numel(), layout.row_dim), float("nan"), dtype=torch.bfloat16)
        assert impl.lookup(ids, out=out) is out
        want = reference_mxfp8(layout, ids.numpy(), out_dtype=torch.bfloat16)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_the_torch_anchor_gathers_and_decodes_the_rows_of_the_files(engram, rng):
    anchor = TorchResident(engram, CPU)
    assert anchor.scales.shape == (engram.num_rows, engram.row_dim // 32)
    _check(anchor, engram, rng)
    anchor.close()
    assert anchor.rows is None and anchor.scales is None


@interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_the_pinned_stand_in_reads_its_copies_with_the_mxfp8_kernel(engram, rng):
    pinned = VllmEngramPinned(engram, CPU, use_vllm=False)
    assert pinned.kernel == "stand-in" and pinned.capture_safe
    _check(pinned, engram, rng)
    assert pinned.counters.tolist() == [2 * 306, 0]  # every id looked up, none outside the table
    pinned.close()
    assert pinned.host is None and pinned.host_scales is None


@interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_the_pinned_copies_read_by_vllms_own_kernel(engram, rng):
    """vLLM 0.33's ``_engram_lookup_kernel``, launched as the contender launches it on a GPU (its
    bf16 cast of float32 subnormals put as a GPU rounds them: ``as_on_a_gpu``)."""
    engram_module()
    pinned = VllmEngramPinned(engram, CPU, use_vllm=True)
    assert pinned.kernel == "vllm"
    for _ in range(2):
        ids = _ids(engram, rng)
        out = torch.full((ids.numel(), engram.row_dim), float("nan"), dtype=torch.bfloat16)
        assert pinned.lookup(ids, out=out) is out
        got = as_on_a_gpu(out, pinned.weight, pinned.scales, ids)
        want = reference_mxfp8(engram, ids.numpy(), out_dtype=torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_bench_calls_decode_into_bf16_for_every_contender(engram, rng):
    """``lookup_call`` hands an Engram lookup a bf16 output (the anchor's too); the decode step
    runs on the decoded rows."""
    anchor = TorchResident(engram, CPU)
    ids = _ids(engram, rng, 58).view(1, -1)
    call = lookup_call(anchor, ids, engram, ids.shape[1], CPU)
    out = call(0)
    assert out.dtype == torch.bfloat16 and out.shape == (64, engram.row_dim)
    want = reference_mxfp8(engram, ids[0].numpy(), out_dtype=torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    step = DecodeStep(anchor, engram, CPU, 4, 16, [ids[0]])
    assert step.graph is None and step.eager(ids[0]).shape == (4, 64)
    assert torch.equal(step.out.view(torch.int16), want.view(torch.int16))


def test_each_engram_contender_says_what_it_is():
    anchor = describe("torch index_select", "GPU memory", mxfp8=True)
    assert "E8M0 scales" in anchor and "decoded to bf16 by torch ops" in anchor and "GPU memory" in anchor
    assert "_engram_lookup_kernel" in describe("vllm pinned-host", "GPU memory", mxfp8=True)
    stand_in = describe(ENGRAM_STAND_IN, "GPU memory", mxfp8=True)
    assert "stand-in" in stand_in and "vLLM is not installed" in stand_in
    assert "one Triton program per row" in describe("vllm pinned-host", "GPU memory")


def test_the_synthetic_engram_table_is_written_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    cfg = config.Config(size=1 << 20, model=config.ENGRAM_MODEL)
    layout = config.bench_layout(cfg)
    rows = (1 << 20) // 264
    assert layout.is_mxfp8 and (layout.layer, layout.num_rows, layout.row_dim) == (1, rows, 256)
    assert layout.nbytes == rows * 264 and layout.directory == config.table_path(cfg)
    assert os.path.basename(layout.directory) == f"bench-engram-{rows}x264-1"
    assert sizing.largest_file_bytes(cfg) >= os.path.getsize(layout.files[0])
    written = os.path.getmtime(layout.files[0])
    assert config.bench_layout(cfg) == layout and os.path.getmtime(layout.files[0]) == written
    values = np.fromfile(layout.files[0], dtype=np.uint8)
    assert len(set(values[-rows * 8 :].tolist())) > 100  # the scales hold data, not a hole
    with config.open_ple_um(layout, CPU, "cpu") as table:
        ids = torch.tensor([0, rows - 1, 5])
        out = torch.full((3, 256), float("nan"), dtype=torch.bfloat16)
        table.lookup(ids, out=out)
        want = reference_mxfp8(layout, ids.numpy(), out_dtype=torch.bfloat16)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
