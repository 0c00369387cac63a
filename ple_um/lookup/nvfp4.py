"""Host-gathered NVFP4 rows decoded with torch ops on the device (the GPU modes' kernels do the same
arithmetic while they gather).

An NVFP4 value is ``e2m1 * (block_scale * global_scale)`` in float32, cast to the output dtype: the
arithmetic of vLLM 0.33's own NVFP4 decoder, so the results agree bit for bit. Every op here can be
captured in a CUDA graph (no host copy: the E2M1 table is put on each device once).
"""

from __future__ import annotations

import threading

import torch

from ple_um.checkpoint import NVFP4_BLOCK

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
