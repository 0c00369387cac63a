"""NVFP4 rows decoded with torch ops: the cpu mode's decoder (the GPU modes decode in the kernel).

A value is ``e2m1 * (block_scale * global_scale)`` in float32, cast to the output dtype: the
arithmetic of vLLM 0.33's own NVFP4 decoder, so the results agree bit for bit.
"""

from __future__ import annotations

import torch

BLOCK = 16  # values per E4M3 block scale
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def decode_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``packed`` uint8 [n, D/2] (low nibble the even value), ``scales`` uint8/E4M3 [n, D/16],
    ``global_scale`` float32 [1] -> ``out`` [n, D]."""
    n, dim = out.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, dim).long()
    values = _E2M1.to(out.device)[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    block = scales.view(torch.float8_e4m3fn).float() * global_scale
    out.copy_((values.view(n, dim // BLOCK, BLOCK) * block.unsqueeze(-1)).view(n, dim))
