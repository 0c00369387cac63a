"""Early lookups in SGLang: a step's first PLE layer starts every PLE layer's prefetch.

SGLang 0.5.23's Qwen4Exp model calls ``Qwen4ExpPLELayer.start_prefetch(batch, forward_batch)`` one
decoder layer ahead of each PLE layer, which computes that layer's n-gram ids from the step's
``_PLEBatch`` (SGLang's own ``compute_ngram_ids``), forks the layer's own prefetch stream, gathers
the rows there into the layer's own buffer, and leaves them for the layer's forward, which joins
that stream. The ids depend only on the step's batch and the layer's hash configuration, so the
whole step's exist before layer 0 runs. ``link`` groups a model's PLE layers served by ple-um
(a ``StepGroup``, when the model is built: ``plugin``); with ``PLE_UM_EARLY_LOOKUPS`` the group's
first layer's ``start_prefetch`` runs SGLang's own ``start_prefetch`` of every later PLE layer too,
each on its layer's stream into its layer's buffers, and a later layer's own call in the same forward
(the same batch) finds its lookup started and returns. Each layer's forward joins only its own
stream, as stock. An idle rank (no batch) starts its layers' prefetches the same way: under DP
attention each one gathers the ids across the ranks, which must call it in the same order. A FULL
CUDA graph captures every fork and every join; SGLang's breakable graphs run the prefetch in an
eager break, where the first layer's break starts them all.

The rows go where SGLang's stock prefetch puts them (each layer's eager buffer, and one buffer per
captured batch size), so early lookups take no memory beyond those; ``link`` logs their size a token.
A layer without a prefetch stream (a CPU device, ``PLE_UM_OVERLAP=0``) looks its rows up in its
forward, early lookups or not: ``auto`` and ``on`` are the same here.
"""

from __future__ import annotations

import logging

from torch import nn

from ple_um.served import StepGroup
from ple_um.units import format_bytes

logger = logging.getLogger("ple_um.sglang")

_BF16_BYTES = 2  # SGLang's prefetch buffers hold bf16 rows


def ple_um_layers(model: nn.Module) -> list[nn.Module]:
    """The model's PLE layers whose table ple-um serves, in layer order."""
    from ple_um.sglang.embedding import PleUmHostEmbedding

    found = []
    for layer in getattr(model, "layers", ()):
        ple = getattr(layer, "ple", None)
        embedding = getattr(getattr(ple, "ple_embedding", None), "ngram_embedding", None)
        if isinstance(embedding, PleUmHostEmbedding):
            found.append(ple)
    return found


def link(layers: list[nn.Module]) -> StepGroup | None:
    """Group ``layers`` (PLE layers of one model, in its order) for early lookups and log it; None
    for no layer. A step is its batch objects (SGLang hands every layer the same ones in one
    forward; a breakable graph's replay refills its holder with a new batch)."""
    if not layers:
        return None
    group = StepGroup(layers)
    for layer in layers:
        layer._ple_um_early = group
    per_token = sum(layer.ple_embed_dim * _BF16_BYTES for layer in layers)
    streamless = all(layer._prefetch_stream is None for layer in layers)  # each looks up in its forward
    why_not = "no prefetch stream: PLE_UM_OVERLAP=0 or not a CUDA device" if streamless else None
    group.announce(logger, "each on its layer's stream", f"{format_bytes(per_token)} a token in all", why_not)
    return group


def start_prefetch(original, self, batch=None, forward_batch=None, **kwargs) -> None:
    """``Qwen4ExpPLELayer.start_prefetch`` (AROUND): the layer's group starts it (and the step's
    later PLE layers') where it may, else the stock method runs."""
    group = getattr(self, "_ple_um_early", None)

    def start_from(members: list[nn.Module]) -> bool:
        for member in members:
            original(member, batch=batch, forward_batch=forward_batch)
        return True

    # An idle rank (no batch) starts early too: under DP attention each start gathers the ids across
    # the ranks, a collective every rank must call in the same order as the busy ones.
    if kwargs or group is None or not group.start(self, (batch, forward_batch), start_from):
        original(self, batch=batch, forward_batch=forward_batch, **kwargs)


def model_built(result, self, *args, **kwargs) -> None:
    """After ``Qwen4ExpModel.__init__``: ``link`` its ple-um PLE layers."""
    link(ple_um_layers(self))
