"""Checkpoints that do not fit the layer, and tables that cannot be found, fail with errors that say
what is wrong; none is served."""

from __future__ import annotations

import glob
import json
import os
import struct

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


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_width(world, patched, table_dir, tmp_path, table_elsewhere, dtype):
    """Rows of half the layer's head_dim (FP8: 4 of 8; NVFP4: 16 of 32 values): rejected when vLLM
    delivers the shards (shape check, as stock does) and when PLE_UM_DIR names the table (layout
    check)."""
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    wrong = h.write_table(tmp_path / "wrong", config, row_dim=h.head_dim(config) // 2)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    error = ple_um.CheckpointError if table_elsewhere else ValueError
    with pytest.raises(error, match="row width|head_dim"):
        h.load(module, source)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_count(world, patched, table_dir, tmp_path, table_elsewhere, dtype):
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    wrong = h.write_table(tmp_path / "wrong", config, num_rows=right.num_rows + 7)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    error = ple_um.CheckpointError if table_elsewhere else ValueError
    with pytest.raises(error, match="rows"):
        h.load(module, source)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_wrong_shard_count(world, patched, table_dir, tmp_path, dtype):
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    table_dir(h.write_table(tmp_path / "wrong", config, shards=h.PARTS + 1).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="split_ngram_parts"):
        h.load(module, right.directory)


DTYPE_PAIRS = [(a, b) for a in ("fp8", "bf16", "nvfp4") for b in ("fp8", "bf16", "nvfp4") if a != b]
PAIR_IDS = [f"{a}-layer-{b}-table" for a, b in DTYPE_PAIRS]


@pytest.mark.parametrize(("layer", "table"), DTYPE_PAIRS, ids=PAIR_IDS)
def test_dtype_must_match_quant_method(world, patched, table_dir, tmp_path, layer, table):
    """PLE_UM_DIR naming a table of another dtype than the layer's embedding method serves (FP8,
    BF16, NVFP4; rows of the same width): not vLLM's numerics, refused before anything is mapped."""
    config = h.text_config(dtype=layer, head_dim=h.NVFP4_HEAD_DIM)
    model = h.write_table(tmp_path / "model", config)
    table_dir(h.write_table(tmp_path / "table", config, dtype=table).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="stored as") as info:
        h.load(module, model.directory)
    if "nvfp4" in (layer, table):
        assert "NVFP4" in str(info.value) and "ple_embedding_dtype='nvfp4'" in str(info.value)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("layer", ["fp8", "bf16"])
def test_nvfp4_checkpoint_under_another_method(world, patched, table_dir, tmp_path, layer):
    """An NVFP4 checkpoint loaded into a layer configured FP8 (or BF16): its packed shards are
    refused as they arrive, the cure named, before any byte is read or anything mapped."""
    config = h.text_config(dtype=layer, head_dim=h.NVFP4_HEAD_DIM)
    model = h.write_table(table_dir(tmp_path / "model"), config, dtype="nvfp4")
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError) as info:
        h.load(module, model.directory)
    message = str(info.value)
    assert "NVFP4" in message and "ple_embedding_dtype='nvfp4'" in message
    assert "shard_0" in message and os.path.basename(model.shards[0].path) in message  # file named
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("table", ["fp8", "bf16"])
def test_other_checkpoint_under_nvfp4_method(world, patched, table_dir, tmp_path, table):
    """An FP8 (or BF16) checkpoint loaded into a layer configured NVFP4: refused as stock refuses
    it (a cast would reinterpret the bytes), and saying the table is not NVFP4."""
    config = h.text_config(dtype="nvfp4")
    model = h.write_table(table_dir(tmp_path / "model"), config, dtype=table)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=r"requires torch\.uint8.*not NVFP4"):
        h.load(module, model.directory)
    assert module.ngram_embedding.table is None


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


@pytest.mark.parametrize(
    ("dtype", "scale_name", "expected"),
    [("fp8", synthetic.scale_name, "scale"), ("nvfp4", synthetic.global_scale_name, "weight_scale_2")],
    ids=["fp8", "nvfp4"],
)
def test_without_global_scale(world, patched, table_dir, tmp_path, dtype, scale_name, expected):
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    _drop_tensor(layout.directory, scale_name(h.LAYER))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=expected):
        h.load(module, layout.directory)


def test_nvfp4_without_block_scales_of_a_shard(world, patched, table_dir, tmp_path):
    config = h.text_config(dtype="nvfp4")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    _drop_tensor(layout.directory, synthetic.block_scale_name(h.LAYER, 2))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="shard_2.weight_scale|block scale"):
        h.load(module, layout.directory)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize(("dtype", "name"), [("fp8", "weight_scale"), ("nvfp4", "weight_scale_2")])
def test_scale_of_another_table(world, patched, table_dir, tmp_path, dtype, name):
    """PLE_UM_DIR naming a table whose global scale differs from the one vLLM loaded."""
    config = h.text_config(dtype=dtype)
    model = h.write_table(tmp_path / "model", config, seed=0)
    table_dir(h.write_table(tmp_path / "other", config, seed=9).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=f"loaded {name} "):
        h.load(module, model.directory)


def _shift_header(path: str) -> None:
    """The issue 19 corruption: the header length one short, so that the header loses its last pad
    space (padded first when it has none) and stays sound JSON, and every tensor of the file is
    read one byte early."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    text, data = blob[8 : 8 + length], blob[8 + length :]
    if not text.endswith(b" "):
        text += b" " * 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) - 1) + text + data)


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_shifted_header_in_the_table_directory(world, patched, table_dir, tmp_path, dtype):
    """PLE_UM_DIR names a copy of the table whose first file (shard tensors only) has a shifted
    header. vLLM never opens those files; its safetensors loader would refuse this one; the plugin
    refuses it at load, naming the file and a tensor, and maps nothing."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    config = h.text_config(dtype=dtype)
    model = h.write_table(tmp_path / "model", config)
    table = h.write_table(tmp_path / "table", config)
    shifted = table.shards[0].path
    with safe_open(shifted, framework="pt") as f:
        assert all(".shard_" in name for name in f.keys())  # noqa: SIM118 - a file vLLM skips
    _shift_header(shifted)
    with pytest.raises(Exception, match="incomplete metadata"):  # stock vLLM's loader, on that file
        list(safetensors_weights_iterator([shifted], False))
    table_dir(table.directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="shifted header") as info:
        h.load(module, model.directory)
    assert info.value.path == shifted and info.value.tensor is not None
    assert module.ngram_embedding.table is None


def test_shifted_header_in_the_models_own_files(world, patched, table_dir, tmp_path):
    """The model's own checkpoint with a shifted shard file, loaded as vLLM's default loader loads
    it with the plugin: its weights are a lazy generator whose file filter opens every header
    (with safetensors, whose error does not name the file). The plugin's model-level hook checks
    the table's headers before that generator starts, so start-up fails naming the file."""
    from vllm.model_executor.model_loader.weight_utils import (
        filter_safetensors_files_by_weight_name,
        safetensors_weights_iterator,
    )
    from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    shifted = layout.shards[0].path
    _shift_header(shifted)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    unused = qwen4_exp_model.Qwen4ExpForConditionalGeneration.is_unused_checkpoint_weight

    def vllm_weights():  # DefaultModelLoader.get_all_weights, reduced to what touches the files
        files = sorted(glob.glob(os.path.join(layout.directory, "*.safetensors")))
        files = filter_safetensors_files_by_weight_name(files, lambda name: unused(holder, name))
        yield from safetensors_weights_iterator(files, False)

    with pytest.raises(Exception, match="incomplete metadata"):  # what vLLM's loader meets first
        next(vllm_weights())
    load_weights = _model_load_weights(lambda model, weights: {name for name, _ in weights})
    with pytest.raises(ple_um.CheckpointError, match="shifted header") as info:
        load_weights(holder, vllm_weights())
    assert info.value.path == shifted
    assert holder.ple.ngram_embedding.table is None


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


def test_a_dummy_graph_of_zero_rows_refuses_a_table_opened_later(
    world, patched, table_dir, tmp_path, monkeypatch
):
    """--load-format dummy, then a graph captures the zero fill (the capture injected: no GPU here),
    then real weights arrive (an RL weight sync): the graphs would replay zeros for ever, so the
    load refuses and says what to do; without a capture the same load opens the table."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config

    from ple_um.vllm import capture

    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    monkeypatch.setenv("PLE_UM_DIR", layout.directory)  # the dummy config names no model path
    dummy = VllmConfig(device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format="dummy"))
    for captured in (False, True):
        with set_current_vllm_config(dummy):
            module = h.build(config, ple_um_on=True)
        with monkeypatch.context() as m:
            m.setattr(capture, "capturing", lambda ids, captured=captured: captured)
            raw, _ = h.forward(module, 0)
        assert not raw.view(torch.uint8).any()
        if captured:
            with pytest.raises(RuntimeError, match="as zero rows.*before graph capture"):
                h.load(module, layout.directory)
            assert module.ngram_embedding.table is None
        else:
            h.load(module, layout.directory)
            assert module.ngram_embedding.table is not None
            module.ngram_embedding.close_table()


def test_prefetch_misuse(world, patched, table_dir, tmp_path):
    """A finalize for another number of tokens than the start looked up raises (stock would hand out
    rows of the wrong batch); a start never finalized (a forward that raised in between) does not
    stop the next one, whose rows are the file's."""
    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    module = h.build(config, ple_um_on=True)
    h.load(module, layout.directory)
    ids, query_start_loc, ngram_context = h.inputs(0, tokens=30)
    with torch.no_grad():
        module.start_prefetch(ids, query_start_loc, ngram_context)
        with pytest.raises(ValueError, match="finalize_prefetch for 61 tokens, but start_prefetch looked"):
            module.ngram_embedding.finalize_prefetch(61)
        module.start_prefetch(ids, query_start_loc, ngram_context)  # never finalized
    raw_again, _ = h.forward(module, 1)
    module.ngram_embedding.close_table()
    stock = h.build(config, ple_um_on=False)
    h.load(stock, layout.directory)
    raw_stock, _ = h.forward(stock, 1)
    assert h.same_bits(raw_again, raw_stock) and raw_stock.view(torch.uint8).any()
