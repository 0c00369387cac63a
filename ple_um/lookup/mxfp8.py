"""Host-gathered MXFP8 rows (DeepSeek-V4.1's Engram tables) decoded with torch ops on the device, as
the GPU modes' kernel (``ple_um/kernels/gather_block_scaled.py``) decodes them while it gathers.

A value is ``float32(e4m3) * scale``, the scale's float32 bits being the E8M0 byte shifted into the
exponent field (``e << 23``: ``e = 0`` a zero scale, ``e = 255`` an infinite one), cast to the
output dtype: the arithmetic of vLLM 0.33's own Engram lookup, so the results agree bit for bit.
Every op here can be captured in a CUDA graph. ``decode_staged`` turns any host-gathered rows into
what a lookup returns: MXFP8 rows decoded here, NVFP4 rows by ``nvfp4.py``, FP8 and 16-bit rows
dequantized (``float32(row) * scale``, cast).
"""

from __future__ import annotations

import torch

from ple_um.checkpoint import MXFP8_BLOCK
from ple_um.lookup.nvfp4 import decode_nvfp4


def decode_mxfp8(values: torch.Tensor, exponents: torch.Tensor, out: torch.Tensor) -> None:
    """``values`` uint8/E4M3 [n, D], ``exponents`` uint8 [n, D/32] -> ``out`` [n, D] (any float)."""
    n, dim = out.shape
    rows = values.reshape(n, dim // MXFP8_BLOCK, MXFP8_BLOCK).view(torch.float8_e4m3fn).float()
    scales = (exponents.reshape(n, -1).to(torch.int32) << 23).view(torch.float32)  # E8M0: e << 23 as bits
    out.copy_((rows * scales.unsqueeze(-1)).view(n, dim))


def decode_staged(
    storage: torch.dtype, staged: list[torch.Tensor], global_scale: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Raw rows gathered on the host (``staged``: uint8 [n, row bytes], and a block-scaled table's
    block scales) into the float ``out``: rows alone dequantized (``float32(row)``, times
    ``global_scale`` where there is one, cast); with block scales, MXFP8 when the rows are stored as
    E4M3, else NVFP4 (packed bytes, with its global scale)."""
    if len(staged) == 1:
        rows = staged[0].view(storage).float()
        out.copy_(rows * global_scale if global_scale is not None else rows)
    elif storage == torch.float8_e4m3fn:
        decode_mxfp8(*staged, out)
    else:
        decode_nvfp4(*staged, global_scale, out)
