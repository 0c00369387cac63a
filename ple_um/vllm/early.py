"""Early lookups: a step's first PLE layer starts every PLE layer's lookup of the step.

Qwen4Exp's model calls each PLE layer's ``start_prefetch(input_ids, query_start_loc,
ngram_context)`` one decoder layer ahead of it. A layer's row ids depend only on those three (the
step's tokens, their requests, the n-gram context) and the layer's hash configuration, so the whole
step's ids exist before layer 0 runs. Once the model is loaded, ``link_model`` groups its ple-um
layers (``EarlyLookups``); with ``PLE_UM_EARLY_LOOKUPS`` the group's first layer's start computes
every later layer's ids exactly as vLLM does (each layer's own ``compute_ngram_ids``, into its own
``_prefetch_ids``, on the current stream), then queues every layer's lookup on one side stream,
marking each, and each layer's ``finalize_prefetch`` joins its own mark only: the last PLE layer's
reads have the whole step's compute to hide behind, the first one's what they had before.

The rows land in each layer's own prefetch buffer (allocated by the first eager step, sized for
vLLM's ``max_num_batched_tokens``), so early lookups take no memory beyond what the layers hold
anyway; ``link_model`` logs the buffers' total. A later layer's ``start_prefetch`` in the same forward
(the same input tensors) finds its lookup started and returns. Everything is stream work: a FULL
CUDA graph captures the fork, the lookups and every join.

``PLE_UM_EARLY_LOOKUPS``: ``auto`` where every lookup may go on a side stream
(the backend's ``may_fork``: a CUDA device, capture-safe tables, not vLLM's piecewise capture,
where graph segments end between a start and its finalize); ``on`` also where they cannot (they then
run in order on the current stream at the first layer); ``off``: each layer one decoder layer ahead.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from vllm.logger import init_logger

from ple_um import envs
from ple_um.served import SideLookups, StepGroup, layer_index
from ple_um.units import format_bytes
from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding
from ple_um.vllm.overlap import queue_lookups

logger = init_logger("vllm.ple_um.early")


class EarlyLookups(StepGroup):
    """The ple-um PLE layers of one model (its ``Qwen4ExpNGramEmbedding`` modules, in the model's
    order) whose lookups of a step start together; a step is its input tensors."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__(layers)
        self.side = SideLookups()

    def buffer_bytes(self) -> int:
        """The prefetch buffers' total: each layer's rows x heads x head_dim in its lookup dtype."""
        total = 0
        for layer in self.layers:
            backend = layer.ngram_embedding
            per_row = layer.ngram_heads * backend.embedding_dim * backend.lookup_dtype.itemsize
            total += backend.overlapped.rows * per_row
        return total

    def start_from(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        members: list[nn.Module],
    ) -> bool:
        """Start the lookups of ``members`` (a layer and the later ones) for a step, each layer's ids
        computed as vLLM does; False, starting nothing, under ``auto`` where they cannot all fork."""
        fork = all(member.ngram_embedding.may_fork(input_ids) for member in members)
        if envs.PLE_UM_EARLY_LOOKUPS == "auto" and not fork:
            return False
        started = []
        for member in members:
            ngram_ids = member.compute_ngram_ids(
                input_ids, query_start_loc, ngram_context, output=member._prefetch_ids[: input_ids.numel()]
            )
            backend = member.ngram_embedding
            started.append((backend, *backend.prepare_lookup(ngram_ids), ngram_ids.shape[0]))
        queue_lookups(self.side, started, fork)
        return True


def link_model(model: nn.Module) -> EarlyLookups | None:
    """Group the model's n-gram embeddings served by ple-um with vLLM's prefetch hook, in layer
    order, for early lookups (called once the model is loaded); the group they already share is
    kept (graphs may have captured its side stream). Logs the group and its buffers' total when it
    is new. None for no layer."""
    layers = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "ngram_embedding", None), Qwen4ExpPLEMappedEmbedding)
        and module.ngram_embedding.supports_prefetch
        and hasattr(module, "_prefetch_ids")
    ]
    if not layers:
        return None
    layers.sort(key=lambda module: layer_index(module.ngram_embedding.prefix))
    group = layers[0].ngram_embedding.early
    if group is not None and group.layers == layers and all(m.ngram_embedding.early is group for m in layers):
        return group
    group = EarlyLookups(layers)
    for layer in layers:
        layer.ngram_embedding.early = group
    group.announce(
        logger,
        "on a side stream, each joined by its layer",
        f"{format_bytes(group.buffer_bytes())} in all ({layers[0].ngram_embedding.overlapped.rows} tokens "
        f"x {layers[0].ngram_heads} heads a layer)",
    )
    return group


def start_prefetch_hook(original):
    """``Qwen4ExpNGramEmbedding.start_prefetch``: the layer's group starts it (and the step's later
    layers' lookups) where it may, else the stock method."""

    @functools.wraps(original)
    def start_prefetch(self, input_ids, query_start_loc, ngram_context) -> None:
        group = getattr(self.ngram_embedding, "early", None)
        step = (input_ids, query_start_loc, ngram_context)
        if group is None or not group.start(self, step, functools.partial(group.start_from, *step)):
            original(self, input_ids, query_start_loc, ngram_context)

    return start_prefetch
