"""Loading the vLLM layer: the table a layer expects, and the checks that what vLLM loads is that
table.

``Qwen4ExpNGramEmbedding.load_weights`` (patched, ``ple_um.vllm.patch``) hands each shard tensor of
the checkpoint (``shard_<i>.weight``; for NVFP4 also ``shard_<i>.weight_scale``, the block scales)
to the layer instead of copying it. The layer (its method, parameters, sizes) asks:

- ``check_shard``: is the tensor of the kind, shape and dtype the layer's embedding method loads
  (vLLM's own shape check, and an NVFP4 checkpoint under another method or the reverse refused
  naming the cure)?
- ``check_layout``: the checkpoint's table (its headers) fits the layer: row width, row count,
  shard count, storage dtype (a 16-bit table under another model dtype is served converted, as
  stock casts it: ``converts_rows``), the global scale and NVFP4's block scales present.

A tensor in memory (a reload from an iterator, a weight sync) must then equal the bytes this rank
maps (``delivered.compare_shard``); a view of a table file on disk is not read at all (``source``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLEUnquantizedEmbeddingMethod,
)

from ple_um.checkpoint import NVFP4_BLOCK, ShardLayout, check_shape, read_layout
from ple_um.checkpoint.naming import global_scale_name, scale_name
from ple_um.errors import CheckpointError

if TYPE_CHECKING:
    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding

NVFP4_HINT = (
    "an NVFP4 table needs ple_embedding_dtype='nvfp4' in the model's text config (or a ModelOpt "
    "mixed-precision quantization config with NVFP4 for this layer)"
)


def _parts(layer: Qwen4ExpPLEMappedEmbedding) -> int:
    """The layer's ``split_ngram_parts`` (set by the patch)."""
    if layer.split_ngram_parts is None:
        raise RuntimeError(f"{layer.prefix}: split_ngram_parts was not set (is the vLLM patch applied?)")
    return layer.split_ngram_parts


def _sharded(layer: Qwen4ExpPLEMappedEmbedding) -> dict[str, tuple[int, torch.dtype]]:
    """Each parameter the checkpoint splits into ``shard_<i>.<name>`` tensors (as stock loads them:
    ``weight``, and NVFP4's ``weight_scale``) with its (width, dtype), which the files must have."""
    names = ("weight", "weight_scale") if layer.is_nvfp4 else ("weight",)
    return {name: (getattr(layer, name).shape[1], getattr(layer, name).dtype) for name in names}


def _width_meaning(layer: Qwen4ExpPLEMappedEmbedding, name: str) -> str:
    head_dim = layer.embedding_dim
    if not layer.is_nvfp4:
        return f"the layer's n-gram head_dim {head_dim}"
    if name == "weight":
        return f"{head_dim // 2}, the packed bytes of the layer's n-gram head_dim {head_dim} (2 a byte)"
    return (
        f"{head_dim // NVFP4_BLOCK}, the block scales of the layer's n-gram head_dim {head_dim} "
        f"(1 per {NVFP4_BLOCK})"
    )


def check_shard(
    layer: Qwen4ExpPLEMappedEmbedding,
    index: int,
    tensor: torch.Tensor,
    name: str,
    backing: tuple[str, int] | None,
) -> None:
    """Shard tensor ``shard_<index>.<name>`` (``backing``: the file it is a view of, if any) must be
    one the layer's embedding method loads, of the shape vLLM's loader requires: else a
    CheckpointError (a ValueError, as stock raises) naming the file and the tensor."""
    parts, num_rows = _parts(layer), layer.org_vocab_size

    def where() -> dict:
        return checkpoint_tensor(layer, index, name, backing)

    if not 0 <= index < parts:
        raise CheckpointError(
            f"PLE embedding shard index {index} exceeds split_ngram_parts={parts} ({layer.prefix})", **where()
        )
    sharded = _sharded(layer)
    _check_shard_kind(layer, sharded, index, tensor, name, where)
    per_shard = -(-num_rows // parts)
    rows = max(0, min(per_shard, num_rows - index * per_shard))
    width = sharded[name][0]  # as stock: the parameter's width
    if tuple(tensor.shape) != (rows, width):
        if tensor.dim() == 2 and tensor.shape[-1] != width:
            what = f"row width {tensor.shape[-1]} != {_width_meaning(layer, name)}"
        else:
            what = (
                f"{tensor.shape[0] if tensor.dim() else 0} rows, expected {rows} "
                f"(ceil({num_rows} rows / {parts} parts) per shard)"
            )
        raise CheckpointError(
            f"Shape mismatch for PLE embedding shard {index}{'' if name == 'weight' else ' ' + name} of "
            f"{layer.prefix}: got {tuple(tensor.shape)}, expected {(rows, width)}: {what}",
            **where(),
        )


def checkpoint_tensor(
    layer: Qwen4ExpPLEMappedEmbedding, index: int, name: str, backing: tuple[str, int] | None
) -> dict:
    """Where shard tensor ``shard_<index>.<name>`` of the layer is in the checkpoint, for an error:
    ``tensor``, its full name in the checkpoint's index (its headers', which vLLM's weights mapper
    may have renamed before the layer saw it), and ``path``, the file it is a view of, else the
    file the checkpoint holds it in. Where the headers cannot tell (no such shard, unreadable
    files), the name under the layer's prefix."""
    tensor, path = f"{layer.prefix}.shard_{index}.{name}", backing[0] if backing else None
    try:
        table = layer.served.table
        layout = table.layout if table is not None else read_layout(layer.source.directory(), layer.layer)
        specs = layout.shards if name == "weight" else layout.block_scales
        if 0 <= index < len(specs):
            tensor, path = specs[index].tensor, path or specs[index].path
    except (CheckpointError, OSError):
        pass
    return {"path": path, "tensor": tensor}


def _check_shard_kind(
    layer: Qwen4ExpPLEMappedEmbedding,
    sharded: dict[str, tuple[int, torch.dtype]],
    index: int,
    tensor: torch.Tensor,
    name: str,
    where: Callable[[], dict],
) -> None:
    """The delivered tensor must be of the kind the layer's embedding method loads: an NVFP4
    checkpoint under an FP8 or 16-bit method, or the reverse, fails here naming the cure (and
    ``where()``: the file and the tensor)."""
    method, prefix = type(layer.embedding_method).__name__, layer.prefix
    if name not in sharded:
        raise CheckpointError(
            f"{prefix}: the checkpoint splits NVFP4 block scales into shards (shard_<i>.{name}), "
            f"but the layer's {method} serves {layer.weight.dtype} rows: {NVFP4_HINT}",
            **where(),
        )
    dtype = sharded[name][1]
    if layer.is_nvfp4 and tensor.dtype != dtype:
        # Stock refuses it too: a cast would silently reinterpret packed E2M1 bytes.
        raise CheckpointError(
            f"{prefix}: NVFP4 PLE shard {index} {name} requires {dtype}, got {tensor.dtype}: "
            f"the layer's {method} serves NVFP4 (ple_embedding_dtype='nvfp4' or its quantization "
            "config) but the checkpoint's table is not NVFP4: configure the layer for the table's dtype",
            **where(),
        )
    if not layer.is_nvfp4 and tensor.dtype == torch.uint8:
        raise CheckpointError(
            f"{prefix}: shard {index} holds packed NVFP4 rows (uint8), but the layer's {method} "
            f"serves {dtype} rows: {NVFP4_HINT}",
            **where(),
        )


def check_layout(layer: Qwen4ExpPLEMappedEmbedding, layout: ShardLayout) -> None:
    """The checkpoint's table must be the one this layer was built for."""
    prefix = layer.prefix
    check_shape(
        layout, prefix, row_dim=layer.embedding_dim, num_rows=layer.org_vocab_size, parts=_parts(layer)
    )
    first = layout.shards[0]
    where = {"path": first.path, "tensor": first.tensor}
    _check_layout_dtype(layer, layout, where)
    if isinstance(layer.embedding_method, Qwen4ExpPLEFp8EmbeddingMethod) and layout.scale is None:
        raise CheckpointError(f"{prefix}: the FP8 table has no {scale_name(first.tensor)}", **where)
    if layer.is_nvfp4 and layout.scale is None:
        raise CheckpointError(
            f"{prefix}: the NVFP4 table has no {global_scale_name(first.tensor)} (its global scale)",
            **where,
        )
    if layer.is_nvfp4 and len(layout.block_scales) != layout.parts:
        raise CheckpointError(
            f"{prefix}: the NVFP4 table has block scales (ngram_embedding.shard_<i>.weight_scale) "
            f"for {len(layout.block_scales)} of its {layout.parts} shards",
            **where,
        )


def converts_rows(layer: Qwen4ExpPLEMappedEmbedding, layout: ShardLayout) -> bool:
    """Whether the layer serves a 16-bit table in its own dtype, another one: stock vLLM's
    unquantized method holds its table in the model dtype and copies a checkpoint's rows into it
    cast (``source.to(dtype=target.dtype)``), a BF16 table under ``--dtype float16`` among them. The
    lookup converts each row as that cast does (``float32(row)``, cast: the same rounding). A table
    with a global scale is not one stock's unquantized method loads."""
    return (
        isinstance(layer.embedding_method, Qwen4ExpPLEUnquantizedEmbeddingMethod)
        and layout.dtype in (torch.bfloat16, torch.float16)
        and layout.scale is None
        and layer.weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def _check_layout_dtype(layer: Qwen4ExpPLEMappedEmbedding, layout: ShardLayout, where: dict) -> None:
    """The table's storage must be the one the layer's embedding method serves (NVFP4: uint8, the
    packed rows), or a 16-bit one the layer converts to its dtype as stock's cast does."""
    stored = layer.weight.dtype
    if (layout.is_nvfp4 == layer.is_nvfp4 and layout.dtype == stored) or converts_rows(layer, layout):
        return
    if layout.is_nvfp4:
        serves, hint = f"{stored} rows", NVFP4_HINT
    elif layer.is_nvfp4:
        serves = "NVFP4 (packed E2M1 rows with E4M3 block scales)"
        hint = (
            "the layer is NVFP4 (ple_embedding_dtype='nvfp4' or its quantization config) but the "
            "table is not: point PLE_UM_DIR at the model's NVFP4 table"
        )
    else:
        serves = str(stored)
        hint = (
            "an FP8 table needs an FP8 quantization config (or ple_embedding_dtype=float8_e4m3fn), "
            "a 16-bit table an unquantized PLE layer"
        )
    raise CheckpointError(
        f"{layer.prefix}: the table is stored as {layout.dtype_name} ({layout.dtype}), but the "
        f"layer's {type(layer.embedding_method).__name__} serves {serves}: {hint}",
        **where,
    )
