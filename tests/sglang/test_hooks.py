"""The construction hooks: under PLE_UM every PLE table is ple-um's whatever the offload flag says,
with PLE_UM unset the layer is stock, and the prefetch stream follows PLE_UM_OVERLAP."""

from __future__ import annotations

import pytest
import torch


def _ngram(tiny, monkeypatch, *, ple_um: bool, **config):
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding

    text = Qwen4ExpTextConfig(**{k: v for k, v in tiny.text_config(8, **config).items() if k != "model_type"})
    with monkeypatch.context() as env:
        if ple_um:
            env.setenv("PLE_UM", "1")
        else:
            env.delenv("PLE_UM", raising=False)
        prefix = f"model.layers.{tiny.layer}.ple.ple_embedding"
        return text, Qwen4ExpNGramEmbedding(text, 32, ple_layer_index=0, prefix=prefix)


@pytest.mark.parametrize("offload", [False, True])
def test_ple_um_builds_its_table_whatever_the_offload_flag(offload, sglang_world, tiny, monkeypatch):
    from ple_um.sglang.embedding import PleUmHostEmbedding

    config, ng = _ngram(tiny, monkeypatch, ple_um=True, ple_offload_embedding=offload)
    table = ng.ngram_embedding
    assert isinstance(table, PleUmHostEmbedding)
    assert config.ple_offload_embedding is offload  # the config is left as it was
    assert table.layer == tiny.layer and table.split_ngram_parts == tiny.parts
    assert table.prefix == f"model.layers.{tiny.layer}.ple.ple_embedding.ngram_embedding"
    assert table.weight.shape == (0, 8) and table.weight.device.type == "cpu"
    assert table.owned_rows == (0, tiny.rows) and table.table is None
    with pytest.raises(RuntimeError, match="the table is not open: the model.s load_weights has not run"):
        table.gather(torch.zeros(2, 4, dtype=torch.long))


def test_without_ple_um_the_layer_is_stock(sglang_world, tiny, monkeypatch):
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    _, ng = _ngram(tiny, monkeypatch, ple_um=False)
    assert type(ng.ngram_embedding) is VocabParallelEmbedding


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_prefetch_stream_follows_overlap(overlap, sglang_world, tiny, monkeypatch):
    """On a CPU device there is no side stream (SGLang's PLE layer then looks up in its forward); on a
    CUDA device one exists only with PLE_UM_OVERLAP."""
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.models.qwen4_exp import Qwen4ExpPLELayer

    monkeypatch.setenv("PLE_UM", "1")
    monkeypatch.setenv("PLE_UM_OVERLAP", overlap)
    text = Qwen4ExpTextConfig(**{k: v for k, v in tiny.text_config(8).items() if k != "model_type"})
    layer = Qwen4ExpPLELayer(text, prefix=f"model.layers.{tiny.layer}.ple", layer_id=tiny.layer)
    assert layer._prefetch_stream is None
    table = layer.ple_embedding.ngram_embedding
    table.device = torch.device("cuda", 0)  # the rule as a CUDA layer applies it (no stream is made here)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("stream", device))
    assert table.prefetch_stream(None) == (("stream", table.device) if overlap == "1" else None)
    assert table.prefetch_stream("stock's") == ("stock's" if overlap == "1" else None)
