"""Early lookups on a real GPU: a step's lookups of several tables (one a PLE layer) forked onto one
side stream at the step's start (``ple_um.served.SideLookups``, what the vLLM plugin's early
lookups queue them with), each joined where its layer takes the rows, between the layers' own GPU
work; the whole step captured in one FULL CUDA graph and replayed with fresh ids, every row checked
against the files. No engine is needed: the plugins' part of it runs on the CPU (tests/vllm,
tests/sglang)."""

from __future__ import annotations

import pytest
import torch
from test_gpu_lookups import expected, poisoned, same

import ple_um
from ple_um.served import SideLookups

# (table name, mode) per layer: host nodes (cpu), the kernel (registered), NVFP4 decoded.
LAYERS = {
    "cpu": (("fp8", "cpu"), ("bf16", "cpu"), ("nvfp4", "cpu")),
    "mixed": (("fp8", "cpu"), ("bf16", "registered"), ("nvfp4", "registered")),
}


@pytest.mark.parametrize("layers", sorted(LAYERS))
def test_a_captured_step_of_early_lookups_replays_exact(layers, tables, ids_for, rng, device, monkeypatch):
    monkeypatch.setenv("PLE_UM_ROWCOPY", "1")
    n = 1024
    dtype = torch.bfloat16
    opened = []
    try:
        for name, mode in LAYERS[layers]:
            layout = tables[name]
            table = ple_um.open_table(layout.directory, mode=mode, device=device)
            opened.append(table)
            assert table.capture_safe
        step_layers = []
        for table, (name, _) in zip(opened, LAYERS[layers], strict=True):
            layout = tables[name]
            ids = torch.from_numpy(ids_for(layout, n, rng)).to(device)
            out = poisoned((n, layout.row_dim), dtype, device)
            taken = poisoned((n, layout.row_dim), dtype, device)
            step_layers.append((table, layout, ids, out, taken))
        side = SideLookups()
        a = torch.randn(2048, 2048, device=device, dtype=dtype)
        work = torch.empty_like(a)

        def step() -> None:
            """What a model step does: every layer's lookup forked at its start, then per layer some
            GPU work, the join of its own lookup and a read of its rows."""
            with side.fork(device):
                for key, (table, _, ids, out, _) in enumerate(step_layers):
                    table.lookup(ids, out=out)
                    side.mark(key)
            for key, (*_, out, taken) in enumerate(step_layers):
                for _ in range(4):
                    torch.mm(a, a, out=work)
                side.join(key, device)
                taken.copy_(out)

        def check() -> None:
            for _, layout, ids, _, taken in step_layers:
                assert same(taken, expected(layout, ids.cpu().numpy(), dtype)), layout.dtype_name

        step()  # eager: buffers, compiled kernels, the side stream
        torch.cuda.synchronize()
        check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        before = [table.stats()["rows"] for table in opened]
        for _ in range(5):
            for _, layout, ids, out, taken in step_layers:
                ids.copy_(torch.from_numpy(ids_for(layout, n, rng)))
                out.view(torch.uint8).fill_(0xAB)
                taken.view(torch.uint8).fill_(0xAB)
            graph.replay()
            torch.cuda.synchronize()
            check()
        assert [table.stats()["rows"] - b for table, b in zip(opened, before, strict=True)] == [5 * n] * 3
    finally:
        for table in opened:
            table.close()
