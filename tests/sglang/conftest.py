"""SGLang integration tests: real SGLang 0.5.23 on the CPU, skipped only when it is not installed.

One gloo world of one rank (``sglang.test.layer_ut_utils.init_single_process_dist``) serves every
in-process test of this folder, and SGLang's own ``load_plugins()`` loads the plugin once, with
PLE_UM=1, through its entry point (``sglang_world``). Each model is built and loaded by SGLang's
real ``DefaultModelLoader`` from a tiny Qwen4Exp config written next to a synthetic checkpoint:
stock when PLE_UM is unset at build time, ple-um when it is set.

The tests model a CPU-only host, whose only mode is ``cpu`` (the Triton interpreter's variable is
dropped, as for the vLLM tests); a test that wants the kernel path sets it again.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import socket
from types import SimpleNamespace

import pytest
import torch

from ple_um.checkpoint import read_layout

HERE = pathlib.Path(__file__).parent
NEEDS_SGLANG = (
    "SGLang 0.5.23 is not installed: pip install -e '.[test,sglang]' (CI runs these tests in its SGLang venv)"
)
ROWS = 240  # the n-gram vocabulary of the tiny config: primes 53 + 59 + 61 + 67, padded to 8
PLE_LAYER = 1  # decoder layer 1 (ple_layer_ids=[2]): checkpoint names layers.1.ple...
PARTS = 4  # split_ngram_parts


def ngram_rows(vocab_base: int, heads: int = 4, divisible_by: int = 8) -> int:
    """The table's rows for an n-gram vocabulary base, as SGLang sizes it: the sum of the ``heads``
    primes that follow ``vocab_base - 1``, padded to ``divisible_by``."""
    import sympy

    total, prime = 0, vocab_base - 1
    for _ in range(heads):
        prime = int(sympy.nextprime(prime))
        total += prime
    return -(-total // divisible_by) * divisible_by


def text_config(row_dim: int, **overrides) -> dict:
    """A Qwen4Exp text config small enough for the CPU; the PLE rows are ``row_dim`` wide."""
    config = dict(
        model_type="qwen4_exp_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "linear_attention"],
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        hc_lowrank=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        vocab_size=128,
        eos_token_id=0,
        ple_layer_ids=[PLE_LAYER + 1],
        ple_embed_dim=4 * row_dim,  # (ngram_size - 1) * heads_per_ngram heads of row_dim
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=PARTS,
    )
    config.update(overrides)
    return config


def pytest_collection_modifyitems(config, items):
    """Without SGLang every test of this folder is skipped, saying why (nothing here imports SGLang
    before a test runs). Asked of the installed distributions: with ``tests/`` on ``sys.path`` (the
    root conftest), this folder itself would pass for an ``sglang`` namespace package."""
    try:
        importlib.metadata.distribution("sglang")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    skip = pytest.mark.skip(reason=NEEDS_SGLANG)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="free_port")
def free_port_fixture():
    """``free_port()``: a free TCP port on the loopback (gloo's rendezvous)."""
    return free_port


@pytest.fixture(scope="session")
def sglang_world():
    """The gloo world and the plugin, loaded by SGLang's ``load_plugins()`` with PLE_UM=1."""
    from sglang.srt.plugins import load_plugins
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=free_port(), backend="gloo")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PLE_UM", "1")
        load_plugins()


@pytest.fixture(autouse=True)
def _cpu_only_host(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def key_proj_shape(row_dim: int) -> tuple[int, int]:
    """The PLE layer's key_proj weight: hidden_size * hc_count outputs, ple_embed_dim inputs."""
    return 64 * 4, 4 * row_dim


@pytest.fixture
def sglang_checkpoint(make_checkpoint):
    """``sglang_checkpoint(dtype=..., seed=..., shards=PARTS, files=2, num_rows=None, **config)`` ->
    (directory, layout, key_proj): a synthetic checkpoint (``ple_um.synthetic.write_checkpoint``) of the
    config's rows (or ``num_rows``), made loadable by SGLang: a config.json of the tiny model, the FP8
    scale as SGLang loads it ([1], not []), and in place of the synthetic unrelated tensor the PLE
    layer's key_proj weight (random bf16), which shares its file with table shards."""
    import safetensors.torch as st

    def make(dtype="fp8", *, seed=0, shards=PARTS, files=2, num_rows=None, **config):
        row_dim = 16 if dtype == "nvfp4" else 8
        rows = ngram_rows(config["ngram_vocab_size_base"]) if "ngram_vocab_size_base" in config else ROWS
        rows = rows if num_rows is None else num_rows
        layout = make_checkpoint(
            num_rows=rows,
            row_dim=row_dim,
            dtype=dtype,
            shards=shards,
            files=files,
            layer=PLE_LAYER,
            seed=seed,
        )
        directory = layout.directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        index = json.load(open(index_path))
        unrelated = next(n for n in index["weight_map"] if n.endswith("embed_tokens.weight"))
        path = os.path.join(directory, index["weight_map"].pop(unrelated))
        tensors = st.load_file(path)
        del tensors[unrelated]
        for name in list(tensors):
            if name.endswith("ngram_embedding.weight_scale") and tensors[name].dim() == 0:
                tensors[name] = tensors[name].reshape(1)
        key_name = f"model.language_model.layers.{PLE_LAYER}.ple.key_proj.weight"
        generator = torch.Generator().manual_seed(seed)
        key_proj = torch.randn(key_proj_shape(row_dim), generator=generator).to(torch.bfloat16)
        tensors[key_name] = key_proj
        st.save_file(tensors, path, metadata={"format": "pt"})
        index["weight_map"][key_name] = os.path.basename(path)
        json.dump(index, open(index_path, "w"))
        hf_config = {
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "language_model_only": True,
            "torch_dtype": "bfloat16",
            "text_config": text_config(row_dim, **config),
        }
        json.dump(hf_config, open(os.path.join(directory, "config.json"), "w"))
        return directory, read_layout(directory, PLE_LAYER), key_proj

    return make


@pytest.fixture
def load_model(sglang_world, monkeypatch):
    """``load_model(directory, ple_um=..., **model_loader_extra_config)``: the model as SGLang's
    DefaultModelLoader builds and loads it on the CPU. Tables opened are closed at the test's end
    (the models in ``load_model.models``)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from ple_um.sglang.embedding import PleUmHostEmbedding

    models = []

    def load(directory, *, ple_um: bool, **extra):
        with monkeypatch.context() as env:
            if ple_um:
                env.setenv("PLE_UM", "1")
            else:
                env.delenv("PLE_UM", raising=False)
            model_config = ModelConfig(directory, language_model_only=True)
            loader = get_model_loader(
                load_config=LoadConfig(model_loader_extra_config=extra), model_config=model_config
            )
            model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
        models.append(model)
        return model

    load.models = models  # a test that drops a model takes it out first
    yield load
    for model in models:
        for module in model.modules():
            if isinstance(module, PleUmHostEmbedding):
                module.close_table()


@pytest.fixture
def tiny():
    """The tiny model's facts: ``rows`` (the table's), ``layer`` (the PLE decoder layer), ``parts``
    (split_ngram_parts), ``ngram(model)`` (its Qwen4ExpNGramEmbedding, the table in
    ``.ngram_embedding``), ``key_proj_shape(row_dim)``, ``text_config(row_dim, **overrides)``."""
    return SimpleNamespace(
        rows=ROWS,
        layer=PLE_LAYER,
        parts=PARTS,
        ngram=lambda model: model.model.layers[PLE_LAYER].ple.ple_embedding,
        key_proj_shape=key_proj_shape,
        text_config=text_config,
    )


@pytest.fixture
def file_rows():
    """``file_rows(layout)``: the table's rows as the safetensors package reads them, [rows, width]."""
    from safetensors import safe_open

    def read(layout, specs=None):
        parts = []
        for spec in specs or layout.shards:
            with safe_open(spec.path, framework="pt") as f:
                parts.append(f.get_tensor(spec.tensor).clone())
        return torch.cat(parts)

    return read
