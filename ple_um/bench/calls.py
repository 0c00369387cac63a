"""The calls the bench times: one lookup into an output allocated once, a decode step eager and
graph-replayed, and a GPU-mode table seen with its kernel for every batch size."""

from __future__ import annotations

from collections.abc import Callable

import torch

import ple_um
from ple_um.checkpoint import ShardLayout


class KernelOnly:
    """A GPU-mode table with the GPU kernel for every batch size: its bulk path switched off for
    the call. Shares the table (one mapping, one registration); closing it leaves the table open."""

    def __init__(self, table) -> None:
        self.table = table
        self.capture_safe = table.capture_safe

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        paths = self.table.paths
        saved, paths.bulk_rows = paths.bulk_rows, None
        try:
            return self.table.lookup(ids, out=out)
        finally:
            paths.bulk_rows = saved

    def close(self) -> None:
        pass


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run once on a side stream (its first-call work: compiles, allocations, buffers), then
    captured into a CUDA graph on the current device: (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def lookup_output(impl, layout: ShardLayout, n: int, device: torch.device) -> torch.Tensor:
    """Where ``impl`` looks ``n`` rows up to: the decoded rows of a block-scaled (NVFP4, MXFP8)
    table in bf16, else the raw rows, in the storage dtype for ple-um's tables and as bytes for a
    contender's."""
    if layout.has_block_scales:
        return torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device=device)
    out = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=device)
    return out.view(layout.dtype) if isinstance(impl, (ple_um.MappedTable, KernelOnly)) else out


def lookup_call(impl, ids, layout: ShardLayout, n: int, device: torch.device) -> Callable[[int], object]:
    """fn(k): one lookup of ``ids[k]`` (n ids) by ``impl`` into an output allocated here, once
    (``lookup_output``)."""
    out = lookup_output(impl, layout, n, device)
    return lambda k: impl.lookup(ids[k], out=out)


class DecodeStep:
    """ids [T, heads] -> lookup -> dequant -> short projection, with its own buffers:
    ``eager(ids)`` runs it, ``replay(ids)`` replays its CUDA graph. ``graph`` is None where the
    contender is not capture-safe (its ``capture_safe``, as the table reports it) or there is no
    CUDA; ``graph_ok``: replays of the ``check`` id sets equal the eager step."""

    def __init__(
        self, impl, layout: ShardLayout, device: torch.device, tokens: int, heads: int, check
    ) -> None:
        self.impl, self.layout, self.T, self.H = impl, layout, tokens, heads
        self.proj = torch.randn(layout.row_dim, 64, dtype=torch.bfloat16, device=device) / 16
        self.ids = torch.zeros((tokens * heads,), dtype=torch.int64, device=device)
        self.out = lookup_output(impl, layout, tokens * heads, device)
        self.scale = torch.tensor(layout.scale or 1.0, dtype=torch.float32, device=device)
        self.capture_safe = bool(getattr(impl, "capture_safe", False))
        self.graph = None
        self.graph_ok = False
        if device.type == "cuda" and self.capture_safe:
            self._capture(check)

    def _capture(self, check) -> None:
        self.ids.copy_(check[0])
        self.graph, self.y = capture(self.step)
        ok = True
        for ids in check:
            self.replay(ids)
            ok &= bool(torch.equal(self.y, self.step()))
        self.graph_ok = ok

    def step(self) -> torch.Tensor:
        self.impl.lookup(self.ids, out=self.out)
        rows = self.out  # NVFP4, MXFP8: the lookup decodes; else the raw rows, dequantized here
        if not self.layout.has_block_scales:
            rows = (rows.view(self.layout.dtype).float() * self.scale).to(torch.bfloat16)
        return (rows @ self.proj).view(self.T, self.H, -1).sum(1)

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        return self.step()

    def replay(self, ids: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.graph.replay()
