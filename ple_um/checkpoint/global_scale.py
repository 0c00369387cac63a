"""A table's global scale: the one tensor that holds it (FP8's ``weight_scale``, NVFP4's
``weight_scale_2``), of a scale dtype and shape ``[]`` or ``[1]``, its value read from the file and
checked to be a finite non-zero number. Only that value's few bytes are read.
"""

from __future__ import annotations

import math
import struct

from ple_um.checkpoint.files import read_bytes
from ple_um.checkpoint.problems import Problems
from ple_um.checkpoint.safetensors import TensorEntry
from ple_um.checkpoint.shard_layout import SCALE_DTYPES
from ple_um.errors import CheckpointError


def read_scale(
    scales: list[TensorEntry],
    expected: str,
    path: str,
    missing: str,
    problems: Problems,
    *,
    noun: str = "scale",
    lost: bool = False,
) -> tuple[float, str] | None:
    """A table's global scale (value, tensor name), or None when absent or unsound (reported).

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
    return value, first.name
