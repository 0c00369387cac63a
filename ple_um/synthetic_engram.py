"""Synthetic DeepSeek-V4.1 Engram checkpoints: real safetensors files with one Engram table per
layer, for tests, benchmarks and demos.

Each table is ``layers.<L>.engram.embed.weight`` (F8_E4M3 ``[rows, D]``, every code but the two
NaNs) and ``layers.<L>.engram.embed.scale`` (E8M0 ``[rows, D/32]``: three in four exponents near 1,
the rest anywhere in 0..254, so zero scales, subnormal and overflowing products all occur; never
255), beside one unrelated tensor a reader must skip; all in one file with its index. The content
is a pure function of ``seed`` and the layer. ``sparse=True`` writes only the headers and leaves
the data as a hole of the right length (zeros), for layout tests at the released geometry's sizes.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from ple_um.checkpoint.engram import read_engram_layout
from ple_um.checkpoint.scan import INDEX_FILE
from ple_um.checkpoint.shard_layout import MXFP8_BLOCK, ShardLayout

PREFIX = "model."
FILE_NAME = "model-00001-of-00001.safetensors"
UNRELATED_NAME = PREFIX + "layers.0.attn.wq.weight"
CHUNK_ROWS = 1 << 16


def weight_name(layer: int) -> str:
    return f"{PREFIX}layers.{layer}.engram.embed.weight"


def scale_name(layer: int) -> str:
    return f"{PREFIX}layers.{layer}.engram.embed.scale"


def _values(rng: np.random.Generator, count: int) -> np.ndarray:
    data = rng.integers(0, 254, count, dtype=np.uint8)
    data += data >= 0x7F  # skip 0x7F and 0xFF, the E4M3 NaNs
    return data


def _exponents(rng: np.random.Generator, count: int) -> np.ndarray:
    near_one = rng.integers(112, 142, count, dtype=np.uint8)
    anywhere = rng.integers(0, 255, count, dtype=np.uint8)
    return np.where(rng.random(count) < 0.75, near_one, anywhere).astype(np.uint8)


def write_engram_checkpoint(
    path: str | os.PathLike,
    *,
    tables: dict[int, int],
    head_dim: int = 256,
    seed: int = 0,
    scale_dtype: str = "F8_E8M0",
    sparse: bool = False,
    write_back: bool = False,
) -> dict[int, ShardLayout]:
    """Write one Engram table per entry of ``tables`` (model layer id -> rows) of ``head_dim``
    values a row into the directory ``path``; returns each layer's ShardLayout as read back.
    ``write_back``: the file is written back to disk (fsync) before it is renamed into place."""
    if head_dim <= 0 or head_dim % MXFP8_BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {MXFP8_BLOCK}, got {head_dim}")
    if scale_dtype not in ("F8_E8M0", "U8"):
        raise ValueError(f"scale_dtype must be F8_E8M0 or U8, got {scale_dtype!r}")
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    width = head_dim // MXFP8_BLOCK
    tensors: list[tuple[str, str, list[int], int, str]] = [(UNRELATED_NAME, "BF16", [4, 8], 0, "unrelated")]
    for layer, rows in sorted(tables.items()):
        tensors.append((weight_name(layer), "F8_E4M3", [rows, head_dim], layer, "weight"))
        tensors.append((scale_name(layer), scale_dtype, [rows, width], layer, "scale"))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, places = 0, []
    for name, dtype, shape, layer, kind in tensors:
        nbytes = shape[0] * shape[1] * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        places.append((offset, shape, layer, kind))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    target = os.path.join(directory, FILE_NAME)
    with open(target + ".partial", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
        for start, shape, layer, kind in places if not sparse else ():
            f.seek(8 + len(raw) + start)
            _write_tensor(f, np.random.default_rng([seed, layer, kind == "scale"]), shape, kind)
        if write_back:
            f.flush()
            os.fsync(f.fileno())
    os.replace(target + ".partial", target)
    index = {"metadata": {}, "weight_map": {name: FILE_NAME for name, *_ in tensors}}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f)
    return {layer: read_engram_layout(directory, layer) for layer in tables}


def _write_tensor(f, rng: np.random.Generator, shape: list[int], kind: str) -> None:
    rows, width = shape
    if kind == "unrelated":
        f.write(rng.integers(0, 1 << 16, rows * width, dtype=np.uint16).tobytes())
        return
    draw = _exponents if kind == "scale" else _values
    for start in range(0, rows, CHUNK_ROWS):
        f.write(draw(rng, min(CHUNK_ROWS, rows - start) * width).tobytes())
