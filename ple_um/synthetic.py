"""Synthetic PLE checkpoints: real safetensors files in the Qwen4Exp naming, for tests and benchmarks.

The table's content is random-looking, always finite, and a pure function of the arguments: each
shard draws from its own generator seeded with ``(seed, shard index)``, so neither the file split
nor the number of writer threads changes it. Data is streamed in chunks of about 64 MiB, so a
16 GiB table is written without holding it in memory; ``workers`` threads write shards at once,
each into its place in its file (NumPy's generators release the GIL while they draw).

NVFP4 tables (``dtype="nvfp4"``) are written as vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod`` loads
them: per shard, U8 ``[rows, D/2]`` packed E2M1 pairs (any byte is valid) and F8_E4M3
``[rows, D/16]`` block scales ``...shard_<i>.weight_scale`` (every finite code, zeros, subnormals
and negatives included), plus the F32 global scale ``...ngram_embedding.weight_scale_2``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from ple_um.checkpoint import NVFP4_BLOCK, ShardLayout, read_layout
from ple_um.checkpoint.scan import INDEX_FILE
from ple_um.checkpoint.shard_layout import FP8_DTYPES, NVFP4_STORAGE, STORAGE_DTYPES

PREFIX = "model.language_model."
CHUNK_BYTES = 64 << 20
# The files a table's shards are split over unless ``files`` is given: at most this many.
MAX_FILES = 4

# Accepted spellings (lower case) -> safetensors dtype name.
_DTYPE_NAMES = {
    **dict.fromkeys(("f8_e4m3", "fp8", "fp8_e4m3", "float8_e4m3fn"), "F8_E4M3"),
    **dict.fromkeys(("f8_e5m2", "fp8_e5m2", "float8_e5m2"), "F8_E5M2"),
    **dict.fromkeys(("bf16", "bfloat16"), "BF16"),
    **dict.fromkeys(("f16", "fp16", "float16"), "F16"),
    "nvfp4": "NVFP4",
}
# The torch dtypes of the tables it writes -> safetensors dtype name (NVFP4 is named, its U8 not).
_TORCH_DTYPES = {dt: name for name, dt in STORAGE_DTYPES.items() if name != NVFP4_STORAGE}
_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2, "F32": 4, "U8": 1}


def shard_name(layer: int, index: int) -> str:
    return f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{index}.weight"


def scale_name(layer: int) -> str:
    return f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale"


def block_scale_name(layer: int, index: int) -> str:
    """NVFP4: the block scales of shard ``index``."""
    return f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{index}.weight_scale"


def global_scale_name(layer: int) -> str:
    """NVFP4: the global scale."""
    return f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale_2"


UNRELATED_NAME = f"{PREFIX}embed_tokens.weight"


def dtype_name(dtype: torch.dtype | str) -> str:
    """The safetensors name of a storage dtype given as a torch dtype or a usual spelling
    ("NVFP4" for ``"nvfp4"``, whose shards are U8)."""
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[dtype]
    elif isinstance(dtype, str) and dtype.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.strip().lower()]
    raise ValueError(
        f"unsupported table dtype {dtype!r}: use torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, "
        f"torch.float16 or one of {', '.join(sorted(_DTYPE_NAMES))} (any case)"
    )


def shard_rows(num_rows: int, shards: int) -> list[int]:
    """Rows of each shard in the Qwen4Exp layout: ceil(num_rows / shards) each, the rest trailing."""
    per_shard = -(-num_rows // shards)
    return [min(max(num_rows - i * per_shard, 0), per_shard) for i in range(shards)]


def scale_value(seed: int) -> float:
    """The FP8 scale (NVFP4's global scale) for ``seed``: in [0.01, 0.05), exactly representable
    in F32, not a power of two."""
    value = float(np.float32(0.01 + 0.04 * np.random.default_rng([seed, 1 << 33]).random()))
    if math.frexp(value)[0] == 0.5:  # a power of two would hide a missing or doubled scale
        value = float(np.float32(value * 1.25))
    return value


def random_bytes(rng: np.random.Generator, name: str, count: int) -> np.ndarray:
    """``count`` elements of dtype ``name`` as uint8, finite by construction."""
    if name == "F8_E4M3":
        # 254 of the 256 codes: skip 0x7F and 0xFF, the e4m3fn NaNs.
        data = rng.integers(0, 254, count, dtype=np.uint8)
        data += data >= 0x7F
        return data
    if name == "U8":  # packed NVFP4: every byte is a pair of valid E2M1 codes
        return rng.integers(0, 256, count, dtype=np.uint8)
    if name == "F8_E5M2":
        data = rng.integers(0, 256, count, dtype=np.uint8)
        # Exponent all ones (inf / NaN): clear its lowest bit.
        data ^= ((data & 0x7C) == 0x7C).view(np.uint8) << 2
        return data
    # 16-bit: random sign and mantissa, exponent in 8 steps around 1: magnitudes in [2**-4, 2**4).
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    shift, mask, low = (10, 0x83FF, 15 - 4) if name == "F16" else (7, 0x807F, 127 - 4)
    exponent = bits >> np.uint16(shift)
    exponent &= np.uint16(7)
    exponent += np.uint16(low)
    exponent <<= np.uint16(shift)
    bits &= np.uint16(mask)
    bits |= exponent
    return bits.view(np.uint8)


class Tensor(NamedTuple):
    """A tensor of a synthetic file, its data drawn from a generator keyed by ``source`` and ``index``."""

    name: str
    dtype: str
    shape: list[int]
    source: str  # "shard", "block_scale" (NVFP4), "unrelated" or "scale"; an Engram "weight" or "scale"
    index: int = 0  # the shard index of a shard or its block scales; an Engram table's layer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return int(value)


def write_checkpoint(
    path: str | os.PathLike,
    *,
    num_rows: int,
    row_dim: int,
    dtype: torch.dtype | str,
    shards: int,
    layer: int = 1,
    seed: int = 0,
    files: int | None = None,
    progress: bool = False,
    workers: int = 1,
    write_back: bool = False,
) -> ShardLayout:
    """Write a PLE table of ``num_rows`` x ``row_dim`` in ``shards`` shards over ``files`` files.

    Also writes, for an FP8 table, the F32 global scale; for an NVFP4 table (``row_dim`` values a
    row, a multiple of 16), each shard's block scales next to it and the F32 global scale
    ``weight_scale_2``; one small unrelated BF16 tensor (which a reader must skip); and
    ``model.safetensors.index.json``. Existing files of the same names are replaced. ``workers``
    threads write shards at once (each holds a chunk of about 64 MiB); the bytes written do not
    depend on it. ``write_back``: each file is written back to disk (fsync) before it is renamed
    into place, so that no writeback is left to run while the table is timed. Returns
    ``read_layout(path, layer)``.
    """
    num_rows = _check_int("num_rows", num_rows, 1)
    row_dim = _check_int("row_dim", row_dim, 1)
    shards = _check_int("shards", shards, 1)
    layer = _check_int("layer", layer, 0)
    seed = _check_int("seed", seed, 0)
    workers = _check_int("workers", workers, 1)
    files = min(shards, MAX_FILES) if files is None else _check_int("files", files, 1)
    if files > shards:
        raise ValueError(f"files ({files}) must not exceed shards ({shards}): each file holds at least one")
    name = dtype_name(dtype)
    nvfp4 = name == "NVFP4"
    if nvfp4 and row_dim % NVFP4_BLOCK:
        raise ValueError(f"row_dim of an NVFP4 table must be a multiple of {NVFP4_BLOCK}, got {row_dim}")
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    plans = _plan_files(name, shard_rows(num_rows, shards), row_dim, layer, files)

    total_bytes = sum(t.nbytes for _, tensors in plans for t in tensors)
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="write", disable=not progress
    )
    with bar, ThreadPoolExecutor(workers, thread_name_prefix="ple-um-write") as pool:
        for name_in_dir, tensors in plans:
            _write_file(os.path.join(directory, name_in_dir), tensors, seed, bar, pool, write_back)
            weight_map.update({t.name: name_in_dir for t in tensors})

    write_index(directory, weight_map, total_bytes)
    return read_layout(directory, layer)


def _plan_files(
    name: str, rows: list[int], row_dim: int, layer: int, files: int
) -> list[tuple[str, list[Tensor]]]:
    """Each file's name and tensors, in the order they are written: contiguous runs of shards per
    file (an NVFP4 shard's block scales beside it), the small tensors in the last file."""
    nvfp4 = name == "NVFP4"
    storage = NVFP4_STORAGE if nvfp4 else name
    width = row_dim // 2 if nvfp4 else row_dim  # elements of the shard tensor per row
    plans: list[tuple[str, list[Tensor]]] = []
    for k, group in enumerate(np.array_split(np.arange(len(rows)), files)):
        tensors = [
            Tensor(shard_name(layer, int(i)), storage, [rows[i], width], "shard", int(i)) for i in group
        ]
        if nvfp4:  # each shard's block scales in its file
            width_scales = row_dim // NVFP4_BLOCK
            tensors += [
                Tensor(
                    block_scale_name(layer, int(i)), "F8_E4M3", [rows[i], width_scales], "block_scale", int(i)
                )
                for i in group
            ]
        if k == files - 1:
            tensors.append(Tensor(UNRELATED_NAME, "BF16", [8, row_dim], "unrelated"))
            if name in FP8_DTYPES:
                tensors.append(Tensor(scale_name(layer), "F32", [], "scale"))
            elif nvfp4:
                tensors.append(Tensor(global_scale_name(layer), "F32", [], "scale"))
        # The safetensors package's order: larger alignment first, then by name; it keeps every
        # tensor aligned to its element size, which loaders that view the data in place need.
        tensors.sort(key=lambda t: (-_ITEMSIZE[t.dtype], t.name))
        plans.append((file_name(k + 1, files), tensors))
    return plans


def _write_file(
    path: str, tensors: list[Tensor], seed: int, bar: tqdm, pool: ThreadPoolExecutor, write_back: bool
) -> None:
    jobs = []
    with safetensors_file(path, tensors, write_back) as (fd, places):
        try:
            for t, pos in zip(tensors, places, strict=True):
                if t.source == "scale":
                    _pwrite(fd, struct.pack("<f", scale_value(seed)), pos)
                    bar.update(t.nbytes)
                else:
                    # A shard draws from (seed, i); its NVFP4 block scales from (seed, i, 2**34); the
                    # unrelated tensor from (seed, 2**32).
                    keys = {"shard": [seed, t.index], "block_scale": [seed, t.index, 1 << 34]}
                    rng = np.random.default_rng(keys.get(t.source, [seed, 1 << 32]))
                    draw = partial(random_bytes, rng, t.dtype)
                    jobs.append(pool.submit(write_rows, fd, pos, t, draw))
            for job in as_completed(jobs):
                bar.update(job.result())
        finally:
            wait(jobs)  # no thread may still write through fd once it is closed (its number is reused)


@contextmanager
def safetensors_file(path: str, tensors: list[Tensor], write_back: bool = False):
    """Yield the descriptor of ``path.partial``, holding the safetensors header of ``tensors`` (in
    their order) and as long as their data (zeros until written), and each tensor's data position in
    it; on a clean exit, written back to disk (fsync) where ``write_back``, then renamed to ``path``."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, offsets = 0, []
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offsets.append(offset)
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec's padding: data starts 8-aligned
    start = 8 + len(raw)
    partial_path = path + ".partial"
    fd = os.open(partial_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(fd, start + offset)
        yield fd, [start + o for o in offsets]
        if write_back:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial_path, path)


def write_rows(fd: int, pos: int, t: Tensor, draw) -> int:
    """Write the rows of the 2-D tensor ``t`` at byte ``pos`` of ``fd``, ``draw(count)`` giving
    ``count`` elements as uint8; returns the bytes written."""
    # Chunks of whole rows, sized from row_bytes alone, so the content depends only on the arguments.
    rows, width = t.shape
    row_bytes = width * _ITEMSIZE[t.dtype]
    chunk_rows = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        _pwrite(fd, memoryview(draw(n * width)), pos + start * row_bytes)
    return rows * row_bytes


def _pwrite(fd: int, data, pos: int) -> None:
    """All of ``data`` at byte ``pos`` (os.pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, pos)
        view, pos = view[done:], pos + done


def write_index(directory: str, weight_map: dict[str, str], total_bytes: int) -> None:
    """``model.safetensors.index.json``: each tensor's file, written whole or not at all."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    path = os.path.join(directory, INDEX_FILE)
    with open(path + ".partial", "wb") as f:
        f.write(json.dumps(index, indent=2).encode())
    os.replace(path + ".partial", path)
