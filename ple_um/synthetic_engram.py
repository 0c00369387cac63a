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

import os
from functools import partial

import numpy as np

from ple_um.checkpoint.engram import read_engram_layout
from ple_um.checkpoint.shard_layout import MXFP8_BLOCK, ShardLayout
from ple_um.synthetic import Tensor, file_name, random_bytes, safetensors_file, write_index, write_rows

PREFIX = "model."
FILE_NAME = file_name(1, 1)
UNRELATED_NAME = PREFIX + "layers.0.attn.wq.weight"


def weight_name(layer: int) -> str:
    return f"{PREFIX}layers.{layer}.engram.embed.weight"


def scale_name(layer: int) -> str:
    return f"{PREFIX}layers.{layer}.engram.embed.scale"


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
    tensors = [Tensor(UNRELATED_NAME, "BF16", [4, 8], "unrelated")]
    for layer, rows in sorted(tables.items()):
        tensors.append(Tensor(weight_name(layer), "F8_E4M3", [rows, head_dim], "weight", layer))
        tensors.append(Tensor(scale_name(layer), scale_dtype, [rows, width], "scale", layer))
    with safetensors_file(os.path.join(directory, FILE_NAME), tensors, write_back) as (fd, places):
        for t, pos in zip(tensors, places, strict=True) if not sparse else ():
            rng = np.random.default_rng([seed, t.index, t.source == "scale"])
            # E8M0 scales from _exponents; the weights and the unrelated tensor any finite value.
            draw = partial(_exponents, rng) if t.source == "scale" else partial(random_bytes, rng, t.dtype)
            write_rows(fd, pos, t, draw)
    write_index(directory, {t.name: FILE_NAME for t in tensors}, sum(t.nbytes for t in tensors))
    return {layer: read_engram_layout(directory, layer) for layer in tables}
