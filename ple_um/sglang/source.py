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

from ple_um import served
from ple_um.checkpoint import ple_match

# The tensors of ``ple_match`` that ple-um reads from the files itself, by the suffix SGLang (and
# ``delivered.compare_shard``) names them with; not the FP8 ``weight_scale``, which SGLang loads.
_SUFFIX = {"shard": "weight", "block_scale": "weight_scale", "global_scale": "weight_scale_2"}

_model_folder: str | None = None


def table_tensor(name: str) -> tuple[int, int, str] | None:
    """(decoder layer, shard index or -1, kind) when ``name`` is a PLE table's tensor, as the checkpoint
    names it (model.language_model.layers.<L>...) or SGLang's load_weights renames it
    (model.layers.<L>...), else None; kind is ``weight``, ``weight_scale`` (NVFP4 block scales) or
    ``weight_scale_2`` (NVFP4 global scale)."""
    found = ple_match(name)
    if found is None or found[1] not in _SUFFIX:
        return None
    layer, kind, index = found
    return layer, -1 if index is None else index, _SUFFIX[kind]


def note_model_folder(folder: str) -> None:
    """The local folder of the checkpoint SGLang is loading the Qwen4Exp model from."""
    global _model_folder
    _model_folder = os.path.realpath(folder)


def table_directory() -> str:
    """The real path of the local directory that holds the PLE table (``served.table_directory``:
    PLE_UM_DIR first, then the folder noted), or CheckpointError saying what was tried."""

    def model_folder(tried: list[str]) -> str | None:
        if _model_folder is None:
            tried.append(
                "SGLang's safetensors loader has not resolved the model's folder (the model was loaded "
                "another way)"
            )
        return _model_folder

    return served.table_directory(model_folder)
