"""Building vLLM 0.33's real Qwen4ExpNGramEmbedding on the CPU, loading it through its real
``load_weights`` from a synthetic checkpoint, and running its forward.

Shared by the single-process tests (one distributed world per session, see conftest.py) and the
two-rank worker (``two_rank_worker.py``), which import it by file name. Not a test module.
(No ``__init__.py`` in this folder: ``tests/`` is on sys.path, and a package named ``vllm`` there
would shadow vLLM itself.)
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
from collections.abc import Iterator

import pytest
import torch

from ple_um import synthetic


def _vllm_installed() -> bool:
    """Whether the vLLM distribution is installed (``find_spec("vllm")`` would also find this
    folder, tests/vllm, as a namespace package once tests/ is on sys.path)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_vllm = pytest.mark.skipif(
    not _vllm_installed(),
    reason="vLLM is not installed: pip install 'ple-um[vllm]' (vLLM 0.33) to run the vLLM tests",
)

LAYER = 1  # checkpoint layer index: "...layers.1.ple..."
PREFIX = f"model.layers.{LAYER}.ple.ple_embedding"
HEADS = 16  # (ngram_size - 1) * heads_per_ngram with the config defaults 3 and 8
HEAD_DIM = 8
NVFP4_HEAD_DIM = 32  # NVFP4 rows hold blocks of 16 values: two blocks a row
PARTS = 7  # 1280 rows -> shards of 183, the last 182: boundaries fall inside ETP ranges
VOCAB = 97
EOS = 2


# Table dtypes as the tests name them -> the config's ple_embedding_dtype (None: the model dtype).
EMBEDDING_DTYPES = {"fp8": "float8_e4m3fn", "bf16": None, "nvfp4": "nvfp4"}
# Per table dtype: the layer's global-scale parameter, and the shard tensors per shard (the rows,
# and NVFP4's block scales).
GLOBAL_SCALE = {"fp8": "weight_scale", "bf16": None, "nvfp4": "weight_scale_2"}
PER_SHARD = {"fp8": 1, "bf16": 1, "nvfp4": 2}


def text_config(
    *, fp8: bool = False, dtype: str | None = None, parts: int = PARTS, head_dim: int | None = None
):
    """A small Qwen4ExpTextConfig: 1280 n-gram rows of ``head_dim`` elements in ``parts`` shards.

    ``dtype`` ("fp8", "bf16", "nvfp4"; default "fp8" when ``fp8`` else "bf16") sets
    ``ple_embedding_dtype``, which is how vLLM picks the PLE embedding method (Fp8 / NvFp4, or
    unquantized); ``head_dim`` defaults to HEAD_DIM, NVFP4_HEAD_DIM for NVFP4.
    """
    from transformers import Qwen4ExpTextConfig

    dtype = dtype or ("fp8" if fp8 else "bf16")
    if head_dim is None:
        head_dim = NVFP4_HEAD_DIM if dtype == "nvfp4" else HEAD_DIM
    config = Qwen4ExpTextConfig(
        eos_token_id=EOS,
        vocab_size=VOCAB,
        ngram_vocab_size_base=40,
        split_ngram_parts=parts,
        ple_embed_dim=HEADS * head_dim,
    )
    if EMBEDDING_DTYPES[dtype] is not None:
        config.ple_embedding_dtype = EMBEDDING_DTYPES[dtype]
    return config


def table_dtype(config) -> str:
    """The table dtype ("fp8", "bf16", "nvfp4") ``config`` asks for."""
    wanted = getattr(config, "ple_embedding_dtype", None)
    return next(name for name, value in EMBEDDING_DTYPES.items() if value == wanted)


def head_dim(config) -> int:
    return config.ple_embed_dim // HEADS


def table_rows(config, dense_id: int = 0) -> int:
    """Rows of the table of the PLE layer of dense index ``dense_id`` (the n-gram vocabulary padded
    as vLLM pads it)."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.utils.math_utils import round_up

    heads = (config.ngram_size - 1) * config.heads_per_ngram
    _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=config.ngram_vocab_size_base, ngram_heads=heads, ple_dense_layer_id=dense_id
    )
    return round_up(total, config.make_ngram_vocab_size_divisible_by)


def write_table(directory, config, *, fp8: bool | None = None, seed: int = 0, **overrides):
    """A synthetic checkpoint for ``config``'s PLE layer, in the dtype ``config`` asks for (``fp8``:
    FP8 or BF16 instead); ``overrides`` change write_checkpoint args."""
    args = dict(
        num_rows=table_rows(config),
        row_dim=head_dim(config),
        dtype=table_dtype(config) if fp8 is None else ("fp8" if fp8 else "bf16"),
        shards=config.split_ngram_parts,
        layer=LAYER,
        seed=seed,
    )
    args.update(overrides)
    return synthetic.write_checkpoint(directory, **args)


@contextlib.contextmanager
def vllm_world(tmp_dir: str, *, world_size: int = 1, rank: int = 0, vllm_config=None) -> Iterator[object]:
    """A current VllmConfig (CPU device) and an initialized gloo world of ``world_size`` with
    tensor parallelism over all ranks (so the embedding-parallel group spans them too)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = vllm_config or VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=f"file://{os.path.join(tmp_dir, 'dist_init')}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(world_size, 1)
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@contextlib.contextmanager
def _ple_um_env(on: bool) -> Iterator[None]:
    previous = os.environ.get("PLE_UM")
    os.environ["PLE_UM"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PLE_UM"]
        else:
            os.environ["PLE_UM"] = previous


def modelopt_mixed(algo: str):
    """A ModelOpt MIXED_PRECISION quantization config that quantizes the PLE layer with ``algo``
    ("NVFP4" or "FP8"): the other way vLLM picks the PLE embedding method (no ple_embedding_dtype)."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    layers = {f"{PREFIX}.ngram_embedding": {"quant_algo": algo, "group_size": 16}}
    return ModelOptMixedPrecisionConfig.from_config(
        {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    )


def build(
    config,
    *,
    ple_um_on: bool,
    max_tokens: int = 256,
    params_dtype: torch.dtype = torch.bfloat16,
    quant_config=None,
    prefix: str = PREFIX,
    data_parallel_rank: int = 0,
    use_sequence_parallel: bool = False,
    dense_id: int = 0,
):
    """The real (NVIDIA) Qwen4ExpNGramEmbedding of the PLE layer of dense index ``dense_id``; the
    patched constructor builds the ple-um backend when PLE_UM is set, the stock device backend
    otherwise. ``use_sequence_parallel`` (with the
    embedding-parallel group equal to the TP group, as here) makes the embedding return its rank's
    partial rows unreduced, as vLLM's sequence-parallel decoder builds it."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    with _ple_um_env(ple_um_on):
        return Qwen4ExpNGramEmbedding(
            config,
            config.ple_embed_dim,
            dense_id,
            max_tokens,
            data_parallel_rank=data_parallel_rank,
            prefix=prefix,
            quant_config=quant_config,
            params_dtype=params_dtype,
            use_sequence_parallel=use_sequence_parallel,
        )


def build_amd(config, *, ple_um_on: bool, max_tokens: int = 256):
    """The ROCm variant (vllm.models.qwen4_exp.amd.ple_layer), whose constructor differs."""
    from vllm.models.qwen4_exp.amd.ple_layer import Qwen4ExpNGramEmbedding

    with _ple_um_env(ple_um_on):
        return Qwen4ExpNGramEmbedding(
            config,
            config.ple_embed_dim,
            0,
            max_tokens,
            PREFIX,
            PREFIX.rpartition(".")[0],
            data_parallel_rank=0,
            quant_config=None,
            params_dtype=torch.bfloat16,
        )


def stock(config, directory, **build_args):
    """The layer with the stock device backend, loaded from ``directory``."""
    module = build(config, ple_um_on=False, **build_args)
    load(module, directory)
    return module


def mapped(config, directory, **build_args):
    """The layer with the ple-um backend, loaded from ``directory``."""
    module = build(config, ple_um_on=True, **build_args)
    load(module, directory)
    return module


def drop_tensor(directory, name: str) -> None:
    """Rewrite the checkpoint file holding ``name`` without it, and the index without its entry."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    path = os.path.join(directory, index["weight_map"].pop(name))
    with safe_open(path, framework="pt") as f:
        kept = {key: f.get_tensor(key).clone() for key in f.keys() if key != name}  # noqa: SIM118
    save_file(kept, path, metadata={"format": "pt"})
    with open(index_path, "w") as f:
        json.dump(index, f)


def checkpoint_weights(
    directory, layer: int = LAYER, *, model=None, whole_files: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Decoder layer ``layer``'s tensors as vLLM's default loader yields them (its safetensors
    iterator: lazy views of the files), named as Qwen4ExpNGramEmbedding.load_weights receives them.
    With ``model``, only the files vLLM's file filter keeps, fed the patched model class's
    ``is_unused_checkpoint_weight`` for ``model`` (as ``DefaultModelLoader`` loads a model from its
    files); with ``whole_files``, each tensor read into memory, as its whole-file loaders (eager,
    multi-thread, fastsafetensors) deliver them."""
    from vllm.model_executor.model_loader.weight_utils import (
        filter_safetensors_files_by_weight_name,
        safetensors_weights_iterator,
    )

    prefix = f"{synthetic.PREFIX}layers.{layer}.ple.ple_embedding."
    files = sorted(glob.glob(os.path.join(os.fspath(directory), "*.safetensors")))
    if model is not None:
        from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

        unused = qwen4_exp_model.Qwen4ExpForConditionalGeneration.is_unused_checkpoint_weight
        files = filter_safetensors_files_by_weight_name(files, lambda name: unused(model, name))
    for name, tensor in safetensors_weights_iterator(files, False):
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor.clone() if whole_files else tensor


def delivered(directory, delivery: str, drop: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """The layer's checkpoint tensors as vLLM's iterator yields them (``file``: lazy views of the
    files) or copied into memory (``memory``: a reload, a weight sync), less ``drop``."""
    weights = [(name, t) for name, t in checkpoint_weights(directory) if name not in drop]
    return [(name, t.clone()) for name, t in weights] if delivery == "memory" else weights


def streamed_nvfp4(directory, delivery: str) -> list[tuple[str, torch.Tensor]]:
    """An NVFP4 layer's tensors in the order vLLM's streaming test delivers them: shards out of
    order, each shard's block scales before its rows, the global scale last."""
    tensors = dict(delivered(directory, delivery))
    order = []
    for shard in (2, 0, 1, 6, 3, 5, 4):
        order += [f"ngram_embedding.shard_{shard}.weight_scale", f"ngram_embedding.shard_{shard}.weight"]
    order.append("ngram_embedding.weight_scale_2")
    assert sorted(order) == sorted(tensors), "the checkpoint is not PARTS NVFP4 shards"
    return [(name, tensors[name]) for name in order]


def load_in_calls(module, weights, per_call: int = 3) -> set[str]:
    """``weights`` through ``per_call`` tensors a load_weights call; the names the calls loaded."""
    loaded: set[str] = set()
    for start in range(0, len(weights), per_call):
        loaded |= module.load_weights(iter(weights[start : start + per_call]))
    return loaded


def load(module, directory) -> set[str]:
    """Load through the real load_weights, then vLLM's post-load processing of the embedding."""
    layer = int(re.findall(r"layers\.(\d+)\.", module.ngram_embedding.prefix)[-1])
    loaded = module.load_weights(checkpoint_weights(directory, layer))
    embedding = module.ngram_embedding
    embedding.quant_method.process_weights_after_loading(embedding)
    return loaded


def inputs(seed: int, *, tokens: int = 61, requests: int = 3):
    """Token ids, query_start_loc and ngram_context for ``requests`` requests, eos included."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    ids[ids % 11 == 0] = EOS
    cuts = torch.randperm(tokens - 1, generator=g)[: requests - 1].add(1).sort().values
    query_start_loc = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).to(torch.int32)
    ngram_context = torch.randint(0, VOCAB, (requests, 2), generator=g)
    return ids, query_start_loc, ngram_context


def forward(module, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw rows as the layer returns them, dequantized to ``dtype`` as the PLE layer does)."""
    ids, query_start_loc, ngram_context = inputs(seed)
    with torch.no_grad():
        # As Qwen4Exp's model does, one decoder layer ahead (a no-op where it is not supported).
        module.start_prefetch(ids, query_start_loc, ngram_context)
        raw = module(None, ids, query_start_loc, ngram_context)
        return raw, module.ngram_embedding.dequantize(raw, dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port nothing listens on now (for vLLM's data-parallel group, which starts over TCP)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(worker: str, tmp, *args: str) -> list[dict]:
    """Run ``worker RANK 2 TMP ARGS...`` as two processes (ranks 0 and 1 of one gloo world) and
    return what each wrote to ``TMP/rank<R>.pt``; a rank that fails fails the caller with its log."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PLE_UM_DIR", "VLLM_PLE_MMAP_DIR")}
    # The stock masked lookup is a torch.compile(inductor) function: compiling it on the CPU costs
    # more than the rest of the test, and eager integer masking is the same computation.
    env["TORCHDYNAMO_DISABLE"] = "1"
    # The workers import the ple_um under test (this checkout's), not whichever one is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), "2", str(tmp), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        logs.append(out)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    return [torch.load(os.path.join(tmp, f"rank{rank}.pt"), weights_only=False) for rank in range(2)]


def file_rows(layout, ids, rows: tuple[int, int] | None = None, params_dtype=torch.bfloat16) -> torch.Tensor:
    """What the layer's lookup of ``ids`` must return, read from the files by the tests' reference
    readers: ``ids.shape + (row_dim,)``, raw in the storage dtype (FP8, BF16), or for NVFP4 decoded
    to ``params_dtype``; zeros for ids outside the table and outside ``rows``."""
    import numpy as np
    from helpers.reference import reference_nvfp4, reference_rows

    ids = ids.cpu() if isinstance(ids, torch.Tensor) else ids
    if layout.is_nvfp4:
        return reference_nvfp4(layout, ids, rows, out_dtype=params_dtype)
    data = reference_rows(layout, ids, rows)
    raw = torch.zeros(data.shape, dtype=torch.uint8)  # (from_numpy of an empty array cannot be viewed)
    raw.numpy()[...] = data
    return raw.view(layout.dtype).reshape(*np.shape(np.asarray(ids)), layout.row_dim)
