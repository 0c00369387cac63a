"""The CUDA-graph rules of the vLLM layer: where a lookup may run while vLLM captures graphs, and
what a capture fixes for good.

- ``capturing``: whether a lookup is being captured into a CUDA graph.
- ``segments_end_before_join`` and ``prefetch_may_fork``: whether ``start_prefetch`` may queue its
  lookup on a side stream. It may in eager calls and in FULL captures (the graph captures the fork
  and the join); it may not in vLLM's breakable piecewise captures, where an attention op ends the
  graph segment between ``start_prefetch`` and ``finalize_prefetch`` (a fork left unjoined at a
  segment's end is a CUDA error), nor for a table that is not capture-safe.
- ``host_lookup``: the lookup of a table that is not capture-safe (the cpu mode without its C row
  copy), run in an eager break of vLLM's piecewise capture.
- ``check_cudagraph_mode``: such a table refused at load under a graph mode that has no eager
  breaks, naming the flags that work.
- ``CapturedLookups``: what the graphs captured from one layer hold (a lookup of its open table, or
  the zero rows of ``--load-format dummy``), and the opens that would leave them replaying stale
  work, refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.compilation.breakable_cudagraph import (
    BreakableCUDAGraphCapture,
    eager_break_during_capture,
    is_breakable_cudagraph_enabled,
)
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available

from ple_um import MappedTable

if TYPE_CHECKING:
    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding


def capturing(ids: torch.Tensor) -> bool:
    """Whether this lookup is being captured into a CUDA graph."""
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


def segments_end_before_join() -> bool:
    """Whether vLLM is capturing a breakable CUDA graph in a mode other than FULL (its PIECEWISE
    captures): then each attention op ends a graph segment, some between ``start_prefetch`` and
    ``finalize_prefetch`` (the model starts layer L+1's lookup before layer L runs), and a side
    stream forked in one segment and joined in a later one would leave the first capture unjoined,
    a CUDA error. The same test vLLM's ``eager_break_during_capture`` makes."""
    capture = BreakableCUDAGraphCapture.current()
    if capture is None or not capture._capturing:
        return False
    if is_forward_context_available():
        return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.FULL
    return True


def prefetch_may_fork(ids: torch.Tensor, table: MappedTable) -> bool:
    """Whether ``start_prefetch`` queues the lookup of ``ids`` on a side stream: on a CUDA device,
    for a capture-safe table, outside a graph segment that ends before the join. Otherwise the
    lookup runs on the current stream (a CPU device; the host path's eager break; a segment that
    ends before the join, which captures the lookup into it)."""
    return ids.is_cuda and table.capture_safe and not segments_end_before_join()


@eager_break_during_capture
def host_lookup(embedding: Qwen4ExpPLEMappedEmbedding, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The lookup of a table that is not capture-safe (the cpu mode without its C row copy): host
    work that waits for the device, so a piecewise CUDA graph capture runs it in an eager break
    (replayed with the same ``ids`` and ``out`` buffers)."""
    embedding.require_table().lookup(ids, out=out)


def check_cudagraph_mode(prefix: str, table: MappedTable, vllm_config) -> None:
    """A lookup that is not capture-safe (the cpu mode without its C row copy: it waits for the
    device) can only live in an eager break of a piecewise graph: RuntimeError under any other
    graph mode vLLM is configured for."""
    if table.capture_safe:
        return
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    breakable = is_breakable_cudagraph_enabled()
    if breakable and not mode.has_full_cudagraphs():
        return
    why = (
        f"cudagraph_mode={mode.name} captures FULL graphs, where an eager break cannot run"
        if mode.has_full_cudagraphs()
        else f"cudagraph_mode={mode.name} without VLLM_USE_BREAKABLE_CUDAGRAPH=1 has no eager breaks"
    )
    raise RuntimeError(
        f"ple-um serves {prefix} in the {table.mode} mode without its host node "
        f"({table.row_reads}): the lookup waits for the device and needs an eager break in the CUDA "
        f"graph; {why}. Make the C row copy available (a working C compiler, PLE_UM_ROWCOPY=1), "
        "or start vLLM with -cc.cudagraph_mode=PIECEWISE and VLLM_USE_BREAKABLE_CUDAGRAPH=1 "
        "(or -cc.cudagraph_mode=NONE), "
        f"or make a GPU mode available (why not: {table.report.reasons})"
    )


class CapturedLookups:
    """What CUDA graphs captured from one layer. ``lookup``: a lookup of its open table, so the
    graphs hold the table's mapping and the prefetch buffer's address. ``zeros``: the zero rows of
    ``--load-format dummy`` (no table open), which the graphs replay for ever."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.lookup = False
        self.zeros = False

    def note_lookup(self, ids: torch.Tensor) -> None:
        if capturing(ids):
            self.lookup = True

    def note_zeros(self, ids: torch.Tensor) -> None:
        if capturing(ids):
            self.zeros = True

    def check_open(self, directory: str, open_dir: str | None) -> None:
        """Refuse to open the table at ``directory`` (``open_dir``: the directory of the table open
        now, or None) when the graphs captured would go on replaying something else."""
        if self.zeros:
            raise RuntimeError(
                f"{self.prefix}: CUDA graphs captured this layer's lookup as zero rows (--load-format "
                f"dummy, no table open); opening the table at {directory} now would not change what they "
                "replay. Load the real weights before graph capture (or run with --enforce-eager), or "
                "restart vLLM on the checkpoint"
            )
        if open_dir is not None and self.lookup:
            raise RuntimeError(
                f"{self.prefix}: the PLE table moved from {open_dir} to {directory} after CUDA graphs "
                "captured its lookup; the captured graphs read the old mapping. Restart vLLM on the new "
                "checkpoint"
            )
