"""The layer itself (``ple_um.vllm.backend``) inside vLLM 0.33's real Qwen4ExpNGramEmbedding,
against the stock device backend.

Both are built from the same small config and loaded through the real ``load_weights`` from the same
synthetic checkpoint (FP8, BF16 or NVFP4), fed by vLLM's own safetensors iterator; their forward
outputs must be equal bit for bit, raw and after ``dequantize()``. Also: no table memory, a reload
from another directory remapped, the open's log line, data-parallel token gathering, the layer
before loading and under ``--load-format dummy``.
"""

from __future__ import annotations

import os

import pytest
import torch
import vllm_harness as h

import ple_um

pytestmark = [pytest.mark.vllm, h.needs_vllm]


@pytest.fixture(params=["fp8", "bf16", "nvfp4"])
def dtype(request):
    return request.param


# The raw rows' dtype (NVFP4: decoded to the layer's params_dtype, bf16 here).
RAW_DTYPE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "nvfp4": torch.bfloat16}
METHOD = {
    "fp8": "Qwen4ExpPLEFp8EmbeddingMethod",
    "bf16": "Qwen4ExpPLEUnquantizedEmbeddingMethod",
    "nvfp4": "Qwen4ExpPLENvFp4EmbeddingMethod",
}


@pytest.mark.parametrize("overlap", [True, False])
def test_matches_stock_bit_for_bit(world, patched, table_dir, tmp_path, dtype, overlap, monkeypatch):
    """Through vLLM's prefetch hook (start_prefetch one layer ahead, finalize_prefetch in forward:
    PLE_UM_OVERLAP, the default) and through forward's own lookup."""
    monkeypatch.setenv("PLE_UM_OVERLAP", "1" if overlap else "0")
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    assert layout.is_nvfp4 == (dtype == "nvfp4")
    stock = h.stock(config, layout.directory)
    mapped = h.mapped(config, layout.directory)
    assert mapped.ngram_embedding.supports_prefetch is overlap
    assert not stock.ngram_embedding.supports_prefetch

    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding

    backend = mapped.ngram_embedding
    assert isinstance(backend, Qwen4ExpPLEMappedEmbedding)
    assert type(stock.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    assert type(backend.embedding_method).__name__ == METHOD[dtype]
    assert type(stock.ngram_embedding.embedding_method).__name__ == METHOD[dtype]
    assert backend.table.mode == "cpu"  # the only mode a CPU-only host has
    assert backend.table.rows == (0, layout.num_rows) == backend.owned_rows
    assert backend.weight.dtype == stock.ngram_embedding.weight.dtype
    scale = h.GLOBAL_SCALE[dtype]
    if scale is not None:
        assert torch.equal(getattr(backend, scale), getattr(stock.ngram_embedding, scale))
        assert float(getattr(backend, scale)) == layout.scale

    for seed in (0, 1, 2):
        raw_stock, deq_stock = h.forward(stock, seed)
        raw_mapped, deq_mapped = h.forward(mapped, seed)
        assert raw_mapped.dtype == RAW_DTYPE[dtype]
        assert raw_mapped.view(torch.uint8).any(), "vacuous: all rows zero"
        assert h.same_bits(raw_mapped, raw_stock)
        assert h.same_bits(deq_mapped, deq_stock)
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_allocates_no_table(world, patched, table_dir, tmp_path, dtype):
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    module = h.mapped(config, layout.directory)
    backend = module.ngram_embedding
    if dtype == "nvfp4":  # packed rows and block scales: both without rows
        assert tuple(backend.weight.shape) == (0, h.NVFP4_HEAD_DIM // 2)
        assert tuple(backend.weight_scale.shape) == (0, h.NVFP4_HEAD_DIM // 16)
        assert backend.weight_scale_2.numel() == 1
    else:
        assert tuple(backend.weight.shape) == (0, h.HEAD_DIM)
    held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    assert held < 1024 < layout.nbytes  # the global scale and the hash buffers, no rows
    assert backend.table.stats()["device_bytes"] == 0
    backend.close_table()


def test_reload_from_another_directory_remaps(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=True)
    first = h.write_table(table_dir(tmp_path / "a"), config, fp8=True, seed=0)
    second = h.write_table(tmp_path / "b", config, fp8=True, seed=5)
    module = h.mapped(config, first.directory)
    old = module.ngram_embedding.table

    table_dir(second.directory)
    h.load(module, second.directory)
    backend = module.ngram_embedding
    assert backend.table is not old and old.closed
    assert backend.table.layout.directory == second.directory
    assert backend.shards_compared == 0  # the new files were mapped, not read

    stock = h.stock(config, second.directory)
    for seed in (0, 1):
        assert h.same_bits(h.forward(module, seed)[1], h.forward(stock, seed)[1])
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("delivery", ["file", "memory", "memory rows"])
def test_a_failed_reload_leaves_the_old_table_serving(world, patched, table_dir, tmp_path, dtype, delivery):
    """A reload whose table does not agree with what vLLM loaded: PLE_UM_DIR moved to another
    checkpoint's table (b) while the weights come from a third (c, its global scale apart from b's):
    its views of the files (``file``), or in memory b's shards with c's scale (``memory``: refused by
    the scale check at the end of the load), or c's shards (``memory rows``: refused while comparing
    them with b's table). The refusal leaves the old table (a) serving, open, and the layer's global
    scale back at a's, so the layer returns a's rows as stock loaded from a does; b is not mapped."""
    from ple_um.delivered import ReloadMismatchError
    from ple_um.errors import CheckpointError

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    third = h.write_table(tmp_path / "c", config, seed=9)
    assert len({first.scale, other.scale, third.scale}) == 3
    module = h.mapped(config, first.directory)
    backend = module.ngram_embedding
    old = backend.table
    stock = h.stock(config, first.directory)
    assert h.same_bits(h.forward(module, 0)[1], h.forward(stock, 0)[1])

    table_dir(other.directory)
    scale = f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"
    if delivery == "file":
        weights, error = list(h.checkpoint_weights(third.directory)), CheckpointError
    elif delivery == "memory":
        weights = [(n, t) for n, t in h.delivered(other.directory, "memory") if n != scale]
        weights += [(n, t) for n, t in h.delivered(third.directory, "memory") if n == scale]
        error = CheckpointError
    else:
        weights, error = h.delivered(third.directory, "memory"), ReloadMismatchError
    with pytest.raises(error, match="loaded weight_scale|delivered in memory differs"):
        module.load_weights(iter(weights))
    assert backend.table is old and not old.closed
    assert backend.served.directory == first.directory and backend.served.staged is None
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
    for seed in (0, 1):
        raw, dequantized = h.forward(module, seed)
        expected_raw, expected = h.forward(stock, seed)
        assert h.same_bits(raw, expected_raw) and h.same_bits(dequantized, expected)

    table_dir(third.directory)  # the reload done right: c's table, c's scale
    h.load(module, third.directory)
    assert backend.table is not old and old.closed
    assert backend.table.layout.directory == third.directory
    stock = h.stock(config, third.directory)
    assert h.same_bits(h.forward(module, 0)[1], h.forward(stock, 0)[1])
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("failure", ["in the load", "at its end"])
def test_a_reload_whose_table_cannot_open_keeps_the_old_scale(
    world, patched, table_dir, tmp_path, dtype, failure
):
    """A model's reload that copies another checkpoint's global scale (c) into the layer (its first
    run of names), then fails because PLE_UM_DIR names a table that does not fit the layer (b: more
    rows): while comparing the shards a second run delivers in memory (``in the load``), or when
    the model's load ends (``at its end``). The old table (a) serves on, and so does its scale: the
    layer returns a's rows as stock loaded from a does, not a's rows under c's scale."""
    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    wrong = h.write_table(tmp_path / "b", config, seed=5, num_rows=first.num_rows + 7)
    third = h.write_table(tmp_path / "c", config, seed=9)
    assert third.scale != first.scale
    holder = torch.nn.Module()
    holder.add_module("ple", h.mapped(config, first.directory))
    backend = holder.ple.ngram_embedding
    old = backend.table
    stock = h.stock(config, first.directory)
    scale = f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"
    runs = [[(n, t) for n, t in h.delivered(third.directory, "memory") if n == scale]]
    if failure == "in the load":
        runs.append([(n, t) for n, t in h.delivered(first.directory, "memory") if ".shard_" in n])

    def in_runs(model, weights):
        return set().union(*(model.ple.load_weights(iter(run)) for run in runs))

    table_dir(wrong.directory)
    with pytest.raises(ple_um.CheckpointError, match="rows") as info:
        _model_load_weights(in_runs)(holder, iter([]))
    assert info.value.path in wrong.files
    assert backend.table is old and not old.closed and backend.served.staged is None
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
    for seed in (0, 1):
        raw, dequantized = h.forward(holder.ple, seed)
        expected_raw, expected = h.forward(stock, seed)
        assert h.same_bits(raw, expected_raw) and h.same_bits(dequantized, expected)
    backend.close_table()


def _table_last(weights: list, scale: str | None) -> list:
    """``weights`` with the table's shard tensors first and its global scale (``scale``) last, as a
    weight sync may send them."""
    shards = [(n, t) for n, t in weights if ".shard_" in n]
    rest = [(n, t) for n, t in weights if ".shard_" not in n and n != scale]
    return shards + rest + [(n, t) for n, t in weights if n == scale]


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_a_sync_spread_over_several_calls_is_checked_once_all_of_it_is_in(
    world, patched, table_dir, tmp_path, dtype
):
    """A weight sync after a remap (PLE_UM_DIR moved from a to b) delivering b's table in memory a few
    tensors a ``load_weights`` call, its global scale last: as stock vLLM's layerwise reload processes
    a layer once all its weights are in, the new table is checked once all of it is: each call before
    the last leaves a's table serving (the new one staged, neither refused nor served half-checked),
    the last one makes b's serve, as stock loaded from b serves. The same sync with a third
    checkpoint's scale (c) is refused by that last call alone, leaving a's table and scale."""
    from ple_um.errors import CheckpointError

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    third = h.write_table(tmp_path / "c", config, seed=9)
    module = h.mapped(config, first.directory)
    backend = module.ngram_embedding
    old = backend.table
    stock = h.stock(config, first.directory)
    scale = h.GLOBAL_SCALE[dtype] and f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"

    table_dir(other.directory)
    weights = _table_last(h.delivered(other.directory, "memory"), scale)
    if scale is not None:  # c's scale in place of b's
        foreign = [(n, t) for n, t in h.delivered(third.directory, "memory") if n == scale]
        with pytest.raises(CheckpointError, match="loaded weight_scale"):
            h.load_in_calls(module, weights[:-1] + foreign)
        assert backend.table is old and not old.closed and backend.served.staged is None
        assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
        assert h.same_bits(h.forward(module, 0)[1], h.forward(stock, 0)[1])

    calls = [weights[start : start + 3] for start in range(0, len(weights), 3)]
    assert len(calls) > 2
    for weights_of_call in calls[:-1]:
        module.load_weights(iter(weights_of_call))
        assert backend.table is old and not old.closed and backend.served.staged is not None
        assert h.same_bits(h.forward(module, 0)[1], h.forward(stock, 0)[1])
    module.load_weights(iter(calls[-1]))
    assert old.closed and backend.served.staged is None
    assert backend.table.layout.directory == other.directory
    assert backend.shards_compared == h.PER_SHARD[dtype] * h.PARTS * (2 if scale else 1)
    stock = h.stock(config, other.directory)
    for seed in (0, 1):
        raw, dequantized = h.forward(module, seed)
        expected_raw, expected = h.forward(stock, seed)
        assert h.same_bits(raw, expected_raw) and h.same_bits(dequantized, expected)
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_a_reload_reaching_the_layer_in_several_calls_is_checked_at_the_models_end(
    world, patched, table_dir, tmp_path, dtype
):
    """A model's reload from another directory (the model path moved: here PLE_UM_DIR) whose weights
    reach the PLE layer in several ``load_weights`` calls (vLLM's AutoWeightsLoader calls a module
    once per run of its names: the shard views in one file, the global scale in another): the new
    table is checked once, when the model's load_weights ends, against the scale loaded by then,
    and serves; not refused by a check after the first call, which saw the old scale."""
    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    scale = f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"

    def in_runs(model, weights):  # the layer's names in two runs, the scale in the second
        weights = _table_last(list(weights), scale)
        return model.ple.load_weights(iter(weights[:-1])) | model.ple.load_weights(iter(weights[-1:]))

    load_weights = _model_load_weights(in_runs)
    load_weights(holder, h.checkpoint_weights(first.directory))
    backend = holder.ple.ngram_embedding
    old = backend.table
    assert old.layout.directory == first.directory
    table_dir(other.directory)
    load_weights(holder, h.checkpoint_weights(other.directory))
    assert old.closed and backend.table.layout.directory == other.directory
    assert backend.shards_skipped == 2 * h.PER_SHARD[dtype] * h.PARTS  # views, never read
    stock = h.stock(config, other.directory)
    embedding = holder.ple.ngram_embedding
    embedding.quant_method.process_weights_after_loading(embedding)
    for seed in (0, 1):
        assert h.same_bits(h.forward(holder.ple, seed)[1], h.forward(stock, seed)[1])
    backend.close_table()


def _replace_by_rename(directory, source) -> None:
    """Each file of ``source`` renamed over its namesake in ``directory``: a new checkpoint put in
    place of the old one the safe way (a served mapping keeps the files it mapped)."""
    for name in os.listdir(source):
        os.replace(os.path.join(source, name), os.path.join(directory, name))


@pytest.mark.parametrize("fp8", [True, False])
def test_reload_after_the_files_were_replaced_serves_the_new_table(world, patched, table_dir, tmp_path, fp8):
    """A new checkpoint renamed into the served directory, then reloaded from it (vLLM's
    ``reload_weights()`` reads the model path again): the layer serves the new files' rows, as stock
    does, not the mapping of the replaced ones; the shard views are still skipped, not read. With a
    graph holding the table, the reload is refused naming the changed file."""
    from ple_um import served

    config = h.text_config(fp8=fp8)
    first = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=fp8, seed=0)
    module = h.mapped(config, first.directory)
    backend = module.ngram_embedding
    old = backend.table
    _replace_by_rename(first.directory, h.write_table(tmp_path / "new", config, fp8=fp8, seed=5).directory)
    stock = h.stock(config, first.directory)
    assert not h.same_bits(h.forward(module, 0)[1], h.forward(stock, 0)[1])  # the old rows, mapped

    h.load(module, first.directory)
    assert backend.table is not old and old.closed
    assert backend.shards_compared == 0
    for seed in (0, 1):
        assert h.same_bits(h.forward(module, seed)[1], h.forward(stock, seed)[1])

    _replace_by_rename(first.directory, h.write_table(tmp_path / "third", config, fp8=fp8, seed=7).directory)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(served, "capturing", lambda ids: True)  # a capture (injected: no GPU here)
        h.forward(module, 0)
    assert backend.served.captured
    with pytest.raises(
        RuntimeError,
        match=r"changed on disk \(model-.*\.safetensors.*\) after CUDA graphs captured its lookup",
    ):
        h.load(module, first.directory)
    backend.close_table()


def test_a_remap_is_refused_while_graphs_hold_the_table_and_not_after_it_closed(
    world, patched, table_dir, tmp_path, monkeypatch
):
    """A lookup captured (injected: no GPU here) holds the open table: a load from another directory
    is refused, naming the move, and the table serves on. Once the layer's table is closed (its
    graphs with it), a load opens the new table and a later remap is not refused by the closed
    table's capture."""
    from ple_um import served

    monkeypatch.setenv("PLE_UM_OVERLAP", "0")  # forward's own lookup, the one captured here
    config = h.text_config(fp8=True)
    first = h.write_table(table_dir(tmp_path / "a"), config, fp8=True, seed=0)
    second = h.write_table(tmp_path / "b", config, fp8=True, seed=5)
    module = h.mapped(config, first.directory)
    backend = module.ngram_embedding
    with monkeypatch.context() as m:
        m.setattr(served, "capturing", lambda ids: True)
        h.forward(module, 0)
    assert backend.served.captured
    table_dir(second.directory)
    with pytest.raises(RuntimeError, match="moved from .* after CUDA graphs captured its lookup"):
        h.load(module, second.directory)
    assert backend.table.layout.directory == first.directory and not backend.table.closed

    backend.close_table()
    assert not backend.served.captured  # no table open: no graph holds one
    h.load(module, second.directory)
    assert backend.table.layout.directory == second.directory and not backend.served.captured
    table_dir(first.directory)
    h.load(module, first.directory)  # no graph captured the second table: remapped
    assert backend.table.layout.directory == first.directory
    stock = h.stock(config, first.directory)
    for seed in (0, 1):
        assert h.same_bits(h.forward(module, seed)[1], h.forward(stock, seed)[1])
    backend.close_table()


def test_a_dropped_model_releases_its_table(world, patched, table_dir, tmp_path):
    """No layer closes its table on its own, and none needs to: a model dropped without
    ``close_table()`` lets its table go once the garbage collector frees the layer, released on
    ``ple_um.dropped``'s thread (which never synchronizes the device): no mapping of its files left."""
    import gc
    import weakref

    from helpers.dropped_tables import drain
    from helpers.reference import maps_of

    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True, seed=0)
    module = h.mapped(config, layout.directory)
    h.forward(module, 0)
    table = weakref.ref(module.ngram_embedding.table)
    assert maps_of(layout.files)
    del module
    gc.collect()
    assert drain(60)
    assert table() is None and maps_of(layout.files) == []


def test_mode_logged_once_per_process(world, patched, table_dir, tmp_path, monkeypatch, caplog):
    import logging

    from ple_um import served
    from ple_um.vllm import backend as backend_module

    monkeypatch.setattr(served, "_reported", set())
    monkeypatch.setattr(backend_module.logger, "propagate", True)  # vLLM may route it elsewhere
    config = h.text_config(fp8=False)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=False)
    with caplog.at_level(logging.INFO, logger=backend_module.logger.name):
        first, second = h.mapped(config, layout.directory), h.mapped(config, layout.directory)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "served from" in r.getMessage()
    ]
    assert len(lines) == 1
    assert "in the cpu mode" in lines[0] and "not ats: no CUDA device" in lines[0]
    for module in (first, second):
        module.ngram_embedding.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_dp_token_gathering_as_stock(world, patched, table_dir, tmp_path, monkeypatch, dtype):
    """With the table shared across data-parallel ranks (ETP spanning DP), the backend gathers the
    DP group's ids into fixed slots and keeps its own slot, as the stock backend does. The DP group
    and the forward context are stood in for: rank 1 of 2, with 7 and 9 tokens."""
    from types import SimpleNamespace

    from vllm.models.qwen4_exp.common import ngram_embedding as common

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    stock, mapped = h.stock(config, layout.directory), h.mapped(config, layout.directory)
    g = torch.Generator().manual_seed(11)
    mine = torch.randint(0, layout.num_rows, (9, h.HEADS), generator=g)
    theirs = torch.randint(0, layout.num_rows, (7, h.HEADS), generator=g)

    class DPGroup:
        rank_in_group = 1

        def all_gather(self, ids, dim=0):
            padded = torch.cat([theirs, theirs.new_zeros(ids.shape[0] - theirs.shape[0], h.HEADS)])
            return torch.cat([padded, ids], dim=dim)

    metadata = SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([7, 9]))
    monkeypatch.setattr(common, "get_dp_group", DPGroup)
    monkeypatch.setattr(common, "get_forward_context", lambda: SimpleNamespace(dp_metadata=metadata))
    for module in (stock, mapped):
        monkeypatch.setattr(module.ngram_embedding, "etp_data_parallel_size", 2)
        monkeypatch.setattr(module.ngram_embedding, "data_parallel_rank", 1)
    expected = stock.ngram_embedding(mine)
    got = mapped.ngram_embedding(mine)
    backend = mapped.ngram_embedding
    assert got.shape == (9, h.HEADS, h.head_dim(config))
    assert h.same_bits(got, expected)
    assert h.same_bits(got, backend.table.lookup(mine, out_dtype=backend.lookup_dtype))
    mapped.ngram_embedding.close_table()


def test_forward_before_loading(world, patched, tmp_path):
    module = h.build(h.text_config(fp8=True), ple_um_on=True)
    with pytest.raises(RuntimeError, match="not open"):
        h.forward(module, 0)


def test_dummy_load_format_serves_zeros(world, patched):
    """--load-format dummy never calls load_weights: no table, zero rows (as stock's are random)."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config

    dummy = VllmConfig(device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format="dummy"))
    with set_current_vllm_config(dummy):
        module = h.build(h.text_config(fp8=True), ple_um_on=True)
    raw, _ = h.forward(module, 0)
    assert module.ngram_embedding.table is None and not raw.view(torch.uint8).any()


def _remapped_sync(config, table_dir, tmp_path):
    """A layer serving a's table (seed 0), PLE_UM_DIR then moved to b's (seed 5): (a's and b's
    layouts, the layer, stock loaded from a, b's tensors in memory as a weight sync sends them, its
    global scale last)."""
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    module = h.mapped(config, first.directory)
    stock = h.stock(config, first.directory)
    table_dir(other.directory)
    scale = h.GLOBAL_SCALE[h.table_dtype(config)]
    weights = _table_last(h.delivered(other.directory, "memory"), scale and f"ngram_embedding.{scale}")
    return first, other, module, stock, weights


def _serves_as(module, stock) -> None:
    """``module`` returns what ``stock`` returns, raw and dequantized, bit for bit."""
    for seed in (0, 1):
        raw, dequantized = h.forward(module, seed)
        expected_raw, expected = h.forward(stock, seed)
        assert h.same_bits(raw, expected_raw) and h.same_bits(dequantized, expected)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_a_sync_whose_scale_comes_first_serves_the_old_table_with_its_own_scale(
    world, patched, table_dir, tmp_path, dtype
):
    """A weight sync after a remap (PLE_UM_DIR moved from a to b) that sends b's global scale with
    its first tensors, the rest of b's table in later calls: vLLM copies b's scale into the layer at
    once, but a's table serves until b's is all in, and it serves under a's scale (a's rows as stock
    loaded from a returns them, not a's rows under b's scale). The call that completes the sync
    checks b's table against the scale the sync sent, held meanwhile, and b's table serves under it."""
    config = h.text_config(dtype=dtype)
    first, other, module, stock, weights = _remapped_sync(config, table_dir, tmp_path)
    backend = module.ngram_embedding
    old = backend.table
    assert other.scale != first.scale
    weights = weights[-1:] + weights[:-1]  # the scale first
    calls = [weights[start : start + 3] for start in range(0, len(weights), 3)]
    assert len(calls) > 2
    for weights_of_call in calls[:-1]:
        module.load_weights(iter(weights_of_call))
        assert backend.table is old and not old.closed and backend.served.staged is not None
        assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
        _serves_as(module, stock)
    module.load_weights(iter(calls[-1]))
    assert old.closed and backend.served.staged is None
    assert backend.table.layout.directory == other.directory
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == other.scale
    stock = h.stock(config, other.directory)
    _serves_as(module, stock)
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
@pytest.mark.parametrize("whole_files", [False, True], ids=["views", "whole-files"])
def test_a_reload_from_the_files_after_part_of_a_sync_serves_the_new_table(
    world, patched, table_dir, tmp_path, dtype, whole_files
):
    """A model loaded from its files as vLLM's default loader loads it (its file filter leaving out
    the files that hold only table tensors, the rest yielded as views of the files or, by its
    whole-file loaders, read into memory) serves its table (a). A weight sync after a remap
    (PLE_UM_DIR moved to b) that sends one shard of b's table in memory and stops leaves b's table
    staged, a's serving; a reload of the model from b's files, read the same way, brings all of b's
    table: b's table serves under the scale that reload loaded, as stock loaded from b serves, and
    a's is closed (not b's left staged, a's serving, nor b's closed as a sync that sent no more)."""
    from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

    assert qwen4_exp_model  # imported before the first ple-um layer is built, which patches its classes

    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    backend = holder.ple.ngram_embedding
    load_weights = _model_load_weights(lambda model, weights: model.ple.load_weights(weights))

    def reload(directory) -> None:  # vLLM's reload_weights() from the model's files
        load_weights(holder, h.checkpoint_weights(directory, model=holder, whole_files=whole_files))
        backend.quant_method.process_weights_after_loading(backend)

    reload(first.directory)
    old = backend.table
    assert old is not None and old.layout.directory == first.directory and backend.served.staged is None
    _serves_as(holder.ple, h.stock(config, first.directory))

    table_dir(other.directory)
    shard = "ngram_embedding.shard_1.weight"
    load_weights(holder, iter([(shard, dict(h.delivered(other.directory, "memory"))[shard])]))
    assert backend.table is old and not old.closed and backend.served.staged is not None

    reload(other.directory)
    assert old.closed and backend.served.staged is None and backend.stats()["staged"] is None
    assert backend.table.layout.directory == other.directory
    if h.GLOBAL_SCALE[dtype] is not None:
        assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == other.scale
    _serves_as(holder.ple, h.stock(config, other.directory))
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_a_sync_that_never_sends_the_rest_is_said_and_closed_by_the_next_load(
    world, patched, table_dir, tmp_path, dtype, caplog
):
    """A weight sync after a remap (a to b) that sends part of b's table and stops: the staged table
    is said in the log and in ``stats()["staged"]`` (its directory, what it lacks), a's table serving
    with a's scale. The next load that delivers nothing of b's table (a load of other weights, or
    of none) ends that sync: b's table is closed, said in the log, and a's serves on."""
    import logging

    config = h.text_config(dtype=dtype)
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    module = h.mapped(config, first.directory)
    backend = module.ngram_embedding
    old = backend.table
    stock = h.stock(config, first.directory)
    scale = f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"
    assert backend.stats()["staged"] is None and backend.stats()["lookups"] == old.stats()["lookups"]

    table_dir(other.directory)
    weights = dict(h.delivered(other.directory, "memory"))
    sent = [scale, "ngram_embedding.shard_1.weight"]
    with caplog.at_level(logging.INFO, logger="vllm.ple_um"):
        module.load_weights(iter([(name, weights[name]) for name in sent]))
    staged = backend.served.staged[0]
    kinds = ("weight", "weight_scale") if dtype == "nvfp4" else ("weight",)
    lacks = [f"shard_{i}.{kind}" for i in range(h.PARTS) for kind in kinds]
    lacks = [name for name in lacks if name != "shard_1.weight"]
    assert backend.stats()["staged"] == {"directory": other.directory, "lacks": lacks}
    assert any("stays staged" in r.message and "shard_0.weight" in r.message for r in caplog.records)
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.ple_um"):
        module.load_weights(iter([]))
    assert staged.closed and backend.served.staged is None and backend.stats()["staged"] is None
    assert backend.table is old and not old.closed
    assert any("lacked" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
    _serves_as(module, stock)
    backend.close_table()


def _change_first_row(path, tensor) -> None:
    """Rewrite the file at ``path`` with the first byte of ``tensor``'s first row flipped."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
    tensors[tensor].view(torch.uint8)[0, 0] ^= 1
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_shards_compared_before_the_files_were_replaced_do_not_count_for_the_new_ones(
    world, patched, table_dir, tmp_path, dtype
):
    """A weight sync after a remap (a to b) that sends b's table over several calls, b's files
    replaced after its first call by a new checkpoint that differs only in shard 0 (renamed into
    place): the shards the first call sent were compared with the old files, not the new ones, so
    the calls that send the rest leave the new table staged, lacking them, a's serving (a's rows
    under a's scale, as stock loaded from a); not the new table served with a shard 0 the sync
    never sent. Sent again, shard 0 is refused: it differs from the new files."""
    from ple_um.delivered import ReloadMismatchError

    config = h.text_config(dtype=dtype)
    changed = h.write_table(tmp_path / "c", config, seed=5)  # b's table but for shard 0
    _change_first_row(changed.shards[0].path, changed.shards[0].tensor)
    first, other, module, stock, weights = _remapped_sync(config, table_dir, tmp_path)
    backend = module.ngram_embedding
    old = backend.table
    assert weights[0][0] == "ngram_embedding.shard_0.weight"
    module.load_weights(iter(weights[:3]))
    replaced = backend.served.staged[0]
    _replace_by_rename(other.directory, changed.directory)
    module.load_weights(iter(weights[3:]))
    staged = backend.served.staged[0]
    assert replaced.closed and staged is not replaced and not staged.closed
    assert backend.table is old and not old.closed
    lacks = backend.stats()["staged"]["lacks"]
    assert "shard_0.weight" in lacks and len(lacks) == 3
    assert float(getattr(backend, h.GLOBAL_SCALE[dtype])) == first.scale
    _serves_as(module, stock)
    with pytest.raises(ReloadMismatchError, match="shard 0 at row 0 delivered in memory differs"):
        module.load_weights(iter(weights[:1]))
    assert staged.closed and backend.served.staged is None and backend.table is old and not old.closed
    _serves_as(module, stock)
    backend.close_table()


@pytest.mark.parametrize("refused", [0, 1], ids=["first-refused", "second-refused"])
def test_a_models_reload_with_one_table_refused_serves_no_new_table(
    world, patched, table_dir, tmp_path, refused
):
    """A model's reload (PLE_UM_DIR moved from a to b) reaching two PLE layers, one of which is sent
    a third checkpoint's scale (c) and refused by the check at the model's end: no layer serves b's
    table (each new table is checked before any serves), and every layer serves a's rows under a's
    scale, the one checked before the refused one and the one after it alike (the later one is not
    left staged with b's scale copied in while a's table serves)."""
    from ple_um.errors import CheckpointError
    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(dtype="fp8")
    first = h.write_table(table_dir(tmp_path / "a"), config, seed=0)
    other = h.write_table(tmp_path / "b", config, seed=5)
    third = h.write_table(tmp_path / "c", config, seed=9)
    assert len({first.scale, other.scale, third.scale}) == 3
    holder = torch.nn.Module()
    for name in ("p0", "p1"):
        holder.add_module(name, h.mapped(config, first.directory))
    layers = [holder.p0, holder.p1]
    olds = [layer.ngram_embedding.table for layer in layers]
    stock = h.stock(config, first.directory)
    scale = "ngram_embedding.weight_scale"
    sent = {}
    for index in (0, 1):
        source = third if index == refused else other
        sent[index] = [(n, t) for n, t in h.delivered(source.directory, "memory") if n == scale]

    def in_runs(model, weights):
        return model.p0.load_weights(iter(sent[0])) | model.p1.load_weights(iter(sent[1]))

    table_dir(other.directory)
    with pytest.raises(CheckpointError, match="loaded weight_scale"):
        _model_load_weights(in_runs)(holder, iter([]))
    for layer, old in zip(layers, olds, strict=True):
        backend = layer.ngram_embedding
        assert backend.table is old and not old.closed and backend.served.staged is None
        assert float(backend.weight_scale) == first.scale
        _serves_as(layer, stock)
        backend.close_table()
