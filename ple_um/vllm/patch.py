"""The patch the plugin applies to vLLM 0.33 when PLE_UM=1: Qwen4Exp PLE layers get the ple-um backend.

vLLM symbols it replaces (class attributes, by ``replace``: the originals are kept on the class
under ``_ple_um_original``, which also makes a second application a no-op; the tests' ``restore``
puts them back):

- ``Qwen4ExpNGramEmbedding.__init__`` (``vllm.models.qwen4_exp.nvidia.ngram_embedding``, or
  ``vllm.models.qwen4_exp.amd.ple_layer`` on ROCm): runs the stock constructor while that module's
  names ``Qwen4ExpPLEDeviceEmbedding`` and ``Qwen4ExpPLEPinnedHostEmbedding`` both point at
  ``Qwen4ExpPLEMappedEmbedding``, so vLLM's own backend selection builds ours with vLLM's own
  arguments (vocab padding, embedding method, ETP group, DP rank, reduce flag).
- ``Qwen4ExpNGramEmbedding.start_prefetch`` (NVIDIA's; ROCm's layer has none): the layer's early
  lookup group starts it where it may (``early``), else the stock method runs.
- ``Qwen4ExpNGramEmbedding.load_weights``: shard tensors (``shard_<i>.weight``, and an NVFP4
  table's block scales ``shard_<i>.weight_scale``) go to the backend's ``receive_shard`` (never
  copied) before the stock method sees the rest; then ``finish_load`` opens the table (inside a
  model's load, which may reach the layer in several calls, the model's ``load_weights`` does, once).
- ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` of the same package, patched
  when the first ple-um layer is built inside one: ``is_unused_checkpoint_weight`` (vLLM then skips
  files that hold only shard tensors and NVFP4 block scales, even with loaders that read whole
  files) and ``load_weights`` (``check_headers`` on every ple-um layer before vLLM's loader opens
  a file; run by ``delivered.load_model``: ``finish_loads`` once the whole model is loaded, every
  layer's new table checked before any serves, or every layer's load abandoned where it fails;
  then ``early.link_model``).

The patched constructor reads PLE_UM each time a layer is built: with it unset the layer is stock.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType

import torch
import vllm
from vllm.logger import init_logger

from ple_um import delivered, envs
from ple_um.checkpoint import ple_match
from ple_um.errors import CheckpointError
from ple_um.vllm import early
from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding
from ple_um.vllm.source import file_backing

logger = init_logger("vllm.ple_um.patch")

NGRAM_CLASS = "Qwen4ExpNGramEmbedding"
STOCK_BACKENDS = ("Qwen4ExpPLEDeviceEmbedding", "Qwen4ExpPLEPinnedHostEmbedding")
MODEL_CLASSES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
ORIGINAL = "_ple_um_original"

# Names as Qwen4ExpNGramEmbedding.load_weights sees them, and as the checkpoint spells them: the
# rows (.weight) and an NVFP4 table's block scales (.weight_scale) of each shard.
_LAYER_SHARD = re.compile(r"^ngram_embedding\.shard_(\d+)\.(weight|weight_scale)$")


def apply() -> list[str]:
    """Patch the Qwen4ExpNGramEmbedding vLLM uses on this platform (as vLLM picks it); returns the
    class patched now (empty when already patched)."""
    from vllm.platforms import current_platform

    layer = "amd.ple_layer" if current_platform.is_rocm() else "nvidia.ngram_embedding"
    name = f"vllm.models.qwen4_exp.{layer}"
    return [f"{name}.{NGRAM_CLASS}"] if patch_ngram_class(importlib.import_module(name)) else []


def replace(cls: type, methods: dict) -> bool:
    """Set ``methods`` (name: new attribute) on ``cls``, keeping the class's own originals under
    ``ORIGINAL`` (None for one it inherits); False, changing nothing, when ``cls`` was patched."""
    if ORIGINAL in cls.__dict__:
        return False
    setattr(cls, ORIGINAL, {name: cls.__dict__.get(name) for name in methods})
    for name, value in methods.items():
        setattr(cls, name, value)
    return True


def patch_ngram_class(module: ModuleType) -> bool:
    """Patch ``module.Qwen4ExpNGramEmbedding``; False when it already was."""
    missing = [n for n in (NGRAM_CLASS, *STOCK_BACKENDS) if not hasattr(module, n)]
    if missing:
        raise RuntimeError(
            f"ple-um: {module.__name__} has no {', '.join(missing)}: vLLM {vllm.__version__} is not the "
            "layout ple-um patches (vLLM 0.33). Unset PLE_UM (and VLLM_PLE_MMAP)."
        )
    cls = getattr(module, NGRAM_CLASS)
    methods = {
        "__init__": _patched_init(module, cls.__init__),
        "load_weights": _patched_load_weights(cls.load_weights),
    }
    if "start_prefetch" in cls.__dict__:
        methods["start_prefetch"] = early.start_prefetch_hook(cls.start_prefetch)
    return replace(cls, methods)


def _patched_init(module: ModuleType, original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        if not envs.PLE_UM:
            original(self, *args, **kwargs)
            return
        saved = {name: getattr(module, name) for name in STOCK_BACKENDS}
        for name in STOCK_BACKENDS:
            setattr(module, name, Qwen4ExpPLEMappedEmbedding)
        try:
            original(self, *args, **kwargs)
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
        backend = self.ngram_embedding
        if not isinstance(backend, Qwen4ExpPLEMappedEmbedding):
            raise RuntimeError(
                f"ple-um: {module.__name__}.{NGRAM_CLASS} built {type(backend).__name__}, not the ple-um "
                f"backend: vLLM {vllm.__version__} selects its backend differently than vLLM 0.33"
            )
        backend.split_ngram_parts = int(self.split_ngram_parts)
        if not hasattr(type(self), "start_prefetch"):
            # No prefetch wiring in this layer (ROCm's): with the hook declared, its forward would
            # take the pinned backend's branch and call sync_lookup; without it, the backend's forward.
            backend.supports_prefetch = False
        _patch_model_classes(module)

    return __init__


def _patched_load_weights(original):
    @functools.wraps(original)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        backend = self.ngram_embedding
        if not isinstance(backend, Qwen4ExpPLEMappedEmbedding):
            return original(self, weights)
        received: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                found = _LAYER_SHARD.match(name)
                if found is not None:
                    backend.receive_shard(int(found.group(1)), tensor, found.group(2))
                    received.add(found.group(2))
                elif name == "ngram_embedding.weight":
                    backing = file_backing(tensor)  # the file it is a view of, named if there is one
                    raise CheckpointError(
                        f"{backend.prefix}: the checkpoint stores the PLE table unsharded; ple-um serves "
                        "tables split into ngram_embedding.shard_<i>.weight tensors",
                        path=backing[0] if backing else None,
                        tensor=_name_in_file(backing, backend.layer, name),
                    )
                else:
                    yield name, tensor

        try:
            loaded = original(self, others())
        except BaseException:
            backend.abandon_load()  # a table the failed load staged: the old one serves on
            raise
        loaded.update(f"ngram_embedding.{name}" for name in received)
        if f"ngram_embedding.{backend.scale_name}" in loaded:
            backend.deliveries().note_scale()
        # Inside a model's load, whose weights reach this layer in as many calls as runs of its
        # names (vLLM's AutoWeightsLoader groups them), the model's load_weights finishes once at its
        # end; a layer loaded on its own finishes each call.
        if not backend.in_model_load:
            backend.finish_load()
        return loaded

    return load_weights


def _name_in_file(backing: tuple[str, int] | None, layer: int, name: str) -> str:
    """The full name, as the checkpoint's file holds it, of decoder layer ``layer``'s tensor the layer
    got as ``name`` (a view of that file, ``backing``): the one such name in its header. Else ``name``."""
    if backing is None:
        return name
    from safetensors import safe_open

    with safe_open(backing[0], framework="pt") as f:
        found = [k for k in f.keys() if k.endswith("." + name) and f"layers.{layer}." in k]  # noqa: SIM118
    return found[0] if len(found) == 1 else name


def _backends(model) -> tuple[Qwen4ExpPLEMappedEmbedding, ...]:
    found = model.__dict__.get("_ple_um_backends")
    if found is None:
        found = tuple(m for m in model.modules() if isinstance(m, Qwen4ExpPLEMappedEmbedding))
        model.__dict__["_ple_um_backends"] = found
    return found


def _patch_model_classes(ngram_module: ModuleType) -> None:
    package = ngram_module.__name__.rpartition(".")[0]
    model_module = sys.modules.get(f"{package}.model")
    if model_module is None:
        return  # a layer built outside a Qwen4Exp model
    for name in MODEL_CLASSES:
        cls = getattr(model_module, name, None)
        if cls is None or ORIGINAL in cls.__dict__:
            continue
        unused = getattr(cls, "is_unused_checkpoint_weight", None)
        replace(
            cls,
            {
                "load_weights": _model_load_weights(cls.load_weights),
                "is_unused_checkpoint_weight": _model_is_unused(unused),
            },
        )
        logger.debug("ple-um: patched %s.%s", model_module.__name__, name)


def _model_load_weights(original):
    @functools.wraps(original)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # vLLM's weights are a lazy generator: nothing of the checkpoint has been opened yet.
        backends = _backends(self)
        for backend in backends:
            backend.check_headers()
        # Every new table checked before any serves; a failed load abandons each layer's.
        loaded = delivered.load_model(backends, lambda: original(self, weights))
        early.link_model(self)
        return loaded

    return load_weights


def _model_is_unused(original):
    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Shard tensors of ple-um layers are served from the files, never loaded. vLLM's loader asks
        this of every tensor of the files it is about to load from: a load from the checkpoint files,
        which leaves out the files holding only the table's tensors and may read the rest into memory
        (its whole-file loaders), so that a layer is not delivered all of its table in memory; the
        layer's deliveries are told (``Deliveries.note_files``): its table is not a partial one."""
        found = ple_match(name)
        if found is not None and found[1] in ("shard", "block_scale") and _backends(self):
            for backend in _backends(self):
                if backend.layer == found[0]:
                    backend.deliveries().note_files()
            return True
        return bool(original(self, name)) if original is not None else False

    return is_unused_checkpoint_weight
