"""Early lookups (``ple_um.vllm.early``): the step's first PLE layer starts every PLE layer's lookup.

Three real Qwen4ExpNGramEmbedding layers (decoder layers 1, 3 and 5: dense PLE indices 0, 1, 2,
each with its own hash multipliers and table) are built twice, stock and ple-um, each loaded through
vLLM's real load_weights from its own synthetic checkpoint, and driven in the order Qwen4Exp's
model drives them: a layer's start_prefetch one decoder layer ahead, then its forward (whose
finalize_prefetch takes the rows). A CPU device cannot fork a side stream, so ``on`` is what runs
the early path here (``auto`` keeps each layer on its own there); the side stream and a FULL graph
capture of it run on the GPU (tests/gpu/test_gpu_early.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import vllm_harness as h
from torch import nn

pytestmark = [pytest.mark.vllm, h.needs_vllm]

LAYERS = ((1, 0), (3, 1), (5, 2))  # (decoder layer, dense PLE index)
MAX_TOKENS = 64


class _Model(nn.Module):
    """Holds the ple-um layers as a model does (``link_model`` finds them by walking modules)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


@pytest.fixture
def three_layers(world, patched, tmp_path, monkeypatch):
    """``make(dtype)`` -> (stock layers, ple-um layers, layouts), in layer order; tables closed after."""
    opened = []
    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)

    def make(dtype: str):
        config = h.text_config(dtype=dtype)
        stock, mapped, layouts = [], [], []
        for layer, dense in LAYERS:
            directory = tmp_path / f"ckpt{layer}"
            layout = h.write_table(
                directory, config, layer=layer, num_rows=h.table_rows(config, dense), seed=layer + 10
            )
            monkeypatch.setenv("PLE_UM_DIR", str(directory))
            args = dict(
                prefix=f"model.layers.{layer}.ple.ple_embedding", dense_id=dense, max_tokens=MAX_TOKENS
            )
            stock.append(h.stock(config, directory, **args))
            mapped.append(h.mapped(config, directory, **args))
            opened.append(mapped[-1].ngram_embedding)
            layouts.append(layout)
        return stock, mapped, layouts

    yield make
    for backend in opened:
        backend.close_table()


def _lookups(module) -> int:
    return module.ngram_embedding.table.stats()["lookups"]


def _step(stock, mapped, layouts, seed: int, tokens: int, *, early: bool) -> None:
    """One step as the model runs it, checked: after the first layer's start_prefetch every layer's
    lookup has run (``early``) or only the first one's; each layer looks its rows up once; every
    layer's output is stock's, raw and dequantized, bit for bit, and its rows are the files'."""
    ids, query_start_loc, ngram_context = h.inputs(seed, tokens=tokens)
    for module in mapped:
        if (buffer := module.ngram_embedding.overlapped.buffer) is not None:
            buffer.view(torch.uint8).fill_(0x7F)  # poisoned: a row not written shows
    before = [_lookups(module) for module in mapped]
    with torch.no_grad():
        mapped[0].start_prefetch(ids, query_start_loc, ngram_context)
        for index, (s, module, layout) in enumerate(zip(stock, mapped, layouts, strict=True)):
            started = module.ngram_embedding.overlapped.started
            if early or index == 0:
                assert started is not None and _lookups(module) == before[index] + 1
                expected = h.file_rows(layout, s.compute_ngram_ids(ids, query_start_loc, ngram_context))
                assert h.same_bits(started[0], expected) and expected.view(torch.uint8).any()
            else:
                assert started is None and _lookups(module) == before[index]
        for index, (s, module) in enumerate(zip(stock, mapped, strict=True)):
            if index:
                module.start_prefetch(ids, query_start_loc, ngram_context)  # one decoder layer ahead
            raw = module(None, ids, query_start_loc, ngram_context)
            raw_stock = s(None, ids, query_start_loc, ngram_context)
            assert h.same_bits(raw, raw_stock)
            dequantize = module.ngram_embedding.dequantize
            assert h.same_bits(
                dequantize(raw, torch.bfloat16), s.ngram_embedding.dequantize(raw_stock, torch.bfloat16)
            )
    assert [_lookups(module) for module in mapped] == [b + 1 for b in before]


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_first_layer_starts_every_lookup_of_the_step(three_layers, monkeypatch, dtype):
    """PLE_UM_EARLY_LOOKUPS=on: the first layer's start looks every layer's rows up (each with its
    own ids, as vLLM computes them), the later starts of the same forward find theirs started, and
    every output equals stock's; steps of other sizes and fresh tokens follow."""
    from ple_um.vllm import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "on")
    stock, mapped, layouts = three_layers(dtype)
    group = early.link_model(_Model([mapped[2], mapped[0], mapped[1]]))  # found in layer order
    assert group.layers == mapped and all(m.ngram_embedding.early is group for m in mapped)
    assert early.link_model(_Model(mapped)) is group  # a second load keeps the group
    for seed, tokens in ((0, 61), (1, 17), (2, MAX_TOKENS)):
        _step(stock, mapped, layouts, seed, tokens, early=True)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_each_layer_on_its_own_where_early_lookups_do_not_apply(three_layers, monkeypatch, mode):
    """``off``, and ``auto`` where the lookups cannot go on a side stream (a CPU device): each layer's
    start looks up its own rows one decoder layer ahead, as without the group."""
    from ple_um.vllm import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", mode)
    stock, mapped, layouts = three_layers("fp8")
    early.link_model(_Model(mapped))
    for seed in (3, 4):
        _step(stock, mapped, layouts, seed, 40, early=False)


def test_a_step_begun_again_midway(three_layers, monkeypatch):
    """A forward that stops after its first layer (it raised), then a step whose first start comes
    from a later layer, with other inputs (equal values in new tensors are another step too): the
    lookups started for the old step are not taken for the new one; every output is stock's."""
    from ple_um.vllm import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "on")
    stock, mapped, layouts = three_layers("fp8")
    early.link_model(_Model(mapped))
    old = h.inputs(5, tokens=30)
    with torch.no_grad():
        for new in (h.inputs(6, tokens=30), tuple(t.clone() for t in old)):
            mapped[0].start_prefetch(*old)  # starts all three for the old step
            mapped[0](None, *old)  # the forward stops here
            before = [_lookups(m) for m in mapped]
            mapped[1].start_prefetch(*new)
            assert [_lookups(m) - b for m, b in zip(mapped, before, strict=True)] == [0, 1, 1]
            for index, (s, module) in enumerate(zip(stock[1:], mapped[1:], strict=True)):
                if index:
                    module.start_prefetch(*new)
                assert h.same_bits(module(None, *new), s(None, *new))
            assert [_lookups(m) - b for m, b in zip(mapped, before, strict=True)] == [0, 1, 1]
    _step(stock, mapped, layouts, 7, 30, early=True)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_start_that_raised_serves_no_rows(three_layers, monkeypatch, mode):
    """A step started but never finalized (its forward raised), then a start of the next step (as
    many tokens) whose lookup raised (a failed read): a finalize that still follows refuses, never
    handing out the older step's rows; the next whole step is stock's, bit for bit."""
    from ple_um.vllm import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", mode)
    stock, mapped, layouts = three_layers("fp8")
    early.link_model(_Model(mapped))
    backend = mapped[0].ngram_embedding
    old, new = h.inputs(14, tokens=30), h.inputs(15, tokens=30)
    with torch.no_grad():
        mapped[0].start_prefetch(*old)  # its forward never comes
        assert backend.overlapped.started is not None

        def failed_read(ids, out):
            raise OSError("read failed")

        with monkeypatch.context() as m:
            m.setattr(backend, "lookup_rows", failed_read)
            with pytest.raises(OSError, match="read failed"):
                mapped[0].start_prefetch(*new)
        with pytest.raises(RuntimeError, match="requires a prior start_prefetch"):
            mapped[0](None, *new)
        with pytest.raises(RuntimeError, match="requires a prior start_prefetch"):
            backend.finalize_prefetch(30)
    _step(stock, mapped, layouts, 16, 30, early=mode == "on")


def test_buffers_bounded_and_logged(three_layers, monkeypatch, caplog):
    """The group's log line states the prefetch buffers' total (tokens x heads x head_dim in the
    lookup dtype, a layer), which is what the layers hold after steps up to vLLM's token budget."""
    from ple_um.units import format_bytes

    stock, mapped, layouts = three_layers("fp8")
    line = _group_line(mapped, "on", monkeypatch, caplog)
    heads, head_dim = mapped[0].ngram_heads, mapped[0].ngram_embedding.embedding_dim
    expected = len(LAYERS) * MAX_TOKENS * heads * head_dim  # FP8: a byte an element
    assert f"{format_bytes(expected)} in all" in line, line
    for seed, tokens in ((8, MAX_TOKENS), (9, 5)):
        _step(stock, mapped, layouts, seed, tokens, early=True)
    held = [m.ngram_embedding.overlapped.buffer for m in mapped]
    assert sum(b.numel() * b.element_size() for b in held) == expected


def test_captured_early_lookups_are_tracked(three_layers, monkeypatch):
    """Under a capture (injected: no GPU here) the first layer's start captures every layer's
    lookup, so each layer knows its graphs hold its table and buffer (a later remap is refused);
    before any eager step has sized the buffers, a capture is refused, naming the need."""
    from ple_um import served
    from ple_um.vllm import early, overlap

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "on")
    stock, mapped, layouts = three_layers("fp8")
    early.link_model(_Model(mapped))
    ids, query_start_loc, ngram_context = h.inputs(10, tokens=20)
    with monkeypatch.context() as m:
        m.setattr(served, "capturing", lambda ids: True)
        m.setattr(overlap, "capturing", lambda ids: True)
        with pytest.raises(RuntimeError, match="allocated by an eager call"):
            mapped[0].start_prefetch(ids, query_start_loc, ngram_context)
    _step(stock, mapped, layouts, 11, 20, early=True)
    assert not any(m.ngram_embedding.served.captured for m in mapped)
    with monkeypatch.context() as m:
        m.setattr(served, "capturing", lambda ids: True)
        m.setattr(overlap, "capturing", lambda ids: True)
        with torch.no_grad():
            mapped[0].start_prefetch(ids, query_start_loc, ngram_context)
    assert all(m.ngram_embedding.served.captured for m in mapped)
    _step(stock, mapped, layouts, 12, 20, early=True)


def test_the_log_line_says_when_starts_are_not_taken_early(three_layers, monkeypatch, caplog):
    """PLE_UM_EARLY_LOOKUPS=off: the group's log line says each layer starts its own lookup, never
    that the first layer starts them all (which it does not: ``_step`` checks it)."""
    stock, mapped, layouts = three_layers("fp8")
    line = _group_line(mapped, "off", monkeypatch, caplog)
    assert "not taken" in line and "PLE_UM_EARLY_LOOKUPS=off" in line and "starts all" not in line, line
    _step(stock, mapped, layouts, 13, 20, early=False)


def _group_line(mapped, mode: str, monkeypatch, caplog) -> str:
    """The one log line of the group ``link_model`` makes of ``mapped``, PLE_UM_EARLY_LOOKUPS=``mode``."""
    from ple_um.vllm import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", mode)
    monkeypatch.setattr(early.logger, "propagate", True)  # vLLM may route it elsewhere
    with caplog.at_level(logging.INFO, logger=early.logger.name):
        early.link_model(_Model(mapped))
    lines = [r.getMessage() for r in caplog.records if "early lookups" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]
