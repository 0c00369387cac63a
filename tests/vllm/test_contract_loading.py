"""vLLM's own PLE loading tests as ple-um's contract, on one rank: BF16, FP8 and NVFP4 shards
through the real ``load_weights`` (the legacy ``token_lookup`` tensor ignored, NVFP4 block scales
before their rows, a few tensors per call), a global scale missing, vLLM's post-load processing,
the PLE layer's dequantization.

Each test names the vLLM 0.33 test (``tests/models/qwen4_exp/test_ple.py``) whose behaviour it
checks, builds the real layer twice the way vLLM's model does (real constructor, real loader; the
stock device backend, and the plugin in effect) and loads both from one synthetic checkpoint, the
shard tensors as views of the files (vLLM's safetensors iterator: ple-um skips them unread) or in
memory (ple-um compares them with the mapped bytes). The two-rank halves (shards across the ranks'
boundaries) are in ``test_contract_two_ranks.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import vllm_harness as h

import ple_um
from ple_um import synthetic

pytestmark = [pytest.mark.vllm, h.needs_vllm]


def _post_load(module) -> None:
    embedding = module.ngram_embedding
    embedding.quant_method.process_weights_after_loading(embedding)


def _check_counts(backend, delivery: str, tensors: int) -> None:
    """File views skipped unread, tensors in memory compared with the mapped bytes."""
    assert (backend.shards_skipped, backend.shards_compared) == (
        (tensors, 0) if delivery == "file" else (0, tensors)
    )


# vLLM: test_ngram_embedding_loads_shards_and_ignores_legacy_token_lookup,
# test_ngram_embedding_loads_fp8_shards_and_global_scale
@pytest.mark.parametrize("delivery", ["file", "memory"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_loads_shards_and_ignores_legacy_tensors(world, patched, table_dir, tmp_path, dtype, delivery):
    """The shards and the FP8 global scale load, the legacy ``token_lookup`` and ``hashstats_*``
    tensors are ignored, and load_weights reports the same names as stock; the rows and the scale
    are stock's, bit for bit."""
    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=21)
    legacy = [("token_lookup", torch.tensor([2, 1, 0])), ("ngram_embedding.hashstats_hits", torch.ones(3))]
    expected = {"ngram_embedding.weight"} | ({"ngram_embedding.weight_scale"} if dtype == "fp8" else set())
    stock, mapped = h.build(config, ple_um_on=False), h.build(config, ple_um_on=True)
    assert isinstance(mapped.ngram_embedding, Qwen4ExpPLEMappedEmbedding)
    for module in (stock, mapped):
        assert module.load_weights(iter(h.delivered(layout.directory, delivery) + legacy)) == expected
        _post_load(module)
    ours, theirs = mapped.ngram_embedding, stock.ngram_embedding
    _check_counts(ours, delivery, h.PARTS)
    assert ours.weight.dtype == theirs.weight.dtype == layout.dtype
    if dtype == "fp8":
        assert ours.weight_scale.dtype == theirs.weight_scale.dtype == torch.float32
        assert torch.equal(ours.weight_scale, theirs.weight_scale)
        assert float(ours.weight_scale) == layout.scale
    for seed in (0, 1):
        raw_stock, deq_stock = h.forward(stock, seed)
        raw, deq = h.forward(mapped, seed)
        assert raw.view(torch.uint8).any() and h.same_bits(raw, raw_stock) and h.same_bits(deq, deq_stock)
    ours.close_table()


# vLLM: test_nvfp4_ple_loads_streamed_shards_across_etp_boundaries (one rank)
@pytest.mark.parametrize("delivery", ["file", "memory"])
def test_nvfp4_shards_streamed_a_few_at_a_time(world, patched, table_dir, tmp_path, delivery):
    """Block scales before their rows, shards out of order, three tensors per load_weights call: the
    same names reported as stock's, every row decoded as stock decodes it and as the files hold it."""
    config = h.text_config(dtype="nvfp4")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=22)
    names = {f"ngram_embedding.{n}" for n in ("weight", "weight_scale", "weight_scale_2")}
    stock, mapped = h.build(config, ple_um_on=False), h.build(config, ple_um_on=True)
    for module in (stock, mapped):
        assert h.load_in_calls(module, h.streamed_nvfp4(layout.directory, delivery)) == names
        _post_load(module)
    ours, theirs = mapped.ngram_embedding, stock.ngram_embedding
    _check_counts(ours, delivery, 2 * h.PARTS)
    assert ours.weight.dtype == theirs.weight.dtype == torch.uint8
    assert ours.weight_scale.dtype == theirs.weight_scale.dtype == torch.float8_e4m3fn
    assert ours.weight.numel() + ours.weight_scale.numel() == 0  # the rows stay in the files
    ids = torch.arange(layout.num_rows).view(-1, h.HEADS)  # every row of every shard
    with torch.no_grad():
        got = ours(ids)
        assert h.same_bits(got, theirs(ids)) and h.same_bits(got, h.file_rows(layout, ids))
    ours.close_table()


# vLLM: test_ple_fp8_embedding_rejects_missing_global_scale, test_nvfp4_ple_rejects_missing_global_scale
@pytest.mark.parametrize(("dtype", "scale"), [("fp8", "weight_scale"), ("nvfp4", "weight_scale_2")])
def test_a_global_scale_the_load_never_delivered(world, patched, table_dir, tmp_path, dtype, scale):
    """The checkpoint holds the scale but the weights handed to load_weights lack it: vLLM's own
    post-load check refuses both layers, in the same words (ple-um keeps vLLM's embedding method,
    and leaves a scale that was never loaded to it)."""
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=23)
    for ple_um_on in (False, True):
        module = h.build(config, ple_um_on=ple_um_on)
        module.load_weights(iter(h.delivered(layout.directory, "file", drop=(f"ngram_embedding.{scale}",))))
        with pytest.raises(ValueError, match="PLE checkpoint is missing its global scale"):
            _post_load(module)
        if ple_um_on:
            module.ngram_embedding.close_table()


# vLLM: test_ple_fp8_embedding_rejects_missing_global_scale, test_nvfp4_ple_rejects_missing_global_scale
@pytest.mark.parametrize(("dtype", "scale"), [("fp8", "weight_scale"), ("nvfp4", "weight_scale_2")])
def test_a_global_scale_missing_from_the_checkpoint(world, patched, table_dir, tmp_path, dtype, scale):
    """The checkpoint itself lacks the scale. Stock loads the rows and refuses in its post-load
    check; ple-um refuses in load_weights, before serving anything, with a CheckpointError (a
    ValueError, as stock's) that names the missing tensor and a file of the table: it reads the
    table's headers when it opens the table, so it can say which checkpoint lacks what."""
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=24)
    name = (synthetic.scale_name if dtype == "fp8" else synthetic.global_scale_name)(h.LAYER)
    h.drop_tensor(layout.directory, name)
    stock = h.build(config, ple_um_on=False)
    stock.load_weights(iter(h.delivered(layout.directory, "file")))
    with pytest.raises(ValueError, match="PLE checkpoint is missing its global scale"):
        _post_load(stock)
    mapped = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="without its global scale") as info:
        mapped.load_weights(iter(h.delivered(layout.directory, "file")))
    assert isinstance(info.value, ValueError)
    assert info.value.tensor == name and name in str(info.value)
    assert info.value.path in layout.files
    assert mapped.ngram_embedding.table is None


# vLLM: test_pinned_ple_post_load_validates_scale_without_staging
@pytest.mark.parametrize("requires_device_loading", [False, True])
@pytest.mark.parametrize("load_scale", [False, True])
def test_post_load_processing_validates_the_scale_in_place(
    world, patched, table_dir, tmp_path, monkeypatch, load_scale, requires_device_loading
):
    """vLLM's loader post-processing (``process_weights_after_loading`` of model_loader.utils) over a
    model holding the layer: it validates the global scale where it lies, stages the layer on the
    target device only when its method asks to, and leaves the weight where it was; for ple-um's
    layer as for stock's."""
    from vllm.model_executor.model_loader import utils as loader_utils

    config = h.text_config(dtype="fp8")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=25)
    drop = () if load_scale else ("ngram_embedding.weight_scale",)
    staging = loader_utils.device_loading_context
    for ple_um_on in (False, True):
        module = h.build(config, ple_um_on=ple_um_on)
        module.load_weights(iter(h.delivered(layout.directory, "file", drop=drop)))
        embedding = module.ngram_embedding
        assert not embedding.quant_method.requires_device_loading
        if requires_device_loading:
            monkeypatch.setattr(embedding.quant_method, "requires_device_loading", True, raising=False)
        staged = []

        def track(layer, device, staged=staged):
            staged.append(layer)
            return staging(layer, device)

        monkeypatch.setattr(loader_utils, "device_loading_context", track)
        model = torch.nn.Module()
        model.add_module("ple", module)
        model_config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization="fp8")
        weight = embedding.weight
        if load_scale:
            loader_utils.process_weights_after_loading(model, model_config, torch.device("cpu"))
        else:
            with pytest.raises(ValueError, match="missing its global scale"):
                loader_utils.process_weights_after_loading(model, model_config, torch.device("cpu"))
        assert embedding.weight is weight and weight.device.type == "cpu"
        assert staged == ([embedding] if requires_device_loading else [])
        if ple_um_on:
            assert embedding.weight.shape[0] == 0  # no table memory, staged or not
            embedding.close_table()


# vLLM: test_ple_fp8_embedding_dequantizes_in_ple_layer
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_dequantized_by_the_ple_layer(stock_and_mapped, table_dir, tmp_path, dtype):
    """The PLE layer dequantizes the n-gram layer's output through the embedding
    (``Qwen4ExpPLELayer._dequantize_embeddings``; only that outer owner is built with ``__new__``,
    as in vLLM's test): bit for bit stock's, and for FP8 vLLM's formula on the files' rows."""
    from torch import nn
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=26)
    stock, mapped = stock_and_mapped(config, layout.directory)
    token_ids, query_start_loc, ngram_context = h.inputs(3)
    outputs = []
    with torch.no_grad():
        ids = stock.compute_ngram_ids(token_ids, query_start_loc, ngram_context)
        for module in (stock, mapped):
            module.start_prefetch(token_ids, query_start_loc, ngram_context)
            raw = module(None, token_ids, query_start_loc, ngram_context)
            ple_layer = Qwen4ExpPLELayer.__new__(Qwen4ExpPLELayer)
            nn.Module.__init__(ple_layer)
            ple_layer.ple_embedding = module
            outputs.append(ple_layer._dequantize_embeddings(raw, torch.bfloat16))
    theirs, ours = outputs
    assert ours.dtype == torch.bfloat16 and ours.shape == (token_ids.shape[0], config.ple_embed_dim)
    assert h.same_bits(ours, theirs) and ours.any()
    rows = h.file_rows(layout, ids).flatten(-2)
    if dtype == "fp8":  # vLLM's FP8 dequantize: both in the output dtype, then the product
        rows = rows.to(torch.bfloat16) * torch.tensor(layout.scale).to(torch.bfloat16)
    assert h.same_bits(ours, rows)
