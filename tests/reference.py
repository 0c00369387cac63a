"""Reference implementations for tests, independent of ple_um's own readers and writers.

- ``reference_rows``: the rows a lookup must return, read with plain open/seek/read.
- ``encode_safetensors`` / ``write_safetensors`` / ``write_raw``: safetensors files built byte by
  byte, sound or deliberately broken.

Import from any test module as ``from reference import reference_rows`` (pytest puts ``tests/`` on
``sys.path``, the rootdir-conftest way) or ``from tests.reference import ...`` from the repo root.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable

import numpy as np

ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "U8": 1}


def reference_rows(layout, ids, rows: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 ``[len(ids), layout.row_bytes]``: each id's row read from the files with open/seek/read.

    ``ids`` is anything np.asarray takes (a CPU torch tensor too), flattened. Ids outside
    ``[0, num_rows)``, and outside the owned range ``rows=(start, end)`` when given, give zeros.
    """
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    out = np.zeros((flat.size, layout.row_bytes), dtype=np.uint8)
    start, end = (0, layout.num_rows) if rows is None else rows
    handles: dict[str, object] = {}
    try:
        for k, row in enumerate(flat.tolist()):
            if not (0 <= row < layout.num_rows and start <= row < end):
                continue
            shard = layout.shards[row // layout.rows_per_shard]
            local = row - shard.index * layout.rows_per_shard
            assert 0 <= local < shard.rows, (row, shard)
            f = handles.get(shard.path)
            if f is None:
                f = handles[shard.path] = open(shard.path, "rb")  # noqa: SIM115 - closed below
            f.seek(shard.offset + local * layout.row_bytes)
            data = f.read(layout.row_bytes)
            assert len(data) == layout.row_bytes, (row, shard)
            out[k] = np.frombuffer(data, dtype=np.uint8)
    finally:
        for f in handles.values():
            f.close()
    return out


def encode_safetensors(
    tensors: dict[str, tuple[str, list[int], bytes]],
    *,
    metadata: dict[str, str] | None = None,
    order: Iterable[str] | None = None,
) -> bytes:
    """A sound safetensors file of ``{name: (dtype, shape, data)}``, data in ``order`` (default: as given)."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    names = list(order) if order is not None else list(tensors)
    for name in names:
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors[name][2] for name in names)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, tuple[str, list[int], bytes]], **kw) -> str:
    with open(path, "wb") as f:
        f.write(encode_safetensors(tensors, **kw))
    return os.fspath(path)


def write_raw(
    path: str | os.PathLike, header: bytes | str | object, data: bytes = b"", *, length: int | None = None
) -> str:
    """A file with the given header (bytes verbatim, str UTF-8, else JSON) and a length field
    (default: the header's true length)."""
    if isinstance(header, str):
        raw = header.encode()
    elif isinstance(header, bytes):
        raw = header
    else:
        raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return os.fspath(path)


def tensor_bytes(dtype: str, shape: list[int], fill: int | None = None, seed: int = 0) -> bytes:
    """Data of the right size; distinct per seed so tests can tell tensors apart."""
    n = math.prod(shape) * ITEMSIZE[dtype]
    if fill is not None:
        return bytes([fill]) * n
    # Bytes below 0x70 are finite in every dtype used here.
    return (np.random.default_rng(seed).integers(0, 0x70, n, dtype=np.uint8)).tobytes()
