"""vLLM's own PLE lookup tests as ple-um's contract, on one rank: padded and empty ids, the prefetch
hook (``finalize_prefetch`` with and without the reduce, without a prior ``start_prefetch``, its
buffer allocated lazily, prefetch ids that outlive ``start_prefetch``).

vLLM 0.33's ``tests/models/qwen4_exp/test_ple.py`` builds the stock backends with ``__new__`` and
asserts on their internals, so it cannot run against ple-um as it is. Each test here names the vLLM
test whose behaviour it checks, builds the real layer the way vLLM's model does (real constructor,
real ``load_weights``, the plugin in effect) and compares ple-um with the stock device backend on
one synthetic checkpoint, bit for bit, and with the rows read from the files. The two-rank halves
are in ``test_contract_two_ranks.py``; the graph replays of padded and empty ids run on a GPU in
``tests/gpu/test_gpu_vllm_contract.py``.
"""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

pytestmark = [pytest.mark.vllm, h.needs_vllm]


@pytest.fixture(params=["fp8", "bf16", "nvfp4"])
def loaded(request, stock_and_mapped, table_dir, tmp_path):
    """(layout, stock, mapped) for one table dtype, both loaded from one checkpoint."""
    config = h.text_config(dtype=request.param)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=13)
    return (layout, *stock_and_mapped(config, layout.directory))


def _ids(layout, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, layout.num_rows, (tokens, h.HEADS), generator=torch.Generator().manual_seed(seed))


def _prefetched(module, ids: torch.Tensor) -> torch.Tensor:
    backend = module.ngram_embedding
    backend.start_prefetch(ids)
    return backend.finalize_prefetch(ids.shape[0])


# vLLM: test_nvfp4_ple_cuda_lookup_and_graph_replay (its `lookup_fn(ids[:0]).shape == (0, 2, 160)`)
def test_empty_ids(loaded):
    """An empty batch gives [0, heads, head_dim] rows in the lookup dtype, directly and through the
    prefetch hook. For NVFP4 the comparison is with the shape stock's CUDA path returns (the one
    vLLM's test checks): its CPU decode raises on an empty batch, while ple-um serves it."""
    layout, stock, mapped = loaded
    empty = _ids(layout, 0, 0)
    backend = mapped.ngram_embedding
    if layout.is_nvfp4:
        with pytest.raises(RuntimeError, match="0 elements"):
            stock.ngram_embedding(empty)
        expected = torch.empty((0, h.HEADS, layout.row_dim), dtype=backend.params_dtype)
    else:
        expected = stock.ngram_embedding(empty)
    assert expected.shape == (0, h.HEADS, layout.row_dim)
    assert h.same_bits(backend(empty), expected)
    assert h.same_bits(_prefetched(mapped, empty), expected.flatten(-2))
    # The table served the empty batches and is still sound: a lookup after them is the files' rows.
    ids = _ids(layout, 5, 1)
    assert h.same_bits(backend(ids), h.file_rows(layout, ids))


# vLLM: test_nvfp4_ple_cuda_lookup_and_graph_replay (its `padded_ids = [[8, -1]]` -> zero rows)
def test_padded_ids(loaded):
    """Tokens whose ids are padding values (the row count, -1, far beyond the table) come back as
    zero rows, the other tokens as their rows. ple-um differs from stock on one rank on purpose:
    there the stock device backend masks nothing (vLLM's VocabParallelEmbedding masks only with
    more than one rank) and the embedding's index check raises, while ple-um serves every id, out of
    range ones as zero rows counted in ``out_of_range``, so a padded batch never reads outside the
    table. On two ranks both mask, and both give zeros (test_contract_two_ranks.py)."""
    layout, stock, mapped = loaded
    n = layout.num_rows
    ids = _ids(layout, 9, 2)
    padded = [1, 4, 8]
    ids[padded] = torch.tensor([n, -1] * (h.HEADS // 2))
    ids[4, 3], ids[8, :2] = 1 << 40, torch.tensor([n + 7, -(1 << 40)])
    with pytest.raises(IndexError):
        stock.ngram_embedding(ids)
    kept = [k for k in range(ids.shape[0]) if k not in padded]
    table = mapped.ngram_embedding.table
    before = table.stats()["out_of_range"]
    for got in (mapped.ngram_embedding(ids), _prefetched(mapped, ids).unflatten(-1, (h.HEADS, -1))):
        assert not got[padded].view(torch.uint8).any()
        assert h.same_bits(got[kept], stock.ngram_embedding(ids[kept]))
        assert h.same_bits(got, h.file_rows(layout, ids))
    assert table.stats()["out_of_range"] - before == 2 * len(padded) * h.HEADS


# vLLM: test_pinned_embedding_finalize_prefetch_requires_prior_start_prefetch,
# test_pinned_embedding_finalize_requires_prior_start_prefetch
def test_finalize_prefetch_requires_a_prior_start_prefetch(loaded):
    """In stock's words ("prior start_prefetch"). ple-um also refuses a second finalize of one start,
    which the stock pinned backend would answer with the same rows again: each start has one join."""
    layout, _, mapped = loaded
    backend = mapped.ngram_embedding
    with pytest.raises(RuntimeError, match="prior start_prefetch"):
        backend.finalize_prefetch(total_tokens=2)
    ids = _ids(layout, 2, 3)
    backend.start_prefetch(ids)
    assert h.same_bits(backend.finalize_prefetch(2), h.file_rows(layout, ids).flatten(-2))
    with pytest.raises(RuntimeError, match="prior start_prefetch"):
        backend.finalize_prefetch(total_tokens=2)


# vLLM: test_pinned_embedding_finalize_prefetch_optionally_reduces_output (its output, a new tensor)
def test_finalize_prefetch_returns_rows_of_the_callers_own(loaded):
    """The rows finalize_prefetch returns are not a view of the prefetch buffer: the layer's next
    start_prefetch (the next step) leaves them as they were, as the stock pinned backend's
    ``output`` (a new tensor the rows are copied into)."""
    layout, stock, mapped = loaded
    backend = mapped.ngram_embedding
    first, second = _ids(layout, 4, 9), _ids(layout, 4, 10)
    rows = _prefetched(mapped, first)
    buffer = backend.overlapped.buffer
    assert rows.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    backend.start_prefetch(second)
    assert h.same_bits(rows, stock.ngram_embedding(first).flatten(-2))
    assert h.same_bits(backend.finalize_prefetch(4), stock.ngram_embedding(second).flatten(-2))


# vLLM: test_pinned_embedding_start_prefetch_allocates_lazily
def test_prefetch_buffer_is_allocated_lazily(loaded):
    """No buffer after construction and loading; the first start_prefetch allocates it for
    max_total_tokens rows of [heads, head_dim] in the lookup dtype, and finalize_prefetch returns
    the rows. ple-um makes its side stream only where it forks one (a CUDA device), never here."""
    layout, stock, mapped = loaded
    backend = mapped.ngram_embedding
    assert backend.supports_prefetch and backend.overlapped.buffer is None
    ids = _ids(layout, 2, 4)
    output = _prefetched(mapped, ids)
    buffer = backend.overlapped.buffer
    assert buffer.shape == (256, h.HEADS, layout.row_dim)  # the harness builds for 256 tokens
    assert buffer.dtype == backend.lookup_dtype and buffer.device.type == "cpu"
    assert backend.overlapped.side.stream is None
    assert h.same_bits(output, stock.ngram_embedding(ids).flatten(-2))


# vLLM: test_amd_pinned_embedding_prefetch_machinery_is_lazy
def test_rocm_layer_never_allocates_the_prefetch_machinery(world, patched, table_dir, tmp_path):
    """ROCm's layer never prefetches: its forward leaves the buffer and the side stream unmade."""
    from helpers.vllm_patch import restore
    from vllm.models.qwen4_exp.amd import ple_layer

    from ple_um.vllm.patch import patch_ngram_class

    patch_ngram_class(ple_layer)
    try:
        config = h.text_config(fp8=True)
        layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
        module = h.build_amd(config, ple_um_on=True)
        h.load(module, layout.directory)
        backend = module.ngram_embedding
        ids = _ids(layout, 3, 5)
        assert h.same_bits(backend(ids), h.file_rows(layout, ids))
        assert backend.overlapped.buffer is None and backend.overlapped.side.stream is None
        backend.close_table()
    finally:
        restore(ple_layer.Qwen4ExpNGramEmbedding)


# vLLM: test_ngram_prefetch_ids_outlive_start_prefetch
def test_prefetch_ids_outlive_start_prefetch(loaded):
    """ple-um holds the ids a start_prefetch was given until finalize_prefetch joins it (on a GPU a
    side stream may still be reading them: their memory must not go back to the allocator), and a
    caller that reuses its buffers in between still gets the rows of the ids it started with,
    directly and through the whole layer. (vLLM's layer computes the ids into a persistent buffer
    on CUDA only; on the CPU it makes a fresh tensor, which is what ple-um holds here.)"""
    layout, stock, mapped = loaded
    backend = mapped.ngram_embedding
    ids = _ids(layout, 6, 8)
    kept = ids.clone()
    backend.start_prefetch(ids)
    assert backend.overlapped.started[1] is ids
    ids.fill_(-1)  # the caller's next ids, written before this start's join
    assert h.same_bits(backend.finalize_prefetch(6), stock.ngram_embedding(kept).flatten(-2))
    assert backend.overlapped.started is None  # released at the join

    token_ids, query_start_loc, ngram_context = h.inputs(6)
    with torch.no_grad():
        expected = stock(None, token_ids, query_start_loc, ngram_context)
        mapped.start_prefetch(token_ids, query_start_loc, ngram_context)
        mapped._prefetch_ids.fill_(-1)
        token_ids.random_(0, h.VOCAB)
        assert h.same_bits(mapped(None, token_ids, query_start_loc, ngram_context), expected)


# vLLM: test_pinned_embedding_finalize_prefetch_optionally_reduces_output (one rank)
@pytest.mark.parametrize("reduce_results", [True, False])
def test_finalize_prefetch_with_and_without_the_reduce(stock_and_mapped, table_dir, tmp_path, reduce_results):
    """The layer built with and without the reduce (sequence parallelism makes it leave the sum to
    the caller's reduce-scatter): finalize_prefetch returns every token's rows, flattened, as
    stock's forward. On one rank the reduce has nothing to sum; test_contract_two_ranks.py sums."""
    config = h.text_config(dtype="fp8")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, seed=14)
    stock, mapped = stock_and_mapped(config, layout.directory, use_sequence_parallel=not reduce_results)
    assert mapped.ngram_embedding.reduce_results is stock.ngram_embedding.reduce_results is reduce_results
    ids = _ids(layout, 3, 7)
    output = _prefetched(mapped, ids)
    assert output.dtype == torch.float8_e4m3fn and output.shape == (3, h.HEADS * layout.row_dim)
    assert h.same_bits(output, stock.ngram_embedding(ids).flatten(-2))
    assert h.same_bits(output, h.file_rows(layout, ids).flatten(-2))
