"""ShardLayout: where each row of one PLE layer's table lies in the checkpoint's files.

The Qwen4Exp layout: the table's rows are split into ``split_ngram_parts`` shard tensors named
``...layers.<L>.ple.ple_embedding.ngram_embedding.shard_<i>.weight`` (any prefix); shard ``i``
holds global rows ``[i*S, i*S + rows_i)`` with ``S = ceil(num_rows / parts)``. FP8 tables add one
global ``...ngram_embedding.weight_scale``.
"""

from __future__ import annotations

import glob
import math
import operator
import os
import re
import struct
from dataclasses import dataclass, field

import torch

from ple_um.checkpoint.safetensors import TensorEntry, read_bytes, read_header, read_json_file
from ple_um.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

_PLE = r"(?:^|\.)layers\.([0-9]+)\.ple\.ple_embedding\.ngram_embedding\."
SHARD_RE = re.compile(_PLE + r"shard_([0-9]+)\.weight\Z")
SCALE_RE = re.compile(_PLE + r"weight_scale\Z")

# Storage dtypes a table may have: safetensors name -> torch dtype.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class ShardSpec:
    """One shard tensor: its rows lie contiguously in ``path`` from byte ``offset``."""

    index: int  # shard index i in the tensor name
    path: str  # absolute path of the safetensors file
    tensor: str  # full tensor name in that file
    offset: int  # absolute byte offset of the shard's row 0 in the file
    rows: int  # rows in this shard (0 for a legal trailing empty shard)


@dataclass(frozen=True)
class ShardLayout:
    """A validated table: every shard present, one dtype, one row width, the ceil layout kept."""

    directory: str
    layer: int
    dtype_name: str  # safetensors dtype: F8_E4M3, F8_E5M2, BF16, F16
    dtype: torch.dtype  # the matching torch dtype
    row_dim: int  # elements per row
    row_bytes: int  # bytes per row
    num_rows: int  # global rows (sum of shard rows)
    rows_per_shard: int  # S = ceil(num_rows / parts)
    shards: tuple[ShardSpec, ...]  # all parts, in index order
    scale: float | None  # the global FP8 scale (None for 16-bit tables)
    scale_tensor: str | None  # its tensor name

    @property
    def parts(self) -> int:
        return len(self.shards)

    def shard_start(self, index: int) -> int:
        return index * self.rows_per_shard

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({s.path for s in self.shards}))

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes


def find_layers(directory: str) -> list[int]:
    """PLE layer indices that have shard tensors in the checkpoint at ``directory``.

    Reads only headers; raises CheckpointError when the directory or a header cannot be read.
    """
    problems = _Problems(strict=True)
    scan = _scan(directory, None, problems)
    assert scan is not None  # a strict _Problems raises instead of returning nothing
    return sorted(scan.layers)


def read_layout(directory: str, layer: int | None = None) -> ShardLayout:
    """Read and validate one layer's table; raise CheckpointError naming file and tensor.

    ``layer=None`` picks the only layer that has shards. Only headers and the scale's few bytes
    are read, never table data.
    """
    problems = _Problems(strict=True)
    layout = _analyze(directory, layer, problems)
    assert layout is not None  # a strict _Problems raises on the first problem
    return layout


def validate(directory: str, layer: int | None = None) -> list[str]:
    """Every problem found (empty when sound), for `ple-um inspect`.

    The checks are read_layout's; where read_layout stops at the first problem, this goes on as
    far as the checkpoint allows (with ``layer=None`` and several layers, it checks each).
    """
    problems = _Problems(strict=False)
    _analyze(directory, layer, problems)
    return [str(e) for e in problems.found]


class _Problems:
    """Where checks report: raise the first (read_layout) or collect them all (validate)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.found: list[CheckpointError] = []

    def add(self, error: CheckpointError) -> None:
        if self.strict:
            raise error
        self.found.append(error)

    def report(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        self.add(CheckpointError(message, path=path, tensor=tensor))


@dataclass
class _LayerTensors:
    """The PLE tensors of one layer, as found in the headers (duplicates kept, to be reported)."""

    shards: dict[int, list[TensorEntry]] = field(default_factory=dict)
    scales: list[TensorEntry] = field(default_factory=list)


@dataclass
class _Scan:
    directory: str
    layers: set[int]  # every layer seen with at least one shard tensor
    tensors: dict[int, _LayerTensors]  # per layer (only the requested one when a layer is given)


def _ple_match(name: str) -> tuple[int, int | None] | None:
    """(layer, shard index or None for the scale) when ``name`` is a PLE tensor, else None.

    Indices of more than 9 digits are taken as no match: no real table has them, and int() of a
    several-thousand-digit name would raise.
    """
    shard = SHARD_RE.search(name)
    match = shard or SCALE_RE.search(name)
    if match is None or any(len(g) > 9 for g in match.groups()):
        return None
    return int(match.group(1)), (int(shard.group(2)) if shard else None)


def _scan(directory: str, layer: int | None, problems: _Problems) -> _Scan | None:
    """Read the headers of the files that may hold PLE tensors; None when none can be read."""
    directory = os.path.abspath(directory)
    if not os.path.exists(directory):
        problems.report(f"checkpoint directory {directory} does not exist")
        return None
    if not os.path.isdir(directory):
        problems.report(f"checkpoint path {directory} is not a directory")
        return None

    index_path = os.path.join(directory, INDEX_FILE)
    claims: dict[str, str] = {}  # PLE tensor name -> absolute file path, per the index
    index_layers: set[int] = set()
    if os.path.lexists(index_path):
        files = _files_from_index(directory, index_path, layer, problems, claims, index_layers)
        if files is None:
            return None
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))

    scan = _Scan(directory=directory, layers=set(index_layers), tensors={})
    for path in files:
        try:
            header = read_header(path, strict=False)
        except CheckpointError as e:
            problems.add(e)
            continue
        for error in header.problems:
            problems.add(error)
        for name, entry in header.tensors.items():
            match = _ple_match(name)
            if match is None:
                continue
            at, index = match
            if index is not None:
                scan.layers.add(at)
            if layer is not None and at != layer:
                continue
            found = scan.tensors.setdefault(at, _LayerTensors())
            if index is not None:
                found.shards.setdefault(index, []).append(entry)
            else:
                found.scales.append(entry)
        bad = {e.tensor for e in header.problems}
        for name, claimed in claims.items():
            if claimed == path and name not in header.tensors and name not in bad:
                problems.report(
                    f"{INDEX_FILE} maps this tensor to {os.path.basename(path)}, which does not hold it",
                    path=path,
                    tensor=name,
                )
    return scan


def _files_from_index(
    directory: str,
    index_path: str,
    layer: int | None,
    problems: _Problems,
    claims: dict[str, str],
    index_layers: set[int],
) -> list[str] | None:
    """The files the index says hold PLE tensors (of ``layer`` when given); fills ``claims``."""
    try:
        index = read_json_file(index_path, what="index")
    except CheckpointError as e:
        problems.add(e)
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        problems.report("index has no weight_map object", path=index_path)
        return None
    files: set[str] = set()
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name or "\0" in file_name:
            problems.report(
                f"index entry names file {file_name!r}, expected a file name", path=index_path, tensor=name
            )
            continue
        normal = os.path.normpath(file_name)
        if os.path.isabs(file_name) or normal == ".." or normal.startswith(".." + os.sep):
            problems.report(
                f"index entry names {file_name!r}, outside the checkpoint directory",
                path=index_path,
                tensor=name,
            )
            continue
        match = _ple_match(name)
        if match is None:
            continue
        at, index = match
        if index is not None:
            index_layers.add(at)
        if layer is not None and at != layer:
            continue
        path = os.path.join(directory, normal)
        if not os.path.exists(path):
            what = "a symlink to a missing file" if os.path.islink(path) else "a missing file"
            problems.report(f"index entry names {file_name!r}, {what}", path=index_path, tensor=name)
            continue
        claims[name] = path
        files.add(path)
    return sorted(files)


def _analyze(directory: str, layer: int | None, problems: _Problems) -> ShardLayout | None:
    """Every check of read_layout and validate, reporting to ``problems``; the layout when sound."""
    if layer is not None:
        layer = operator.index(layer)  # TypeError for a str or a float, as for any index
    scan = _scan(directory, layer, problems)
    if scan is None:
        return None
    present = ", ".join(str(at) for at in sorted(scan.layers)) or "none"
    if layer is None:
        if not scan.layers:
            problems.report(f"no PLE shards were found in {scan.directory}")
            return None
        if len(scan.layers) > 1:
            problems.report(
                f"several PLE layers have shards in {scan.directory}: {present}; pass layer= to pick one"
            )
            for at in sorted(scan.layers):
                _build(scan, at, problems)
            return None
        (layer,) = scan.layers
    elif layer not in scan.layers:
        problems.report(f"no PLE shards of layer {layer} in {scan.directory}; layers with shards: {present}")
        return None
    return _build(scan, layer, problems)


def _build(scan: _Scan, layer: int, problems: _Problems) -> ShardLayout | None:
    """Check one layer's shards and scale; its ShardLayout when sound, else None (all reported)."""
    found = scan.tensors.get(layer, _LayerTensors())
    sound = True

    # One tensor per index: a second one (another file, another prefix, a leading zero) is an error.
    shards: dict[int, TensorEntry] = {}
    for index in sorted(found.shards):
        first, *others = sorted(found.shards[index], key=lambda e: (e.path, e.name))
        for other in others:
            problems.report(
                f"duplicate shard index {index}: also tensor {first.name} in {first.path}",
                path=other.path,
                tensor=other.name,
            )
            sound = False
        shards[index] = first

    reference: TensorEntry | None = None
    for entry in shards.values():
        if entry.dtype not in STORAGE_DTYPES:
            problems.report(
                f"unsupported dtype {entry.dtype} for a PLE shard (supported: {', '.join(STORAGE_DTYPES)})",
                path=entry.path,
                tensor=entry.name,
            )
            sound = False
        elif len(entry.shape) != 2:
            problems.report(
                f"shard tensor has shape {list(entry.shape)}, expected 2-D [rows, row_dim]",
                path=entry.path,
                tensor=entry.name,
            )
            sound = False
        elif reference is None:
            reference = entry
        elif entry.dtype != reference.dtype:
            problems.report(
                f"dtype {entry.dtype} differs from {reference.dtype} of shard tensor {reference.name}",
                path=entry.path,
                tensor=entry.name,
            )
            sound = False
        elif entry.shape[1] != reference.shape[1]:
            problems.report(
                f"row width {entry.shape[1]} differs from {reference.shape[1]} "
                f"of shard tensor {reference.name}",
                path=entry.path,
                tensor=entry.name,
            )
            sound = False
    if reference is not None and reference.shape[1] == 0:
        problems.report("rows have 0 elements", path=reference.path, tensor=reference.name)
        sound = False

    if not shards:  # the index named shards that their files do not hold (reported by _scan)
        problems.report(f"no PLE shards of layer {layer} could be read in {scan.directory}")
        return None
    parts = max(shards) + 1
    missing = _missing(sorted(shards), parts)
    if missing:
        count = parts - len(shards)
        listed = ", ".join(str(i) for i in missing) + (", ..." if count > len(missing) else "")
        problems.report(
            f"layer {layer}: {count} of shard indices 0..{parts - 1} missing: {listed}",
            path=shards[max(shards)].path,
        )
        sound = False
    if not sound or reference is None:
        return None

    dtype_name = reference.dtype
    row_dim = reference.shape[1]
    row_bytes = row_dim * STORAGE_DTYPES[dtype_name].itemsize
    total = sum(entry.shape[0] for entry in shards.values())
    if total == 0:
        problems.report(f"layer {layer}: the table has 0 rows", path=reference.path, tensor=reference.name)
        return None
    per_shard = -(-total // parts)
    for index, entry in shards.items():
        expected = min(max(total - index * per_shard, 0), per_shard)
        if entry.shape[0] != expected:
            problems.report(
                f"shard {index} holds {entry.shape[0]} rows, expected {expected} ({total} rows in {parts} "
                f"parts: ceil({total}/{parts}) = {per_shard} rows per shard)",
                path=entry.path,
                tensor=entry.name,
            )
            sound = False

    scale, scale_tensor = None, None
    if dtype_name in FP8_DTYPES:
        read = _read_scale(found.scales, reference, problems)
        if read is None:
            sound = False
        else:
            scale, scale_tensor = read
    if not sound:
        return None

    return ShardLayout(
        directory=scan.directory,
        layer=layer,
        dtype_name=dtype_name,
        dtype=STORAGE_DTYPES[dtype_name],
        row_dim=row_dim,
        row_bytes=row_bytes,
        num_rows=total,
        rows_per_shard=per_shard,
        shards=tuple(
            ShardSpec(index=i, path=e.path, tensor=e.name, offset=e.start, rows=e.shape[0])
            for i, e in shards.items()
        ),
        scale=scale,
        scale_tensor=scale_tensor,
    )


def _missing(present: list[int], parts: int, limit: int = 10) -> list[int]:
    """The first ``limit`` indices of ``range(parts)`` not in sorted ``present`` (no range is built)."""
    missing: list[int] = []
    expected = 0
    for index in [*present, parts]:
        while expected < index and len(missing) < limit:
            missing.append(expected)
            expected += 1
        if len(missing) >= limit:
            break
        expected = index + 1
    return missing


def _read_scale(
    scales: list[TensorEntry], shard: TensorEntry, problems: _Problems
) -> tuple[float, str] | None:
    """The FP8 table's global scale (value, tensor name), or None when absent or unsound (reported)."""
    if not scales:
        expected = shard.name[: shard.name.rindex("shard_")] + "weight_scale"
        problems.report(
            f"FP8 table ({shard.dtype}) without its global scale; no such tensor in any file",
            path=shard.path,
            tensor=expected,
        )
        return None
    first, *others = sorted(scales, key=lambda e: (e.path, e.name))
    for other in others:
        problems.report(
            f"duplicate scale: also tensor {first.name} in {first.path}", path=other.path, tensor=other.name
        )
    if others:
        return None
    if first.dtype not in SCALE_DTYPES:
        problems.report(
            f"scale dtype {first.dtype} is not one of {', '.join(SCALE_DTYPES)}",
            path=first.path,
            tensor=first.name,
        )
        return None
    if first.shape not in ((), (1,)):
        problems.report(
            f"scale shape {list(first.shape)} is not [] or [1]", path=first.path, tensor=first.name
        )
        return None
    try:
        raw = read_bytes(first.path, first.start, first.nbytes)
    except CheckpointError as e:
        problems.report(f"cannot read the scale: {e}", tensor=first.name)
        return None
    if first.dtype == "F32":
        (value,) = struct.unpack("<f", raw)
    elif first.dtype == "F16":
        (value,) = struct.unpack("<e", raw)
    else:  # BF16: the high half of an F32
        (value,) = struct.unpack("<f", b"\0\0" + raw)
    if not math.isfinite(value) or value == 0.0:
        problems.report(
            f"scale is {value}, expected a finite non-zero number", path=first.path, tensor=first.name
        )
        return None
    return value, first.name
