"""The entry point: SGLang's own ``load_plugins()`` finds it, and with PLE_UM=1 (only then) the hooks
are applied. The construction hooks: under PLE_UM every PLE table is ple-um's whatever the offload
flag says, with PLE_UM unset the layer is stock, and the prefetch stream follows PLE_UM_OVERLAP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

# Run by a fresh interpreter: SGLang's load_plugins() loads plugins once per process.
_CHILD = """
import json
from sglang.srt.models import qwen4_exp
from sglang.srt.model_loader.loader import DefaultModelLoader
from sglang.srt.plugins import load_plugins
load_plugins()
print(json.dumps({
    "offload_class": qwen4_exp.Qwen4ExpPinnedHostEmbedding.__name__,
    "wrapped": sorted(
        name
        for name, fn in [
            ("ngram_init", qwen4_exp.Qwen4ExpNGramEmbedding.__init__),
            ("ple_layer_init", qwen4_exp.Qwen4ExpPLELayer.__init__),
            ("load_weights", qwen4_exp.Qwen4ExpForConditionalGeneration.load_weights),
            ("weights_iterator", DefaultModelLoader._get_weights_iterator),
        ]
        if hasattr(fn, "__wrapped__")
    ),
}))
"""


def _child(ple_um: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PLE_UM", "VLLM_PLE_MMAP", "SGLANG_PLUGINS")}
    if ple_um:
        env["PLE_UM"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_entry_point_is_discovered():
    from ple_um.sglang.plugin import register

    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ple_um"]
    assert len(found) == 1 and found[0].value == "ple_um.sglang.plugin:register"
    assert found[0].load() is register


def test_load_plugins_applies_the_hooks_only_with_ple_um():
    assert _child(ple_um=True) == {
        "offload_class": "PleUmHostEmbedding",
        "wrapped": ["load_weights", "ngram_init", "ple_layer_init", "weights_iterator"],
    }
    assert _child(ple_um=False) == {"offload_class": "Qwen4ExpPinnedHostEmbedding", "wrapped": []}


def test_hooks_applied_in_this_process(sglang_world):
    """The session's load_plugins() (conftest) replaced the offload class wherever SGLang names it."""
    from sglang.srt.models import qwen4_exp

    from ple_um.sglang import plugin
    from ple_um.sglang.embedding import PleUmHostEmbedding, applied

    assert applied()
    assert qwen4_exp.Qwen4ExpPinnedHostEmbedding is PleUmHostEmbedding
    stock = [
        base for base in PleUmHostEmbedding.__mro__[1:] if base.__name__ == "Qwen4ExpPinnedHostEmbedding"
    ]
    assert len(stock) == 1 and stock[0].__module__ == qwen4_exp.__name__  # a subclass of the stock class
    assert plugin.register() == []  # idempotent


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
