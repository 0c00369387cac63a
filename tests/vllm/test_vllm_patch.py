"""The patch of vLLM (``ple_um.vllm.patch``): the layer built stock when PLE_UM is unset at build
time; the model's file filter skipping the files that hold only shard tensors; the model-level
load hook; the ROCm layer, patched the same way but taking no prefetch hook."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

import ple_um

pytestmark = [pytest.mark.vllm, h.needs_vllm]


def test_built_stock_when_unset_at_build_time(world, patched, monkeypatch, tmp_path):
    module = h.build(h.text_config(fp8=False), ple_um_on=False)
    assert type(module.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_shard_files_are_not_even_opened(world, patched, table_dir, tmp_path, dtype):
    """vLLM's file filter, fed the model's is_unused_checkpoint_weight, drops the files that hold
    only shard tensors (NVFP4: rows and block scales): loaders that read whole files (eager,
    prefetch, fastsafetensors) skip them."""
    from vllm.model_executor.model_loader.weight_utils import filter_safetensors_files_by_weight_name
    from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    mapped = h.build(config, ple_um_on=True)  # the first ple-um layer patches the model classes
    holder = torch.nn.Module()
    holder.add_module("ple", mapped)
    for cls in (qwen4_exp_model.Qwen4ExpForCausalLM, qwen4_exp_model.Qwen4ExpForConditionalGeneration):
        unused = cls.is_unused_checkpoint_weight
        assert unused(holder, ple_um.synthetic.shard_name(h.LAYER, 0))
        assert not unused(holder, ple_um.synthetic.scale_name(h.LAYER))
        assert not unused(holder, ple_um.synthetic.UNRELATED_NAME)
        assert unused(holder, ple_um.synthetic.block_scale_name(h.LAYER, 3))
        assert not unused(holder, ple_um.synthetic.global_scale_name(h.LAYER))
        assert not unused(torch.nn.Module(), ple_um.synthetic.shard_name(h.LAYER, 0))  # no ple-um layer
        files = sorted(set(layout.files) | {s.path for s in layout.shards})
        kept = filter_safetensors_files_by_weight_name(files, lambda name, u=unused: u(holder, name))
        assert kept == [files[-1]]  # the last file also holds the scale and an unrelated tensor


def test_model_load_opens_tables_never_given_weights(world, patched, table_dir, tmp_path):
    """When vLLM's file filter leaves a layer no tensor at all (BF16 shards in their own files), the
    model-level hook still opens its table after the model's load_weights, and links the model's
    layers for early lookups."""
    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(fp8=False)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=False)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    calls = []
    load_weights = _model_load_weights(lambda model, weights: calls.append(list(weights)) or {"x"})
    assert load_weights(holder, iter([])) == {"x"} and calls == [[]]
    backend = holder.ple.ngram_embedding
    assert backend.table is not None and backend.table.layout.directory == layout.directory
    assert backend.shards_skipped == 0
    assert backend.early.layers == [holder.ple]  # linked for early lookups once the model is loaded
    stock = h.stock(config, layout.directory)
    assert h.same_bits(h.forward(holder.ple, 0)[0], h.forward(stock, 0)[0])
    backend.close_table()


# vLLM: test_amd_fp8_embedding_loads_checkpoint_shards_and_global_scale (its cpu-resident case)
def test_amd_variant_matches_stock(world, table_dir, tmp_path):
    """The ROCm Qwen4ExpNGramEmbedding (another constructor signature) takes the same patch; its
    lookup op copies the backend's rows into a params_dtype buffer, then the layer dequantizes."""
    from helpers.vllm_patch import restore
    from vllm.models.qwen4_exp.amd import ple_layer

    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding
    from ple_um.vllm.patch import patch_ngram_class

    patch_ngram_class(ple_layer)
    try:
        config = h.text_config(fp8=True)
        layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
        stock = h.build_amd(config, ple_um_on=False)
        h.load(stock, layout.directory)
        mapped = h.build_amd(config, ple_um_on=True)
        h.load(mapped, layout.directory)
        assert isinstance(mapped.ngram_embedding, Qwen4ExpPLEMappedEmbedding)
        ids = torch.randint(0, layout.num_rows, (40, h.HEADS), generator=torch.Generator().manual_seed(4))
        outputs = []
        for module in (stock, mapped):
            embedding = module.ngram_embedding
            output = ids.new_empty((ids.shape[0], config.ple_embed_dim), dtype=embedding.params_dtype)
            output.copy_(embedding(ids).flatten(-2))  # qwen4_exp_amd_ple_ngram_embedding's body
            outputs.append(embedding.dequantize(output, torch.bfloat16))
        assert h.same_bits(*outputs) and outputs[0].any()
        mapped.ngram_embedding.close_table()
    finally:
        restore(ple_layer.Qwen4ExpNGramEmbedding)


def test_rocm_layer_takes_no_prefetch_hook(world, patched, monkeypatch):
    """ROCm's Qwen4ExpNGramEmbedding has no prefetch wiring and sends a backend that declares the hook
    down the pinned backend's branch (sync_lookup, which this backend lacks): there the backend
    declares none, and the layer calls its forward; the NVIDIA layer keeps the hook."""
    from helpers.vllm_patch import restore
    from vllm.models.qwen4_exp.amd import ple_layer

    from ple_um.vllm.patch import patch_ngram_class

    monkeypatch.setenv("PLE_UM_OVERLAP", "1")
    config = h.text_config(fp8=True)
    assert h.build(config, ple_um_on=True).ngram_embedding.supports_prefetch
    patch_ngram_class(ple_layer)
    try:
        assert not h.build_amd(config, ple_um_on=True).ngram_embedding.supports_prefetch
    finally:
        restore(ple_layer.Qwen4ExpNGramEmbedding)
