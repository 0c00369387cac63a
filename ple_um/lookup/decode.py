"""Host-gathered rows decoded with torch ops on the device, as the GPU modes' kernels
(``ple_um/kernels/gather.py``, ``gather_block_scaled.py``) decode them while they gather.
``decode_staged`` turns any host-gathered rows into what a lookup returns; every op here can be
captured in a CUDA graph (no host copy: the E2M1 table is put on each device once).

- FP8 and 16-bit rows: ``float32(row) * scale``, cast to the output dtype.
- NVFP4: a value is ``e2m1 * (block_scale * global_scale)`` in float32, cast: the arithmetic of
  vLLM 0.33's own NVFP4 decoder, so the results agree bit for bit.
- MXFP8 (DeepSeek-V4.1's Engram tables): a value is ``float32(e4m3) * scale``, the scale's float32
  bits being the E8M0 byte shifted into the exponent field (``e << 23``: ``e = 0`` a zero scale,
  ``e = 255`` an infinite one), cast: the arithmetic of vLLM 0.33's own Engram lookup.
"""

from __future__ import annotations

import threading

import torch

from ple_um.checkpoint import MXFP8_BLOCK, NVFP4_BLOCK

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
_on_device: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def e2m1_values(device: torch.device) -> torch.Tensor:
    """The eight E2M1 magnitudes on ``device``, copied there once (call it outside any capture)."""
    with _lock:
        values = _on_device.get(device)
        if values is None:
            values = _on_device[device] = _E2M1.to(device)
        return values


def decode_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``packed`` uint8 [n, D/2] (low nibble the even value), ``scales`` uint8/E4M3 [n, D/16],
    ``global_scale`` float32 [1] -> ``out`` [n, D]."""
    n, dim = out.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, dim).long()
    values = e2m1_values(out.device)[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    block = scales.view(torch.float8_e4m3fn).float() * global_scale
    out.copy_((values.view(n, dim // NVFP4_BLOCK, NVFP4_BLOCK) * block.unsqueeze(-1)).view(n, dim))


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
