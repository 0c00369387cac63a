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


def engram_ids(num_rows: int, rows, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random ids of a table of ``num_rows`` and 8 at the edges (of the owned ``rows``, of
    the table, outside it), shuffled."""
    extra = [rows[0] - 1, rows[0], rows[1] - 1, rows[1], -1, num_rows, 0, num_rows - 1]
    return rng.permutation(np.concatenate([extra, rng.integers(0, num_rows, n)])).astype(np.int64)


def graph_replays_differ(table, rows, ids_for, device, replays: int = 3) -> list[int]:
    """A bf16 lookup of 24 x 64 ids captured in a CUDA graph (after an eager warm-up), replayed with
    new ids ``ids_for(n)`` (n plus 8 edge ids) into a poisoned output: the replays whose rows differ
    from the files' (none, for a table served right)."""
    ids = torch.zeros(24 * 64, dtype=torch.int64, device=device)
    out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16, device=device)
    table.lookup(ids, out=out)  # warm-up outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.lookup(ids, out=out)
    differ = []
    for k in range(replays):
        ids_np = ids_for(ids.numel() - 8)
        ids.copy_(torch.from_numpy(ids_np))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        want = reference_mxfp8(table.layout, ids_np, rows, torch.bfloat16)
        if not torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)):
            differ.append(k)
    return differ
