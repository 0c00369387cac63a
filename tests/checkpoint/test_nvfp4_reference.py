"""The NVFP4 reference decoder the lookup paths are checked against (tests/helpers/reference.py):
its E2M1 and E4M3 codes, rows decoded by hand, one rounding in the output dtype, and agreement with
torch's float8 decoder and with vLLM's own CPU dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import block, global_name, one_file, scalar, shard
from helpers.reference import decode_e2m1, decode_e4m3, reference_nvfp4, reference_rows

from ple_um.checkpoint import read_layout


def test_e2m1_codes():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    values = decode_e2m1(np.arange(16))
    assert values.dtype == np.float32 and values.tolist() == expected
    assert np.signbit(values[8]) and not np.signbit(values[0])


def test_e4m3_codes():
    values = decode_e4m3(np.arange(256))
    assert values.dtype == np.float32
    hand = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x38: 1.0, 0x3C: 1.5, 0x40: 2.0}
    hand |= {0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x81: -(2.0**-9), 0x30: 0.5, 0x47: 3.75}
    for code, value in hand.items():
        assert values[code] == value, hex(code)
    assert np.signbit(values[0x80]) and values[0x80] == 0
    assert np.isnan(values[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(values, [0x7F, 0xFF])).all()
    # torch's float8_e4m3fn agrees, bit for bit but for the NaNs' sign and payload.
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = np.isfinite(values)
    assert np.array_equal(np.isnan(theirs), ~finite)
    assert np.array_equal(values[finite].view(np.uint32), theirs[finite].view(np.uint32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (so -0.0 differs from 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def hand_table(tmp_path, packed: bytes, scales: bytes, global_scale: float):
    """One row of ``2 * len(packed)`` values in one shard."""
    tensors = {
        shard(0): ("U8", [1, len(packed)], packed),
        block(0): ("F8_E4M3", [1, len(scales)], scales),
        global_name(): ("F32", [], scalar("F32", global_scale)),
    }
    return read_layout(one_file(tmp_path, tensors))


def test_reference_decoder_by_hand(tmp_path):
    # 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) element 1; 0x80: +0, -0;
    # 0xF7: 6, -6; 0x9B: -1.5, -0.5; then zeros.
    packed = bytes([0x21, 0x80, 0xF7, 0x9B]) + bytes(4) + bytes([0x44, 0x0F]) + bytes(6)
    layout = hand_table(tmp_path, packed, scales=bytes([0x38, 0x3C]), global_scale=1.0)
    got = reference_nvfp4(layout, [0], out_dtype=torch.float32)
    assert got.shape == (1, 32) and got.dtype == torch.float32
    assert got[0, :8].tolist() == [0.5, 1.0, 0.0, -0.0, 6.0, -6.0, -1.5, -0.5]
    assert torch.signbit(got[0, 3]) and not torch.signbit(got[0, 2])
    assert not got[0, 8:16].any()
    # Block 1 has scale 1.5: 0x44 -> 2, 2; 0x0F -> -6, 0.
    assert got[0, 16:20].tolist() == [3.0, 3.0, -9.0, 0.0]
    # The global scale multiplies too; ids out of range give zeros.
    other = tmp_path / "other"
    other.mkdir()
    layout = hand_table(other, packed, scales=bytes([0x40, 0x01]), global_scale=0.25)  # 2.0, 2**-9
    got = reference_nvfp4(layout, [[0, 1], [-1, 0]], out_dtype=torch.float32)
    assert got.shape == (2, 2, 32)
    assert got[0, 0, :6].tolist() == [0.25, 0.5, 0.0, -0.0, 3.0, -3.0]
    assert got[0, 0, 16:19].tolist() == [2.0**-10, 2.0**-10, -6 * 2.0**-11]
    assert not got[0, 1].any() and not got[1, 0].any()
    assert torch.equal(got[1, 1], got[0, 0])
    assert not reference_nvfp4(layout, [0], rows=(1, 5)).any()
    assert reference_nvfp4(layout, [0]).dtype == torch.bfloat16


def test_reference_decoder_rounds_once_in_the_output_dtype(tmp_path):
    # 1.5 * (1.5 * 0.3) in float32, then to bfloat16: the scales' product first.
    layout = hand_table(tmp_path, bytes([0x33]) + bytes(7), bytes([0x3C]), global_scale=0.3)
    scale = np.float32(1.5) * np.float32(0.3)
    f32 = np.float32(1.5) * scale
    got = reference_nvfp4(layout, [0], out_dtype=torch.float32)
    assert got[0, 0].item() == float(f32) == got[0, 1].item()
    assert reference_nvfp4(layout, [0])[0, 0] == torch.tensor(float(f32)).to(torch.bfloat16)


def test_reference_decoder_against_torch(make_checkpoint):
    """The same computation with torch's own float8 decoder and vLLM's nibble order."""
    layout = make_checkpoint(dtype="nvfp4", num_rows=40, row_dim=64, shards=3, seed=2)
    ids = np.array([0, 39, 13, 14, -1, 40, 26, 5])
    packed = torch.from_numpy(reference_rows(layout, ids))
    scales = torch.from_numpy(reference_rows(layout.scale_layout(), ids)).view(torch.float8_e4m3fn)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(len(ids), 64).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    product = scales.float() * torch.tensor(layout.scale, dtype=torch.float32)
    expect = (values.reshape(len(ids), 4, 16) * product.unsqueeze(-1)).reshape(len(ids), 64)
    valid = torch.from_numpy((ids >= 0) & (ids < 40))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = reference_nvfp4(layout, ids, out_dtype=dtype)
        assert same_bits(got[valid], expect[valid].to(dtype)), dtype
        assert same_bits(got[~valid], torch.zeros_like(got[~valid]))


@pytest.mark.vllm
def test_reference_decoder_against_vllm_cpu_path(make_checkpoint):
    """vLLM's own CPU dequantization (what Qwen4ExpPLENvFp4EmbeddingMethod.embedding runs on the
    CPU) gives the same bits."""
    emulation = pytest.importorskip("vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils")
    layout = make_checkpoint(dtype="nvfp4", num_rows=300, row_dim=128, shards=4, seed=9)
    ids = np.arange(layout.num_rows)
    packed = torch.from_numpy(reference_rows(layout, ids))
    scales = torch.from_numpy(reference_rows(layout.scale_layout(), ids)).view(torch.float8_e4m3fn)
    global_scale = torch.tensor([layout.scale], dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        theirs = emulation.dequantize_to_dtype(packed, scales, global_scale, dtype, swizzle=False)
        ours = reference_nvfp4(layout, ids, out_dtype=dtype)
        assert theirs.dtype == ours.dtype and theirs.shape == ours.shape
        assert same_bits(theirs, ours), dtype
