"""vLLM's own PLE tests as ple-um's contract, on two ranks (two processes, gloo; the worker is
``two_rank_contract_worker.py``): NVFP4 shards streamed across the ranks' row boundaries, shards
that overlap a rank's rows or miss them, the reduce (FP8 sent as int8), padded and empty ids,
``finalize_prefetch`` with and without the reduce, the sequence-parallel layer, and two
data-parallel ranks sharing one table.

vLLM's tests stand in for the second rank with a mocked group; here both ranks are real, and each
builds the real layer twice (the stock device backend, and ple-um's), so every comparison is stock
against ple-um on one synthetic checkpoint, bit for bit, and against the rows read from the files.
Each test names the vLLM test whose behaviour it checks.
"""

from __future__ import annotations

import os

import pytest
import torch
import vllm_harness as h
from two_rank_contract_worker import DP_TOKENS, DTYPES

pytestmark = [pytest.mark.vllm, h.needs_vllm, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_rank_contract_worker.py")
OWNED = [(0, 640), (640, 1280)]  # the ranks' halves of the 1280-row tables


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(layouts by dtype, the two ranks' reports)."""
    tmp = tmp_path_factory.mktemp("contract_two_ranks")
    for world in ("tp", "dp"):
        (tmp / world).mkdir()
    layouts = {
        dtype: h.write_table(tmp / "ckpt" / dtype, h.text_config(dtype=dtype), seed=40 + k)
        for k, dtype in enumerate(DTYPES)
    }
    return layouts, h.run_two_ranks(WORKER, tmp, str(tmp / "ckpt"), str(tmp), str(h.free_port()))


def _all_rows(layout) -> torch.Tensor:
    return torch.arange(layout.num_rows).view(-1, h.HEADS)


def _summed(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a sum over the ranks gives them: each row has one owner and the other rank adds
    zeros, so every value stays, but a -0.0 of bf16 rows (NVFP4 decodes some) becomes +0.0; FP8
    bytes are summed as int8 and keep their bits."""
    if rows.dtype == torch.float8_e4m3fn:
        return rows
    return rows + torch.zeros_like(rows)


def _zero_tokens(rows: torch.Tensor, tokens) -> bool:
    return not rows[list(tokens)].view(torch.uint8).any()


# vLLM: test_nvfp4_ple_loads_streamed_shards_across_etp_boundaries (both ranks)
@pytest.mark.parametrize("delivery", ["file", "memory"])
def test_nvfp4_shards_streamed_across_the_ranks_boundary(run, delivery):
    """Shards out of order, block scales before rows, three tensors per load_weights call, shard 3
    split between the ranks: each rank's partial rows (zeros outside its half) and the reduced rows
    are stock's, and the files'."""
    layouts, reports = run
    layout = layouts["nvfp4"]
    per_shard = layout.rows_per_shard
    assert 3 * per_shard < OWNED[0][1] < 4 * per_shard  # the boundary lies inside shard 3
    ids = _all_rows(layout)
    names = {f"ngram_embedding.{n}" for n in ("weight", "weight_scale", "weight_scale_2")}
    for rank, report in enumerate(reports):
        result = report["streamed"][delivery]
        assert tuple(result["owned_rows"]) == OWNED[rank]
        assert result["stock_loaded"] == result["mapped_loaded"] == names
        assert result["counts"] == ((14, 0) if delivery == "file" else (0, 14))  # skipped, compared
        partial = h.file_rows(layout, ids, rows=OWNED[rank])
        assert h.same_bits(result["mapped_partial"], result["stock_partial"])
        assert h.same_bits(result["mapped_partial"], partial)
        assert h.same_bits(result["mapped_reduced"], result["stock_reduced"])
        assert h.same_bits(result["mapped_reduced"], _summed(h.file_rows(layout, ids)))


# vLLM: test_ple_shard_overlap_and_copy, test_ple_shard_copy_is_a_noop_without_overlap
def test_shards_delivered_in_memory_are_taken_only_where_they_overlap_the_rank(run):
    """A byte changed in rows another rank owns (in shard 3, which the ranks split, or in a shard
    wholly the other rank's) changes nothing on this rank: stock copies only the overlap, ple-um
    compares only the overlap. A byte changed in this rank's own rows: stock copies it into its
    table; ple-um differs on purpose, since it serves the checkpoint files read-only: it refuses
    the load, naming the row (ReloadMismatchError)."""
    layouts, reports = run
    layout = layouts["fp8"]
    ids = _all_rows(layout)
    for rank, report in enumerate(reports):
        result = report["overlap"]
        expected = h.file_rows(layout, ids, rows=OWNED[rank])
        for case in ("other_rows_of_a_crossing_shard", "a_shard_of_the_other_rank"):
            stock, mapped = result[case]["stock"], result[case]["mapped"]
            assert isinstance(mapped, torch.Tensor), mapped
            assert h.same_bits(mapped, stock) and h.same_bits(mapped, expected), case
        own = result["rows"]["own"]
        stock, mapped = result["own_rows"]["stock"], result["own_rows"]["mapped"]
        changed = (stock.view(torch.uint8) != expected.view(torch.uint8)).flatten(1).any(dim=1)
        assert changed.nonzero().flatten().tolist() == [own // h.HEADS]  # the token holding row `own`
        assert isinstance(mapped, str) and mapped.startswith("ReloadMismatchError"), mapped
        assert f"at row {own} " in mapped


# vLLM: test_ple_fp8_embedding_uses_int8_for_parallel_reduce,
# test_pinned_fp8_embedding_uses_int8_for_parallel_reduce
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reduce_sends_fp8_as_int8(run, dtype):
    """Every all-reduce of the layer's rows gets int8 for an FP8 table (each row has one owner, so
    the bytes sum exactly), the rows themselves otherwise (BF16, NVFP4 decoded to bf16): ple-um's
    forward and prefetch hook as stock's forward. The reduced rows are FP8 again, and the files'."""
    layouts, reports = run
    wire = {"fp8": torch.int8, "bf16": torch.bfloat16, "nvfp4": torch.bfloat16}[dtype]
    for report in reports:
        result = report["lookups"][dtype]
        assert result["stock_reduced_reduces"] and set(result["stock_reduced_reduces"]) == {wire}
        assert result["mapped_reduced_reduces"] == [wire] * 4  # forward and prefetch, ids and empty
        assert result["stock_partial_reduces"] == result["mapped_partial_reduces"] == []
        assert result["mapped_reduced"].dtype == (torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
        assert h.same_bits(result["mapped_reduced"], result["stock_reduced"])
        assert h.same_bits(result["mapped_reduced"], _summed(h.file_rows(layouts[dtype], result["ids"])))


# vLLM: test_nvfp4_ple_cuda_lookup_and_graph_replay (padded [8, -1] and empty ids, on its rank 1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_and_empty_ids_on_two_ranks(run, dtype):
    """Tokens padded with the row count and -1 are zero rows on both ranks, partial and reduced,
    for stock (which masks them on two ranks) and ple-um alike. An empty batch gives [0, heads,
    head_dim]; for NVFP4 stock's CPU decode raises on it (its CUDA path, which vLLM's test checks,
    returns that shape), and ple-um serves it."""
    layouts, reports = run
    layout = layouts[dtype]
    for rank, report in enumerate(reports):
        result = report["lookups"][dtype]
        for kind in ("partial", "reduced"):
            mapped = result[f"mapped_{kind}"]
            assert _zero_tokens(mapped, (1, 4)) and h.same_bits(mapped, result[f"stock_{kind}"])
            empty, stock_empty = result[f"mapped_{kind}_empty"], result[f"stock_{kind}_empty"]
            assert isinstance(empty, torch.Tensor) and empty.shape == (0, h.HEADS, layout.row_dim), empty
            if dtype == "nvfp4":
                assert isinstance(stock_empty, str) and "0 elements" in stock_empty
            else:
                assert h.same_bits(empty, stock_empty)
            assert result[f"prefetched_{kind}_empty"].shape == (0, h.HEADS * layout.row_dim)
        assert h.same_bits(result["mapped_partial"], h.file_rows(layout, result["ids"], rows=OWNED[rank]))


# vLLM: test_pinned_embedding_finalize_prefetch_optionally_reduces_output
@pytest.mark.parametrize("dtype", DTYPES)
def test_finalize_prefetch_with_and_without_the_reduce(run, dtype):
    """With the reduce, finalize_prefetch returns the group's sum (stock's reduced forward); without
    it (sequence parallelism leaves the sum to the caller's reduce-scatter), this rank's partial
    rows (stock's unreduced forward), every token's, flattened."""
    layouts, reports = run
    for report in reports:
        result = report["lookups"][dtype]
        for kind in ("partial", "reduced"):
            prefetched = result[f"prefetched_{kind}"]
            assert prefetched.shape == (result["ids"].shape[0], h.HEADS * layouts[dtype].row_dim)
            assert h.same_bits(prefetched, result[f"stock_{kind}"].flatten(-2)), kind


# vLLM tests/models/qwen4_exp/test_tpsp.py: test_hc_sp_decoder_and_ple (its PLE embedding)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sequence_parallel_layer(run, dtype):
    """The whole n-gram layer under sequence parallelism (the PLE part of vLLM's HC SP decoder
    test): each rank returns its shard of the tokens, reduce-scattered across the group; ple-um's
    (through the prefetch hook) equal stock's, and together the files' rows of every token."""
    layouts, reports = run
    shards = []
    for report in reports:
        result = report["lookups"][dtype]
        assert h.same_bits(result["mapped_layer_shard"], result["stock_layer_shard"])
        shards.append(result["mapped_layer_shard"])
    ids = reports[0]["lookups"][dtype]["layer_ids"]
    assert torch.equal(ids, reports[1]["lookups"][dtype]["layer_ids"])
    rows = torch.cat(shards)[: ids.shape[0]]
    assert h.same_bits(rows, _summed(h.file_rows(layouts[dtype], ids).flatten(-2)))


# vLLM: test_etp_lookup_gathers_and_returns_dp_local_rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_parallel_ranks_sharing_one_table(run, dtype):
    """Two data-parallel ranks (5 and 9 tokens) share the table, half each (vLLM's
    ``embedding_across_dp``): the ids are gathered into slots of the larger count, looked up, summed
    across both ranks and each rank's own tokens selected; ple-um's forward and prefetch hook equal
    stock's forward, and the files' rows (padded tokens zero)."""
    layouts, reports = run
    wire = torch.int8 if dtype == "fp8" else torch.bfloat16
    for rank, report in enumerate(reports):
        assert report["dp"]["groups"] == (2, rank, 2)  # DP group, this rank in it, the table's group
        result = report["dp"][dtype]
        assert result["stock_etp_dp"] == result["mapped_etp_dp"] == 2
        assert tuple(result["owned_rows"]) == OWNED[rank]
        ids = result["ids"]
        assert ids.shape[0] == DP_TOKENS[rank]
        assert result["stock_reduces"] == [wire] and result["mapped_reduces"] == [wire, wire]
        assert h.same_bits(result["mapped"], result["stock"])
        assert h.same_bits(result["prefetched"], result["stock"].flatten(-2))
        assert _zero_tokens(result["mapped"], (1, 4))
        assert h.same_bits(result["mapped"], _summed(h.file_rows(layouts[dtype], ids)))
