"""DeepSeek-V4.1's Engram tables through the plugin (``ple_um.vllm.engram``): vLLM 0.33's real
``ParallelEngramEmbedding`` (stock: its own table, its own Triton lookup under the interpreter)
against ple-um's, both made by vLLM's real ``Engram._create_embedding`` from the same synthetic
checkpoint, bit for bit, on the CPU: TP 1 in this process, TP 2 and 4 as processes of one gloo
world (``engram_rank_worker.py``). Loading reads no byte of the table (the tensors handed over live
on the meta device); unsupported layouts are refused at build with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import vllm_harness
from helpers.vllm_engram import DIM, LAYERS, as_on_a_gpu, engram_module
from helpers.vllm_engram import engram_config as _config

from ple_um.synthetic_engram import write_engram_checkpoint

pytestmark = [pytest.mark.vllm, vllm_harness.needs_vllm]


@pytest.fixture(scope="session")
def module():
    # Session-scoped and asked for before ``world``: vLLM is first imported here, so that its Triton
    # kernels stay real (interpreted: the interpreter's variable is still set while session fixtures run).
    return engram_module()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = _config()
    path = tmp_path_factory.mktemp("engram")
    write_engram_checkpoint(
        path, tables=dict(zip(LAYERS, config.engram_num_embeddings, strict=True)), head_dim=DIM
    )
    return path


@pytest.fixture
def engram_world(module, world, monkeypatch, table_dir, checkpoint):
    """The session's gloo world with an EngramConfig, the checkpoint as PLE_UM_DIR, and the CUDA
    device vLLM's constructor asks for (its SM count) injected."""
    from helpers.vllm_patch import restore
    from vllm.config import DeviceConfig, EngramConfig, VllmConfig, set_current_vllm_config

    from ple_um.vllm import engram

    props = types.SimpleNamespace(multi_processor_count=8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    table_dir(checkpoint)
    engram.apply()
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    # Set after validation, which asks for a model config with Engram layers (the test world has none).
    object.__setattr__(config, "engram_config", EngramConfig(cpu_offload=False))
    with set_current_vllm_config(config):
        yield module
    restore(module.Engram)
    model = sys.modules.get(engram.MODEL_MODULE)  # its drop_checkpoint_cache, its model's load_weights
    if model is not None:
        restore(model)
        restore(getattr(model, engram.MODEL_CLASS))


def _tensors(path, layer):
    from safetensors import safe_open

    from ple_um.synthetic_engram import FILE_NAME, scale_name, weight_name

    with safe_open(str(path / FILE_NAME), framework="pt") as f:
        return f.get_tensor(weight_name(layer)), f.get_tensor(scale_name(layer))


def _build(module, monkeypatch, on: bool, index: int):
    monkeypatch.setenv("PLE_UM", "1" if on else "0")
    layout = module.EngramLayout(_config())
    return module.Engram._create_embedding(None, layout, index), layout


def _load(table, weight, scales) -> None:
    table.weight.weight_loader(table.weight, weight)
    table.weight_scale_inv.weight_loader(table.weight_scale_inv, scales)


def _hashes(layout, index, rng, tokens):
    """[tokens, heads] int32 row ids, each head's column inside its own prime range, its ends included."""
    sizes = [p for order in layout.primes[index] for p in order]
    starts = np.cumsum([0, *sizes[:-1]])
    cols = [rng.integers(0, size, tokens) for size in sizes]
    for col, size in zip(cols, sizes, strict=True):
        col[:2] = (0, size - 1)
    return torch.from_numpy((np.stack(cols, axis=1) + starts).astype(np.int32))


@pytest.mark.parametrize("index", [0, 1])
def test_ple_um_rows_equal_stock_bit_for_bit(engram_world, monkeypatch, checkpoint, rng, index):
    from ple_um.vllm.engram import MappedEngramEmbedding

    module = engram_world
    weight, scales = _tensors(checkpoint, LAYERS[index])
    stock, layout = _build(module, monkeypatch, False, index)
    assert type(stock) is module.ParallelEngramEmbedding
    _load(stock, weight, scales)
    ours, _ = _build(module, monkeypatch, True, index)
    assert isinstance(ours, MappedEngramEmbedding) and isinstance(ours, module.ParallelEngramEmbedding)
    assert (ours.part_n_hash_cols, ours.vocab_start_idx, ours.vocab_end_idx) == (
        stock.part_n_hash_cols,
        stock.vocab_start_idx,
        stock.vocab_end_idx,
    )
    # Handed over on the meta device: a loader that read one byte would raise.
    _load(ours, torch.empty_like(weight, device="meta"), torch.empty_like(scales, device="meta"))
    assert ours.served.table is not None and ours.served.table.rows == (
        0,
        sum(p for o in layout.primes[index] for p in o),
    )
    assert ours.weight.numel() == 0 and ours.weight_scale_inv.numel() == 0
    hashes = _hashes(layout, index, rng, 50)
    want = as_on_a_gpu(stock(hashes), weight, scales, hashes)
    got = ours(hashes)
    assert got.shape == want.shape == (50, 8, DIM) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # vLLM's layer writes into its persistent staging buffer through lookup().
    staged = torch.full((50, 8, DIM), float("nan"), dtype=torch.bfloat16)  # poisoned
    ours.lookup(hashes, staged)
    assert torch.equal(staged.view(torch.int16), want.view(torch.int16))
    ours.served.close()


def test_a_tensor_of_the_wrong_shape_is_refused(engram_world, monkeypatch, checkpoint):
    from ple_um.errors import CheckpointError

    ours, _ = _build(engram_world, monkeypatch, True, 0)
    weight, _ = _tensors(checkpoint, LAYERS[1])  # the other layer's rows: 3100, not 2700
    from ple_um.synthetic_engram import FILE_NAME, scale_name, weight_name

    path = str(checkpoint / FILE_NAME)
    with pytest.raises(CheckpointError, match="the layer expects .* \\[2700, 64\\]") as info:
        ours.weight.weight_loader(ours.weight, weight)
    # The checkpoint's own name of the layer's rows (with its prefix, as in its index) and its file.
    assert info.value.tensor == weight_name(LAYERS[0]) and LAYERS[0] == 2
    assert os.path.realpath(info.value.path) == os.path.realpath(path), str(info.value)
    _, scales = _tensors(checkpoint, LAYERS[1])
    with pytest.raises(CheckpointError, match="the layer expects") as info:
        ours.weight_scale_inv.weight_loader(ours.weight_scale_inv, scales)
    assert info.value.tensor == scale_name(LAYERS[0])
    # As vLLM's safetensors iterator delivers it (a view of the file): the file is named too.
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    view = dict(safetensors_weights_iterator([path], False))[weight_name(LAYERS[1])]
    with pytest.raises(CheckpointError, match="the layer expects") as info:
        ours.weight.weight_loader(ours.weight, view)
    assert info.value.path == os.path.realpath(path), str(info.value)
    with pytest.raises(RuntimeError, match="the table is not open"):
        ours(torch.zeros((1, 8), dtype=torch.int32))


def test_unsupported_parallel_layouts_are_refused_at_build(engram_world, monkeypatch):

    from ple_um.vllm import engram
    from ple_um.vllm.engram import EngramLayoutError

    monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: 3)
    with pytest.raises(EngramLayoutError, match="8 hash heads do not split evenly over 3 TP ranks"):
        _build(engram_world, monkeypatch, True, 0)
    monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(engram, "get_engram_dp_size", lambda: 2)
    with pytest.raises(EngramLayoutError, match="sharded over 2 DP replicas.*embedding_across_dp"):
        _build(engram_world, monkeypatch, True, 0)
    layout = engram_world.EngramLayout(_config())
    shared = engram.MappedEngramEmbedding(
        engram.geometry_of(layout), 2, cpu_offload=True, dp_shared_memory=True
    )
    assert shared.dp_size == 1 and shared.cpu_offload


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engram_rank_worker.py")


def _run_ranks(tmp, checkpoint, world_size: int) -> list[dict]:
    """``engram_rank_worker.py`` as ``world_size`` processes of one gloo world; each rank's report."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (vllm_harness.REPO, env.get("PYTHONPATH")) if p)
    env.pop("PLE_UM_DIR", None)
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(world_size), str(tmp), str(checkpoint)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=900)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    return [torch.load(os.path.join(tmp, f"rank{rank}.pt")) for rank in range(world_size)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_ranks_each_map_their_heads_and_gather_stocks_rows(tmp_path, checkpoint, world_size):
    reports = _run_ranks(tmp_path, checkpoint, world_size)
    for layer in LAYERS:
        runs = [r["layers"][layer] for r in reports]
        heads = [run["heads"] for run in runs]
        per = 8 // world_size
        assert heads == [(k * per, (k + 1) * per) for k in range(world_size)]
        for run in runs:
            assert tuple(run["table_rows"]) == tuple(run["stock_rows"])
            assert run["shape"] == (60, 8, DIM) and run["equal"] and run["nonzero"]
        ends = [run["table_rows"] for run in runs]
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False)) and ends[0][0] == 0


def test_tensors_delivered_in_memory_are_compared_with_the_files(engram_world, monkeypatch, checkpoint):
    """A load that hands the table over in memory (a weight sync, a reload from an iterator) is
    compared with the mapped files, never ignored: the table is read-only, so that rows or scales
    that differ in this rank's rows (its first and last) raise, naming the row; rows no head owns
    are not served and not compared."""
    from ple_um.delivered import ReloadMismatchError

    weight, scales = _tensors(checkpoint, LAYERS[0])
    ours, _ = _build(engram_world, monkeypatch, True, 0)
    _load(ours, weight.clone(), scales.clone())  # equal to the files: served
    assert ours.served.table is not None
    start, end = ours.vocab_start_idx, ours.vocab_end_idx
    assert end < weight.shape[0]  # rows past the last head's: in the file, served by no head
    for what, row in (("weight", start), ("weight", end - 1), ("scale", start), ("scale", end - 1)):
        changed = (weight if what == "weight" else scales).clone()
        changed.view(torch.uint8)[row, -1] ^= 1
        given = (changed, scales) if what == "weight" else (weight, changed)
        with pytest.raises(ReloadMismatchError, match=f"at row {row} delivered in memory differs"):
            _load(ours, *given)
    beyond = weight.clone()
    beyond.view(torch.uint8)[end:] ^= 1
    _load(ours, beyond, scales)
    ours.served.close()


def _loaded_and_another(module, monkeypatch, checkpoint, tmp_path, rng):
    """Another checkpoint's Engram tables (seed 7), and ple-um's first table loaded from
    ``checkpoint`` with 16 tokens' hashes of it: (the other checkpoint's path, the table, hashes)."""
    config = _config()
    other = tmp_path / "other"
    write_engram_checkpoint(
        other, tables=dict(zip(LAYERS, config.engram_num_embeddings, strict=True)), head_dim=DIM, seed=7
    )
    ours, layout = _build(module, monkeypatch, True, 0)
    _load(ours, *_tensors(checkpoint, LAYERS[0]))
    return other, ours, _hashes(layout, 0, rng, 16)


def test_a_reload_refused_by_the_comparison_leaves_the_old_table_serving(
    engram_world, monkeypatch, table_dir, checkpoint, tmp_path, rng
):
    """A reload with PLE_UM_DIR moved to another checkpoint's table whose rows differ from those the
    load delivers in memory: refused, and the old table serves on, open (the new one was never
    served), returning the rows it returned. Rows that agree then make the new table serve."""
    from ple_um.delivered import ReloadMismatchError

    other, ours, hashes = _loaded_and_another(engram_world, monkeypatch, checkpoint, tmp_path, rng)
    old = ours.served.table
    out = torch.empty(hashes.shape[0], ours.part_n_hash_cols, DIM, dtype=torch.bfloat16)
    ours.lookup(hashes, out)
    served = out.clone()

    table_dir(other)
    with pytest.raises(ReloadMismatchError, match="delivered in memory differs"):
        _load(ours, *(t.clone() for t in _tensors(checkpoint, LAYERS[0])))
    assert ours.served.table is old and not old.closed and ours.served.staged is None
    ours.lookup(hashes, out.zero_())
    assert torch.equal(out.view(torch.uint8), served.view(torch.uint8))

    _load(ours, *(t.clone() for t in _tensors(other, LAYERS[0])))
    assert old.closed and ours.served.table.layout.directory == os.path.realpath(other)
    ours.served.close()


def _stock_rows(module, monkeypatch, path, index, hashes) -> torch.Tensor:
    """The rows stock's table, loaded from the checkpoint at ``path``, returns for ``hashes`` on a GPU."""
    weight, scales = _tensors(path, LAYERS[index])
    stock, _ = _build(module, monkeypatch, False, index)
    _load(stock, weight, scales)
    return as_on_a_gpu(stock(hashes), weight, scales, hashes)


def _looked_up(ours, hashes) -> torch.Tensor:
    out = torch.full((hashes.shape[0], ours.part_n_hash_cols, DIM), float("nan"), dtype=torch.bfloat16)
    ours.lookup(hashes, out)  # into a poisoned buffer
    return out


def test_a_sync_that_sends_the_rows_before_the_scales_stages_the_new_table(
    engram_world, monkeypatch, table_dir, checkpoint, tmp_path, rng, caplog
):
    """A weight sync with PLE_UM_DIR moved to another checkpoint's table (b) that delivers b's rows in
    memory, its scales in a later call: until they come, b's table is staged, not served (the old
    table returns the rows stock loaded from the old checkpoint returns), and said in the log and in
    ``stats()["staged"]`` (its directory, that it lacks the scales). Scales that differ from b's are
    refused and close b's table, the old one serving on; b's own scales make b's table serve, the old
    one closed, returning the rows stock loaded from b returns."""
    import logging

    from ple_um.delivered import ReloadMismatchError

    other, ours, hashes = _loaded_and_another(engram_world, monkeypatch, checkpoint, tmp_path, rng)
    old = ours.served.table
    served = _stock_rows(engram_world, monkeypatch, checkpoint, 0, hashes)
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))
    assert ours.stats()["staged"] is None

    table_dir(other)
    weight, scales = _tensors(other, LAYERS[0])
    for refused in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.ple_um"):
            ours.weight.weight_loader(ours.weight, weight.clone())
        staged = ours.served.staged[0]
        assert ours.served.table is old and not old.closed and not staged.closed
        assert ours.stats()["staged"] == {
            "directory": os.path.realpath(other),
            "lacks": ["shard_0.weight_scale"],
        }
        assert any("stays staged" in r.message for r in caplog.records)
        assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))
        if refused:
            changed = scales.clone()
            changed.view(torch.uint8)[ours.vocab_start_idx, -1] ^= 1
            with pytest.raises(ReloadMismatchError, match="delivered in memory differs"):
                ours.weight_scale_inv.weight_loader(ours.weight_scale_inv, changed)
            assert staged.closed and ours.served.staged is None and ours.stats()["staged"] is None
            assert ours.served.table is old and not old.closed
            assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))
    ours.weight_scale_inv.weight_loader(ours.weight_scale_inv, scales.clone())
    assert old.closed and ours.served.table is staged and ours.served.staged is None
    assert ours.stats()["staged"] is None
    want = _stock_rows(engram_world, monkeypatch, other, 0, hashes)
    assert not torch.equal(want.view(torch.int16), served.view(torch.int16))
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), want.view(torch.int16))
    ours.close_table()


@pytest.mark.parametrize(
    ("cpu_offload", "mode", "breakable", "refused"),
    [
        (False, "FULL_AND_PIECEWISE", True, True),
        (False, "PIECEWISE", True, True),
        (False, "NONE", False, False),
        (True, "FULL", True, True),
        (True, "PIECEWISE", False, True),
        (True, "PIECEWISE", True, False),
    ],
)
def test_a_table_that_waits_for_the_device_is_refused_under_graphs_that_capture_it(
    engram_world, monkeypatch, checkpoint, cpu_offload, mode, breakable, refused
):
    """The cpu mode without its C row copy (PLE_UM_ROWCOPY=0) waits for the device, so its lookup
    can only run in an eager break: vLLM's Engram layer makes one around its prefetch (cpu_offload
    on) in breakable piecewise graphs, and none for its inline lookup (cpu_offload off). Where the
    graphs would capture the lookup, the load fails naming the flags, as for a PLE layer, and nothing
    stays open; where they would not, the table serves stock's rows."""
    from vllm.config import CUDAGraphMode, get_current_vllm_config

    monkeypatch.setenv("PLE_UM_ROWCOPY", "0")
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1" if breakable else "0")
    config = get_current_vllm_config()
    monkeypatch.setattr(config.compilation_config, "cudagraph_mode", CUDAGraphMode[mode])
    monkeypatch.setattr(config.engram_config, "cpu_offload", cpu_offload)
    weight, scales = _tensors(checkpoint, LAYERS[0])
    ours, layout = _build(engram_world, monkeypatch, True, 0)
    if refused:
        with pytest.raises(RuntimeError, match="waits for the device.*cudagraph_mode=") as info:
            _load(ours, weight, scales)
        assert "cpu mode" in str(info.value) and ours.served.table is None
        return
    _load(ours, weight, scales)
    assert ours.served.table.mode == "cpu" and not ours.served.table.capture_safe
    monkeypatch.setattr(config.engram_config, "cpu_offload", False)  # stock's pinned copy needs a GPU
    stock, _ = _build(engram_world, monkeypatch, False, 0)
    _load(stock, weight, scales)
    hashes = _hashes(layout, 0, np.random.default_rng(3), 20)
    want = as_on_a_gpu(stock(hashes), weight, scales, hashes)
    assert torch.equal(ours(hashes).view(torch.int16), want.view(torch.int16))
    ours.served.close()


def test_use_thp_keeps_the_page_cache_the_tables_are_read_from(engram_world, monkeypatch, tmp_path, caplog):
    """With use_thp, DeepSeek-V4.1's model releases every checkpoint file's page cache (vLLM's
    ``drop_checkpoint_cache``: POSIX_FADV_DONTNEED) to give its huge-page Engram host tables memory,
    before building them and after loading. With PLE_UM set there are no host tables and the
    Engram tables are read from those pages: they stay (they were dropped), and the log says why.
    With it unset the stock release runs."""
    import inspect
    import logging

    from vllm.models.deepseek_v41.nvidia import model

    from ple_um.residency import cached_pages
    from ple_um.synthetic_engram import FILE_NAME
    from ple_um.vllm import engram

    # vLLM calls it by the name its model module imported: the name the plugin replaces.
    load_weights = inspect.unwrap(model.DeepseekV41LLMForCausalLM.load_weights)  # the plugin wraps it
    for method in (model.DeepseekV4Model.__init__, load_weights):
        assert "drop_checkpoint_cache" in method.__code__.co_names
    tables = dict(zip(LAYERS, _config().engram_num_embeddings, strict=True))
    write_engram_checkpoint(tmp_path, tables=tables, head_dim=DIM, write_back=True)
    path = os.fspath(tmp_path / FILE_NAME)

    def cached_around_the_release(ple_um_on: bool) -> tuple[int, int]:
        monkeypatch.setenv("PLE_UM", "1" if ple_um_on else "0")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            assert len(os.pread(fd, size, 0)) == size  # the whole file into the page cache
            before = cached_pages(fd, 0, size)
            model.drop_checkpoint_cache(os.fspath(tmp_path))
            return before, cached_pages(fd, 0, size)
        finally:
            os.close(fd)

    before, after = cached_around_the_release(False)
    if before is None or after != 0:
        pytest.skip("the page cache keeps this file (tmpfs?) or cachestat is missing: no release to see")
    monkeypatch.setattr(engram.logger, "propagate", True)  # vLLM may route it elsewhere
    with caplog.at_level(logging.INFO, logger=engram.logger.name):
        before, after = cached_around_the_release(True)
    assert before > 0 and after == before
    said = [r.getMessage() for r in caplog.records if r.name == engram.logger.name]
    assert said == [
        f"ple-um: use_thp: the page cache of the checkpoint in {tmp_path} is kept: vLLM releases it to "
        "give its huge-page Engram host tables memory, and with PLE_UM there are none; the Engram "
        "tables are read from those pages"
    ]


def _text_model(layer):
    """vLLM's DeepSeek-V4.1 text model class (its ``load_weights``, as the plugin patched it, with
    its checkpoint-name mapper) over a decoder stand-in that holds only the Engram layer ``layer``
    of model layer ``LAYERS[0]``, where vLLM's decoder holds it (``layers.<L>.engram.embed_tokens``):
    vLLM's ``AutoWeightsLoader`` hands its tensors to its parameters' weight loader. The decoder's
    own building (attention, experts) needs a GPU."""
    from torch import nn
    from vllm.models.deepseek_v41.nvidia import model as models

    class Decoder(nn.Module):  # what the text model's load_weights reads of DeepseekV4Model
        def __init__(self):
            super().__init__()
            engram = nn.Module()
            engram.embed_tokens = layer
            holder = nn.Module()
            holder.engram = engram
            self.layers = nn.ModuleDict({str(LAYERS[0]): holder})
            self.vllm_config = types.SimpleNamespace(engram_config=None)

        def finalize_mhc_broadcast_weights(self):
            pass

    cls = models.DeepseekV41LLMForCausalLM
    text = cls.__new__(cls)
    nn.Module.__init__(text)
    text.model = Decoder()
    return text


def test_a_failed_model_load_leaves_nothing_for_the_next_one(
    engram_world, monkeypatch, table_dir, checkpoint, tmp_path, rng, caplog
):
    """A model load that fails in vLLM's loader after the Engram rows of another checkpoint (b,
    PLE_UM_DIR moved) arrived in memory: b's table is closed, not left staged, and nothing of that
    load carries over: the old table serves on. A next load that sends b's scales alone then stages
    b's table, lacking its rows (the failed load's rows do not complete it); a load that sends them
    makes it serve, returning the rows stock loaded from b returns."""
    import logging

    from ple_um.synthetic_engram import scale_name, weight_name

    config = _config()
    other = tmp_path / "other"
    write_engram_checkpoint(
        other, tables=dict(zip(LAYERS, config.engram_num_embeddings, strict=True)), head_dim=DIM, seed=7
    )
    ours, layout = _build(engram_world, monkeypatch, True, 0)
    text = _text_model(ours)
    names = [weight_name(LAYERS[0]), scale_name(LAYERS[0])]  # as the checkpoint names them
    mapped = [name for name, _ in text.hf_to_vllm_mapper.apply((name, None) for name in names)]
    embed = f"model.layers.{LAYERS[0]}.engram.embed_tokens"
    assert mapped == [f"{embed}.weight", f"{embed}.weight_scale_inv"]  # vLLM's names of our parameters
    text.load_weights(list(zip(names, (t.clone() for t in _tensors(checkpoint, LAYERS[0])), strict=True)))
    old = ours.served.table
    assert old is not None and ours.served.staged is None
    hashes = _hashes(layout, 0, rng, 16)
    served = _stock_rows(engram_world, monkeypatch, checkpoint, 0, hashes)
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))

    table_dir(other)
    weight, scales = _tensors(other, LAYERS[0])
    with pytest.raises(ValueError, match="no module or parameter named"):
        text.load_weights([(names[0], weight.clone()), ("layers.9.ffn.gate.weight", torch.zeros(1))])
    assert ours.served.table is old and not old.closed and ours.served.staged is None
    assert ours.stats()["staged"] is None and not ours.deliveries().names and not ours._received
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))

    with caplog.at_level(logging.INFO, logger="vllm.ple_um"):
        text.load_weights([(names[1], scales.clone())])
    assert any("stays staged" in r.message for r in caplog.records)
    staged = ours.served.staged[0]
    assert ours.served.table is old and not old.closed
    assert ours.stats()["staged"] == {"directory": os.path.realpath(other), "lacks": ["shard_0.weight"]}
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), served.view(torch.int16))

    text.load_weights([(names[0], weight.clone())])
    assert old.closed and ours.served.table is staged and ours.served.staged is None
    want = _stock_rows(engram_world, monkeypatch, other, 0, hashes)
    assert not torch.equal(want.view(torch.int16), served.view(torch.int16))
    assert torch.equal(_looked_up(ours, hashes).view(torch.int16), want.view(torch.int16))
    ours.close_table()
