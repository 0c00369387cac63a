"""CUDA tables dropped without ``close()``: released (their wait for the device and the release of
their host path and registrations run on ``ple_um.dropped``'s own thread), and a table dropped
while another table's lookups are being captured into a CUDA graph breaks neither that capture nor
its replays (the release's device wait runs in the relaxed capture mode of its own thread)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from helpers.dropped_tables import drain
from helpers.reference import maps_of, reference_rows

import ple_um
from ple_um import ops
from ple_um.errors import TableClosedError


def _released(files, patience: float = 60.0) -> bool:
    end = time.monotonic() + patience
    while maps_of(files) and time.monotonic() < end:
        gc.collect()
        time.sleep(0.05)
    return not maps_of(files)


@pytest.mark.parametrize("mode", ["cpu", "registered", "device"])
def test_a_dropped_cuda_table_is_released(tables, device, mode):
    layout = tables["bf16"]
    table = ple_um.open_table(layout.directory, mode=mode, device=device)
    handle = table.handle
    ids = torch.arange(0, 1000, device=device)
    out = table.lookup(ids)  # queued: the release waits for it before it unmaps
    del table
    gc.collect()
    assert drain(60) and _released(layout.files)
    want = reference_rows(layout, np.arange(1000))
    assert np.array_equal(out.view(torch.uint8).cpu().numpy().reshape(1000, -1), want.reshape(1000, -1))
    with pytest.raises(TableClosedError):
        ops.lookup(ids, handle, layout.dtype)


def test_a_table_dropped_during_another_tables_capture_breaks_nothing(tables, device, rng):
    captured, other = tables["fp8"], tables["f16"]
    with ple_um.open_table(captured.directory, mode="cpu", device=device) as table:
        ids = torch.zeros(512, dtype=torch.int64, device=device)
        out = torch.empty((512, table.row_dim), dtype=table.dtype, device=device)
        victim = ple_um.open_table(other.directory, mode="cpu", device=device)
        victim.lookup(torch.arange(0, 100, device=device))
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            table.lookup(ids, out=out)  # warm-up outside the capture
            torch.cuda.current_stream(device).synchronize()
            with torch.cuda.graph(graph, stream=stream):
                table.lookup(ids, out=out)
                del victim
                gc.collect()
                assert drain(60)  # released on its own thread while this capture runs
        assert _released(other.files)
        for _ in range(3):
            fresh = rng.integers(0, captured.num_rows, 512)
            ids.copy_(torch.from_numpy(fresh))
            out.view(torch.uint8).fill_(0xA5)
            graph.replay()
            torch.cuda.synchronize(device)
            got = out.view(torch.uint8).cpu().numpy().reshape(512, -1)
            assert np.array_equal(got, reference_rows(captured, fresh).reshape(512, -1))
