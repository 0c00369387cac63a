"""PleUmHostEmbedding against SGLang's stock layer, both built and loaded by SGLang's real loader
from the same synthetic checkpoint: raw rows and dequantized rows, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def _ids(rng, rows: int, per_shard: int, count: int = 64) -> torch.Tensor:
    """Every row, the rows on each side of every shard boundary, and random rows: [n, 4] n-gram ids."""
    edges = [e for k in range(1, -(-rows // per_shard)) for e in (k * per_shard - 1, k * per_shard)]
    flat = np.concatenate([np.arange(rows), edges, [0, rows - 1], rng.integers(0, rows, count)])
    flat = flat[: len(flat) // 4 * 4]
    return torch.from_numpy(rng.permutation(flat)).view(-1, 4)


def _same_bits(got: torch.Tensor, expect: torch.Tensor) -> None:
    assert got.shape == expect.shape and got.dtype == expect.dtype, (got.shape, got.dtype, expect.shape)
    differ = (got.view(torch.int16) != expect.view(torch.int16)).nonzero()
    assert differ.numel() == 0, f"{len(differ)} elements differ, first at {differ[0].tolist()}"


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        ("fp8", {}),  # stock switches its storage to FP8 at load
        ("fp8", {"ple_embedding_dtype": "float8_e4m3fn"}),  # stock's FP8 storage declared by the config
        ("bf16", {}),
        ("f16", {}),  # stock rounds rows to bf16 at load, ple-um at lookup: the same rounding
        ("fp8_e5m2", {}),
    ],
)
def test_rows_equal_stock(dtype, config, sglang_checkpoint, load_model, tiny, file_rows, rng):
    from ple_um.sglang.embedding import PleUmHostEmbedding

    directory, layout, _ = sglang_checkpoint(dtype, seed=int(rng.integers(1 << 30)), **config)
    stock = tiny.ngram(load_model(directory, ple_um=False))
    ours = tiny.ngram(load_model(directory, ple_um=True))
    assert not isinstance(stock.ngram_embedding, PleUmHostEmbedding)
    table = ours.ngram_embedding
    assert isinstance(table, PleUmHostEmbedding) and table.table is not None
    assert table.weight.shape[0] == 0 and table.org_vocab_size == tiny.rows == layout.num_rows
    ids = _ids(rng, layout.num_rows, layout.rows_per_shard)

    # Raw rows: the stored values as bf16, without the scale (the model applies weight_scale).
    reference = file_rows(layout).to(torch.bfloat16)[ids]
    got = table(ids)
    _same_bits(got, reference)
    _same_bits(got, stock.ngram_embedding(ids))
    # Dequantized, through the model's own path: rows * weight_scale.
    _same_bits(table.weight_scale, stock.ngram_embedding.weight_scale)
    n = ids.shape[0]
    _same_bits(ours._embed_ngram_ids(ids, None, n), stock._embed_ngram_ids(ids, None, n))
    if layout.scale is not None:
        assert float(table.weight_scale) == float(torch.tensor(layout.scale).to(torch.bfloat16))


def test_gather_into_prefetch_buffer(sglang_checkpoint, load_model, tiny, file_rows, rng):
    """``gather(ids, out=view)`` as the PLE layer's start_prefetch calls it: into a view of a buffer from
    ``allocate_output`` ([tokens, ple_embed_dim] viewed [tokens, heads, head_dim]), every element
    written; ``reduce`` is the identity at tp=1."""
    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    ng = tiny.ngram(load_model(directory, ple_um=True))
    table = ng.ngram_embedding
    ids = _ids(rng, layout.num_rows, layout.rows_per_shard)
    buffer = table.allocate_output((ids.shape[0] + 3, ng.ngram_embed_dim), ids.device)
    assert buffer.dtype == torch.bfloat16
    buffer.view(torch.uint8).fill_(0xAB)
    view = buffer[: ids.shape[0]].view(ids.shape[0], ng.ngram_heads, -1)
    assert table.gather(ids, out=view) is view
    _same_bits(view, file_rows(layout).to(torch.bfloat16)[ids])
    assert (buffer[ids.shape[0] :].view(torch.uint8) == 0xAB).all()  # nothing past the view
    _same_bits(table.reduce(view), view)
    with pytest.raises(ValueError, match="output shape"):
        table.gather(ids, out=buffer[:1].view(1, ng.ngram_heads, -1))
    with pytest.raises(ValueError, match="bfloat16"):
        table.gather(ids, out=torch.empty(view.shape, dtype=torch.float32))
    assert table.gather(ids[:0]).shape == (0, 4, table.embedding_dim)


def test_ids_outside_the_table_give_zero_rows(sglang_checkpoint, load_model, tiny, file_rows, rng):
    """Ids outside [0, rows) (the vocabulary padding rows, negatives, huge values) are zero rows, as
    SGLang's pinned gather gives them (its stock device layer would read padding or fault)."""
    directory, layout, _ = sglang_checkpoint("bf16", seed=int(rng.integers(1 << 30)))
    table = tiny.ngram(load_model(directory, ple_um=True)).ngram_embedding
    assert table.num_embeddings_padded > layout.num_rows  # padding rows exist past the table
    outside = torch.tensor([[-1, layout.num_rows, table.num_embeddings_padded - 1, 1 << 40]])
    inside = torch.tensor([[0, layout.num_rows - 1, layout.rows_per_shard, 1]])
    got = table.gather(torch.cat([outside, inside]))
    assert (got[0] == 0).all()
    _same_bits(got[1], file_rows(layout).to(torch.bfloat16)[inside[0]])
    assert table.table.stats()["out_of_range"] == 4


def test_nvfp4_is_decoded_by_ple_um(sglang_checkpoint, load_model, tiny, file_rows, rng):
    """SGLang's own layer cannot load an NVFP4 table; through ple-um the rows are decoded to bf16 as
    ``e2m1 * (block scale * weight_scale_2)`` in float32, and weight_scale stays 1."""
    directory, layout, _ = sglang_checkpoint("nvfp4", seed=int(rng.integers(1 << 30)))
    with pytest.raises((RuntimeError, ValueError, AssertionError)):
        load_model(directory, ple_um=False)
    ng = tiny.ngram(load_model(directory, ple_um=True))
    table = ng.ngram_embedding
    ids = _ids(rng, layout.num_rows, layout.rows_per_shard)
    packed, blocks = file_rows(layout)[ids], file_rows(layout, layout.block_scales)[ids]
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    e2m1 = torch.tensor(magnitudes + [-m for m in magnitudes])  # code bit 3 is the sign
    values = torch.stack([e2m1[(packed & 0xF).long()], e2m1[(packed >> 4).long()]], dim=-1).flatten(-2)
    scales = (blocks.float() * torch.tensor(layout.scale, dtype=torch.float32)).repeat_interleave(16, dim=-1)
    reference = (values * scales).to(torch.bfloat16)
    _same_bits(table(ids), reference)
    assert float(table.weight_scale) == 1.0
    _same_bits(ng._embed_ngram_ids(ids, None, ids.shape[0]), reference)


def test_bf16_table_under_an_fp8_config_is_served_as_stored(
    sglang_checkpoint, load_model, tiny, file_rows, rng, caplog
):
    """Stock would round a BF16 table to the FP8 storage its config declares; ple-um serves the stored
    rows and says so."""
    directory, layout, _ = sglang_checkpoint(
        "bf16", seed=int(rng.integers(1 << 30)), ple_embedding_dtype="float8_e4m3fn"
    )
    with caplog.at_level("WARNING", logger="ple_um.sglang"):
        table = tiny.ngram(load_model(directory, ple_um=True)).ngram_embedding
    assert "serves them as stored" in caplog.text
    ids = _ids(rng, layout.num_rows, layout.rows_per_shard)
    _same_bits(table(ids), file_rows(layout)[ids])
