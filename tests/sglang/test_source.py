"""Which tensors are a table's, and which directory the table is mapped from."""

from __future__ import annotations

import os

import pytest

from ple_um.errors import CheckpointError
from ple_um.sglang import source

_PLE = "layers.7.ple.ple_embedding.ngram_embedding"


@pytest.mark.parametrize(
    ("name", "found"),
    [
        (f"model.language_model.{_PLE}.shard_3.weight", (7, 3, "weight")),
        (f"model.{_PLE}.shard_12.weight", (7, 12, "weight")),  # as SGLang's load_weights renames it
        (f"model.language_model.{_PLE}.shard_0.weight_scale", (7, 0, "weight_scale")),  # NVFP4 blocks
        (f"model.language_model.{_PLE}.weight_scale_2", (7, -1, "weight_scale_2")),  # NVFP4 global
        (f"model.language_model.{_PLE}.weight_scale", None),  # the FP8 scale: SGLang loads it
        (f"model.language_model.{_PLE}.weight", None),  # an unsharded table: SGLang refuses it
        (f"model.language_model.{_PLE}.shard_3.weight.extra", None),
        ("model.language_model.layers.7.ple.key_proj.weight", None),
        ("model.language_model.embed_tokens.weight", None),
    ],
)
def test_table_tensor(name, found):
    assert source.table_tensor(name) == found


def test_table_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "_model_folder", None)
    with pytest.raises(CheckpointError, match="PLE_UM_DIR .*unset.*has not resolved the model.s folder"):
        source.table_directory()
    source.note_model_folder(str(tmp_path))
    assert source.table_directory() == os.path.realpath(tmp_path)
    other = tmp_path / "copy"
    other.mkdir()
    monkeypatch.setenv("VLLM_PLE_MMAP_DIR", str(other))  # the seeds' alias
    assert source.table_directory() == os.path.realpath(other)
    monkeypatch.setenv("PLE_UM_DIR", str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="PLE_UM_DIR=.* is not a directory"):
        source.table_directory()
