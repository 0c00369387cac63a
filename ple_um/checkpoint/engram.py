"""DeepSeek-V4.1's Engram tables in a checkpoint: one layer's table read as a ShardLayout (one
unsplit shard, MXFP8: E4M3 rows and E8M0 block scales), checked against the model's geometry where
given.

The tensors, under any prefix: ``...layers.<L>.engram.embed.weight`` (F8_E4M3 ``[rows, D]``) and
``...layers.<L>.engram.embed.scale`` (one E8M0 exponent per 32 values: F8_E8M0 or U8
``[rows, D/32]``), one of each per table, as vLLM 0.33's DeepSeek-V4.1 loads them (it renames them
``embed_tokens.weight`` / ``embed_tokens.weight_scale_inv``). The files are found and their
headers read by a PLE table's ``scan`` (the index, else every ``*.safetensors``; each header exactly
what the ``safetensors`` package accepts), ``naming.engram_match`` picking the tensors; only headers
are read, never table data. Every problem raises a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import os

from ple_um.checkpoint.engram_geometry import EngramGeometry
from ple_um.checkpoint.naming import engram_match
from ple_um.checkpoint.safetensors import TensorEntry
from ple_um.checkpoint.scan import LayerTensors, Problems, layer_number, refusal, scan
from ple_um.checkpoint.shard_layout import MXFP8, MXFP8_BLOCK, STORAGE_DTYPES, ShardLayout
from ple_um.checkpoint.validation import shard_specs
from ple_um.errors import CheckpointError

ROW_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F8_E8M0", "U8")

__all__ = ["EngramGeometry", "read_engram_layout"]


def _one(entries: list[TensorEntry], what: str, expected: str, where: TensorEntry | None) -> TensorEntry:
    if not entries:
        raise CheckpointError(
            f"no {what} for this Engram table (expected a tensor named like {expected})",
            path=where.path if where else None,
            tensor=where.name if where else None,
        )
    if len(entries) > 1:
        first, second = sorted(entries, key=lambda e: (e.path, e.name))[:2]
        raise refusal(first, f"a second {what} of the same Engram table: {second.name} in {second.path}")
    return entries[0]


def _check(weight: TensorEntry, scale: TensorEntry) -> None:
    """The formats and shapes the MXFP8 decode needs."""
    if weight.dtype != ROW_DTYPE:
        raise refusal(
            weight,
            f"Engram rows have dtype {weight.dtype}; only {ROW_DTYPE} (with E8M0 block scales) is served",
        )
    if (
        len(weight.shape) != 2
        or weight.shape[0] == 0
        or weight.shape[1] == 0
        or weight.shape[1] % MXFP8_BLOCK
    ):
        raise refusal(
            weight,
            f"Engram rows have shape {list(weight.shape)}; expected 2-D [rows, D], rows > 0, "
            f"D a positive multiple of {MXFP8_BLOCK} (one E8M0 scale per {MXFP8_BLOCK} values)",
        )
    if scale.dtype not in SCALE_DTYPES:
        raise refusal(
            scale,
            f"Engram block scales have dtype {scale.dtype}; "
            f"expected E8M0 exponents ({' or '.join(SCALE_DTYPES)})",
        )
    expect = [weight.shape[0], weight.shape[1] // MXFP8_BLOCK]
    if list(scale.shape) != expect:
        raise refusal(
            scale,
            f"Engram block scales have shape {list(scale.shape)}, expected {expect} "
            f"(one per {MXFP8_BLOCK} values of the rows tensor {weight.name})",
        )


def _check_geometry(weight: TensorEntry, layer: int, geometry: EngramGeometry) -> None:
    """The table has the rows and the row width the config gives that layer."""
    if layer not in geometry.layer_ids:
        raise refusal(
            weight,
            f"layer {layer} has an Engram table, "
            f"but the config's engram_layer_ids are {list(geometry.layer_ids)}",
        )
    rows = geometry.num_rows[geometry.index(layer)]
    if weight.shape[0] != rows:
        raise refusal(
            weight,
            f"the Engram table has {weight.shape[0]} rows, "
            f"but the config gives {rows} (engram_num_embeddings)",
        )
    if weight.shape[1] != geometry.head_dim:
        raise refusal(
            weight,
            f"the Engram table's rows have {weight.shape[1]} values, but the config's engram_head_dim "
            f"is {geometry.head_dim}",
        )
    # The heads' ranges lie one after the other from row 0 (``EngramGeometry.head_rows``): the last
    # ends at their sum, which a table with fewer rows lacks.
    needed = sum(geometry.head_sizes[geometry.index(layer)])
    if needed > weight.shape[0]:
        raise refusal(
            weight,
            f"the config's hash heads of layer {layer} need {needed} rows (their prime-sized ranges, "
            f"one after the other), but the Engram table has {weight.shape[0]}",
        )


def read_engram_layout(
    directory: str | os.PathLike, layer: int | None = None, geometry: EngramGeometry | None = None
) -> ShardLayout:
    """One layer's Engram table (``layer``: the model layer id, as in the tensors' names; None: the
    only one there is), checked, and against ``geometry`` when given (its rows, its row width, the
    layer among the config's Engram layers). A ``geometry`` of another type is a TypeError naming
    it, raised before anything is read."""
    directory = os.path.abspath(os.fspath(directory))
    layer = layer_number(layer)
    if geometry is not None and not isinstance(geometry, EngramGeometry):
        raise TypeError(
            f"geometry={geometry!r} ({type(geometry).__name__}): expected an EngramGeometry, or None"
        )
    # Every Engram tensor (of ``layer`` when given) the headers hold; the first problem raises.
    found = scan(directory, layer, Problems(strict=True), engram_match)
    assert found is not None  # a strict Problems raises instead of returning nothing
    # The layers with rows; where none has any, those with scales alone: a table whose rows tensor is
    # missing is refused naming its scales (``_one``), not taken for no table at all.
    layers = found.layers or set(found.tensors)
    listed = ", ".join(map(str, sorted(layers))) or "none"
    if layer is None and not layers:
        raise CheckpointError(f"no Engram table was found in {directory}")
    if layer is None and len(layers) != 1:
        raise CheckpointError(f"Engram tables of layers {listed} in {directory}; pass layer= to pick one")
    if layer is None:
        (layer,) = layers
    tensors = found.tensors.get(layer, LayerTensors())
    if layer not in found.layers and not tensors.block_scales:
        raise CheckpointError(f"no Engram table of layer {layer} in {directory}; layers with one: {listed}")
    weights, scales = tensors.shards.get(0, []), tensors.block_scales.get(0, [])
    stem = f"layers.{layer}.engram.embed"
    weight = _one(weights, "rows tensor", f"{stem}.weight", scales[0] if scales else None)
    scale = _one(scales, "block-scale tensor", weight.name.removesuffix("weight") + "scale", weight)
    _check(weight, scale)
    if geometry is not None:
        _check_geometry(weight, layer, geometry)
    rows, dim = weight.shape
    return ShardLayout(
        directory=directory,
        layer=layer,
        dtype_name=MXFP8,
        dtype=STORAGE_DTYPES[ROW_DTYPE],
        row_dim=dim,
        row_bytes=dim,
        num_rows=rows,
        rows_per_shard=rows,
        shards=shard_specs({0: weight}),
        block_scales=shard_specs({0: scale}),  # as many rows as the weight (_check)
        block_size=MXFP8_BLOCK,
    )
