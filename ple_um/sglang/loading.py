"""Loading a Qwen4Exp model whose PLE tables ple-um serves: the shard tensors are never read.

Two hooks (registered by ``plugin``):

- ``weights_iterator`` wraps ``DefaultModelLoader._get_weights_iterator``, through which SGLang's
  default loader, a layered load and ``update_weights_from_disk`` get their weights. For a Qwen4Exp
  model under PLE_UM=1 with safetensors files it notes the model's local folder (``source``),
  checks the headers of every PLE table there (a broken file is a ``CheckpointError`` naming the
  file and tensor, before SGLang opens any file), and hands SGLang's own iterator only the files
  that hold none of a table's tensors. Files that hold only table tensors are not opened; files that
  mix them with other tensors are read here, through the same ``safetensors.safe_open`` SGLang
  uses, every tensor but the table's. So neither SGLang's prefetch, its copies nor its page-cache
  drops touch a table's bytes. Such a load reads each table the files hold from its files: when the
  model's ``load_weights`` (below) reads the stream through, that table's layer is told
  (``Deliveries.note_files``), so a table a weight update left staged with part of it sent is
  completed by ``update_weights_from_disk`` (checked against the scale it loaded, then served).
- ``load_weights`` wraps ``Qwen4ExpForConditionalGeneration.load_weights``: a table tensor that
  still arrives (a loader that does not go through the iterator above, ``update_weights_from_tensor``)
  goes to its layer's ``compare_delivered``, which compares it with the mapped files instead of copying
  it; once SGLang's own method has loaded the rest (the FP8 ``weight_scale`` among it), each
  ple-um layer opens its table (``delivered.finish_loads``): a new one (another directory,
  replaced files) serves only once checked against that scale, and only once every layer's is,
  the old ones serving on where one is refused.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Iterable, Iterator

import safetensors
import torch
from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding

from ple_um import delivered, envs
from ple_um.checkpoint import find_layers, read_layout
from ple_um.sglang.embedding import NOT_APPLIED, PleUmHostEmbedding, applied
from ple_um.sglang.source import note_model_folder, table_directory, table_tensor

MODEL_CLASS = "Qwen4ExpForConditionalGeneration"

# The ple-um layers, by decoder layer, of the model whose ``load_weights`` is reading its weights
# now: a stream of the checkpoint files (``weights_iterator``) read through by that load tells them.
_loading: contextvars.ContextVar[dict[int, PleUmHostEmbedding] | None] = contextvars.ContextVar(
    "ple_um_sglang_loading", default=None
)


def weights_iterator(original, loader, source, *, resolved_source=None, **kwargs):
    """The AROUND hook of ``DefaultModelLoader._get_weights_iterator`` (see the module's docstring)."""
    model_config = getattr(source, "model_config", None)
    architectures = getattr(getattr(model_config, "hf_config", None), "architectures", None) or ()
    if not envs.PLE_UM or MODEL_CLASS not in architectures:  # not a Qwen4Exp model under PLE_UM=1
        return original(loader, source, resolved_source=resolved_source, **kwargs)
    if not applied():  # stock tables would get no rows
        raise RuntimeError(NOT_APPLIED)
    if resolved_source is None:
        folder, files, use_safetensors = loader._prepare_weights(
            source.model_or_path, source.revision, source.fall_back_to_pt, source.allow_patterns_overrides
        )
    else:
        folder = resolved_source.hf_folder
        files, use_safetensors = list(resolved_source.weight_files), resolved_source.use_safetensors
    note_model_folder(folder)
    if not use_safetensors:  # .bin/.pt weights: the table tensors arrive in memory and are compared
        resolved = loader.ResolvedSource(source, folder, tuple(files), use_safetensors)
        return original(loader, source, resolved_source=resolved, **kwargs)
    directory = table_directory()
    for layer in find_layers(directory):
        read_layout(directory, layer)  # every table's headers, before SGLang opens a file
    plain, mixed, tables = [], [], set()
    for path in files:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
        found = [found[0] for name in names if (found := table_tensor(name)) is not None]
        tables.update(found)
        if not found:
            plain.append(path)
        elif len(found) < len(names):
            mixed.append(path)
    resolved = loader.ResolvedSource(source, folder, tuple(plain), True)
    rest = original(loader, source, resolved_source=resolved, **kwargs)
    return _from_files(itertools.chain(rest, _mixed_files(loader, source, mixed)), tables)


def _from_files(stream: Iterator[tuple[str, torch.Tensor]], tables: set[int]):
    """``stream``; once read through by a model's ``load_weights`` (the weights of its load, or of
    ``update_weights_from_disk``), each of that model's ple-um layers whose table the files hold
    (decoder layers ``tables``) is told the load was from the files (``Deliveries.note_files``): the
    whole table, which ple-um maps, though none of it was delivered in memory. A stream read outside
    such a load (or not read through) tells no layer."""
    yield from stream
    for layer, embedding in (_loading.get() or {}).items():
        if layer in tables:
            embedding.deliveries().note_files()


def _mixed_files(loader, source, paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``paths`` but a table's, named as SGLang's iterator names them."""

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path in paths:
            with safetensors.safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if table_tensor(name) is None:
                        yield name, f.get_tensor(name)

    draft = loader.load_config.draft_model_idx
    if draft is not None:
        return loader._filter_mtp_weights(tensors(), source.prefix, draft)
    return ((source.prefix + name, tensor) for name, tensor in tensors())


def load_weights(original, model, weights: Iterable[tuple[str, torch.Tensor]]):
    """The AROUND hook of ``Qwen4ExpForConditionalGeneration.load_weights`` (see the module's docstring)."""
    # The model's ple-um tables by decoder layer, with their module names.
    served = {m.layer: (name, m) for name, m in model.named_modules() if isinstance(m, PleUmHostEmbedding)}
    if envs.PLE_UM and any(
        isinstance(m, Qwen4ExpNGramEmbedding) and not isinstance(m.ngram_embedding, PleUmHostEmbedding)
        for m in model.modules()
    ):  # SGLang's iterator, under PLE_UM, delivers no table rows to a stock table
        raise RuntimeError(
            "ple-um: PLE_UM is set, but this Qwen4Exp model was built with stock PLE tables (PLE_UM was "
            "unset when it was built): set PLE_UM before SGLang builds the model, or unset it"
        )
    if not served:
        return original(model, weights)

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            found = table_tensor(name)
            layer = served.get(found[0]) if found is not None else None
            if layer is None:
                yield name, tensor  # not a table's, or a layer outside this pipeline stage (stock skips it)
            else:
                layer[1].compare_delivered(found[1], tensor, found[2])

    def load():
        loaded = original(model, others())
        for name, layer in served.values():
            if loaded is not None and f"{name}.weight_scale" in loaded:
                layer.deliveries().note_scale()
        return loaded

    # Every new table checked before any serves; a failed load abandons each layer's (the old
    # tables serve on).
    loading = _loading.set({layer: m for layer, (_, m) in served.items()})
    try:
        loaded = delivered.load_model((layer for _, layer in served.values()), load)
    finally:
        _loading.reset(loading)
    if loaded is not None:  # as stock reports a table it copied
        loaded.update(f"{name}.weight" for name, _ in served.values())
    return loaded
