"""NVFP4 row gather: packed E2M1 rows and their E4M3 block scales, decoded on the device.

An NVFP4 table is two tables with the same row ids: packed rows (two E2M1 values a byte, the low
nibble the even element) and block scales (one E4M3 byte per 16 values), each reached through its
own per-shard base addresses. A value is ``e2m1 * (block_scale * global_scale)`` in float32 (the
order vLLM 0.33's own decoder multiplies in), cast to the output dtype. Rows outside the owned
range and ids outside the table are never read and come back as zeros; the counters are the same
as the plain gather's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple_um.checkpoint import NVFP4_BLOCK
from ple_um.kernels.gather import NUM_WARPS, ROWS_PER_PROGRAM, _block_scales, _decode, _locate, _store_decoded
from ple_um.kernels.launch import DirectLaunch, launch_decoding

_BLOCK = tl.constexpr(NVFP4_BLOCK)  # values per block scale


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
def _gather_nvfp4_kernel(
    row_bases_ptr,  # int64 [parts]: address of each shard's packed row 0
    scale_bases_ptr,  # int64 [parts]: address of each shard's block-scale row 0
    ids_ptr,
    out_ptr,  # [n, row_dim] float32 / float16 / bfloat16 (as int16)
    counters_ptr,  # int64 [2]: rows looked up, ids outside [0, num_rows)
    global_scale_ptr,  # float32 [1]
    n,
    row_start,
    row_end,
    num_rows,
    rows_per_shard,
    row_dim,
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
):
    rows, in_batch, owned, shard, local = _locate(
        ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS
    )
    row_base, e, m, scale_byte = _block_scales(
        row_bases_ptr, scale_bases_ptr, owned, shard, local, row_dim, _BLOCK, DIM
    )
    packed = row_base + local * (row_dim // 2)
    byte = tl.load(packed[:, None] + (e // 2)[None, :], mask=m, other=0).to(tl.int32)
    code = (byte >> ((e % 2) * 4)[None, :]) & 0xF
    block_scale = _decode(scale_byte, 0) * tl.load(global_scale_ptr)  # 0: E4M3 (constexpr literal)
    _store_decoded(out_ptr, _e2m1(code) * block_scale, rows, in_batch, e, row_dim, OUT_BF16)


def gather_nvfp4(
    row_bases: torch.Tensor,
    scale_bases: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    row_start: int,
    row_end: int,
    num_rows: int,
    rows_per_shard: int,
    row_dim: int,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    launch: DirectLaunch | None = None,
) -> torch.Tensor:
    """Decode the NVFP4 rows of flat ``ids`` into ``out`` [n, row_dim] (bf16, f16 or f32); ``launch``
    as ``gather_rows``'. No allocation, no host sync."""
    geometry = (row_start, row_end, num_rows, rows_per_shard, row_dim)
    extra = (global_scale,)
    bases = (row_bases, scale_bases)
    return launch_decoding(
        _gather_nvfp4_kernel, launch, bases, ids, out, counters, extra, geometry, rows_per_program, num_warps
    )
