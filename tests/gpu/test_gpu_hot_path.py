"""The host path's length on a CUDA device, measured as ``tests/structure/test_hot_path.py`` measures
the direct call: an eager ``cpu``-mode lookup through the dispatcher thread and through a host node,
after a warm-up lookup, crosses exactly these Python files, and up to the row copy (a float output's
dequantization comes after it), with the job struct's ctypes mirror and the C file of the row copy,
at most ``HOST_PATH_FILES`` (docs/DESIGN.md, "The hot path of one
lookup")."""

from __future__ import annotations

import pytest
import torch
from helpers.hot_path import MIRROR, python_files_crossed

import ple_um
from ple_um.lookup.host.gather import HostGather

HOST_PATH_FILES = 6
# The table, the routing, the host path, and its binding to CUDA (the stream, the driver's calls,
# what a stream keeps, the dispatcher's words).
EAGER_ON_CUDA = {
    "ple_um/table.py",
    "ple_um/lookup/paths.py",
    "ple_um/lookup/host/gather.py",
    "ple_um/lookup/host/cuda.py",
}
DECODE = {"ple_um/lookup/decode.py"}  # a float output: the staged rows dequantized on the device
ROW_COPY_C = {"ple_um/lookup/native/rowcopy.c"}


@pytest.mark.parametrize("dispatcher", ["1", "0"], ids=["dispatcher", "host node"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["raw", "dequantized"])
def test_an_eager_cpu_lookup_on_a_gpu_crosses_these_files(
    tables, device, rng, check_rows, monkeypatch, dispatcher, out_dtype
):
    monkeypatch.setenv("PLE_UM_DISPATCHER", dispatcher)
    layout = tables["fp8"]
    ids = torch.from_numpy(rng.integers(-5, layout.num_rows + 5, 1000)).to(device)
    with ple_um.open_table(layout.directory, mode="cpu", device=device) as table:
        host = table.paths.host
        assert isinstance(host, HostGather) and (dispatcher == "1" or not host.dispatcher), table.row_reads
        table.lookup(ids, out_dtype=out_dtype)  # the warm-up
        torch.cuda.synchronize()
        got = []
        crossed = python_files_crossed(lambda: got.append(table.lookup(ids, out_dtype=out_dtype)))
        torch.cuda.synchronize()
        check_rows(got[0], layout, ids)
    assert crossed == EAGER_ON_CUDA | (DECODE if out_dtype is not None else set())
    # To the C row copy; a float output's dequantization runs after it (docs/DESIGN.md).
    assert len((crossed - DECODE) | {MIRROR} | ROW_COPY_C) <= HOST_PATH_FILES
