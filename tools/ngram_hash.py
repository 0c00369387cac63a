"""vLLM's own n-gram hash, which turns a request's tokens into PLE table rows: vLLM 0.33's
``Qwen4ExpNGramEmbedding.compute_ngram_ids``, on the real class built on the CPU with the released
model's configuration. vLLM and transformers are imported only when a hash is built.

The configuration (``released_config``): every value the hash reads is ``Qwen4ExpTextConfig``'s
default (transformers' ``models/qwen4_exp/configuration_qwen4_exp.py``, the version vLLM 0.33
installs) but two that it has no default for. ``eos_token_id`` (the token a request's n-grams are
padded with before its first token) is 248 044, ``<|endoftext|>``, the eos token of the Qwen3.5
tokenizer that transformers' AutoTokenizer gives the qwen4_exp model type (``Qwen3_5Tokenizer``).
``ple_embed_dim`` (the row width) does not enter the hash; it is set to one value per head so that
the table vLLM allocates on the CPU is small. The layer is the first PLE layer (dense id 0): its
table has 320 001 536 rows, the row count of the released checkpoint's table.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import tempfile

import numpy as np

from ple_um.bench.trace import Trace

EOS_TOKEN_ID = 248044
# What the hash reads from the configuration, and where each value comes from.
HASH_KEYS = (
    "vocab_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "seed",
)
DEFAULTS_FROM = (
    "the default of transformers' Qwen4ExpTextConfig (models/qwen4_exp/configuration_qwen4_exp.py)"
)
EOS_FROM = (
    "no Qwen4ExpTextConfig default; <|endoftext|>, the eos token of the Qwen3.5 tokenizer "
    "(transformers' Qwen3_5Tokenizer, AutoTokenizer's class for qwen4_exp)"
)
PREFIX = "model.layers.1.ple.ple_embedding"


def released_config(eos_token_id: int = EOS_TOKEN_ID):
    """The released model's Qwen4ExpTextConfig as far as the hash reads it: the defaults, the eos
    token, and a row width of one value per n-gram head."""
    from transformers import Qwen4ExpTextConfig

    defaults = Qwen4ExpTextConfig()
    heads = (defaults.ngram_size - 1) * defaults.heads_per_ngram
    return Qwen4ExpTextConfig(eos_token_id=eos_token_id, ple_embed_dim=heads)


class NGramHash:
    """vLLM's Qwen4ExpNGramEmbedding for ``config`` (``released_config()`` by default) and PLE
    layer ``layer`` (its dense id), built on the CPU in a gloo world of one rank (the current one
    where vLLM's model parallel state is already initialized). Owns the world it started and the
    module; ``close()`` (idempotent; also on leaving a ``with``) releases both."""

    def __init__(self, config=None, layer: int = 0) -> None:
        import torch
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state

        self.config = config if config is not None else released_config()
        self.layer = layer
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(
                set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
            )
            if not parallel_state.model_parallel_is_initialized():
                self._start_world(parallel_state)
            from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

            heads = (int(self.config.ngram_size) - 1) * int(self.config.heads_per_ngram)
            self.module = Qwen4ExpNGramEmbedding(
                self.config,
                int(self.config.ple_embed_dim),
                layer,
                1,
                data_parallel_rank=0,
                prefix=PREFIX,
                params_dtype=torch.bfloat16,
            )
        except BaseException:
            self._stack.close()
            raise
        self.heads = heads
        self.context_len = int(self.config.ngram_size) - 1
        self.eos = int(self.config.eos_token_id)
        # Row ids lie below hashed_rows; the table holds them padded to total_rows.
        self.hashed_rows = int(self.module.ngram_heads_offsets[-1] + self.module.ngram_heads_vocab_sizes[-1])
        self.total_rows = int(self.module.ngram_embedding.org_vocab_size)

    def _start_world(self, parallel_state) -> None:
        tmp = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="ple-um-ngram-hash-"))
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{os.path.join(tmp, 'dist_init')}",
            local_rank=0,
            backend="gloo",
        )
        self._stack.callback(parallel_state.destroy_distributed_environment)
        parallel_state.initialize_model_parallel(1, 1)
        self._stack.callback(parallel_state.destroy_model_parallel)

    def rows(self, tokens: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        """The table rows of one request's tokens, int64 [len, heads]: ``compute_ngram_ids`` of the
        tokens as one request, ``context`` (the tokens before them; eos ids by default, a request
        from its start) as its ngram_context."""
        import torch

        tokens = np.asarray(tokens, dtype=np.int64)
        if context is None:
            context = np.full(self.context_len, self.eos, dtype=np.int64)
        ids = self.module.compute_ngram_ids(
            torch.from_numpy(tokens),
            torch.tensor([0, tokens.size], dtype=torch.int64),
            torch.from_numpy(np.asarray(context, dtype=np.int64).reshape(1, self.context_len)),
        )
        return ids.numpy()

    def describe(self) -> dict:
        """The configuration the hash ran with: each value with where it comes from, the layer,
        the table's rows and the versions of vLLM and transformers."""
        values = {key: {"value": int(getattr(self.config, key)), "from": DEFAULTS_FROM} for key in HASH_KEYS}
        values["eos_token_id"] = {"value": self.eos, "from": EOS_FROM}
        values["ple_dense_layer_id"] = {"value": self.layer, "from": "the first PLE layer"}
        return {
            "function": f"{type(self.module).__module__}.Qwen4ExpNGramEmbedding.compute_ngram_ids",
            "values": values,
            "heads": self.heads,
            "layer_multipliers": [int(m) for m in self.module.layer_multipliers],
            "head_rows": [int(s) for s in self.module.ngram_heads_vocab_sizes],
            "head_offsets": [int(o) for o in self.module.ngram_heads_offsets],
            "hashed_rows": self.hashed_rows,
            "total_rows": self.total_rows,
            "vllm": importlib.metadata.version("vllm"),
            "transformers": importlib.metadata.version("transformers"),
        }

    def close(self) -> None:
        self.module = None
        self._stack.close()

    def __enter__(self) -> NGramHash:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def trace_of(requests, ngram_hash: NGramHash, description: dict) -> Trace:
    """The trace of ``requests`` (a sequence of ``(about, tokens)``: a dict naming the request's
    source and name, and its token ids), each request hashed from its start (eos context) by
    ``ngram_hash``; ``description`` is completed with the hash's configuration, the table's rows,
    the requests and the figures."""
    tokens, rows, offsets, about = [], [], [0], []
    for meta, ids in requests:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            continue
        if ids.min() < 0 or ids.max() >= int(ngram_hash.config.vocab_size):
            raise ValueError(
                f"request {meta}: token ids outside [0, vocab_size = {ngram_hash.config.vocab_size})"
            )
        tokens.append(ids.astype(np.uint32))
        rows.append(ngram_hash.rows(ids))
        offsets.append(offsets[-1] + ids.size)
        about.append(dict(meta, tokens=int(ids.size)))
    if not tokens:
        raise ValueError("no request has a token")
    dtype = np.uint32 if ngram_hash.total_rows <= 1 << 32 else np.int64
    trace = Trace(
        np.concatenate(tokens),
        np.concatenate(rows).astype(dtype),
        np.asarray(offsets, dtype=np.int64),
        np.full((len(tokens), ngram_hash.context_len), ngram_hash.eos, dtype=np.int64),
        dict(description, config=ngram_hash.describe(), total_rows=ngram_hash.total_rows, requests=about),
    )
    trace.description["figures"] = trace.figures()
    return trace


def request_of(trace: Trace, q: int) -> tuple[np.ndarray, np.ndarray]:
    """Request ``q`` of ``trace``: its tokens and their rows (``trace_of``'s inverse for one request)."""
    at = slice(trace.offsets[q], trace.offsets[q + 1])
    return trace.tokens[at], trace.rows[at]
