"""DeepSeek-V4.1's Engram tables in a checkpoint: find the layers that have one, read one layer's
table as a ShardLayout (one unsplit shard, MXFP8: E4M3 rows and E8M0 block scales), checked against
the model's config where given.

The tensors, under any prefix: ``...layers.<L>.engram.embed.weight`` (F8_E4M3 ``[rows, D]``) and
``...layers.<L>.engram.embed.scale`` (one E8M0 exponent per 32 values: F8_E8M0 or U8
``[rows, D/32]``), one of each per table, as vLLM 0.33's DeepSeek-V4.1 loads them (it renames them
``embed_tokens.weight`` / ``embed_tokens.weight_scale_inv``). Files are found as for a PLE table
(the index, else every ``*.safetensors``) and their headers read by the same rules
(``safetensors.read_header``: exactly what the ``safetensors`` package accepts); only headers are
read, never table data. Every problem raises a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import glob
import operator
import os
import re

from ple_um.checkpoint.engram_geometry import EngramGeometry
from ple_um.checkpoint.files import read_json_file
from ple_um.checkpoint.safetensors import MAX_HEADER_BYTES, TensorEntry, read_header
from ple_um.checkpoint.scan import INDEX_FILE
from ple_um.checkpoint.shard_layout import MXFP8, MXFP8_BLOCK, STORAGE_DTYPES, ShardLayout
from ple_um.checkpoint.validation import shard_specs
from ple_um.errors import CheckpointError

ENGRAM_RE = re.compile(r"(?:^|\.)layers\.([0-9]{1,9})\.engram\.embed\.(weight|scale)\Z")
ROW_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F8_E8M0", "U8")

__all__ = ["EngramGeometry", "find_engram_layers", "read_engram_layout"]


def engram_match(name: str) -> tuple[int, str] | None:
    """(layer, "weight" or "scale") when ``name`` is an Engram table's tensor, else None."""
    match = ENGRAM_RE.search(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def _files(directory: str, layer: int | None) -> tuple[list[str], dict[str, str]]:
    """The files that may hold the Engram tensors (of ``layer`` when given), and what the index
    claims: tensor name -> file."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.lexists(index_path):
        return sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors"))), {}
    index = read_json_file(index_path, what="index", limit=MAX_HEADER_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError("index has no weight_map object", path=index_path)
    claims: dict[str, str] = {}
    for name, file_name in weight_map.items():
        match = engram_match(name)
        if match is None or (layer is not None and match[0] != layer):
            continue
        if not isinstance(file_name, str) or not file_name or "\0" in file_name:
            raise CheckpointError(
                f"index entry names file {file_name!r}, expected a file name", path=index_path, tensor=name
            )
        normal = os.path.normpath(file_name)
        if os.path.isabs(file_name) or normal == ".." or normal.startswith(".." + os.sep):
            raise CheckpointError(
                f"index entry names {file_name!r}, outside the checkpoint directory",
                path=index_path,
                tensor=name,
            )
        path = os.path.join(directory, normal)
        if not os.path.exists(path):
            raise CheckpointError(
                f"index entry names {file_name!r}, a missing file", path=index_path, tensor=name
            )
        claims[name] = path
    return sorted(set(claims.values())), claims


def _scan(directory: str, layer: int | None) -> dict[int, dict[str, list[TensorEntry]]]:
    """Layer -> {"weight": [...], "scale": [...]}: every Engram tensor the headers hold."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(f"checkpoint directory {directory} {what}")
    files, claims = _files(directory, layer)
    found: dict[int, dict[str, list[TensorEntry]]] = {}
    for path in files:
        header = read_header(path)
        for name, entry in header.tensors.items():
            match = engram_match(name)
            if match is not None and (layer is None or match[0] == layer):
                found.setdefault(match[0], {"weight": [], "scale": []})[match[1]].append(entry)
        for name, claimed in claims.items():
            if claimed == path and name not in header.tensors:
                raise CheckpointError(
                    f"{INDEX_FILE} maps this tensor to {os.path.basename(path)}, which does not hold it",
                    path=path,
                    tensor=name,
                )
    return found


def find_engram_layers(directory: str | os.PathLike) -> list[int]:
    """The model layer ids that have an Engram table's rows in the checkpoint (headers only)."""
    found = _scan(os.path.abspath(os.fspath(directory)), None)
    return sorted(at for at, tensors in found.items() if tensors["weight"])


def _one(entries: list[TensorEntry], what: str, expected: str, where: TensorEntry | None) -> TensorEntry:
    if not entries:
        raise CheckpointError(
            f"no {what} for this Engram table (expected a tensor named like {expected})",
            path=where.path if where else None,
            tensor=where.name if where else None,
        )
    if len(entries) > 1:
        first, second = sorted(entries, key=lambda e: (e.path, e.name))[:2]
        raise CheckpointError(
            f"a second {what} of the same Engram table: {second.name} in {second.path}",
            path=first.path,
            tensor=first.name,
        )
    return entries[0]


def _check(weight: TensorEntry, scale: TensorEntry) -> None:
    """The formats and shapes the MXFP8 decode needs."""
    if weight.dtype != ROW_DTYPE:
        raise CheckpointError(
            f"Engram rows have dtype {weight.dtype}; only {ROW_DTYPE} (with E8M0 block scales) is served",
            path=weight.path,
            tensor=weight.name,
        )
    if (
        len(weight.shape) != 2
        or weight.shape[0] == 0
        or weight.shape[1] == 0
        or weight.shape[1] % MXFP8_BLOCK
    ):
        raise CheckpointError(
            f"Engram rows have shape {list(weight.shape)}; expected 2-D [rows, D], rows > 0, "
            f"D a positive multiple of {MXFP8_BLOCK} (one E8M0 scale per {MXFP8_BLOCK} values)",
            path=weight.path,
            tensor=weight.name,
        )
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(
            f"Engram block scales have dtype {scale.dtype}; "
            f"expected E8M0 exponents ({' or '.join(SCALE_DTYPES)})",
            path=scale.path,
            tensor=scale.name,
        )
    expect = [weight.shape[0], weight.shape[1] // MXFP8_BLOCK]
    if list(scale.shape) != expect:
        raise CheckpointError(
            f"Engram block scales have shape {list(scale.shape)}, expected {expect} "
            f"(one per {MXFP8_BLOCK} values of the rows tensor {weight.name})",
            path=scale.path,
            tensor=scale.name,
        )


def _check_geometry(weight: TensorEntry, layer: int, geometry: EngramGeometry) -> None:
    """The table has the rows and the row width the config gives that layer."""
    where = {"path": weight.path, "tensor": weight.name}
    if layer not in geometry.layer_ids:
        raise CheckpointError(
            f"layer {layer} has an Engram table, "
            f"but the config's engram_layer_ids are {list(geometry.layer_ids)}",
            **where,
        )
    rows = geometry.num_rows[geometry.index(layer)]
    if weight.shape[0] != rows:
        raise CheckpointError(
            f"the Engram table has {weight.shape[0]} rows, "
            f"but the config gives {rows} (engram_num_embeddings)",
            **where,
        )
    if weight.shape[1] != geometry.head_dim:
        raise CheckpointError(
            f"the Engram table's rows have {weight.shape[1]} values, but the config's engram_head_dim "
            f"is {geometry.head_dim}",
            **where,
        )


def read_engram_layout(
    directory: str | os.PathLike, layer: int | None = None, geometry: EngramGeometry | None = None
) -> ShardLayout:
    """One layer's Engram table (``layer``: the model layer id, as in the tensors' names; None: the
    only one there is), checked, and against ``geometry`` when given (its rows, its row width, the
    layer among the config's Engram layers)."""
    directory = os.path.abspath(os.fspath(directory))
    if layer is not None:
        layer = operator.index(layer)  # TypeError for a str or a float, as for any index
    found = _scan(directory, layer)
    layers = sorted(at for at, tensors in found.items() if tensors["weight"])
    if layer is None:
        if len(layers) != 1:
            listed = ", ".join(map(str, layers)) or "none"
            raise CheckpointError(f"Engram tables of layers {listed} in {directory}; pass layer= to pick one")
        (layer,) = layers
    elif layer not in layers and not found.get(layer, {}).get("scale"):
        listed = ", ".join(map(str, find_engram_layers(directory))) or "none"
        raise CheckpointError(f"no Engram table of layer {layer} in {directory}; layers with one: {listed}")
    tensors = found.get(layer, {"weight": [], "scale": []})
    stem = f"layers.{layer}.engram.embed"
    any_scale = tensors["scale"][0] if tensors["scale"] else None
    weight = _one(tensors["weight"], "rows tensor", f"{stem}.weight", any_scale)
    scale = _one(tensors["scale"], "block-scale tensor", weight.name.removesuffix("weight") + "scale", weight)
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
        scale=None,
        scale_tensor=None,
        block_scales=shard_specs({0: scale}),  # as many rows as the weight (_check)
        block_size=MXFP8_BLOCK,
    )
