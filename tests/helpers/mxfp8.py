"""The rows an MXFP8 (DeepSeek-V4.1 Engram) lookup must return, decoded from the files with NumPy
from the format: E4M3 values (``decode_e4m3``) times the float32 whose bits are the E8M0 byte
shifted into the exponent field (vLLM 0.33's own decode: byte 0 a zero scale)."""

from __future__ import annotations

import numpy as np
import torch

from helpers.reference import decode_e4m3, reference_rows


def reference_mxfp8(layout, ids, rows=None, out_dtype=torch.float32) -> torch.Tensor:
    """``[len(ids), row_dim]`` in ``out_dtype`` (rounded to nearest even); zeros for ids outside
    the table or the owned ``rows``."""
    values = decode_e4m3(reference_rows(layout, ids, rows))
    exponents = reference_rows(layout.scale_layout(), ids, rows).astype(np.uint32)
    scales = (exponents << np.uint32(23)).view(np.float32)
    with np.errstate(over="ignore"):  # large exponents overflow to infinity, as on the device
        decoded = values.reshape(len(values), -1, 32) * scales[:, :, None]
    return torch.from_numpy(decoded.reshape(len(values), -1)).to(out_dtype)
