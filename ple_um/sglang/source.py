"""Where the table comes from: the checkpoint directory to map, and which checkpoint tensors are the
table's.

- ``table_directory``: ``PLE_UM_DIR`` (alias ``VLLM_PLE_MMAP_DIR``) when set, else the local folder
  SGLang's loader resolved for the model (its path, or the Hugging Face snapshot it downloaded),
  which the loading hook notes with ``note_model_folder`` before any weight is read.
- ``table_tensor``: whether a tensor name is one of a PLE table's (a shard's rows, an NVFP4 shard's
  block scales, NVFP4's global scale), which ple-um reads from the files itself.

Imports nothing from SGLang.
"""

from __future__ import annotations

import os
import re

from ple_um.checkpoint import directory_from_knob
from ple_um.errors import CheckpointError

# A PLE table's tensors as the checkpoint names them (model.language_model.layers.<L>...) and as
# SGLang's load_weights renames them (model.layers.<L>...): group 1 the decoder layer, then either
# the shard index and "weight" (rows) or "weight_scale" (NVFP4 block scales), or "weight_scale_2".
_TABLE_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\."
    r"(?:shard_(\d+)\.(weight|weight_scale)|(weight_scale_2))\Z"
)

_model_folder: str | None = None


def table_tensor(name: str) -> tuple[int, int, str] | None:
    """(decoder layer, shard index or -1, kind) when ``name`` is a PLE table's tensor, else None; kind is
    ``weight``, ``weight_scale`` (NVFP4 block scales) or ``weight_scale_2`` (NVFP4 global scale)."""
    found = _TABLE_TENSOR.search(name)
    if found is None:
        return None
    if found.group(4):
        return int(found.group(1)), -1, "weight_scale_2"
    return int(found.group(1)), int(found.group(2)), found.group(3)


def note_model_folder(folder: str) -> None:
    """The local folder of the checkpoint SGLang is loading the Qwen4Exp model from."""
    global _model_folder
    _model_folder = os.path.realpath(folder)


def table_directory() -> str:
    """The local directory that holds the PLE table, or CheckpointError saying what was tried."""
    override = directory_from_knob()
    if override is not None:
        return os.path.realpath(override)
    if _model_folder is not None:
        return _model_folder
    raise CheckpointError(
        "cannot find the checkpoint directory of the PLE table: PLE_UM_DIR is unset and SGLang's "
        "safetensors loader has not resolved the model's folder (the model was loaded another way). "
        "Set PLE_UM_DIR to the directory holding the *.safetensors files with the "
        "...ple_embedding.ngram_embedding.shard_<i>.weight tensors"
    )
