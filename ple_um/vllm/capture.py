"""The CUDA-graph rules of the vLLM layer: where a lookup may run while vLLM captures graphs.

- ``segments_end_before_join``: whether ``start_prefetch`` may queue its lookup on a side stream
  (the backend's ``may_fork``). It may in eager calls and in FULL captures (the graph captures the
  fork and the join); it may not in vLLM's breakable piecewise captures, where an attention op ends
  the graph segment between ``start_prefetch`` and ``finalize_prefetch`` (a fork left unjoined at a
  segment's end is a CUDA error), nor for a table that is not capture-safe.
- ``host_lookup``: the lookup of a table that is not capture-safe (the cpu mode without its C row
  copy), run in an eager break of vLLM's piecewise capture.
- ``check_cudagraph_mode``: such a table refused at load under a graph mode that has no eager
  breaks, naming the flags that work.

What a capture fixes for good (a lookup of the open table, the zero rows of ``--load-format
dummy``) the layer's ``ServedTable`` and the backend note, and refuse the opens that would leave the
graphs replaying stale work.
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
from ple_um.served import host_lookup_refused

if TYPE_CHECKING:
    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding


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
    raise host_lookup_refused(
        prefix,
        table,
        f"it needs an eager break in the CUDA graph; {why}",
        "or start vLLM with -cc.cudagraph_mode=PIECEWISE and VLLM_USE_BREAKABLE_CUDAGRAPH=1 "
        "(or -cc.cudagraph_mode=NONE)",
    )
