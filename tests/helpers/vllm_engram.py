"""vLLM 0.33's DeepSeek-V4.1 Engram module, imported so that its Triton kernels are real (run under
the Triton interpreter on a host without a GPU).

vLLM decides at its first import whether Triton is usable (``vllm.triton_utils.HAS_TRITON``): on a
host with no GPU driver it finds no active driver and swaps ``triton.jit`` for a placeholder,
unless the process looks like a distributed worker whose devices are not visible yet
(``CUDA_VISIBLE_DEVICES`` set and empty). ``engram_module()`` imports vLLM that way when no GPU is
present and vLLM's Triton has not been decided yet, and skips (vLLM missing) or fails (imported
earlier with the placeholder) otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import pytest
import torch


@contextlib.contextmanager
def _no_visible_devices():
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def engram_module():
    """``vllm.models.deepseek_v41.common.engram`` with real Triton kernels."""
    pytest.importorskip("vllm")
    name = "vllm.models.deepseek_v41.common.engram"
    if "vllm.triton_utils" not in sys.modules and not torch.cuda.is_available():
        with _no_visible_devices():
            importlib.import_module("vllm.triton_utils")
    module = importlib.import_module(name)
    if not hasattr(module._engram_lookup_kernel, "__getitem__"):
        pytest.fail("vLLM was imported before tests/helpers/vllm_engram.py could keep its Triton real")
    return module
