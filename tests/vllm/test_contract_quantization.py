"""vLLM's own PLE quantization-method tests as ple-um's contract: under each quantization config
vLLM's tests use (Fp8, ModelOpt NVFP4 and mixed precision, INC, Quark, compressed-tensors, online
FP8), the real layer built with the plugin in effect selects the embedding method stock selects,
and serves where stock serves, bit for bit; where a config cannot be served it is refused as stock
refuses it, and where stock would convert the table's values on load (ple-um serves the files'
bytes as they lie, so it cannot), ple-um refuses, naming the dtypes and the cure.

Each test names the vLLM 0.33 test (``tests/models/qwen4_exp/test_ple.py``) whose behaviour it
checks; vLLM's tests call ``Qwen4ExpPLEEmbeddingMethod.from_quant_config`` alone, these build and
load the whole layer.
"""

from __future__ import annotations

import logging

import pytest
import torch
import vllm_harness as h

import ple_um

pytestmark = [pytest.mark.vllm, h.needs_vllm]

UNQUANTIZED = "Qwen4ExpPLEUnquantizedEmbeddingMethod"
FP8 = "Qwen4ExpPLEFp8EmbeddingMethod"
NVFP4 = "Qwen4ExpPLENvFp4EmbeddingMethod"
# The table each method serves: its storage dtype.
TABLE = {UNQUANTIZED: "bf16", FP8: "fp8", NVFP4: "nvfp4"}


def _prefix(layer: int) -> str:
    return f"model.layers.{layer}.ple.ple_embedding"


def _fp8(ignored=()):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    return Fp8Config(ignored_layers=list(ignored), weight_block_size=[128, 128])


def _modelopt_nvfp4(exclude=()):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    return ModelOptNvFp4Config(exclude_modules=list(exclude))


def _online_fp8():
    from vllm.config.quantization import QuantizationConfigArgs
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    return OnlineQuantizationConfig(QuantizationConfigArgs(linear="fp8_per_tensor"))


def _compressed_tensors():
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return CompressedTensorsConfig(
        target_scheme_map={"re:.*ngram_embedding": {"weights": QuantizationArgs(num_bits=8, type="int")}},
        ignore=[],
        quant_format="int-quantized",
    )


def _inc(extra_config):
    from vllm.model_executor.layers.quantization.inc import INCConfig

    return INCConfig(
        weight_bits=4, group_size=128, block_name_to_quantize="model.layers", extra_config=extra_config
    )


def _quark():
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

    return QuarkConfig({"exclude": [], "global_quant_config": {}})


def _mixed(exclude=(), layer_1="FP8", layer_2="NVFP4"):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    layers = {
        f"{_prefix(1)}.ngram_embedding": {"quant_algo": layer_1},
        f"{_prefix(2)}.ngram_embedding": {"quant_algo": layer_2},
        "model.layers.2.moe.gate_proj": {"quant_algo": "MXFP8"},
    }
    return ModelOptMixedPrecisionConfig.from_config(
        {
            "quantization": {
                "quant_algo": "MIXED_PRECISION",
                "exclude_modules": list(exclude),
                "group_size": 16,
                "quantized_layers": layers,
            }
        }
    )


EMBEDDING = f"{_prefix(1)}.ngram_embedding"
# (id, the vLLM test, the config, the layer built, ple_embedding_dtype, the method stock selects,
# whether vLLM warns that it falls back to an unquantized table)
SERVED = [
    (
        "fp8",
        "test_ple_fp8_embedding_respects_checkpoint_shard_exclusions",
        lambda: _fp8(),
        1,
        None,
        FP8,
        False,
    ),
    (
        "fp8-shard-excluded",
        "test_ple_fp8_embedding_respects_checkpoint_shard_exclusions",
        lambda: _fp8([f"{EMBEDDING}.shard_0"]),
        1,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "none",
        "test_ple_fp8_embedding_respects_checkpoint_shard_exclusions",
        lambda: None,
        1,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "modelopt-nvfp4",
        "test_ple_embedding_falls_back_for_unsupported_quantization_configs",
        _modelopt_nvfp4,
        1,
        None,
        UNQUANTIZED,
        True,
    ),
    (
        "online-fp8",
        "test_ple_embedding_falls_back_for_unsupported_quantization_configs",
        _online_fp8,
        1,
        None,
        UNQUANTIZED,
        True,
    ),
    (
        "compressed-tensors",
        "test_ple_embedding_falls_back_for_unsupported_quantization_configs",
        _compressed_tensors,
        1,
        None,
        UNQUANTIZED,
        True,
    ),
    (
        "modelopt-excluded",
        "test_ple_embedding_respects_modelopt_exclusion",
        lambda: _modelopt_nvfp4([EMBEDDING]),
        1,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "inc-16-bit",
        "test_ple_embedding_respects_inc_layer_config",
        lambda: _inc({".*ple.*": {"bits": 16, "data_type": "float"}}),
        1,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "inc-default",
        "test_ple_embedding_respects_inc_layer_config",
        lambda: _inc(None),
        1,
        None,
        UNQUANTIZED,
        True,
    ),
    ("quark", "test_ple_embedding_is_unquantized_under_quark", _quark, 1, None, UNQUANTIZED, False),
    (
        "dtype-over-modelopt-exclusion",
        "test_ple_embedding_dtype_overrides_modelopt_exclusion",
        lambda: _modelopt_nvfp4([EMBEDDING]),
        1,
        "float8_e4m3fn",
        FP8,
        False,
    ),
    ("mixed-fp8", "test_ple_fp8_embedding_supports_mixed_precision_config", _mixed, 1, None, FP8, False),
    (
        "mixed-nvfp4",
        "test_nvfp4_ple_resolves_from_mixed_precision_quantized_layers",
        _mixed,
        2,
        None,
        NVFP4,
        False,
    ),
    (
        "mixed-unlisted",
        "test_ple_fp8_embedding_supports_mixed_precision_config",
        _mixed,
        3,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "mixed-excluded",
        "test_ple_fp8_embedding_supports_mixed_precision_config",
        lambda: _mixed([EMBEDDING]),
        1,
        None,
        UNQUANTIZED,
        False,
    ),
    (
        "mixed-excluded-pattern",
        "test_ple_fp8_embedding_supports_mixed_precision_config",
        lambda: _mixed(["*.ngram_embedding"]),
        1,
        None,
        UNQUANTIZED,
        False,
    ),
]


@pytest.fixture
def fallbacks(monkeypatch, caplog):
    """The warnings vLLM's method selection logs (its logger routed to pytest, as vLLM's test does)."""
    from vllm.models.qwen4_exp.common import ngram_embedding

    test_logger = logging.getLogger("test.ple_fallback")
    monkeypatch.setattr(ngram_embedding, "logger", test_logger)
    caplog.set_level(logging.WARNING, logger=test_logger.name)
    return lambda: [r for r in caplog.records if "Falling back to unquantized PLE" in r.getMessage()]


@pytest.mark.parametrize(
    ("vllm_test", "make_config", "layer", "embedding_dtype", "method", "warns"),
    [case[1:] for case in SERVED],
    ids=[case[0] for case in SERVED],
)
def test_served_where_stock_serves(
    stock_and_mapped,
    table_dir,
    tmp_path,
    fallbacks,
    vllm_test,
    make_config,
    layer,
    embedding_dtype,
    method,
    warns,
):
    """Each case is the config of ``vllm_test``: the same method selected for both layers, and the
    table of that method's storage dtype served as stock serves it."""
    config = h.text_config(dtype="bf16", head_dim=h.NVFP4_HEAD_DIM)
    if embedding_dtype is not None:
        config.ple_embedding_dtype = embedding_dtype
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype=TABLE[method], layer=layer, seed=layer)
    stock, mapped = stock_and_mapped(
        config, layout.directory, quant_config=make_config(), prefix=_prefix(layer)
    )
    for module in (stock, mapped):
        assert type(module.ngram_embedding.embedding_method).__name__ == method
    assert len(fallbacks()) == (2 if warns else 0)
    assert mapped.ngram_embedding.table.layout.dtype == stock.ngram_embedding.weight.dtype
    for seed in (0, 1):
        raw_stock, deq_stock = h.forward(stock, seed)
        raw, deq = h.forward(mapped, seed)
        assert raw.view(torch.uint8).any()
        assert h.same_bits(raw, raw_stock) and h.same_bits(deq, deq_stock)


# vLLM: test_ple_fp8_embedding_supports_mixed_precision_config (its MXFP8 case)
def test_an_unsupported_quant_algo_is_refused_as_stock_refuses_it(world, patched):
    """A mixed-precision config giving the PLE layer a format no PLE method has: the real
    constructor raises vLLM's own error, with the plugin in effect as without it."""
    config = h.text_config(dtype="bf16", head_dim=h.NVFP4_HEAD_DIM)
    for ple_um_on in (False, True):
        with pytest.raises(ValueError, match="Unsupported quant_algo 'MXFP8'"):
            h.build(config, ple_um_on=ple_um_on, quant_config=_mixed(layer_2="MXFP8"), prefix=_prefix(2))


# vLLM: test_ple_embedding_falls_back_for_unsupported_quantization_configs (a table it falls back on)
@pytest.mark.parametrize(
    "make_config", [_modelopt_nvfp4, _compressed_tensors, _quark], ids=["modelopt", "ct", "quark"]
)
def test_an_fp8_table_under_a_config_that_falls_back_is_refused_as_stock_refuses_it(
    world, patched, table_dir, tmp_path, make_config
):
    """The config selects the unquantized method, the checkpoint is FP8: its global scale has no
    parameter to load into, and vLLM's own loader refuses both layers in the same words."""
    config = h.text_config(dtype="bf16")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype="fp8")
    for ple_um_on in (False, True):
        module = h.build(config, ple_um_on=ple_um_on, quant_config=make_config())
        assert type(module.ngram_embedding.embedding_method).__name__ == UNQUANTIZED
        with pytest.raises(ValueError, match="no module or parameter named 'ngram_embedding.weight_scale'"):
            h.load(module, layout.directory)


def test_a_16_bit_table_under_an_fp8_config_is_refused(world, patched, table_dir, tmp_path):
    """ple-um differs from stock on purpose here. Stock copies the checkpoint's rows into its own
    parameter, casting them to the method's dtype: a BF16 table under an FP8 config is cast to FP8
    before vLLM notices the missing scale. ple-um serves the files' rows and does not quantize
    them: it refuses at load, naming the table's dtype, the method and the cure, and serves nothing.
    A 16-bit table under another 16-bit model dtype ple-um serves cast as stock casts it
    (``test_a_16_bit_table_under_another_model_dtype_is_served_as_stock_casts_it``)."""
    config = h.text_config(dtype="bf16")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype="bf16")
    stock = h.build(config, ple_um_on=False, quant_config=_fp8())
    with pytest.raises(ValueError, match="missing its global scale"):
        h.load(stock, layout.directory)
    mapped = h.build(config, ple_um_on=True, quant_config=_fp8())
    with pytest.raises(ple_um.CheckpointError, match="stored as BF16") as info:
        h.load(mapped, layout.directory)
    message = str(info.value)
    assert type(mapped.ngram_embedding.embedding_method).__name__ in message and "a 16-bit table" in message
    assert mapped.ngram_embedding.table is None
