"""MXFP8 row gather (DeepSeek-V4.1's Engram tables): E4M3 rows and their E8M0 block scales, decoded
on the device.

An MXFP8 table is two tables with the same row ids: the E4M3 rows and the block scales (one E8M0
exponent byte per 32 values), each reached through its own per-shard base addresses. A value is
``float32(e4m3) * scale`` with the scale's float32 bits ``e << 23``, cast to the output dtype: the
arithmetic of vLLM 0.33's own Engram lookup kernel (``_engram_lookup_kernel``), so the results
agree bit for bit (``e = 0`` is a zero scale there, ``e = 255`` an infinite one, and so here). Rows
outside the owned range and ids outside the table are never read and come back as zeros; the
counters are the plain gather's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple_um.checkpoint import MXFP8_BLOCK
from ple_um.kernels.gather import NUM_WARPS, ROWS_PER_PROGRAM, _block_scales, _decode, _locate, _store_decoded
from ple_um.kernels.launch import DirectLaunch, launch_decoding

_BLOCK = tl.constexpr(MXFP8_BLOCK)  # values per block scale


# Never specialized on the batch (ple_um/kernels/launch.py).
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["ids_ptr", "out_ptr"])
def _gather_mxfp8_kernel(
    row_bases_ptr,  # int64 [parts]: address of each shard's E4M3 row 0
    scale_bases_ptr,  # int64 [parts]: address of each shard's block-scale row 0
    ids_ptr,
    out_ptr,  # [n, row_dim] float32 / float16 / bfloat16 (as int16)
    counters_ptr,  # int64 [2]: rows looked up, ids outside [0, num_rows)
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
    row_base, e, m, exponent = _block_scales(
        row_bases_ptr, scale_bases_ptr, owned, shard, local, row_dim, _BLOCK, DIM
    )
    code = tl.load((row_base + local * row_dim)[:, None] + e[None, :], mask=m, other=0).to(tl.int32)
    # The E8M0 byte is the float32 exponent field of a power of two.
    val = _decode(code, 0) * (exponent << 23).to(tl.float32, bitcast=True)  # 0: E4M3 (constexpr)
    _store_decoded(out_ptr, val, rows, in_batch, e, row_dim, OUT_BF16)


def gather_mxfp8(
    row_bases: torch.Tensor,
    scale_bases: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
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
    """Decode the MXFP8 rows of flat ``ids`` into ``out`` [n, row_dim] (bf16, f16 or f32);
    ``launch`` as ``gather_rows``'. No allocation, no host sync."""
    geometry = (row_start, row_end, num_rows, rows_per_shard, row_dim)
    bases = (row_bases, scale_bases)
    return launch_decoding(
        _gather_mxfp8_kernel, launch, bases, ids, out, counters, (), geometry, rows_per_program, num_warps
    )
