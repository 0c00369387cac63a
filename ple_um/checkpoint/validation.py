"""The checks that turn a scan's PLE tensors into a ShardLayout: one tensor per shard index, one dtype
and row width, every index present, rows in the ceil layout, and the scales each dtype needs (FP8:
one global scale; NVFP4: per-shard E4M3 block scales of the right shape and one global scale). A
global scale is the one tensor that holds it (FP8's ``weight_scale``, NVFP4's ``weight_scale_2``),
of a scale dtype and shape ``[]`` or ``[1]``, its value read from the file (only its few bytes) and
checked to be a finite non-zero number. Every problem goes to a ``Problems``: the first raises
(read_layout), or all are listed (validate), in the same order either way.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Container

from ple_um.checkpoint.files import read_bytes
from ple_um.checkpoint.naming import block_scale_name, global_scale_name, rows_name, scale_name
from ple_um.checkpoint.safetensors import TensorEntry
from ple_um.checkpoint.scan import LayerTensors, Problems, Scan, layer_number, scan
from ple_um.checkpoint.shard_layout import (
    FP8_DTYPES,
    NVFP4,
    NVFP4_BLOCK,
    NVFP4_SCALE_DTYPE,
    NVFP4_STORAGE,
    SCALE_DTYPES,
    STORAGE_DTYPES,
    ShardLayout,
    ShardSpec,
)
from ple_um.errors import CheckpointError

# Tensors of one layer whose file is reported already, as (kind, shard index or None): see Scan.lost.
_Lost = Container[tuple[str, int | None]]


class _Every:
    """Every tensor: what a file refused with no index may hold (Scan.blind)."""

    def __contains__(self, _: object) -> bool:
        return True


_SUPPORTED = ", ".join(f"{d} ({NVFP4})" if d == NVFP4_STORAGE else d for d in STORAGE_DTYPES)


def analyze(directory: str, layer: int | None, problems: Problems) -> ShardLayout | None:
    """Every check of read_layout and validate, reporting to ``problems``; the layout when sound."""
    layer = layer_number(layer)
    found = scan(directory, layer, problems)
    if found is None:
        return None
    present = ", ".join(str(at) for at in sorted(found.layers)) or "none"
    if layer is None:
        if not found.layers:
            if not found.blind:
                problems.report(f"no PLE shards were found in {found.directory}")
            return None
        if len(found.layers) > 1:
            problems.report(
                f"several PLE layers have shards in {found.directory}: {present}; pass layer= to pick one"
            )
            for at in sorted(found.layers):
                _build(found, at, problems)
            return None
        (layer,) = found.layers
    elif layer not in found.layers:
        if not found.blind:
            problems.report(
                f"no PLE shards of layer {layer} in {found.directory}; layers with shards: {present}"
            )
        return None
    return _build(found, layer, problems)


def _build(found: Scan, layer: int, problems: Problems) -> ShardLayout | None:
    """Check one layer's shards and scales; its ShardLayout when sound, else None (all reported)."""
    tensors = found.tensors.get(layer, LayerTensors())
    # One tensor per index: a second one (another file, another prefix, a leading zero) is an error.
    shards = _one_per_index(tensors.shards, "duplicate shard index", problems)
    sound = all(len(v) == 1 for v in tensors.shards.values())
    reference, rows_sound = _check_rows(shards, problems)
    sound = sound and rows_sound
    lost_here = {(kind, index) for at, kind, index in found.lost if at == layer}
    lost: _Lost = _Every() if found.blind else lost_here
    lost_shards = {index for kind, index in lost_here if kind == "shard"}
    if not shards:  # the index named shards that their files do not hold (reported by the scan)
        if not lost_shards and not found.blind:
            problems.report(f"no PLE shards of layer {layer} could be read in {found.directory}")
        return None
    parts = max(shards.keys() | lost_shards) + 1
    whole = not found.blind and _check_indices(layer, shards, lost_shards, parts, problems)
    sound = whole and sound and not lost_shards
    # An NVFP4 table goes on to its block scales and global scale even when its rows are unsound,
    # so that validate lists their problems too; other tables stop here.
    nvfp4 = reference is not None and reference.dtype == NVFP4_STORAGE
    if reference is None or not (sound or nvfp4):
        return None

    total = per_shard = 0
    if sound:
        counted = _check_ceil(layer, shards, parts, reference, problems)
        if counted is None:
            return None
        total, per_shard, sound = counted
    scales = _check_scales(tensors, shards, reference, problems, lost)
    if scales is None or not sound:
        return None
    scale, scale_tensor, scale_path, blocks = scales
    storage = reference.dtype
    return ShardLayout(
        directory=found.directory,
        layer=layer,
        dtype_name=NVFP4 if nvfp4 else storage,
        dtype=STORAGE_DTYPES[storage],
        row_dim=2 * reference.shape[1] if nvfp4 else reference.shape[1],
        row_bytes=reference.shape[1] * STORAGE_DTYPES[storage].itemsize,
        num_rows=total,
        rows_per_shard=per_shard,
        shards=shard_specs(shards),
        scale=scale,
        scale_tensor=scale_tensor,
        scale_path=scale_path,
        block_scales=shard_specs(blocks),
        block_size=NVFP4_BLOCK if nvfp4 else 0,
    )


def shard_specs(entries: dict[int, TensorEntry]) -> tuple[ShardSpec, ...]:
    """The ShardSpecs of tensors by shard index, in index order: each a whole tensor of rows."""
    return tuple(
        ShardSpec(index=i, path=e.path, tensor=e.name, offset=e.start, rows=e.shape[0], identity=e.identity)
        for i, e in sorted(entries.items())
    )


def _one_per_index(
    entries: dict[int, list[TensorEntry]], what: str, problems: Problems
) -> dict[int, TensorEntry]:
    """The first tensor of each index (by file, then name); every further one is reported."""
    return {index: problems.first(entries[index], f"{what} {index}") for index in sorted(entries)}


def _check_rows(shards: dict[int, TensorEntry], problems: Problems) -> tuple[TensorEntry | None, bool]:
    """The first shard of a supported dtype and 2-D shape (the one the others must match), and
    whether every shard matches it with rows of a width the dtype can hold."""
    sound = True
    reference: TensorEntry | None = None
    for entry in shards.values():
        wrong = None
        if entry.dtype not in STORAGE_DTYPES:
            wrong = f"unsupported dtype {entry.dtype} for a PLE shard (supported: {_SUPPORTED})"
        elif len(entry.shape) != 2:
            wrong = f"shard tensor has shape {list(entry.shape)}, expected 2-D [rows, row_dim]"
        elif reference is None:
            reference = entry
        elif entry.dtype != reference.dtype:
            wrong = f"dtype {entry.dtype} differs from {reference.dtype} of shard tensor {reference.name}"
        elif entry.shape[1] != reference.shape[1]:
            wrong = (
                f"row width {entry.shape[1]} differs from {reference.shape[1]} "
                f"of shard tensor {reference.name}"
            )
        if wrong is not None:
            sound = problems.about(entry, wrong)
    if reference is not None and reference.shape[1] == 0:
        sound = problems.about(reference, "rows have 0 elements")
    packed_block = NVFP4_BLOCK // 2  # packed bytes of one block: two values a byte
    if reference is not None and reference.dtype == NVFP4_STORAGE and reference.shape[1] % packed_block:
        sound = problems.about(
            reference,
            f"NVFP4 rows of {2 * reference.shape[1]} values ({reference.shape[1]} packed bytes) do not "
            f"split into blocks of {NVFP4_BLOCK}: the packed width must be a multiple of {packed_block}",
        )
    return reference, sound


def _check_indices(
    layer: int, shards: dict[int, TensorEntry], lost: set[int], parts: int, problems: Problems
) -> bool:
    """Whether every index of ``range(parts)`` has a shard or is ``lost`` (its file's problem is
    reported already); the first missing ones are reported."""
    accounted = shards.keys() | lost
    # At most len(accounted) + 10 indices are looked at, however large ``parts`` is.
    missing = list(itertools.islice((i for i in range(parts) if i not in accounted), 10))
    if not missing:
        return True
    count = parts - len(accounted)
    listed = ", ".join(str(i) for i in missing) + (", ..." if count > len(missing) else "")
    problems.report(
        f"layer {layer}: {count} of shard indices 0..{parts - 1} missing: {listed}",
        path=shards[max(shards)].path,
    )
    return False


def _check_ceil(
    layer: int, shards: dict[int, TensorEntry], parts: int, reference: TensorEntry, problems: Problems
) -> tuple[int, int, bool] | None:
    """(rows, rows per shard, whether every shard holds its ceil share); None for a table of 0 rows."""
    total = sum(entry.shape[0] for entry in shards.values())
    if total == 0:
        problems.about(reference, f"layer {layer}: the table has 0 rows")
        return None
    per_shard = -(-total // parts)
    sound = True
    for index, entry in shards.items():
        expected = min(max(total - index * per_shard, 0), per_shard)
        if entry.shape[0] != expected:
            problems.about(
                entry,
                f"shard {index} holds {entry.shape[0]} rows, expected {expected} ({total} rows in "
                f"{parts} parts: ceil({total}/{parts}) = {per_shard} rows per shard)",
            )
            sound = False
    return total, per_shard, sound


def read_scale(
    scales: list[TensorEntry],
    expected: str,
    path: str,
    missing: str,
    problems: Problems,
    *,
    noun: str = "scale",
    lost: bool = False,
) -> tuple[float, str, str] | None:
    """A table's global scale (value, tensor name, file), or None when absent or unsound (reported).

    ``missing`` is the message when there is none, naming the ``expected`` tensor and the shard
    file ``path``; ``noun`` names the scale in the other messages (the FP8 "scale", NVFP4's
    "global scale"); ``lost``: the file that should hold it is reported already.
    """
    if not scales:
        if not lost:
            problems.report(missing, path=path, tensor=expected)
        return None
    first = problems.first(scales, f"duplicate {noun}")
    if len(scales) > 1:
        return None
    if first.dtype not in SCALE_DTYPES:
        problems.about(first, f"{noun} dtype {first.dtype} is not one of {', '.join(SCALE_DTYPES)}")
        return None
    if first.shape not in ((), (1,)):
        problems.about(first, f"{noun} shape {list(first.shape)} is not [] or [1]")
        return None
    try:
        raw = read_bytes(first.path, first.start, first.nbytes, first.identity)
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
        problems.about(first, f"{noun} is {value}, expected a finite non-zero number")
        return None
    return value, first.name, first.path


def _check_scales(
    tensors: LayerTensors,
    shards: dict[int, TensorEntry],
    reference: TensorEntry,
    problems: Problems,
    lost: _Lost,
) -> tuple[float | None, str | None, str | None, dict[int, TensorEntry]] | None:
    """The scales the table's dtype needs: (global scale, its tensor name, its file, NVFP4 block
    scales by shard index); None when they are unsound (reported; one ``lost`` is not reported
    missing). 16-bit tables need none."""
    if reference.dtype in FP8_DTYPES:
        read = read_scale(
            tensors.scales,
            scale_name(reference.name),
            reference.path,
            f"FP8 table ({reference.dtype}) without its global scale; no such tensor in any file",
            problems,
            lost=("scale", None) in lost,
        )
        return None if read is None else (*read, {})
    if reference.dtype == NVFP4_STORAGE:
        return _check_nvfp4(tensors, shards, reference, problems, lost)
    return None, None, None, {}


def _check_nvfp4(
    tensors: LayerTensors,
    shards: dict[int, TensorEntry],
    reference: TensorEntry,
    problems: Problems,
    lost: _Lost,
) -> tuple[float, str, str, dict[int, TensorEntry]] | None:
    """An NVFP4 table's global scale (value, tensor name, file) and its block scales by shard index;
    None when any of them is unsound (every problem reported; a tensor in ``lost``, of a file
    already reported, is not reported missing again)."""
    sound = True
    # vLLM refuses an unsharded ngram_embedding.weight_scale next to an NVFP4 table.
    for entry in sorted(tensors.scales, key=lambda e: (e.path, e.name)):
        sound = problems.about(
            entry,
            "unsharded weight_scale next to an NVFP4 table: its block scales must be stored per shard, "
            "as ...ngram_embedding.shard_<i>.weight_scale",
        )

    blocks = _one_per_index(tensors.block_scales, "duplicate block scales of shard index", problems)
    sound = sound and all(len(v) == 1 for v in tensors.block_scales.values())
    for index in sorted(shards.keys() | blocks.keys()):
        sound = _check_block(index, shards.get(index), blocks.get(index), reference, problems, lost) and sound

    read = read_scale(
        tensors.global_scales,
        global_scale_name(reference.name),
        reference.path,
        "NVFP4 table without its global scale weight_scale_2; no such tensor in any file",
        problems,
        noun="global scale",
        lost=("global_scale", None) in lost,
    )
    if read is None or not sound:
        return None
    return (*read, blocks)


def _check_block(
    index: int,
    rows: TensorEntry | None,
    block: TensorEntry | None,
    reference: TensorEntry,
    problems: Problems,
    lost: _Lost,
) -> bool:
    """Whether shard ``index`` has both its rows and its block scales, the scales E4M3, 2-D, with
    the rows' count and one scale per NVFP4_BLOCK values of a row (problems reported; a half in
    ``lost`` is not reported missing)."""
    if block is None:
        assert rows is not None
        if ("block_scale", index) not in lost:
            problems.report(
                f"NVFP4 shard {index} without its block scales; no such tensor in any file",
                path=rows.path,
                tensor=block_scale_name(rows.name),
            )
        return False
    if rows is None:
        if ("shard", index) not in lost:
            problems.about(
                block,
                f"block scales of shard {index} without its rows: no tensor {rows_name(block.name)} "
                "in any file",
            )
        return False
    if block.dtype != NVFP4_SCALE_DTYPE:
        return problems.about(block, f"block-scale dtype {block.dtype}, expected {NVFP4_SCALE_DTYPE}")
    if len(block.shape) != 2:
        return problems.about(
            block,
            f"block-scale tensor has shape {list(block.shape)}, expected 2-D [rows, row_dim/{NVFP4_BLOCK}]",
        )
    sound = True
    if rows.dtype == reference.dtype and len(rows.shape) == 2 and block.shape[0] != rows.shape[0]:
        sound = problems.about(
            block,
            f"block scales of shard {index} have {block.shape[0]} rows, its row shard {rows.name} "
            f"has {rows.shape[0]}",
        )
    row_dim = 2 * reference.shape[1]
    if row_dim % NVFP4_BLOCK == 0 and block.shape[1] != row_dim // NVFP4_BLOCK:
        sound = problems.about(
            block,
            f"block-scale width {block.shape[1]}, expected {row_dim // NVFP4_BLOCK}: one scale per "
            f"{NVFP4_BLOCK} of the {row_dim} values of a row ({reference.shape[1]} packed bytes)",
        )
    return sound
