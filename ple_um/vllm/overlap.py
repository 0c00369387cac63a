"""The lookups vLLM's prefetch hook starts one decoder layer ahead, for one layer.

Qwen4Exp's model calls the layer's ``start_prefetch`` one decoder layer ahead and
``finalize_prefetch`` in its forward. ``OverlappedLookups`` holds what lies between the two: the
buffer the lookups write into (allocated by the first, eager call), the side stream they may be
queued on (the backend's ``may_fork`` decides), and the started lookups whose ids must stay
referenced until the side stream is joined. ``queue_lookups`` queues a layer's lookup, or those a
step's first PLE layer starts early (``early``) on that group's side stream, each with its own join.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ple_um.served import SideLookups, capturing


class OverlappedLookups:
    """The prefetch buffer, side stream and started lookups of one layer (``prefix``), whose
    buffer holds at least ``rows`` gathered tokens of ``row_dim`` elements per head."""

    def __init__(self, prefix: str, rows: int, row_dim: int) -> None:
        self.prefix = prefix
        self.rows = rows
        self.row_dim = row_dim
        self.buffer: torch.Tensor | None = None
        self.side = SideLookups()
        # The last start (``queue_lookups``): (rows it writes, the ids it reads, how the current
        # stream joins it, or None where it was queued on the current stream, local tokens). The ids
        # stay referenced until the join: their memory is not reused while a side stream reads it.
        self.started: tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None, int] | None = None
        self.unjoined: list[tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None, int]] = []

    def begin(self) -> None:
        """A new start. One never finalized (a forward that raised in between) keeps its ids
        referenced until the next join, since the side stream may not have read them yet; it is no
        longer the last start, so a finalize after this start raised refuses instead of serving
        the older step's rows."""
        if self.started is not None:
            self.unjoined.append(self.started)
            self.started = None

    def out(self, rows: int, ids: torch.Tensor, dtype: torch.dtype, *, fixed: bool) -> torch.Tensor:
        """The first ``rows`` rows of the buffer ([rows, heads, row_dim] in ``dtype``), allocated at
        the first (eager) call: vLLM's profile run precedes any capture. ``fixed``: a CUDA graph has
        captured a lookup into the buffer, whose address it holds."""
        buffer = self.buffer
        width = (*ids.shape[1:], self.row_dim)
        grow = buffer is not None and rows > buffer.shape[0] and tuple(buffer.shape[1:]) == width
        if buffer is None or (grow and not fixed):
            if capturing(ids):
                raise RuntimeError(
                    f"{self.prefix}: the PLE prefetch buffer must be allocated by an eager call of at least "
                    f"{rows} tokens before CUDA graph capture"
                )
            # An eager batch beyond the buffer (vLLM sizes it for max_total_tokens) grows it while
            # no graph has captured a lookup into it (after that the graphs hold its address).
            shape = (max(self.rows, rows), *width)
            buffer = self.buffer = torch.empty(shape, dtype=dtype, device=ids.device)
        if rows > buffer.shape[0] or tuple(buffer.shape[1:]) != width:
            raise ValueError(
                f"{self.prefix}: the PLE prefetch buffer holds {tuple(buffer.shape)}, but the batch needs "
                f"{(rows, *width)}"
            )
        return buffer[:rows]

    def join(self, total_tokens: int) -> torch.Tensor:
        """The rows of the last start, the side stream joined into the current one."""
        if self.started is None:
            raise RuntimeError(f"{self.prefix}: finalize_prefetch requires a prior start_prefetch")
        rows, _, join, tokens = self.started
        self.started = None
        for started in (*self.unjoined, (rows, None, join, tokens)):
            if started[2] is not None:
                started[2]()
        self.unjoined.clear()
        if total_tokens != tokens:
            raise ValueError(
                f"{self.prefix}: finalize_prefetch for {total_tokens} tokens, but start_prefetch looked up "
                f"{tokens}"
            )
        return rows


def queue_lookups(side: SideLookups, started: list[tuple], fork: bool) -> None:
    """Queue each ``(backend, ids, out, tokens)`` lookup of ``started`` (``ids`` into ``out``, its
    prefetch buffer's rows, for ``tokens`` local tokens) and record it as the backend's start: where
    ``fork``, on ``side``'s stream forked from the current one (a FULL graph captures the fork), each
    marked and joined by its own backend; else on the current stream, in order."""
    device = started[0][1].device
    if fork:
        with side.fork(device):
            for backend, ids, out, _ in started:
                backend.lookup_rows(ids, out)
                side.mark(backend)
    for backend, ids, out, tokens in started:
        if not fork:
            backend.lookup_rows(ids, out)
        join = functools.partial(side.join, backend, device) if fork else None
        backend.overlapped.started = (out, ids, join, tokens)
