"""Reference implementations for tests, independent of ple_um's own readers and writers.

- ``reference_rows``: the rows a lookup must return, read with plain open/seek/read.
- ``reference_nvfp4``: an NVFP4 table's rows decoded as vLLM's CPU path does, by a NumPy decoder
  written from the format (``decode_e2m1``, ``decode_e4m3``), files read with open/seek/read.
- ``encode_safetensors`` / ``write_safetensors`` / ``write_raw``: safetensors files built byte by
  byte, sound or deliberately broken; ``misalign_checkpoint``: a checkpoint's files rewritten so
  their tensors start at odd bytes, as exporters other than the safetensors package may lay them.
- ``safetensors_table``: a table's tensors as the ``safetensors`` package itself reads them.
- ``bits_differ``: an output against the expected rows, shape, dtype and bits.
- ``drop_page_cache`` and ``maps_of``: the page cache and this process's mappings of a table's
  files, read or changed through the OS alone.

Import from any test module as ``from helpers.reference import reference_rows`` (the root conftest
puts ``tests/`` on ``sys.path``) or ``from tests.helpers.reference import ...`` from the repo root.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable

import numpy as np
import torch

from ple_um.residency import evict_pages

ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "U8": 1}

# NVFP4: two E2M1 codes a byte (the even element in the low nibble), one E4M3 scale per 16 values.
NVFP4_BLOCK = 16
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


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


def decode_e2m1(codes) -> np.ndarray:
    """float32 values of E2M1 codes (0..15): bit 3 the sign, bits 0-2 index E2M1_MAGNITUDES.
    Code 8 is -0.0 (0 * -1)."""
    codes = np.asarray(codes, dtype=np.uint8)
    sign = np.where(((codes >> 3) & 1) == 1, np.float32(-1.0), np.float32(1.0))
    return E2M1_MAGNITUDES[codes & 7] * sign


def decode_e4m3(raw) -> np.ndarray:
    """float32 values of E4M3 (e4m3fn) bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m * 2**-9); 0x7F and 0xFF are NaN; there is no infinity."""
    b = np.asarray(raw, dtype=np.uint8).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    value = sign * np.where(exponent == 0, mantissa * 2.0**-9, normal)  # exact in float64
    value = np.where((b & 0x7F) == 0x7F, np.nan, value)
    return value.astype(np.float32)


def decode_nvfp4(packed, block_scales, global_scale) -> np.ndarray:
    """float32 ``[..., 2 * packed.shape[-1]]``: NVFP4 rows decoded as vLLM's CPU path does, from
    their packed bytes (uint8 ``[..., D/2]``, element 2j in the low nibble of byte j), their E4M3
    block-scale bytes (``[..., D/16]``) and the global scale: ``e2m1 * (e4m3_scale * global_scale)``,
    the product of the scales first, all in float32."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    values = decode_e2m1(codes).reshape(*packed.shape[:-1], -1, NVFP4_BLOCK)
    scales = decode_e4m3(block_scales) * np.float32(global_scale)  # float32
    return (values * scales[..., None]).reshape(codes.shape)


def reference_nvfp4(
    layout, ids, rows: tuple[int, int] | None = None, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """``ids.shape + (layout.row_dim,)`` in ``out_dtype``: each id's NVFP4 row decoded from the files.

    The packed bytes (``row_dim // 2`` a row) and the block-scale bytes (``row_dim // 16``) are read
    with open/seek/read at the offsets of ``layout.shards`` and ``layout.block_scales``; the values
    are computed as vLLM's CPU path does: ``e2m1 * (e4m3_scale * global_scale)``, the product of
    the scales first, all in float32, then cast with torch. Ids outside ``[0, num_rows)``, and
    outside ``rows=(start, end)`` when given, give zeros.
    """
    shape = np.shape(np.asarray(ids))
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    dim = layout.row_dim
    assert dim % NVFP4_BLOCK == 0, dim
    packed_bytes, scale_bytes = dim // 2, dim // NVFP4_BLOCK
    global_scale = np.float32(layout.scale)
    out = np.zeros((flat.size, dim), dtype=np.float32)
    start, end = (0, layout.num_rows) if rows is None else rows
    handles: dict[str, object] = {}

    def read(spec, local: int, width: int) -> np.ndarray:
        f = handles.get(spec.path)
        if f is None:
            f = handles[spec.path] = open(spec.path, "rb")  # noqa: SIM115 - closed below
        f.seek(spec.offset + local * width)
        data = f.read(width)
        assert len(data) == width, (spec, local)
        return np.frombuffer(data, dtype=np.uint8)

    try:
        for k, row in enumerate(flat.tolist()):
            if not (0 <= row < layout.num_rows and start <= row < end):
                continue
            index = row // layout.rows_per_shard
            shard, blocks = layout.shards[index], layout.block_scales[index]
            local = row - index * layout.rows_per_shard
            assert shard.index == blocks.index == index and 0 <= local < shard.rows == blocks.rows
            out[k] = decode_nvfp4(
                read(shard, local, packed_bytes), read(blocks, local, scale_bytes), global_scale
            )
    finally:
        for f in handles.values():
            f.close()
    return torch.from_numpy(out).to(out_dtype).reshape(*shape, dim)


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


def misalign_checkpoint(directory: str | os.PathLike, *, starts=(7, 1, 2, 4), leads=(3, 0, 5, 1)) -> None:
    """Rewrite the safetensors files of the checkpoint at ``directory`` (sorted by name; file ``k``
    takes ``starts[k % len(starts)]`` and ``leads[k % len(leads)]``) so that nothing lies aligned:
    the header is padded with spaces until the data section starts at ``start`` mod 8 (not at 0),
    and, when ``lead`` is not 0, an unrelated U8 tensor of ``lead`` bytes comes first in the data.
    Every tensor keeps its bytes and its order, the data stays covered without holes, and the
    index (``model.safetensors.index.json``, when there is one) names the added tensors."""
    directory = os.fspath(directory)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    index_path = os.path.join(directory, "model.safetensors.index.json")
    index = None
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    for k, name in enumerate(names):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            blob = f.read()
        (length,) = struct.unpack("<Q", blob[:8])
        old = json.loads(blob[8 : 8 + length])
        start, lead = starts[k % len(starts)], leads[k % len(leads)]
        header: dict[str, object] = {}
        if "__metadata__" in old:
            header["__metadata__"] = old.pop("__metadata__")
        lead_data = b""
        if lead:
            lead_name = f"unaligned.lead_{k}"
            header[lead_name] = {"dtype": "U8", "shape": [lead], "data_offsets": [0, lead]}
            lead_data = bytes((7 * i + k) % 256 for i in range(lead))
            if index is not None:
                index["weight_map"][lead_name] = name
        for tensor, meta in sorted(old.items(), key=lambda item: item[1]["data_offsets"]):
            a, b = meta["data_offsets"]
            header[tensor] = dict(meta, data_offsets=[a + lead, b + lead])
        raw = json.dumps(header).encode()
        raw += b" " * ((start - 8 - len(raw)) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + lead_data + blob[8 + length :])
    if index is not None:
        with open(index_path, "w") as f:
            json.dump(index, f)


def safetensors_table(layout) -> dict[str, torch.Tensor]:
    """The table of ``layout`` as the ``safetensors`` package reads its files (``safe_open``):
    ``rows`` [num_rows, width] in the shards' dtype (packed uint8 for NVFP4), the shards
    concatenated in index order; for NVFP4 also ``block_scales`` (float8_e4m3fn [num_rows,
    row_dim // 16]); ``scale``, a float32 0-dim tensor, when the table has one."""
    from safetensors import safe_open

    def read(specs) -> torch.Tensor:
        parts = []
        for spec in specs:
            with safe_open(spec.path, framework="pt") as f:
                parts.append(f.get_tensor(spec.tensor))
        return torch.cat(parts)

    table = {"rows": read(layout.shards)}
    if layout.block_scales:
        table["block_scales"] = read(layout.block_scales)
    if layout.scale_tensor is not None:
        for name in sorted(os.listdir(layout.directory)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(layout.directory, name), framework="pt") as f:
                    if layout.scale_tensor in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                        table["scale"] = f.get_tensor(layout.scale_tensor).float()
    return table


def tensor_bytes(dtype: str, shape: list[int], fill: int | None = None, seed: int = 0) -> bytes:
    """Data of the right size; distinct per seed so tests can tell tensors apart."""
    n = math.prod(shape) * ITEMSIZE[dtype]
    if fill is not None:
        return bytes([fill]) * n
    # Bytes below 0x70 are finite in every dtype used here.
    return (np.random.default_rng(seed).integers(0, 0x70, n, dtype=np.uint8)).tobytes()


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_differ(got: torch.Tensor, expect: torch.Tensor, *, raw: bool = True) -> str | None:
    """None when ``got`` has ``expect``'s shape, dtype and bits, element by element, else what
    differs. Where not ``raw`` (dequantized rows) a NaN need only be a NaN: its payload and sign are
    unspecified."""
    if got.shape != expect.shape or got.dtype != expect.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, expected {tuple(expect.shape)} {expect.dtype}"
    got, expect = got.detach().cpu(), expect.detach().cpu()
    view = _INT_VIEW[got.element_size()]
    g, e = got.contiguous().view(view), expect.contiguous().view(view)
    if not raw:
        nan = torch.isnan(expect)
        if not torch.equal(torch.isnan(got), nan):
            return "NaN positions differ"
        g, e = g[~nan], e[~nan]
    if torch.equal(g, e):
        return None
    bad = (g != e).nonzero()
    return f"{bad.shape[0]} elements differ, first at {bad[:4].tolist()}"


def drop_page_cache(layout) -> None:
    """The table's files out of the page cache (the pages no process maps); their pages then read
    as absent until something touches them."""
    evict_pages(layout.files)


def fds_of(paths) -> list[str]:
    """This process's open descriptors of ``paths``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target in paths:
            found.append(target)
    return found


def maps_of(paths) -> list[str]:
    """Lines of /proc/self/maps that map one of ``paths``: what this process still maps of them."""
    with open("/proc/self/maps") as f:
        return [line for line in f if any(line.rstrip().endswith(p) for p in paths)]
