"""The ple-um backend inside vLLM 0.33's real Qwen4ExpNGramEmbedding, against the stock device backend.

Both are built from the same small config and loaded through the real ``load_weights`` from the same
synthetic checkpoint (FP8, BF16 or NVFP4), fed by vLLM's own safetensors iterator; their forward
outputs must be equal bit for bit, raw and after ``dequantize()``.
"""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h
from torch.utils._pytree import tree_map

import ple_um

pytestmark = [pytest.mark.vllm, h.needs_vllm]


@pytest.fixture(params=["fp8", "bf16", "nvfp4"])
def dtype(request):
    return request.param


# The raw rows' dtype (NVFP4: decoded to the layer's params_dtype, bf16 here) and the global scale.
RAW_DTYPE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "nvfp4": torch.bfloat16}
GLOBAL_SCALE = {"fp8": "weight_scale", "bf16": None, "nvfp4": "weight_scale_2"}
METHOD = {
    "fp8": "Qwen4ExpPLEFp8EmbeddingMethod",
    "bf16": "Qwen4ExpPLEUnquantizedEmbeddingMethod",
    "nvfp4": "Qwen4ExpPLENvFp4EmbeddingMethod",
}
# Shard tensors per shard: the rows, and NVFP4's block scales.
PER_SHARD = {"fp8": 1, "bf16": 1, "nvfp4": 2}


def _stock(config, directory):
    module = h.build(config, ple_um_on=False)
    h.load(module, directory)
    return module


def _mapped(config, directory):
    module = h.build(config, ple_um_on=True)
    h.load(module, directory)
    return module


@pytest.mark.parametrize("overlap", [True, False])
def test_matches_stock_bit_for_bit(world, patched, table_dir, tmp_path, dtype, overlap, monkeypatch):
    """Through vLLM's prefetch hook (start_prefetch one layer ahead, finalize_prefetch in forward:
    PLE_UM_OVERLAP, the default) and through forward's own lookup."""
    monkeypatch.setenv("PLE_UM_OVERLAP", "1" if overlap else "0")
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    assert layout.is_nvfp4 == (dtype == "nvfp4")
    stock = _stock(config, layout.directory)
    mapped = _mapped(config, layout.directory)
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
    scale = GLOBAL_SCALE[dtype]
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
    module = _mapped(config, layout.directory)
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


class _Touch(torch.Tensor):
    """A tensor from the loader that records every aten op run on it or on a view of it."""

    @staticmethod
    def __new__(cls, inner, name, log):
        tensor = torch.Tensor._make_subclass(cls, inner)
        tensor._inner, tensor._name, tensor._log = inner, name, log
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        touched = []

        def unwrap(x):
            if isinstance(x, _Touch):
                x._log.append((x._name, str(func)))
                touched.append(x)
                return x._inner
            return x

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

        def rewrap(r):  # views stay recorded (narrow, then copy_)
            if isinstance(r, torch.Tensor) and not isinstance(r, _Touch):
                for source in touched:
                    if r.untyped_storage().data_ptr() == source._inner.untyped_storage().data_ptr():
                        return _Touch(r, source._name, source._log)
            return r

        return tree_map(rewrap, result)


def _recording(directory, log):
    for name, tensor in h.checkpoint_weights(directory):
        yield name, _Touch(tensor, name, log)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_loading_reads_no_shard(world, patched, table_dir, tmp_path, dtype):
    """With the plugin on, load_weights never runs an op on a shard tensor (no byte is read: for
    NVFP4 neither the packed rows nor the block scales); the global scale loads as stock. The same
    recording shows the stock backend copying every shard tensor."""
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    scale = f"ngram_embedding.{GLOBAL_SCALE[dtype]}"
    sharded = {"ngram_embedding.weight"} | ({"ngram_embedding.weight_scale"} if dtype == "nvfp4" else set())

    log: list[tuple[str, str]] = []
    mapped = h.build(config, ple_um_on=True)
    loaded = mapped.load_weights(_recording(layout.directory, log))
    assert sharded | {scale} <= loaded
    assert not [entry for entry in log if ".shard_" in entry[0]]
    assert any(name == scale for name, _ in log)
    assert mapped.ngram_embedding.shards_skipped == h.PARTS * PER_SHARD[dtype]
    assert mapped.ngram_embedding.shards_compared == 0

    log.clear()
    stock = h.build(config, ple_um_on=False)
    assert stock.load_weights(_recording(layout.directory, log)) >= sharded | {scale}
    copied = {name for name, op in log if ".shard_" in name and op.startswith("aten.copy_")}
    assert len(copied) == h.PARTS * PER_SHARD[dtype]
    mapped.ngram_embedding.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_shard_files_are_not_even_opened(world, patched, table_dir, tmp_path, dtype):
    """vLLM's file filter, fed the model's is_unused_checkpoint_weight, drops the files that hold
    only shard tensors (NVFP4: rows and block scales): loaders that read whole files (eager,
    prefetch, fastsafetensors) skip them."""
    from vllm.model_executor.model_loader.weight_utils import filter_safetensors_files_by_weight_name
    from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    mapped = h.build(config, ple_um_on=True)  # the first ple-um layer patches the model classes
    holder = torch.nn.Module()
    holder.add_module("ple", mapped)
    for cls in (qwen4_exp_model.Qwen4ExpForCausalLM, qwen4_exp_model.Qwen4ExpForConditionalGeneration):
        unused = cls.is_unused_checkpoint_weight
        assert unused(holder, ple_um.synthetic.shard_name(h.LAYER, 0))
        assert not unused(holder, ple_um.synthetic.scale_name(h.LAYER))
        assert not unused(holder, ple_um.synthetic.UNRELATED_NAME)
        assert unused(holder, ple_um.synthetic.block_scale_name(h.LAYER, 3))
        assert not unused(holder, ple_um.synthetic.global_scale_name(h.LAYER))
        assert not unused(torch.nn.Module(), ple_um.synthetic.shard_name(h.LAYER, 0))  # no ple-um layer
        files = sorted(set(layout.files) | {s.path for s in layout.shards})
        kept = filter_safetensors_files_by_weight_name(files, lambda name, u=unused: u(holder, name))
        assert kept == [files[-1]]  # the last file also holds the scale and an unrelated tensor


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_reload_from_memory_is_compared(world, patched, table_dir, tmp_path, dtype):
    """Shard tensors delivered in memory are compared with the mapped files (NVFP4: the packed rows
    through lookup_packed's bytes, and the block scales through its scales)."""
    from ple_um.vllm.backend import ReloadMismatchError

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    module = _mapped(config, layout.directory)
    backend = module.ngram_embedding

    in_memory = [(name, tensor.clone()) for name, tensor in h.checkpoint_weights(layout.directory)]
    module.load_weights(iter(in_memory))  # the same rows: accepted
    assert backend.shards_compared == h.PARTS * PER_SHARD[dtype]

    cases = [("shard_3.weight", "shard 3 "), ("shard_3.weight_scale", "shard 3 block scales")]
    for changed_name, what in cases[: PER_SHARD[dtype]]:
        changed = []
        for name, tensor in in_memory:
            if name == f"ngram_embedding.{changed_name}":
                tensor = tensor.clone()
                tensor.view(torch.uint8)[17, 1] ^= 1
            changed.append((name, tensor))
        with pytest.raises(ReloadMismatchError) as info:
            module.load_weights(iter(changed))
        message = str(info.value)
        assert what in message and "row 566" in message, message  # 3 * 183 + 17
        assert changed_name in message  # the tensor named
    backend.close_table()


def test_reload_from_another_directory_remaps(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=True)
    first = h.write_table(table_dir(tmp_path / "a"), config, fp8=True, seed=0)
    second = h.write_table(tmp_path / "b", config, fp8=True, seed=5)
    module = _mapped(config, first.directory)
    old = module.ngram_embedding.table

    table_dir(second.directory)
    h.load(module, second.directory)
    backend = module.ngram_embedding
    assert backend.table is not old and old.closed
    assert backend.table.layout.directory == second.directory
    assert backend.shards_compared == 0  # the new files were mapped, not read

    stock = _stock(config, second.directory)
    for seed in (0, 1):
        assert h.same_bits(h.forward(module, seed)[1], h.forward(stock, seed)[1])
    backend.close_table()


def test_amd_variant_matches_stock(world, table_dir, tmp_path):
    """The ROCm Qwen4ExpNGramEmbedding (another constructor signature) takes the same patch; its
    lookup op copies the backend's rows into a params_dtype buffer, then the layer dequantizes."""
    from vllm.models.qwen4_exp.amd import ple_layer

    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding
    from ple_um.vllm.patch import patch_ngram_class, unpatch_ngram_class

    patch_ngram_class(ple_layer)
    try:
        config = h.text_config(fp8=True)
        layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
        stock = h.build_amd(config, ple_um_on=False)
        h.load(stock, layout.directory)
        mapped = h.build_amd(config, ple_um_on=True)
        h.load(mapped, layout.directory)
        assert isinstance(mapped.ngram_embedding, Qwen4ExpPLEMappedEmbedding)
        ids = torch.randint(0, layout.num_rows, (40, h.HEADS), generator=torch.Generator().manual_seed(4))
        outputs = []
        for module in (stock, mapped):
            embedding = module.ngram_embedding
            output = ids.new_empty((ids.shape[0], config.ple_embed_dim), dtype=embedding.params_dtype)
            output.copy_(embedding(ids).flatten(-2))  # qwen4_exp_amd_ple_ngram_embedding's body
            outputs.append(embedding.dequantize(output, torch.bfloat16))
        assert h.same_bits(*outputs) and outputs[0].any()
        mapped.ngram_embedding.close_table()
    finally:
        unpatch_ngram_class(ple_layer)


def test_model_load_opens_tables_never_given_weights(world, patched, table_dir, tmp_path):
    """When vLLM's file filter leaves a layer no tensor at all (BF16 shards in their own files), the
    model-level hook still opens its table after the model's load_weights."""
    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(fp8=False)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=False)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    calls = []
    load_weights = _model_load_weights(lambda model, weights: calls.append(list(weights)) or {"x"})
    assert load_weights(holder, iter([])) == {"x"} and calls == [[]]
    backend = holder.ple.ngram_embedding
    assert backend.table is not None and backend.table.layout.directory == layout.directory
    assert backend.shards_skipped == 0
    stock = _stock(config, layout.directory)
    assert h.same_bits(h.forward(holder.ple, 0)[0], h.forward(stock, 0)[0])
    backend.close_table()


def test_mode_logged_once_per_process(world, patched, table_dir, tmp_path, monkeypatch, caplog):
    import logging

    from ple_um.vllm import backend as backend_module

    monkeypatch.setattr(backend_module, "_reported", False)
    monkeypatch.setattr(backend_module.logger, "propagate", True)  # vLLM may route it elsewhere
    config = h.text_config(fp8=False)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=False)
    with caplog.at_level(logging.INFO, logger=backend_module.logger.name):
        first, second = _mapped(config, layout.directory), _mapped(config, layout.directory)
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
    stock, mapped = _stock(config, layout.directory), _mapped(config, layout.directory)
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


def test_prefetch_buffer_grows_until_a_graph_captured_it(world, patched, table_dir, tmp_path):
    """vLLM sizes the prefetch buffer for max_total_tokens; an eager batch beyond it grows the buffer,
    unless a CUDA graph has captured a lookup into it (then the batch is refused, naming the sizes)."""
    config = h.text_config(dtype="fp8")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    backend = _mapped(config, layout.directory).ngram_embedding
    prefetches, dtype = backend.prefetches, backend.lookup_dtype
    heads = 4

    def out(rows):
        return prefetches.out(
            rows, torch.zeros((rows, heads), dtype=torch.long), dtype, fixed=backend.graphs.lookup
        )

    small = out(3)
    big = out(prefetches.rows + 5)
    assert small.shape[1:] == big.shape[1:] == (heads, backend.embedding_dim)
    assert big.shape[0] == prefetches.rows + 5 and prefetches.buffer.shape[0] >= big.shape[0]
    backend.graphs.lookup = True
    with pytest.raises(ValueError, match="prefetch buffer holds"):
        out(prefetches.buffer.shape[0] + 1)
    backend.close_table()


def test_rocm_layer_takes_no_prefetch_hook(world, patched, monkeypatch):
    """ROCm's Qwen4ExpNGramEmbedding has no prefetch wiring and sends a backend that declares the hook
    down the pinned backend's branch (sync_lookup, which this backend lacks): there the backend
    declares none, and the layer calls its forward; the NVIDIA layer keeps the hook."""
    from vllm.models.qwen4_exp.amd import ple_layer

    from ple_um.vllm.patch import patch_ngram_class, unpatch_ngram_class

    monkeypatch.setenv("PLE_UM_OVERLAP", "1")
    config = h.text_config(fp8=True)
    assert h.build(config, ple_um_on=True).ngram_embedding.supports_prefetch
    patch_ngram_class(ple_layer)
    try:
        assert not h.build_amd(config, ple_um_on=True).ngram_embedding.supports_prefetch
    finally:
        unpatch_ngram_class(ple_layer)


def test_breakable_piecewise_capture_keeps_the_lookup_in_its_segment(monkeypatch):
    """Under vLLM's breakable capture in a mode other than FULL an attention op ends the graph
    segment between start_prefetch and finalize_prefetch, so the prefetch must not fork a side
    stream there; FULL captures (no breaks) and eager calls may. The capture state is injected (a
    capture needs a GPU), the decision is the backend's own."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config import CUDAGraphMode

    from ple_um.vllm import capture as rules

    assert not rules.segments_end_before_join()  # no capture
    capture = BreakableCUDAGraphCapture()
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", capture, raising=False)
    assert not rules.segments_end_before_join()  # between segments (not capturing)
    capture._capturing = True
    assert rules.segments_end_before_join()  # no forward context: as vLLM's own decorator decides
    monkeypatch.setattr(rules, "is_forward_context_available", lambda: True)
    for mode, ends in ((CUDAGraphMode.PIECEWISE, True), (CUDAGraphMode.FULL, False)):
        context = type("context", (), {"cudagraph_runtime_mode": mode})()
        monkeypatch.setattr(rules, "get_forward_context", lambda context=context: context)
        assert rules.segments_end_before_join() is ends
