"""The GPU half of vLLM's padded- and empty-id PLE tests, with ple-um's own lookup.

vLLM 0.33's ``test_nvfp4_ple_cuda_lookup_and_graph_replay`` (tests/models/qwen4_exp/test_ple.py)
captures the layer's lookup of [tokens, heads] ids in a CUDA graph, replays it with new ids, and
checks padded ids (``[[8, -1]]``: the row count and -1) and an empty batch (``ids[:0]``), on its
rank 1 of 2 (half the rows owned). vLLM is not installed on the GPU host, so this runs the lookup
the vLLM backend makes (``MappedTable.lookup(ids, out=...)``, out in the layer's lookup dtype: raw
FP8 and BF16 rows, NVFP4 decoded to bf16) in every mode the machine has, inside
``torch.cuda.graph`` captures replayed with fresh ids that hold padding values, against the rows
read from the files (zeros for padding and for rows outside the owned range). The vLLM side of the
same contract, stock against ple-um, runs on the CPU in tests/vllm/test_contract_*.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.reference import bits_differ, reference_nvfp4, reference_rows

import ple_um
from ple_um.errors import ModeUnavailableError

HEADS = 2  # vLLM's test looks up [tokens, 2] ids
MODES = ["registered", "device", "cpu", "ats"]


def _lookup_dtype(layout) -> torch.dtype:
    """The dtype the vLLM backend asks its lookups for: the storage dtype, or NVFP4 decoded."""
    return torch.bfloat16 if layout.is_nvfp4 else layout.dtype


def _expected(layout, ids: np.ndarray, rows) -> torch.Tensor:
    if layout.is_nvfp4:
        return reference_nvfp4(layout, ids, rows, out_dtype=torch.bfloat16)
    data = reference_rows(layout, ids, rows)
    raw = torch.zeros(data.shape, dtype=torch.uint8)
    raw.numpy()[...] = data
    return raw.view(layout.dtype).reshape(*ids.shape, layout.row_dim)


def _check(out: torch.Tensor, layout, ids: np.ndarray, rows) -> None:
    why = bits_differ(out, _expected(layout, ids, rows), raw=not layout.is_nvfp4)
    assert why is None, why


def _padded(layout, tokens: int, rng, rows) -> np.ndarray:
    """[tokens, HEADS] ids: random rows of the table with the owned range's edges, and every third
    token padded as vLLM pads (the row count and -1), some with ids far outside the table."""
    n = layout.num_rows
    ids = rng.integers(0, n, (tokens, HEADS)).astype(np.int64)
    edges = [rows[0] - 1, rows[0], rows[1] - 1, min(rows[1], n - 1)]
    ids.reshape(-1)[: len(edges)] = edges[: ids.size]
    ids[::3] = (n, -1)
    if tokens > 4:
        ids[4] = (n + 7, -(1 << 40))
    return ids


@pytest.fixture
def open_mode(monkeypatch, device):
    """``open_mode(layout, mode, rows)``: the table with the C row copy, or a skip where the machine
    lacks the ats mode. Lookups of 20 000 ids or more take the host path in the GPU modes too."""

    def open_(layout, mode, rows):
        monkeypatch.setenv("PLE_UM_ROWCOPY", "1")
        monkeypatch.setenv("PLE_UM_BULK_ROWS", "20000")
        try:
            table = ple_um.open_table(layout.directory, mode=mode, rows=rows, device=device)
        except ModeUnavailableError as exc:
            if mode == "ats":
                pytest.skip(f"no ats mode on this machine: {exc}")
            raise
        assert table.capture_safe, table.row_reads
        return table

    return open_


def _owned(layout, half: bool) -> tuple[int, int]:
    """All rows, or the upper half (vLLM's test runs its rank 1 of 2)."""
    return (layout.num_rows // 2, layout.num_rows) if half else (0, layout.num_rows)


@pytest.mark.parametrize("half", [False, True], ids=["all-rows", "rank-1-of-2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["fp8", "bf16", "nvfp4"])
def test_padded_ids_in_graph_replays(tables, name, mode, half, open_mode, rng, device):
    """Graphs of padded batches of several sizes (2 tokens as vLLM's test, 64, and 12 000: 24 000
    ids, which the GPU modes' host path serves), replayed with fresh padded ids into poisoned outputs:
    every replay is the files' rows, zeros for the padding. Eager lookups of the same kind too."""
    layout = tables[name]
    rows = _owned(layout, half)
    dtype = _lookup_dtype(layout)
    with open_mode(layout, mode, rows) as table:
        graphs = []
        for tokens in (2, 64, 12_000):
            ids_np = _padded(layout, tokens, rng, rows)
            ids = torch.from_numpy(ids_np).to(device)
            out = torch.empty((tokens, HEADS, layout.row_dim), dtype=dtype, device=device)
            out.view(torch.uint8).fill_(0xAB)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                table.lookup(ids, out=out)  # warm-up outside the capture, as vLLM's test does
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            _check(out, layout, ids_np, rows)  # eager
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                table.lookup(ids, out=out)
            graphs.append((graph, ids, out))
        for _ in range(3):
            for graph, ids, out in graphs:
                fresh = _padded(layout, ids.shape[0], rng, rows)
                ids.copy_(torch.from_numpy(fresh))
                out.view(torch.uint8).fill_(0xAB)
                graph.replay()
                torch.cuda.synchronize()
                _check(out, layout, fresh, rows)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_empty_ids_eager_and_in_graph_replays(tables, name, mode, open_mode, rng, device):
    """An empty batch (vLLM's ``ids[:0]``): eager it gives a [0, heads, head_dim] output; captured
    inside a graph beside other work (as in a model's graph) it adds nothing that breaks the
    capture or the replays: the other work replays, and a padded lookup captured after it in the
    same graph is exact with fresh ids."""
    layout = tables[name]
    rows = _owned(layout, True)
    dtype = _lookup_dtype(layout)
    with open_mode(layout, mode, rows) as table:
        empty_ids = torch.empty((0, HEADS), dtype=torch.long, device=device)
        empty_out = torch.empty((0, HEADS, layout.row_dim), dtype=dtype, device=device)
        assert table.lookup(empty_ids, out=empty_out).shape == (0, HEADS, layout.row_dim)
        got = table.lookup(empty_ids, out_dtype=dtype)
        assert got.shape == (0, HEADS, layout.row_dim) and got.dtype == dtype

        ids_np = _padded(layout, 8, rng, rows)
        ids = torch.from_numpy(ids_np).to(device)
        out = torch.empty((8, HEADS, layout.row_dim), dtype=dtype, device=device)
        marker = torch.zeros(4, device=device)
        table.lookup(ids, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            marker.add_(1)
            table.lookup(empty_ids, out=empty_out)
            table.lookup(ids, out=out)
        for k in range(3):
            fresh = _padded(layout, 8, rng, rows)
            ids.copy_(torch.from_numpy(fresh))
            out.view(torch.uint8).fill_(0xAB)
            graph.replay()
            torch.cuda.synchronize()
            assert marker.tolist() == [k + 1.0] * 4
            _check(out, layout, fresh, rows)
