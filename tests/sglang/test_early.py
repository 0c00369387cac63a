"""Early lookups in SGLang (``ple_um.sglang.early``): the step's first PLE layer starts every PLE
layer's prefetch.

A model SGLang's loader builds links its ple-um PLE layers. Three real ``Qwen4ExpPLELayer`` (decoder
layers 1, 3 and 5: PLE indices 0, 1, 2, each with its own hash and table from its own checkpoint)
run SGLang's own ``start_prefetch`` and ``_consume_prefetched_embeddings`` on a decode batch. A CPU
device has no CUDA streams, so the layers' prefetch stream and torch's stream calls are stood in for
by no-ops (on the CPU every operation is done when it returns): what runs is SGLang's prefetch code,
ple-um's lookups and the group's bookkeeping. The side streams and a FULL graph capture of early
lookups run on the GPU (tests/gpu/test_gpu_early.py).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

LAYERS = ((1, 0), (3, 1), (5, 2))  # (decoder layer, PLE index)
ROW_DIM = 8


class _CpuStream:
    """A stream on the CPU: everything queued on it is done already."""

    def wait_stream(self, other) -> None:
        del other


@pytest.fixture
def cpu_streams(monkeypatch):
    """torch's stream calls as no-ops: the CPU runs every operation when it is called."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _CpuStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)


@pytest.fixture
def ple_layers(sglang_world, tiny, make_checkpoint, monkeypatch, cpu_streams):
    """(PLE layers, layouts): three ple-um PLE layers, each loaded from its own BF16 checkpoint, with a
    prefetch stream; the request pool SGLang's id hashing caches its windows in, stood in for."""
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.models import qwen4_exp

    monkeypatch.setattr(qwen4_exp, "get_req_to_token_pool", lambda: SimpleNamespace(ple_window_cache=None))
    monkeypatch.setenv("PLE_UM", "1")
    text = Qwen4ExpTextConfig(**{k: v for k, v in tiny.text_config(ROW_DIM).items() if k != "model_type"})
    layers, layouts = [], []
    for layer, index in LAYERS:
        ple = qwen4_exp.Qwen4ExpPLELayer(
            text, prefix=f"model.layers.{layer}.ple", layer_id=layer, ple_layer_index=index
        )
        table = ple.ple_embedding.ngram_embedding
        layout = make_checkpoint(
            num_rows=table.org_vocab_size,
            row_dim=ROW_DIM,
            dtype="bf16",
            shards=tiny.parts,
            files=2,
            layer=layer,
            seed=layer + 20,
        )
        monkeypatch.setenv("PLE_UM_DIR", layout.directory)
        table.finish_load()
        ple._prefetch_stream = _CpuStream()
        layers.append(ple)
        layouts.append(layout)
    yield layers, layouts
    for ple in layers:
        ple.ple_embedding.ngram_embedding.close_table()


def _decode_batch(rng, tokens: int, vocab: int = 128):
    """A decode step's ``_PLEBatch``: one token a request, each with its n-gram window."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.qwen4_exp import _PLEBatch

    windows = torch.from_numpy(rng.integers(0, vocab, (tokens, 3)))
    windows[windows % 13 == 0] = 0  # eos (the tiny config's eos_token_id) inside windows
    unused = torch.empty(0, dtype=torch.long)
    return _PLEBatch(
        mode=ForwardMode.DECODE,
        use_decode_fast_path=True,
        physical_tokens=tokens,
        processed_tokens=tokens,
        lengths=unused,
        row_width=1,
        req_indices=unused,
        token_offsets=unused,
        valid_tokens=unused,
        state_indices=unused,
        ngram_context=windows,
        ngram_eos_token_id=0,
    )


def _lookups(ple) -> int:
    return ple.ple_embedding.ngram_embedding.table.stats()["lookups"]


def _step(layers, layouts, file_rows, batch, *, early: bool) -> None:
    """One step in the model's order, checked: after the first layer's start every layer's prefetch
    is started (``early``) or only the first one's; each layer looks its rows up once; each layer's
    rows are the files' for its own ids, and what its in-forward lookup gives."""
    before = [_lookups(ple) for ple in layers]
    layers[0].start_prefetch(batch=batch, forward_batch=None)
    for index, ple in enumerate(layers):
        started = early or index == 0
        assert (ple._prefetch_state is not None) == started
        assert _lookups(ple) == before[index] + started
    for index, (ple, layout) in enumerate(zip(layers, layouts, strict=True)):
        if index:
            ple.start_prefetch(batch=batch, forward_batch=None)  # one decoder layer ahead
        got = ple._consume_prefetched_embeddings(None)
        ids = ple.ple_embedding.compute_ngram_ids(batch)
        expected = file_rows(layout).to(torch.bfloat16)[ids].flatten(-2)
        assert got.dtype == expected.dtype and torch.equal(got.view(torch.int16), expected.view(torch.int16))
        assert torch.equal(got.view(torch.int16), ple.ple_embedding(batch, None).view(torch.int16))
        assert got.view(torch.int16).any()
    assert [_lookups(ple) for ple in layers] == [b + 2 for b in before]  # the prefetch, the check


def test_a_loaded_model_links_its_ple_layers(sglang_checkpoint, load_model, tiny):
    directory, _, _ = sglang_checkpoint("fp8")
    model = load_model(directory, ple_um=True)
    ple = model.model.layers[tiny.layer].ple
    assert ple._ple_um_early.layers == [ple]
    stock = load_model(directory, ple_um=False)
    assert getattr(stock.model.layers[tiny.layer].ple, "_ple_um_early", None) is None


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_first_layer_starts_every_prefetch_of_the_step(ple_layers, file_rows, rng, monkeypatch, mode):
    from ple_um.sglang import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", mode)
    layers, layouts = ple_layers
    group = early.link(layers)
    assert all(ple._ple_um_early is group for ple in layers)
    for tokens in (7, 33, 7):
        _step(layers, layouts, file_rows, _decode_batch(rng, tokens), early=True)


def test_off_starts_each_layer_on_its_own(ple_layers, file_rows, rng, monkeypatch):
    from ple_um.sglang import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "off")
    layers, layouts = ple_layers
    early.link(layers)
    for tokens in (9, 20):
        _step(layers, layouts, file_rows, _decode_batch(rng, tokens), early=False)


def test_a_step_begun_again_midway(ple_layers, file_rows, rng, monkeypatch):
    """A forward that stops after its first layer, then a new batch whose first start comes from a
    later layer: that layer's and the next one's prefetches are started for the new batch, and the
    rows are the new batch's."""
    from ple_um.sglang import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "on")
    layers, layouts = ple_layers
    early.link(layers)
    old, new = _decode_batch(rng, 11), _decode_batch(rng, 11)
    layers[0].start_prefetch(batch=old, forward_batch=None)
    layers[0]._consume_prefetched_embeddings(None)
    for ple in layers[1:]:  # the stopped forward's starts, joined as SGLang's next forward would
        ple._consume_prefetched_embeddings(None)
    layers[1].start_prefetch(batch=new, forward_batch=None)
    assert layers[0]._prefetch_state is None and all(p._prefetch_state is not None for p in layers[1:])
    for index, (ple, layout) in enumerate(zip(layers[1:], layouts[1:], strict=True)):
        if index:
            ple.start_prefetch(batch=new, forward_batch=None)  # finds its prefetch started
        got = ple._consume_prefetched_embeddings(None)
        ids = ple.ple_embedding.compute_ngram_ids(new)
        assert torch.equal(got, file_rows(layout).to(torch.bfloat16)[ids].flatten(-2))
    _step(layers, layouts, file_rows, _decode_batch(rng, 11), early=True)


@pytest.fixture
def dp_gathers(ple_layers, monkeypatch):
    """The layers gather their ids across DP-attention ranks (``gather_dp_tokens``), as under
    ``--enable-dp-attention``; SGLang's two collectives are stood in for by one rank of two (the
    other rank's ``OTHER`` tokens, its ids fixed) and record, in order, which of them ran."""
    from sglang.srt.models import qwen4_exp

    layers, _ = ple_layers
    calls: list[str] = []
    other = torch.arange(OTHER * layers[0].ple_embedding.ngram_heads).reshape(OTHER, -1) % 50

    def gather(global_ids, local_ids, forward_batch) -> None:
        calls.append("gather")
        global_ids[: local_ids.shape[0]] = local_ids
        global_ids[local_ids.shape[0] :] = other

    def scatter(local, global_rows, forward_batch) -> None:
        calls.append("scatter")
        local.copy_(global_rows[: local.shape[0]])

    monkeypatch.setattr(qwen4_exp, "dp_gather_replicate", gather)
    monkeypatch.setattr(qwen4_exp, "dp_scatter", scatter)
    for ple in layers:
        ple.ple_embedding.gather_dp_tokens = True
    return calls


OTHER = 5  # tokens of the other DP-attention rank


def _dp_step(layers, batch, tokens: int) -> None:
    """One forward on a rank whose batch is ``batch`` (None: an idle rank): each PLE layer's start,
    then its forward (which joins its prefetch)."""
    forward_batch = SimpleNamespace(
        global_dp_buffer_len=tokens + OTHER, input_ids=torch.zeros(tokens, dtype=torch.long)
    )
    for index, ple in enumerate(layers):
        ple.start_prefetch(batch=batch, forward_batch=forward_batch)
        if batch is None:
            ple.forward_idle(forward_batch)
        else:
            ple._consume_prefetched_embeddings(forward_batch)
        assert ple._prefetch_state is None, index


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_an_idle_dp_rank_calls_the_collectives_of_a_busy_one(ple_layers, dp_gathers, rng, monkeypatch, mode):
    """Under DP attention every rank gathers the step's ids (a collective) at each PLE layer's start,
    an idle rank (no batch) too; the ranks must call them in the same order, or they wait on each
    other for ever. An idle rank takes its starts early exactly when a busy one does."""
    from ple_um.sglang import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", mode)
    layers, _ = ple_layers
    early.link(layers)
    orders = []
    for batch, tokens in ((_decode_batch(rng, 6), 6), (None, 0), (_decode_batch(rng, 4), 4), (None, 0)):
        dp_gathers.clear()
        _dp_step(layers, batch, tokens)
        orders.append(list(dp_gathers))
    step = ["gather"] * 3 + ["scatter"] * 3 if mode == "auto" else ["gather", "scatter"] * 3
    assert orders == [step] * 4, orders


@pytest.mark.parametrize("why", ["off", "no stream"])
def test_the_log_line_says_when_starts_are_not_taken_early(ple_layers, monkeypatch, caplog, why):
    """PLE_UM_EARLY_LOOKUPS=off, or layers without a prefetch stream (PLE_UM_OVERLAP=0, a CPU device:
    each looks its rows up in its forward): the group's log line says the starts are not taken
    early, never that the first layer starts them all."""
    import logging

    from ple_um.sglang import early

    monkeypatch.setenv("PLE_UM_EARLY_LOOKUPS", "off" if why == "off" else "on")
    layers, _ = ple_layers
    if why == "no stream":
        for ple in layers:
            monkeypatch.setattr(ple, "_prefetch_stream", None)
    monkeypatch.setattr(early.logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger=early.logger.name):
        early.link(layers)
    lines = [r.getMessage() for r in caplog.records if "early lookups" in r.getMessage()]
    assert len(lines) == 1 and "not taken" in lines[0] and "starts all" not in lines[0], lines
    assert ("PLE_UM_EARLY_LOOKUPS=off" if why == "off" else "no prefetch stream") in lines[0], lines
