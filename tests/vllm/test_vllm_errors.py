"""Checkpoints that do not fit the layer, and tables that cannot be found, fail with errors that say
what is wrong; none is served."""

from __future__ import annotations

import json
import os

import pytest
import torch
import vllm_harness as h
from safetensors import safe_open
from safetensors.torch import save_file

import ple_um
from ple_um import synthetic

pytestmark = [pytest.mark.vllm, h.needs_vllm]


def test_no_checkpoint_directory(world, patched, monkeypatch, tmp_path):
    """No PLE_UM_DIR and no model path: the error lists what was tried."""
    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError) as info:
        h.load(module, layout.directory)
    message = str(info.value)
    assert "PLE_UM_DIR" in message and "model path" in message


def test_missing_directory_named(world, patched, monkeypatch, tmp_path):
    missing = tmp_path / "not-there"
    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.setenv("VLLM_PLE_MMAP_DIR", str(missing))  # the seeds' alias
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="VLLM_PLE_MMAP_DIR=.*not-there.*is not a directory"):
        h.load(module, layout.directory)


def test_directory_without_table(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    table_dir(empty)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="empty"):
        h.load(module, layout.directory)


@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_width(world, patched, table_dir, tmp_path, table_elsewhere):
    """Rows of 4 elements for a layer whose head_dim is 8: rejected when vLLM delivers the shards
    (shape check, as stock does) and when PLE_UM_DIR names the table (layout check)."""
    config = h.text_config(fp8=True)
    right = h.write_table(tmp_path / "right", config, fp8=True)
    wrong = h.write_table(tmp_path / "wrong", config, fp8=True, row_dim=4)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    error = ple_um.CheckpointError if table_elsewhere else ValueError
    with pytest.raises(error, match="row width|head_dim"):
        h.load(module, source)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_count(world, patched, table_dir, tmp_path, table_elsewhere):
    config = h.text_config(fp8=True)
    right = h.write_table(tmp_path / "right", config, fp8=True)
    wrong = h.write_table(tmp_path / "wrong", config, fp8=True, num_rows=right.num_rows + 7)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    error = ple_um.CheckpointError if table_elsewhere else ValueError
    with pytest.raises(error, match="rows"):
        h.load(module, source)
    assert module.ngram_embedding.table is None


def test_wrong_shard_count(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=True)
    right = h.write_table(tmp_path / "right", config, fp8=True)
    table_dir(h.write_table(tmp_path / "wrong", config, fp8=True, shards=h.PARTS + 1).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="split_ngram_parts"):
        h.load(module, right.directory)


def test_dtype_must_match_quant_method(world, patched, table_dir, tmp_path):
    """PLE_UM_DIR naming a BF16 table for an FP8 layer (and the reverse): not vLLM's numerics."""
    for fp8 in (True, False):
        config = h.text_config(fp8=fp8)
        model = h.write_table(tmp_path / f"model-{fp8}", config, fp8=fp8)
        table_dir(h.write_table(tmp_path / f"table-{fp8}", config, fp8=not fp8).directory)
        module = h.build(config, ple_um_on=True)
        with pytest.raises(ple_um.CheckpointError, match="stored as"):
            h.load(module, model.directory)


def _drop_tensor(directory, name: str) -> None:
    """Rewrite the file holding ``name`` without it, and the index without its entry."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    path = os.path.join(directory, index["weight_map"].pop(name))
    with safe_open(path, framework="pt") as f:
        kept = {key: f.get_tensor(key).clone() for key in f.keys() if key != name}  # noqa: SIM118
    save_file(kept, path, metadata={"format": "pt"})
    with open(index_path, "w") as f:
        json.dump(index, f)


def test_fp8_without_scale(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    _drop_tensor(layout.directory, synthetic.scale_name(h.LAYER))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="scale"):
        h.load(module, layout.directory)


def test_scale_of_another_table(world, patched, table_dir, tmp_path):
    """PLE_UM_DIR naming a table whose FP8 scale differs from the one vLLM loaded."""
    config = h.text_config(fp8=True)
    model = h.write_table(tmp_path / "model", config, fp8=True, seed=0)
    table_dir(h.write_table(tmp_path / "other", config, fp8=True, seed=9).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="weight_scale"):
        h.load(module, model.directory)


def test_nvfp4_refused(world, patched, tmp_path):
    config = h.text_config(fp8=False)
    config.ple_embedding_dtype = "nvfp4"
    with pytest.raises(NotImplementedError, match="NVFP4"):
        h.build(config, ple_um_on=True)


def test_forward_before_loading(world, patched, tmp_path):
    module = h.build(h.text_config(fp8=True), ple_um_on=True)
    with pytest.raises(RuntimeError, match="not open"):
        h.forward(module, 0)


def test_dummy_load_format_serves_zeros(world, patched):
    """--load-format dummy never calls load_weights: no table, zero rows (as stock's are random)."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config

    dummy = VllmConfig(device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format="dummy"))
    with set_current_vllm_config(dummy):
        module = h.build(h.text_config(fp8=True), ple_um_on=True)
    raw, _ = h.forward(module, 0)
    assert module.ngram_embedding.table is None and not raw.view(torch.uint8).any()
