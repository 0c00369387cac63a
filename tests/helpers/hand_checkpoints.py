"""PLE checkpoints built tensor by tensor in the tests' own folders, for the checkpoint layer's
tests, and the one way they assert a checkpoint is refused.

A table is a dict ``{name: (dtype, shape, data)}`` (what ``reference.write_safetensors`` writes):
``ple()`` one FP8 or 16-bit layer with its scale, ``nvfp4()`` one NVFP4 layer with its block
scales and global scale; ``changed`` and ``without`` break them one tensor at a time. ``raises``
checks that read_layout refuses a directory with a CheckpointError naming the file and tensor, and
that validate lists that problem first. ``sparse_table()`` writes an FP8 layer of any size as a
sparse file, for the tests of huge tables.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from ple_um.checkpoint import read_layout, validate
from ple_um.errors import CheckpointError

from .reference import tensor_bytes, write_safetensors

PREFIX = "model.language_model."
INDEX = "model.safetensors.index.json"
GLOBAL = 0.0390625  # a global scale exact in every scale dtype, and not a power of two
UNRELATED = {"model.language_model.embed_tokens.weight": ("I64", [2, 3], tensor_bytes("I64", [2, 3]))}

Tensors = dict[str, tuple[str, list[int], bytes]]


def _ple(layer: int, prefix: str) -> str:
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding."


def shard(i: int, layer: int = 1, prefix: str = PREFIX) -> str:
    return f"{_ple(layer, prefix)}shard_{i}.weight"


def scale_name(layer: int = 1, prefix: str = PREFIX) -> str:
    """The FP8 global scale (refused next to an NVFP4 table)."""
    return f"{_ple(layer, prefix)}weight_scale"


def block(i: int, layer: int = 1, prefix: str = PREFIX) -> str:
    """NVFP4: the block scales of shard ``i``."""
    return f"{_ple(layer, prefix)}shard_{i}.weight_scale"


def global_name(layer: int = 1, prefix: str = PREFIX) -> str:
    """NVFP4: the global scale."""
    return f"{_ple(layer, prefix)}weight_scale_2"


def scalar(dtype: str, value: float) -> bytes:
    if dtype == "F32":
        return struct.pack("<f", value)
    if dtype == "F16":
        return struct.pack("<e", value)
    if dtype == "BF16":
        return struct.pack("<f", value)[2:]
    if dtype == "F64":
        return struct.pack("<d", value)
    raise AssertionError(dtype)


def ple(
    rows=(3, 3, 3, 0),
    dim: int = 4,
    dtype: str = "F8_E4M3",
    layer: int = 1,
    scale: tuple[str, list[int], float] | None = ("F32", [], GLOBAL),
    prefix: str = PREFIX,
) -> Tensors:
    """The tensors of one PLE layer: shards with distinct content, and the scale when given."""
    tensors = {
        shard(i, layer, prefix): (dtype, [r, dim], tensor_bytes(dtype, [r, dim], seed=100 * layer + i))
        for i, r in enumerate(rows)
    }
    if scale is not None:
        sdt, shape, value = scale
        tensors[scale_name(layer, prefix)] = (sdt, shape, scalar(sdt, value))
    return tensors


def nvfp4(
    rows=(3, 3, 3, 0),
    dim: int = 32,
    layer: int = 1,
    prefix: str = PREFIX,
    global_scale: tuple[str, list[int], float] | None = ("F32", [], GLOBAL),
) -> Tensors:
    """One NVFP4 layer: ``dim`` values a row; shards and block scales with distinct content."""
    tensors: Tensors = {}
    for i, r in enumerate(rows):
        tensors[shard(i, layer, prefix)] = ("U8", [r, dim // 2], tensor_bytes("U8", [r, dim // 2], seed=i))
        shape = [r, dim // 16]
        tensors[block(i, layer, prefix)] = ("F8_E4M3", shape, tensor_bytes("F8_E4M3", shape, seed=50 + i))
    if global_scale is not None:
        dtype, shape, value = global_scale
        tensors[global_name(layer, prefix)] = (dtype, shape, scalar(dtype, value))
    return tensors


def changed(tensors: Tensors, name: str, dtype=None, shape=None, data=None) -> Tensors:
    """``tensors`` with the dtype, shape or data of ``name`` replaced (in place)."""
    old = tensors[name]
    tensors[name] = (
        dtype or old[0],
        shape if shape is not None else old[1],
        data if data is not None else old[2],
    )
    return tensors


def without(tensors: Tensors, *names: str) -> Tensors:
    """``tensors`` without ``names`` (in place)."""
    for name in names:
        del tensors[name]
    return tensors


def entry(dtype="U8", shape=(2, 4), offsets=(0, 8)) -> dict:
    """One header entry, for headers written with ``reference.write_raw``."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def one_file(tmp_path, tensors: Tensors, name: str = "model.safetensors", **kw) -> str:
    """``tensors`` in one file of the folder ``tmp_path``; returns the folder."""
    write_safetensors(tmp_path / name, tensors, **kw)
    return str(tmp_path)


def indexed(tmp_path, files: dict[str, Tensors], weight_map: dict | None = None, extra=None) -> str:
    """Write ``files`` and an index mapping each of their tensors (or ``weight_map`` as given)."""
    mapping = {}
    for name, tensors in files.items():
        write_safetensors(tmp_path / name, tensors)
        mapping.update({t: name for t in tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": mapping if weight_map is None else weight_map}
    if extra:
        index["weight_map"].update(extra)
    (tmp_path / INDEX).write_text(json.dumps(index))
    return str(tmp_path)


def sparse_table(folder, rows: int, dim: int) -> str:
    """An FP8 table of two shards of ``rows`` rows of ``dim`` bytes and its scale (0.5) in
    ``folder/model.safetensors``, the rows a hole of a sparse file (zeros, taking no disk): a
    table of any size. Returns the file's path."""
    header = {
        shard(i): entry("F8_E4M3", (rows, dim), (i * rows * dim, (i + 1) * rows * dim)) for i in range(2)
    }
    end = 2 * rows * dim
    header[scale_name()] = entry("F32", (), (end, end + 4))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.seek(8 + len(raw) + end)
        f.write(scalar("F32", 0.5))
    return path


def raises(directory, match: str, *, layer=None, path: str | None = None, tensor: str | None = None):
    """read_layout must raise a CheckpointError matching ``match`` that names ``path`` and ``tensor``;
    validate must report the same problem first."""
    with pytest.raises(CheckpointError, match=match) as info:
        read_layout(directory, layer)
    error = info.value
    assert isinstance(error, ValueError)
    if path is not None:
        assert error.path is not None and os.path.basename(error.path) == path, str(error)
        assert path in str(error)
    if tensor is not None:
        assert error.tensor == tensor, str(error)
        assert tensor in str(error)
    problems = validate(directory, layer)
    assert problems and problems[0] == str(error)
    return error
