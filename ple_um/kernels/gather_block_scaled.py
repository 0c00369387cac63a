"""Block-scaled row gather (NVFP4; MXFP8, DeepSeek-V4.1's Engram tables): rows and their block
scales, decoded on the device.

A block-scaled table is two tables with the same row ids: the rows and the block scales (one byte
per block of values), each reached through its own per-shard base addresses.

- NVFP4: packed E2M1 rows (two values a byte, the low nibble the even element), one E4M3 scale
  per 16 values. A value is ``e2m1 * (block_scale * global_scale)`` in float32 (the order vLLM
  0.33's own decoder multiplies in).
- MXFP8: E4M3 rows, one E8M0 exponent byte per 32 values. A value is ``float32(e4m3) * scale``
  with the scale's float32 bits ``e << 23``: the arithmetic of vLLM 0.33's own Engram lookup
  kernel (``_engram_lookup_kernel``), so the results agree bit for bit (``e = 0`` is a zero scale
  there, ``e = 255`` an infinite one, and so here).

Values are cast to the output dtype. Rows outside the owned range and ids outside the table are
never read and come back as zeros; the counters are the plain gather's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple_um.checkpoint.shard_layout import MXFP8, MXFP8_BLOCK, NVFP4, NVFP4_BLOCK
from ple_um.kernels.gather import NUM_WARPS, ROWS_PER_PROGRAM, _decode, _locate, _store_decoded
from ple_um.kernels.launch import DirectLaunch


@triton.jit
def _e2m1(code):
    """E2M1 code (int32, 4 bits) -> float32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign
    (applied as a multiplication by -1.0, so code 8 is -0.0 as in vLLM's decoder)."""
    mag = code & 7
    ex = mag >> 1
    mn = (mag & 1).to(tl.float32)
    normal = (2.0 + mn) * (1 << tl.maximum(ex - 1, 0)).to(tl.float32) * 0.5
    val = tl.where(ex == 0, mn * 0.5, normal)
    return val * tl.where((code >> 3) == 1, -1.0, 1.0)


# Never specialized on the batch (ple_um/kernels/launch.py).
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["ids_ptr", "out_ptr"])
def _gather_block_scaled_kernel(
    row_bases_ptr,  # int64 [parts]: address of each shard's row 0 (NVFP4: packed; MXFP8: E4M3)
    scale_bases_ptr,  # int64 [parts]: address of each shard's block-scale row 0
    ids_ptr,
    out_ptr,  # [n, row_dim] float32 / float16 / bfloat16 (as int16)
    counters_ptr,  # int64 [2]: rows looked up, ids outside [0, num_rows)
    global_scale_ptr,  # float32 [1]: NVFP4's global scale (read only when NVFP4)
    n,
    row_start,
    row_end,
    num_rows,
    rows_per_shard,
    row_dim,
    NVFP4: tl.constexpr,  # else MXFP8
    BLOCK: tl.constexpr,  # values per block scale
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
):
    rows, in_batch, owned, shard, local = _locate(
        ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS
    )
    row_base = tl.load(row_bases_ptr + shard, mask=owned, other=0).to(tl.pointer_type(tl.uint8))
    scale_base = tl.load(scale_bases_ptr + shard, mask=owned, other=0).to(tl.pointer_type(tl.uint8))
    e = tl.arange(0, DIM)
    m = owned[:, None] & (e < row_dim)[None, :]
    scales = scale_base + local * (row_dim // BLOCK)
    scale_byte = tl.load(scales[:, None] + (e // BLOCK)[None, :], mask=m, other=0).to(tl.int32)
    if NVFP4:
        packed = row_base + local * (row_dim // 2)
        byte = tl.load(packed[:, None] + (e // 2)[None, :], mask=m, other=0).to(tl.int32)
        code = (byte >> ((e % 2) * 4)[None, :]) & 0xF
        block_scale = _decode(scale_byte, 0) * tl.load(global_scale_ptr)  # 0: E4M3 (constexpr literal)
        val = _e2m1(code) * block_scale
    else:
        code = tl.load((row_base + local * row_dim)[:, None] + e[None, :], mask=m, other=0).to(tl.int32)
        # The E8M0 byte is the float32 exponent field of a power of two.
        val = _decode(code, 0) * (scale_byte << 23).to(tl.float32, bitcast=True)  # 0: E4M3 (constexpr)
    _store_decoded(out_ptr, val, rows, in_batch, e, row_dim, OUT_BF16)


def gather_block_scaled(
    row_bases: torch.Tensor,
    scale_bases: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    *,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    row_start: int,
    row_end: int,
    num_rows: int,
    rows_per_shard: int,
    row_dim: int,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    launch: DirectLaunch | None = None,
) -> torch.Tensor:
    """Decode the rows of flat ``ids`` of a ``fmt`` table (``ShardLayout.dtype_name``: NVFP4, with
    its ``global_scale``, a float32 tensor of one element; or MXFP8, with none) into ``out``
    [n, row_dim] (bf16, f16 or f32); ``launch`` as ``gather_rows``'. No allocation, no host sync."""
    if fmt not in (NVFP4, MXFP8) or (fmt == NVFP4) != (global_scale is not None):
        given = "with" if global_scale is not None else "without"
        raise ValueError(
            f"a block-scaled gather takes NVFP4 with a global scale or MXFP8 without; got {fmt} {given}"
        )
    n = ids.numel()
    if n == 0:
        return out
    nvfp4, bf16 = fmt == NVFP4, out.dtype == torch.bfloat16
    target = out.view(torch.int16) if bf16 else out
    block = NVFP4_BLOCK if nvfp4 else MXFP8_BLOCK
    constexprs = (nvfp4, block, bf16, rows_per_program, triton.next_power_of_2(row_dim))  # NVFP4 .. DIM
    scale = counters if global_scale is None else global_scale  # MXFP8: never read
    geometry = (row_start, row_end, num_rows, rows_per_shard, row_dim)
    args = (row_bases, scale_bases, ids, target, counters, scale, n, *geometry, *constexprs)
    kind = (ids.dtype, target.dtype, n >= 1 << 31, *constexprs)
    launch = launch or DirectLaunch(_gather_block_scaled_kernel, direct=False)
    launch(kind, triton.cdiv(n, rows_per_program), args, num_warps)
    return out
