"""vLLM's prefetch hook (``ple_um.vllm.overlap``): the buffer, and starts and finalizes that do
not pair up."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

pytestmark = [pytest.mark.vllm, h.needs_vllm]


def test_prefetch_buffer_grows_until_a_graph_captured_it(world, patched, table_dir, tmp_path):
    """vLLM sizes the prefetch buffer for max_total_tokens; an eager batch beyond it grows the buffer,
    unless a CUDA graph has captured a lookup into it (then the batch is refused, naming the sizes)."""
    config = h.text_config(dtype="fp8")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    backend = h.mapped(config, layout.directory).ngram_embedding
    overlapped, dtype = backend.overlapped, backend.lookup_dtype
    heads = 4

    def out(rows):
        return overlapped.out(
            rows, torch.zeros((rows, heads), dtype=torch.long), dtype, fixed=backend.served.captured
        )

    small = out(3)
    big = out(overlapped.rows + 5)
    assert small.shape[1:] == big.shape[1:] == (heads, backend.embedding_dim)
    assert big.shape[0] == overlapped.rows + 5 and overlapped.buffer.shape[0] >= big.shape[0]
    backend.served.captured = True
    with pytest.raises(ValueError, match="prefetch buffer holds"):
        out(overlapped.buffer.shape[0] + 1)
    backend.close_table()


def test_prefetch_misuse(world, patched, table_dir, tmp_path):
    """A finalize for another number of tokens than the start looked up raises (stock would hand out
    rows of the wrong batch); a start never finalized (a forward that raised in between) does not
    stop the next one, whose rows are the file's."""
    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    module = h.build(config, ple_um_on=True)
    h.load(module, layout.directory)
    ids, query_start_loc, ngram_context = h.inputs(0, tokens=30)
    with torch.no_grad():
        module.start_prefetch(ids, query_start_loc, ngram_context)
        with pytest.raises(ValueError, match="finalize_prefetch for 61 tokens, but start_prefetch looked"):
            module.ngram_embedding.finalize_prefetch(61)
        module.start_prefetch(ids, query_start_loc, ngram_context)  # never finalized
    raw_again, _ = h.forward(module, 1)
    module.ngram_embedding.close_table()
    stock = h.build(config, ple_um_on=False)
    h.load(stock, layout.directory)
    raw_stock, _ = h.forward(stock, 1)
    assert h.same_bits(raw_again, raw_stock) and raw_stock.view(torch.uint8).any()
