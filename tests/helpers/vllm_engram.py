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
import importlib.util
import os
import sys
import types

import pytest
import torch

# The test model's Engram tables: model layer ids with a table, and the head dim.
LAYERS = (2, 5)
DIM = 64


def engram_config() -> types.SimpleNamespace:
    """The test model's Engram config, in the attributes vLLM's ``EngramLayout`` reads."""
    return types.SimpleNamespace(
        engram_layer_ids=list(LAYERS),
        engram_num_embeddings=[2700, 3100],
        engram_max_ngram_size=3,
        engram_n_heads=4,
        engram_head_dim=DIM,
        engram_vocab_size=300,
        engram_compressed_vocab_size=100,
        engram_pad_token_id=0,
    )


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


def _vllm_installed() -> bool:
    """Whether a real vLLM package is importable. ``tests/`` is on ``sys.path`` (pytest's rootdir
    insertion), so ``tests/vllm`` alone would be found as a namespace package named ``vllm``: one
    with no ``__init__`` (no origin) is not vLLM."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def import_vllm_with_real_triton() -> None:
    """Import ``vllm.triton_utils`` with its Triton real (as a worker whose devices are hidden), where
    vLLM is installed, no GPU is present and vLLM has not been imported yet; otherwise nothing."""
    if "vllm.triton_utils" in sys.modules or not _vllm_installed():
        return
    if torch.cuda.is_available():
        return
    with _no_visible_devices():
        importlib.import_module("vllm.triton_utils")


def engram_module():
    """``vllm.models.deepseek_v41.common.engram`` with real Triton kernels."""
    if not _vllm_installed():
        pytest.skip("vLLM is not installed")
    name = "vllm.models.deepseek_v41.common.engram"
    import_vllm_with_real_triton()
    module = importlib.import_module(name)
    if not hasattr(module._engram_lookup_kernel, "__getitem__"):
        pytest.fail("vLLM was imported before tests/helpers/vllm_engram.py could keep its Triton real")
    return module


def as_on_a_gpu(
    stock: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """vLLM's stock Engram rows of ``hashes`` (global row ids) as a GPU gives them: under the Triton
    interpreter vLLM's ``.to(tl.bfloat16)`` truncates, and mangles float32 subnormals, so where a
    product ``e4m3 * 2**(e-127)`` is a float32 subnormal its round-to-nearest-even BF16 is put in
    (a normal product is exact in BF16, where truncation and rounding agree). Every other element
    is stock's own; fewer than one in ten are replaced."""
    ids = hashes.long()
    exponents = scales.view(torch.uint8)[ids].to(torch.int32) << 23
    exact = weight[ids].float() * exponents.view(torch.float32).repeat_interleave(32, dim=-1)
    subnormal = (exact != 0) & (exact.abs() < 2.0**-126)
    assert int(subnormal.sum()) < exact.numel() // 10
    return torch.where(subnormal, exact.to(torch.bfloat16), stock)
