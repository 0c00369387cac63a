"""ShardLayout: where each row of one PLE layer's table lies in the checkpoint's files.

The Qwen4Exp layout: the table's rows are split into ``split_ngram_parts`` shard tensors named
``...layers.<L>.ple.ple_embedding.ngram_embedding.shard_<i>.weight`` (any prefix); shard ``i``
holds global rows ``[i*S, i*S + rows_i)`` with ``S = ceil(num_rows / parts)``. FP8 tables add one
global ``...ngram_embedding.weight_scale``.

NVFP4 tables (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``) store U8 shards ``[rows_i, D/2]`` of packed
E2M1 values (two per byte, the even element in the low nibble), next to each one its block scales
``...shard_<i>.weight_scale``, F8_E4M3 ``[rows_i, D/16]`` (one per 16 values), and one global
``...ngram_embedding.weight_scale_2``; an unsharded ``...ngram_embedding.weight_scale`` is refused
there, as vLLM refuses it.
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
BLOCK_SCALE_RE = re.compile(_PLE + r"shard_([0-9]+)\.weight_scale\Z")  # NVFP4: per shard
GLOBAL_SCALE_RE = re.compile(_PLE + r"weight_scale_2\Z")  # NVFP4: the global scale

# Storage dtypes a table may have: safetensors name -> torch dtype.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,  # packed NVFP4: a layout's dtype_name is then "NVFP4"
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_DTYPES = ("F32", "BF16", "F16")
NVFP4 = "NVFP4"  # dtype_name of an NVFP4 table (U8 shards)
NVFP4_STORAGE = "U8"
NVFP4_BLOCK_SIZE = 16  # values per E4M3 block scale
NVFP4_SCALE_DTYPE = "F8_E4M3"
_SUPPORTED = ", ".join(f"{d} ({NVFP4})" if d == NVFP4_STORAGE else d for d in STORAGE_DTYPES)


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
    dtype_name: str  # safetensors dtype: F8_E4M3, F8_E5M2, BF16, F16; or NVFP4 (U8 shards)
    dtype: torch.dtype  # the matching torch dtype (torch.uint8, the packed bytes, for NVFP4)
    row_dim: int  # elements per row (logical values for NVFP4: twice the packed bytes)
    row_bytes: int  # bytes per row (packed: row_dim // 2 for NVFP4)
    num_rows: int  # global rows (sum of shard rows)
    rows_per_shard: int  # S = ceil(num_rows / parts)
    shards: tuple[ShardSpec, ...]  # all parts, in index order
    scale: float | None  # the global FP8 scale, or NVFP4's weight_scale_2 (None for 16-bit tables)
    scale_tensor: str | None  # its tensor name
    # NVFP4 only: each shard's block scales (E4M3 [rows, row_dim // 16]), in the order and with the
    # rows of ``shards``; and the values per block scale (16). Empty and 0 for other dtypes.
    block_scales: tuple[ShardSpec, ...] = ()
    block_size: int = 0

    @property
    def parts(self) -> int:
        return len(self.shards)

    @property
    def is_nvfp4(self) -> bool:
        return self.dtype_name == NVFP4

    def shard_start(self, index: int) -> int:
        return index * self.rows_per_shard

    @property
    def files(self) -> tuple[str, ...]:
        """Every file that holds table data: the shards', and for NVFP4 the block scales' too."""
        return tuple(sorted({s.path for s in (*self.shards, *self.block_scales)}))

    @property
    def nbytes(self) -> int:
        """Bytes of table data: rows, plus block scales for NVFP4."""
        scale_bytes = self.num_rows * (self.row_dim // self.block_size) if self.block_size else 0
        return self.num_rows * self.row_bytes + scale_bytes

    def scale_layout(self) -> ShardLayout:
        """An NVFP4 table's block scales as a table of their own (E4M3, ``row_dim // 16`` per row),
        to be mapped like any table; ValueError for other dtypes."""
        if not self.is_nvfp4:
            raise ValueError(f"only NVFP4 tables have block scales; this table is {self.dtype_name}")
        width = self.row_dim // self.block_size
        return ShardLayout(
            directory=self.directory,
            layer=self.layer,
            dtype_name=NVFP4_SCALE_DTYPE,
            dtype=STORAGE_DTYPES[NVFP4_SCALE_DTYPE],
            row_dim=width,
            row_bytes=width,
            num_rows=self.num_rows,
            rows_per_shard=self.rows_per_shard,
            shards=self.block_scales,
            scale=None,
            scale_tensor=None,
        )


def find_layers(directory: str, *, strict: bool = True) -> list[int] | None:
    """PLE layer indices that have shard tensors in the checkpoint at ``directory``.

    Reads only headers; raises CheckpointError when the directory or a header cannot be read.
    ``strict=False``: the layers seen in the headers that can be read and in the index, None when
    nothing can be read (for `ple-um inspect`, whose verdict lists why).
    """
    problems = _Problems(strict=strict)
    scan = _scan(directory, None, problems)
    assert scan is not None or not strict  # a strict _Problems raises instead of returning nothing
    return None if scan is None else sorted(scan.layers)


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
    far as the checkpoint allows (with ``layer=None`` and several layers, it checks each). A broken
    file counts once: its first problem (a header that cannot be read, a truncated file, a missing
    file the index names), not each of its tensors, and not the tensors that are missing from the
    table because they are in it (its shards, its scale).
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
    scales: list[TensorEntry] = field(default_factory=list)  # ...ngram_embedding.weight_scale
    block_scales: dict[int, list[TensorEntry]] = field(default_factory=dict)  # NVFP4 shard_<i>.weight_scale
    global_scales: list[TensorEntry] = field(default_factory=list)  # NVFP4 ...weight_scale_2


@dataclass
class _Scan:
    directory: str
    layers: set[int]  # every layer seen with at least one shard tensor
    tensors: dict[int, _LayerTensors]  # per layer (only the requested one when a layer is given)
    # PLE tensors that cannot be read because of a problem already reported (a broken or missing
    # file, an index entry pointing elsewhere), as (layer, kind, shard index or None): their
    # absence from the table is not reported again.
    lost: set[tuple[int, str, int | None]] = field(default_factory=set)

    def lose(self, name: str | None) -> None:
        match = _ple_match(name) if name else None
        if match is not None:
            self.lost.add(match)


_KINDS = (
    ("shard", SHARD_RE),
    ("block_scale", BLOCK_SCALE_RE),
    ("scale", SCALE_RE),
    ("global_scale", GLOBAL_SCALE_RE),
)


def _ple_match(name: str) -> tuple[int, str, int | None] | None:
    """(layer, kind, shard index or None) when ``name`` is a PLE tensor, else None.

    ``kind`` is "shard" (rows), "block_scale" (an NVFP4 shard's block scales), "scale" (the FP8
    scale) or "global_scale" (NVFP4's weight_scale_2); the index is given for the first two.
    Indices of more than 9 digits are taken as no match: no real table has them, and int() of a
    several-thousand-digit name would raise.
    """
    for kind, pattern in _KINDS:
        match = pattern.search(name)
        if match is None:
            continue
        if any(len(g) > 9 for g in match.groups()):
            return None
        index = int(match.group(2)) if match.lastindex == 2 else None
        return int(match.group(1)), kind, index
    return None


def _scan(directory: str, layer: int | None, problems: _Problems) -> _Scan | None:
    """Read the headers of the files that may hold PLE tensors; None when none can be read."""
    directory = os.path.abspath(directory)
    if not os.path.exists(directory):
        problems.report(f"checkpoint directory {directory} does not exist")
        return None
    if not os.path.isdir(directory):
        problems.report(f"checkpoint directory {directory} is not a directory")
        return None

    index_path = os.path.join(directory, INDEX_FILE)
    claims: dict[str, str] = {}  # PLE tensor name -> absolute file path, per the index
    scan = _Scan(directory=directory, layers=set(), tensors={})
    if os.path.lexists(index_path):
        files = _files_from_index(directory, index_path, layer, problems, claims, scan)
        if files is None:
            return None
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))

    for path in files:
        try:
            header = read_header(path, strict=False)
        except CheckpointError as e:
            problems.add(e)
            for name, claimed in claims.items():
                if claimed == path:
                    scan.lose(name)
            continue
        if header.problems:
            problems.add(_one_per_file(header.problems))
        for error in header.problems:
            scan.lose(error.tensor)
        for name, entry in header.tensors.items():
            match = _ple_match(name)
            if match is None:
                continue
            at, kind, index = match
            if kind == "shard":
                scan.layers.add(at)
            if layer is not None and at != layer:
                continue
            found = scan.tensors.setdefault(at, _LayerTensors())
            if kind == "shard":
                found.shards.setdefault(index, []).append(entry)
            elif kind == "block_scale":
                found.block_scales.setdefault(index, []).append(entry)
            elif kind == "scale":
                found.scales.append(entry)
            else:
                found.global_scales.append(entry)
        bad = {e.tensor for e in header.problems}
        for name, claimed in claims.items():
            if claimed == path and name not in header.tensors and name not in bad:
                problems.report(
                    f"{INDEX_FILE} maps this tensor to {os.path.basename(path)}, which does not hold it",
                    path=path,
                    tensor=name,
                )
                scan.lose(name)
    return scan


def _one_per_file(errors: list[CheckpointError]) -> CheckpointError:
    """One error for the problems of one file's header: the first, naming the other tensors."""
    first, rest = errors[0], errors[1:]
    if not rest:
        return first
    names = [e.tensor for e in rest if e.tensor is not None]
    listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    more = f"; {len(rest)} more tensor{'s' if len(rest) > 1 else ''} of this file too: {listed}"
    return CheckpointError(first.message + more, path=first.path, tensor=first.tensor)


def _files_from_index(
    directory: str,
    index_path: str,
    layer: int | None,
    problems: _Problems,
    claims: dict[str, str],
    scan: _Scan,
) -> list[str] | None:
    """The files the index says hold PLE tensors (of ``layer`` when given); fills ``claims``, and
    ``scan``'s layers and lost tensors (those the index maps to a missing file, reported once per
    file)."""
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
    missing: set[str] = set()
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
        at, kind, _ = match
        if kind == "shard":
            scan.layers.add(at)
        if layer is not None and at != layer:
            continue
        path = os.path.join(directory, normal)
        if not os.path.exists(path):
            if path not in missing:
                missing.add(path)
                what = "a symlink to a missing file" if os.path.islink(path) else "a missing file"
                problems.report(f"index entry names {file_name!r}, {what}", path=index_path, tensor=name)
            scan.lose(name)
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


def _one_per_index(
    entries: dict[int, list[TensorEntry]], what: str, problems: _Problems
) -> dict[int, TensorEntry]:
    """The first tensor of each index (by file, then name); every further one is reported."""
    chosen: dict[int, TensorEntry] = {}
    for index in sorted(entries):
        first, *others = sorted(entries[index], key=lambda e: (e.path, e.name))
        for other in others:
            problems.report(
                f"{what} {index}: also tensor {first.name} in {first.path}",
                path=other.path,
                tensor=other.name,
            )
        chosen[index] = first
    return chosen


def _build(scan: _Scan, layer: int, problems: _Problems) -> ShardLayout | None:
    """Check one layer's shards and scale; its ShardLayout when sound, else None (all reported)."""
    found = scan.tensors.get(layer, _LayerTensors())
    sound = True

    # One tensor per index: a second one (another file, another prefix, a leading zero) is an error.
    shards = _one_per_index(found.shards, "duplicate shard index", problems)
    sound = sound and all(len(v) == 1 for v in found.shards.values())

    reference: TensorEntry | None = None
    for entry in shards.values():
        if entry.dtype not in STORAGE_DTYPES:
            problems.report(
                f"unsupported dtype {entry.dtype} for a PLE shard (supported: {_SUPPORTED})",
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
    nvfp4 = reference is not None and reference.dtype == NVFP4_STORAGE
    if nvfp4 and reference.shape[1] % (NVFP4_BLOCK_SIZE // 2):
        problems.report(
            f"NVFP4 rows of {2 * reference.shape[1]} values ({reference.shape[1]} packed bytes) do not "
            f"split into blocks of {NVFP4_BLOCK_SIZE}: the packed width must be a multiple of "
            f"{NVFP4_BLOCK_SIZE // 2}",
            path=reference.path,
            tensor=reference.name,
        )
        sound = False

    lost = {index for at, kind, index in scan.lost if at == layer and kind == "shard"}
    if not shards:  # the index named shards that their files do not hold (reported by _scan)
        if not lost:
            problems.report(f"no PLE shards of layer {layer} could be read in {scan.directory}")
        return None
    parts = max(shards.keys() | lost) + 1
    accounted = sorted(shards.keys() | lost)  # a lost shard's problem is reported already
    missing = _missing(accounted, parts)
    sound = sound and not lost
    if missing:
        count = parts - len(accounted)
        listed = ", ".join(str(i) for i in missing) + (", ..." if count > len(missing) else "")
        problems.report(
            f"layer {layer}: {count} of shard indices 0..{parts - 1} missing: {listed}",
            path=shards[max(shards)].path,
        )
        sound = False
    # An NVFP4 table goes on to its block scales and global scale even when its rows are unsound,
    # so that validate lists their problems too; other tables stop here, as they always have.
    rows_sound = sound
    if reference is None or not (rows_sound or nvfp4):
        return None

    storage = reference.dtype
    row_bytes = reference.shape[1] * STORAGE_DTYPES[storage].itemsize
    row_dim = 2 * reference.shape[1] if nvfp4 else reference.shape[1]
    total = per_shard = 0
    if rows_sound:
        total = sum(entry.shape[0] for entry in shards.values())
        if total == 0:
            problems.report(
                f"layer {layer}: the table has 0 rows", path=reference.path, tensor=reference.name
            )
            return None
        per_shard = -(-total // parts)
        for index, entry in shards.items():
            expected = min(max(total - index * per_shard, 0), per_shard)
            if entry.shape[0] != expected:
                problems.report(
                    f"shard {index} holds {entry.shape[0]} rows, expected {expected} ({total} rows in "
                    f"{parts} parts: ceil({total}/{parts}) = {per_shard} rows per shard)",
                    path=entry.path,
                    tensor=entry.name,
                )
                sound = False

    scale, scale_tensor = None, None
    blocks: dict[int, TensorEntry] = {}
    if storage in FP8_DTYPES:
        read = _read_scale(
            found.scales,
            reference.name[: reference.name.rindex("shard_")] + "weight_scale",
            reference.path,
            f"FP8 table ({storage}) without its global scale; no such tensor in any file",
            problems,
            lost=(layer, "scale", None) in scan.lost,
        )
        if read is None:
            sound = False
        else:
            scale, scale_tensor = read
    elif nvfp4:
        checked = _check_nvfp4(found, shards, reference, problems, {m for m in scan.lost if m[0] == layer})
        if checked is None:
            sound = False
        else:
            blocks, scale, scale_tensor = checked
    if not sound:
        return None

    return ShardLayout(
        directory=scan.directory,
        layer=layer,
        dtype_name=NVFP4 if nvfp4 else storage,
        dtype=STORAGE_DTYPES[storage],
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
        block_scales=tuple(
            ShardSpec(index=i, path=e.path, tensor=e.name, offset=e.start, rows=e.shape[0])
            for i, e in sorted(blocks.items())
        ),
        block_size=NVFP4_BLOCK_SIZE if nvfp4 else 0,
    )


def _check_nvfp4(
    found: _LayerTensors,
    shards: dict[int, TensorEntry],
    reference: TensorEntry,
    problems: _Problems,
    lost: set[tuple[int, str, int | None]],
) -> tuple[dict[int, TensorEntry], float, str] | None:
    """An NVFP4 table's block scales by shard index, and its global scale (value, tensor name);
    None when any of them is unsound (every problem reported; a tensor in ``lost``, of a file
    already reported, is not reported missing again)."""
    lost_kinds = {(kind, index) for _, kind, index in lost}
    sound = True
    # vLLM refuses an unsharded ngram_embedding.weight_scale next to an NVFP4 table.
    for entry in sorted(found.scales, key=lambda e: (e.path, e.name)):
        problems.report(
            "unsharded weight_scale next to an NVFP4 table: its block scales must be stored per shard, "
            "as ...ngram_embedding.shard_<i>.weight_scale",
            path=entry.path,
            tensor=entry.name,
        )
        sound = False

    blocks = _one_per_index(found.block_scales, "duplicate block scales of shard index", problems)
    sound = sound and all(len(v) == 1 for v in found.block_scales.values())

    row_dim = 2 * reference.shape[1]
    width = row_dim // NVFP4_BLOCK_SIZE if row_dim % NVFP4_BLOCK_SIZE == 0 else None
    for index in sorted(shards.keys() | blocks.keys()):
        rows, block = shards.get(index), blocks.get(index)
        if block is None:
            assert rows is not None
            sound = False
            if ("block_scale", index) in lost_kinds:
                continue
            problems.report(
                f"NVFP4 shard {index} without its block scales; no such tensor in any file",
                path=rows.path,
                tensor=rows.name + "_scale",
            )
            continue
        if rows is None:
            sound = False
            if ("shard", index) in lost_kinds:
                continue
            problems.report(
                f"block scales of shard {index} without its rows: no tensor "
                f"{block.name.removesuffix('_scale')} in any file",
                path=block.path,
                tensor=block.name,
            )
            continue
        if block.dtype != NVFP4_SCALE_DTYPE:
            problems.report(
                f"block-scale dtype {block.dtype}, expected {NVFP4_SCALE_DTYPE}",
                path=block.path,
                tensor=block.name,
            )
            sound = False
            continue
        if len(block.shape) != 2:
            problems.report(
                f"block-scale tensor has shape {list(block.shape)}, expected 2-D [rows, row_dim/16]",
                path=block.path,
                tensor=block.name,
            )
            sound = False
            continue
        if rows.dtype == reference.dtype and len(rows.shape) == 2 and block.shape[0] != rows.shape[0]:
            problems.report(
                f"block scales of shard {index} have {block.shape[0]} rows, its row shard {rows.name} "
                f"has {rows.shape[0]}",
                path=block.path,
                tensor=block.name,
            )
            sound = False
        if width is not None and block.shape[1] != width:
            problems.report(
                f"block-scale width {block.shape[1]}, expected {width}: one scale per {NVFP4_BLOCK_SIZE} "
                f"of the {row_dim} values of a row ({reference.shape[1]} packed bytes)",
                path=block.path,
                tensor=block.name,
            )
            sound = False

    read = _read_scale(
        found.global_scales,
        reference.name[: reference.name.rindex("shard_")] + "weight_scale_2",
        reference.path,
        "NVFP4 table without its global scale weight_scale_2; no such tensor in any file",
        problems,
        noun="global scale",
        lost=("global_scale", None) in lost_kinds,
    )
    if read is None or not sound:
        return None
    return blocks, read[0], read[1]


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
    scales: list[TensorEntry],
    expected: str,
    path: str,
    missing: str,
    problems: _Problems,
    *,
    noun: str = "scale",
    lost: bool = False,
) -> tuple[float, str] | None:
    """A table's global scale (value, tensor name), or None when absent or unsound (reported).

    ``missing`` is the message when there is none, naming the ``expected`` tensor and the shard
    file ``path``; ``noun`` names the scale in the other messages (the FP8 "scale", NVFP4's
    "global scale").
    """
    if not scales:
        if not lost:  # else the file that should hold it is reported already
            problems.report(missing, path=path, tensor=expected)
        return None
    first, *others = sorted(scales, key=lambda e: (e.path, e.name))
    for other in others:
        problems.report(
            f"duplicate {noun}: also tensor {first.name} in {first.path}", path=other.path, tensor=other.name
        )
    if others:
        return None
    if first.dtype not in SCALE_DTYPES:
        problems.report(
            f"{noun} dtype {first.dtype} is not one of {', '.join(SCALE_DTYPES)}",
            path=first.path,
            tensor=first.name,
        )
        return None
    if first.shape not in ((), (1,)):
        problems.report(
            f"{noun} shape {list(first.shape)} is not [] or [1]", path=first.path, tensor=first.name
        )
        return None
    try:
        raw = read_bytes(first.path, first.start, first.nbytes)
    except CheckpointError as e:
        problems.report(f"cannot read the {noun}: {e}", tensor=first.name)
        return None
    if first.dtype == "F32":
        (value,) = struct.unpack("<f", raw)
    elif first.dtype == "F16":
        (value,) = struct.unpack("<e", raw)
    else:  # BF16: the high half of an F32
        (value,) = struct.unpack("<f", b"\0\0" + raw)
    if not math.isfinite(value) or value == 0.0:
        problems.report(
            f"{noun} is {value}, expected a finite non-zero number", path=first.path, tensor=first.name
        )
        return None
    return value, first.name
