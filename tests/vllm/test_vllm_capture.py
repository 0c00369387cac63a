"""The CUDA-graph rules (``ple_um.vllm.backend``). With its host node (the C row copy, the default)
the cpu mode is capture-safe: every graph mode is accepted and the lookup never becomes an eager
break. Without it (PLE_UM_ROWCOPY=0, or no C compiler) its lookup waits for the device and runs in
vLLM's eager break, and a graph mode that cannot break fails at start-up naming the flags to use.
The prefetch forks no side stream where a graph segment ends before its join, and graphs that
captured the zero rows of a dummy load refuse a table opened later. (Capture itself runs on a GPU:
tests/gpu; a CPU-only host has only the cpu mode, and the capture state is injected here.)"""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

pytestmark = [pytest.mark.vllm, h.needs_vllm]


@pytest.fixture
def cudagraph(world, monkeypatch):
    """``cudagraph(mode_name, breakable)``: the world's compilation config as vLLM would resolve it."""
    from vllm.config import CUDAGraphMode

    def use(mode: str, breakable: bool) -> None:
        monkeypatch.setattr(world.compilation_config, "cudagraph_mode", CUDAGraphMode[mode])
        monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1" if breakable else "0")

    return use


@pytest.mark.parametrize(
    ("mode", "breakable"),
    [("FULL_AND_PIECEWISE", True), ("FULL", True), ("FULL_DECODE_ONLY", False), ("PIECEWISE", False)],
)
def test_synchronous_cpu_mode_refuses_graphs_it_cannot_break(
    patched, table_dir, tmp_path, cudagraph, mode, breakable, monkeypatch
):
    monkeypatch.setenv("PLE_UM_ROWCOPY", "0")
    cudagraph(mode, breakable)
    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(RuntimeError) as info:
        h.load(module, layout.directory)
    message = str(info.value)
    assert "cpu mode" in message and mode in message
    assert "-cc.cudagraph_mode=PIECEWISE" in message and "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in message
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize(
    ("rowcopy", "mode", "breakable"),
    [
        ("0", "PIECEWISE", True),
        ("0", "NONE", False),
        ("0", "NONE", True),
        ("1", "FULL_AND_PIECEWISE", True),
        ("1", "FULL", False),
        ("1", "FULL_DECODE_ONLY", False),
        ("1", "PIECEWISE", False),
    ],
)
def test_cpu_mode_serves_the_graph_modes_it_can(
    patched, table_dir, tmp_path, cudagraph, monkeypatch, rowcopy, mode, breakable
):
    """Accepted at start-up, and the layer's forward equals stock's bit for bit."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    cudagraph(mode, breakable)
    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    module = h.build(config, ple_um_on=True)
    h.load(module, layout.directory)
    table = module.ngram_embedding.table
    assert table.mode == "cpu" and table.capture_safe == (rowcopy == "1")
    stock = h.build(config, ple_um_on=False)
    h.load(stock, layout.directory)
    for seed in (0, 1):
        raw, deq = h.forward(module, seed)
        assert raw.view(torch.uint8).any(), "vacuous: all rows zero"
        raw_stock, deq_stock = h.forward(stock, seed)
        assert h.same_bits(raw, raw_stock) and h.same_bits(deq, deq_stock)
    module.ngram_embedding.close_table()


class _Capture:
    """Stands in for vLLM's BreakableCUDAGraphCapture (which needs a GPU): records eager segments."""

    _capturing = True

    def __init__(self):
        self.segments = []

    def add_eager(self, fn):
        self.segments.append(fn)
        return fn()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("rowcopy", ["0", "1"])
def test_only_the_synchronous_lookup_is_an_eager_break(
    patched, table_dir, tmp_path, monkeypatch, dtype, rowcopy
):
    """Under a breakable capture the synchronous cpu-mode lookup becomes an eager segment; replaying
    it after new ids were written into the same buffer gathers the new rows into the same output
    (NVFP4: decoded into the layer's params_dtype). The host node's lookup never does."""
    from vllm.compilation import breakable_cudagraph

    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    module = h.build(config, ple_um_on=True)
    h.load(module, layout.directory)
    backend = module.ngram_embedding
    table = backend.table

    ids = torch.tensor([[0, 182, 183, 1279], [5, 700, 900, 64]])
    out = torch.empty((2, 4, h.head_dim(config)), dtype=backend.lookup_dtype)
    out.view(torch.uint8).fill_(0x7F)
    capture = _Capture()
    # weak_ref_tensor needs vLLM's CUDA extension; identity is what it means for these CPU tensors.
    monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensor", lambda t: t)
    monkeypatch.setattr(breakable_cudagraph.BreakableCUDAGraphCapture._tls, "active", capture, raising=False)
    backend.lookup_rows(ids, out)
    if rowcopy == "1":
        assert not capture.segments and table.capture_safe
        assert h.same_bits(out, table.lookup(ids, out_dtype=out.dtype))
        raw, _ = h.forward(module, 0)
        assert not capture.segments
        monkeypatch.undo()
        assert h.same_bits(raw, h.forward(module, 0)[0])
        backend.close_table()
        return
    assert len(capture.segments) == 1
    assert h.same_bits(out, table.lookup(ids, out_dtype=out.dtype))

    ids.copy_(torch.tensor([[1, 2, 3, 4], [1000, 1001, 1002, 1003]]))
    capture.segments[0]()  # the replay of the eager segment
    assert h.same_bits(out, table.lookup(ids, out_dtype=out.dtype))

    raw, _ = h.forward(module, 0)  # a whole forward under capture: one eager segment per lookup
    assert len(capture.segments) == 2
    monkeypatch.undo()
    assert h.same_bits(raw, h.forward(module, 0)[0])
    backend.close_table()


def test_breakable_piecewise_capture_keeps_the_lookup_in_its_segment(monkeypatch):
    """Under vLLM's breakable capture in a mode other than FULL an attention op ends the graph
    segment between start_prefetch and finalize_prefetch, so the prefetch must not fork a side
    stream there; FULL captures (no breaks) and eager calls may. The capture state is injected (a
    capture needs a GPU), the decision is the backend's own."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config import CUDAGraphMode

    from ple_um.vllm import backend as rules

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


def test_a_dummy_graph_of_zero_rows_refuses_a_table_opened_later(
    world, patched, table_dir, tmp_path, monkeypatch
):
    """--load-format dummy, then a graph captures the zero fill (the capture injected: no GPU here),
    then real weights arrive (an RL weight sync): the graphs would replay zeros for ever, so the
    load refuses and says what to do; without a capture the same load opens the table."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config

    from ple_um.vllm import backend

    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    monkeypatch.setenv("PLE_UM_DIR", layout.directory)  # the dummy config names no model path
    dummy = VllmConfig(device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format="dummy"))
    for captured in (False, True):
        with set_current_vllm_config(dummy):
            module = h.build(config, ple_um_on=True)
        with monkeypatch.context() as m:
            m.setattr(backend, "capturing", lambda ids, captured=captured: captured)
            raw, _ = h.forward(module, 0)
        assert not raw.view(torch.uint8).any()
        if captured:
            with pytest.raises(RuntimeError, match="as zero rows.*before graph capture"):
                h.load(module, layout.directory)
            assert module.ngram_embedding.table is None
        else:
            h.load(module, layout.directory)
            assert module.ngram_embedding.table is not None
            module.ngram_embedding.close_table()
