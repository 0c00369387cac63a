"""The ``sglang.srt.plugins`` entry point (``ple_um = "ple_um.sglang.plugin:register"``) and the hooks
it registers with SGLang's ``HookRegistry`` (no source patch).

SGLang's ``load_plugins()`` calls ``register()`` in every process it starts (server, scheduler,
engine, data-parallel controller), once each, then applies the registered hooks. With ``PLE_UM=1``
(alias ``VLLM_PLE_MMAP=1``) it registers the hooks below, so Qwen4Exp PLE tables are served by
ple-um; otherwise it imports nothing from SGLang and registers nothing.

Targets in ``sglang.srt.models.qwen4_exp`` and ``sglang.srt.model_loader.loader`` (SGLang 0.5.23):

- ``Qwen4ExpPinnedHostEmbedding`` (class REPLACE): ``PleUmHostEmbedding``, a subclass, wherever
  SGLang names the class (HookRegistry rebinds every module's import of it).
- ``Qwen4ExpNGramEmbedding.__init__`` (AROUND): SGLang wraps a PLE table in the offload class only
  when ``ple_offload_embedding`` is on (``--ple-offload-embedding``, on by default for BF16 models on
  CUDA); while PLE_UM is set the constructor runs with it on, so every PLE table is ple-um's
  whatever the flags say, and the built table learns its prefix, layer and ``split_ngram_parts``.
  PLE_UM is read each time a layer is built: unset, the layer is stock.
- ``Qwen4ExpPLELayer.__init__`` (AFTER): the layer's prefetch side stream follows PLE_UM_OVERLAP
  (stock makes one only when the offload flag is on; none on a CPU device).
- ``Qwen4ExpPLELayer.start_prefetch`` (AROUND) and ``Qwen4ExpModel.__init__`` (AFTER): the model's
  ple-um PLE layers are linked when it is built, and the step's first one starts them all
  (``ple_um.sglang.early``, PLE_UM_EARLY_LOOKUPS).
- ``Qwen4ExpForConditionalGeneration.load_weights`` and ``DefaultModelLoader._get_weights_iterator``
  (AROUND): ``ple_um.sglang.loading``.
"""

from __future__ import annotations

import inspect
import logging

from ple_um import envs

logger = logging.getLogger("ple_um.sglang")

MODEL = "sglang.srt.models.qwen4_exp"
LOADER = "sglang.srt.model_loader.loader.DefaultModelLoader"

_registered = False


def register() -> list[str]:
    """Register the hooks when PLE_UM is set (``load_plugins`` applies them); returns the targets,
    empty when PLE_UM is unset or they already are registered."""
    global _registered
    if not envs.PLE_UM or _registered:
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ple_um.sglang import early, loading
    from ple_um.sglang.embedding import PleUmHostEmbedding

    hooks = {
        f"{MODEL}.Qwen4ExpPinnedHostEmbedding": (PleUmHostEmbedding, HookType.REPLACE),
        f"{MODEL}.Qwen4ExpNGramEmbedding.__init__": (ngram_init, HookType.AROUND),
        f"{MODEL}.Qwen4ExpPLELayer.__init__": (ple_layer_built, HookType.AFTER),
        f"{MODEL}.Qwen4ExpPLELayer.start_prefetch": (early.start_prefetch, HookType.AROUND),
        f"{MODEL}.Qwen4ExpModel.__init__": (early.model_built, HookType.AFTER),
        f"{MODEL}.Qwen4ExpForConditionalGeneration.load_weights": (loading.load_weights, HookType.AROUND),
        f"{LOADER}._get_weights_iterator": (loading.weights_iterator, HookType.AROUND),
    }
    for target, (hook, kind) in hooks.items():
        HookRegistry.register(target, hook, kind)
    _registered = True
    logger.info(
        "ple-um: PLE_UM is set: Qwen4Exp PLE tables are served from the checkpoint files (hooks on %s)",
        ", ".join(hooks),
    )
    return list(hooks)


def ngram_init(original, self, *args, **kwargs) -> None:
    """Build the n-gram embedding with the offload on, so that SGLang wraps the table in ple-um's class."""
    if not envs.PLE_UM:
        original(self, *args, **kwargs)
        return
    from ple_um.served import layer_index
    from ple_um.sglang.embedding import NOT_APPLIED, applied

    if not applied():
        raise RuntimeError(NOT_APPLIED)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    config, prefix = bound.arguments["config"], bound.arguments.get("prefix", "")
    layer = layer_index(prefix)
    saved = config.ple_offload_embedding
    config.ple_offload_embedding = True
    try:
        original(self, *args, **kwargs)
    finally:
        config.ple_offload_embedding = saved
    self.ngram_embedding.bind(
        prefix=f"{prefix}.ngram_embedding" if prefix else "ngram_embedding",
        layer=layer,
        split_ngram_parts=int(getattr(config, "split_ngram_parts", 512)),
    )


def ple_layer_built(result, self, *args, **kwargs) -> None:
    """After ``Qwen4ExpPLELayer.__init__``: a ple-um table's prefetch stream follows PLE_UM_OVERLAP."""
    from ple_um.sglang.embedding import PleUmHostEmbedding

    table = self.ple_embedding.ngram_embedding
    if isinstance(table, PleUmHostEmbedding):
        self._prefetch_stream = table.prefetch_stream(self._prefetch_stream)
