"""NVFP4 PLE tables (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``: packed E2M1 rows, E4M3 block scales
per shard, one global ``weight_scale_2``) served by ple-um, against the stock device backend.

The lookup decodes to the layer's ``params_dtype`` as the stock method's ``embedding()`` does on the
CPU (``dequantize_to_dtype(..., swizzle=False)``), so every row of the table, in every output dtype
vLLM may build the layer with, must equal stock's bit for bit; the packed bytes ple-um maps must be
the ones stock copies into its parameters.
"""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

pytestmark = [pytest.mark.vllm, h.needs_vllm]

D = h.NVFP4_HEAD_DIM


@pytest.fixture
def nvfp4_pair(world, patched, table_dir, tmp_path):
    """``pair(params_dtype)``: (layout, stock, mapped), both loaded from one NVFP4 checkpoint."""
    config = h.text_config(dtype="nvfp4")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=7)
    opened = []

    def make(params_dtype: torch.dtype):
        stock = h.build(config, ple_um_on=False, params_dtype=params_dtype)
        h.load(stock, layout.directory)
        mapped = h.build(config, ple_um_on=True, params_dtype=params_dtype)
        h.load(mapped, layout.directory)
        opened.append(mapped.ngram_embedding)
        return layout, stock, mapped

    yield make
    for backend in opened:
        backend.close_table()


@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_row_decodes_as_stock(nvfp4_pair, params_dtype):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    layout, stock, mapped = nvfp4_pair(params_dtype)
    ours, theirs = mapped.ngram_embedding, stock.ngram_embedding
    assert type(theirs.embedding_method).__name__ == "Qwen4ExpPLENvFp4EmbeddingMethod"
    assert ours.lookup_dtype == theirs.embedding_method.lookup_dtype(theirs) == params_dtype
    ids = torch.arange(layout.num_rows).view(-1, h.HEADS)  # every row of every shard
    with torch.no_grad():
        expected, got = theirs(ids), ours(ids)
    assert got.dtype == params_dtype and got.shape == (*ids.shape, D)
    assert h.same_bits(got, expected)
    assert got.isfinite().all() and (got != 0).float().mean() > 0.5, "vacuous: mostly zeros"

    # The mapped bytes are the ones stock copied into its parameters, and decode as vLLM decodes.
    packed, scales = ours.table.lookup_packed(ids)
    assert torch.equal(packed.reshape(-1, D // 2), theirs.weight)
    assert torch.equal(scales.reshape(-1, D // 16).view(torch.uint8), theirs.weight_scale.view(torch.uint8))
    decoded = dequantize_to_dtype(
        packed.reshape(-1, D // 2),
        scales.reshape(-1, D // 16),
        theirs.weight_scale_2,
        params_dtype,
        swizzle=False,
    )
    assert h.same_bits(got, decoded.view(got.shape))

    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert h.same_bits(ours.dequantize(got, out_dtype), theirs.dequantize(expected, out_dtype))


@pytest.mark.parametrize("params_dtype", [torch.float16, torch.float32])
def test_layer_forward_in_other_params_dtypes(nvfp4_pair, params_dtype):
    """The whole n-gram layer (hashing, lookup, flatten) in f16 and f32 layers, then dequantize()."""
    _, stock, mapped = nvfp4_pair(params_dtype)
    for seed in (0, 1):
        for out_dtype in (torch.bfloat16, torch.float32):
            raw_stock, deq_stock = h.forward(stock, seed, out_dtype)
            raw_mapped, deq_mapped = h.forward(mapped, seed, out_dtype)
            assert raw_mapped.dtype == params_dtype and deq_mapped.dtype == out_dtype
            assert raw_mapped.any()
            assert h.same_bits(raw_mapped, raw_stock) and h.same_bits(deq_mapped, deq_stock)


def test_global_scale_loaded_as_stock(nvfp4_pair):
    layout, stock, mapped = nvfp4_pair(torch.bfloat16)
    ours, theirs = mapped.ngram_embedding, stock.ngram_embedding
    assert torch.equal(ours.weight_scale_2, theirs.weight_scale_2)
    assert float(ours.weight_scale_2) == layout.scale == ours.table.scale
    assert ours.table.layout.is_nvfp4 and ours.table.layout.scale_tensor.endswith("weight_scale_2")


def test_selected_by_the_quantization_config(world, patched, table_dir, tmp_path):
    """No ple_embedding_dtype: a ModelOpt mixed-precision config marks the PLE layer NVFP4."""
    config = h.text_config(dtype="bf16", head_dim=D)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype="nvfp4")
    modules = []
    for ple_um_on in (False, True):
        module = h.build(config, ple_um_on=ple_um_on, quant_config=h.modelopt_mixed("NVFP4"))
        h.load(module, layout.directory)
        assert type(module.ngram_embedding.embedding_method).__name__ == "Qwen4ExpPLENvFp4EmbeddingMethod"
        modules.append(module)
    stock, mapped = modules
    for seed in (0, 1):
        (raw_stock, deq_stock), (raw_mapped, deq_mapped) = h.forward(stock, seed), h.forward(mapped, seed)
        assert raw_mapped.any() and h.same_bits(raw_mapped, raw_stock) and h.same_bits(deq_mapped, deq_stock)
    mapped.ngram_embedding.close_table()


def test_nvfp4_checkpoint_under_an_fp8_quantization_config(world, patched, table_dir, tmp_path):
    """The quantization config says FP8 for the PLE layer, the checkpoint is NVFP4: refused at load."""
    import ple_um

    config = h.text_config(dtype="bf16", head_dim=D)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype="nvfp4")
    module = h.build(config, ple_um_on=True, quant_config=h.modelopt_mixed("FP8"))
    assert type(module.ngram_embedding.embedding_method).__name__ == "Qwen4ExpPLEFp8EmbeddingMethod"
    with pytest.raises(ple_um.CheckpointError, match="packed NVFP4 rows.*Fp8EmbeddingMethod"):
        h.load(module, layout.directory)
    assert module.ngram_embedding.table is None
