"""tools/ngram_hash.py: vLLM's own n-gram hash of the trace's tokens. The committed sample's rows
recomputed from its tokens, the hash's configuration, and ``trace_of``, which tools/make_trace.py
writes the sample with."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from ple_um.bench.trace import read_trace, sample_path

RELEASED_ROWS = 320001536  # the released checkpoint's table (README: rows [0, 160000768) of 320001536)


def _vllm_installed() -> bool:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_vllm = pytest.mark.skipif(
    not _vllm_installed(), reason="vLLM is not installed: pip install -e '.[vllm]'"
)


@pytest.fixture(scope="module")
def sample():
    return read_trace(sample_path())


@pytest.fixture(scope="module")
def ngram_hash():
    from ngram_hash import NGramHash

    with NGramHash() as h:
        yield h


@pytest.mark.vllm
@needs_vllm
def test_the_sample_rows_are_vllms_own_hash_of_its_tokens(sample, ngram_hash):
    """Every row of the sample recomputed with vLLM's compute_ngram_ids from the sample's tokens
    and each window's context."""
    assert ngram_hash.total_rows == sample.total_rows == RELEASED_ROWS
    assert ngram_hash.describe()["values"] == sample.description["config"]["values"]
    from ngram_hash import request_of

    for q in range(sample.num_requests):
        tokens, rows = request_of(sample, q)
        got = ngram_hash.rows(tokens, sample.context[q])
        np.testing.assert_array_equal(got, rows.astype(np.int64), err_msg=f"window {q}")


@pytest.mark.vllm
@needs_vllm
def test_the_hash_uses_the_config_defaults(ngram_hash):
    from ngram_hash import EOS_TOKEN_ID, HASH_KEYS
    from transformers import Qwen4ExpTextConfig

    defaults = Qwen4ExpTextConfig()
    for key in HASH_KEYS:
        assert getattr(ngram_hash.config, key) == getattr(defaults, key), key
    assert ngram_hash.eos == EOS_TOKEN_ID and ngram_hash.heads == 16
    about = ngram_hash.describe()
    assert about["hashed_rows"] <= about["total_rows"] == RELEASED_ROWS
    assert about["head_offsets"][0] == 0 and len(about["head_rows"]) == 16


@pytest.mark.vllm
@needs_vllm
def test_trace_of_hashes_each_request_from_its_start_as_a_server_does(ngram_hash):
    """A few hundred tokens in requests of 1 to 120 tokens (eos tokens inside one): the trace's rows
    equal vLLM's hash of all the requests packed in one batch, and of each request fed in chunks
    and one token at a time with the context vLLM's model state gives (the tokens before, eos
    before the start)."""
    import torch
    from ngram_hash import request_of, trace_of

    rng = np.random.default_rng(3)
    lengths = [1, 2, 120, 37, 3, 90, 64]
    requests = [({"source": "s", "name": f"r{q}"}, rng.integers(0, 248320, n)) for q, n in enumerate(lengths)]
    requests[2][1][[5, 6, 50]] = ngram_hash.eos
    trace = trace_of(requests, ngram_hash, {"made_by": "test"})
    assert trace.num_requests == len(lengths) and list(trace.request_lengths()) == lengths
    assert (trace.context == ngram_hash.eos).all() and trace.total_rows == RELEASED_ROWS
    assert [r["name"] for r in trace.description["requests"]] == [f"r{q}" for q in range(len(lengths))]
    assert trace.description["figures"]["tokens"] == sum(lengths)
    packed = ngram_hash.module.compute_ngram_ids(
        torch.from_numpy(np.concatenate([ids for _, ids in requests])),
        torch.from_numpy(trace.offsets),
        torch.full((len(lengths), 2), ngram_hash.eos, dtype=torch.int64),
    ).numpy()
    np.testing.assert_array_equal(trace.rows.astype(np.int64), packed)
    for q, (_, ids) in enumerate(requests):
        want = request_of(trace, q)[1].astype(np.int64)
        for chunk in (1, int(rng.integers(2, 50))):
            got = []
            for s in range(0, ids.size, chunk):
                before = np.concatenate([np.full(2, ngram_hash.eos), ids[:s]])[-2:]
                got.append(ngram_hash.rows(ids[s : s + chunk], before))
            np.testing.assert_array_equal(
                np.concatenate(got), want, err_msg=f"request {q}, chunks of {chunk}"
            )


@pytest.mark.vllm
@needs_vllm
def test_trace_of_refuses_tokens_outside_the_vocabulary(ngram_hash):
    from ngram_hash import trace_of

    with pytest.raises(ValueError, match="outside"):
        trace_of([({"name": "x"}, [1, 248320])], ngram_hash, {})
    with pytest.raises(ValueError, match="no request"):
        trace_of([({"name": "x"}, [])], ngram_hash, {})
