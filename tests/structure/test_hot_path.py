"""The host path's length, measured (docs/DESIGN.md, "The hot path of one lookup"): the files a
lookup crosses from ``MappedTable.lookup``'s entry to its return. An eager ``cpu``-mode lookup with
the C row copy, on a machine without CUDA (the row copy called directly), after a warm-up lookup:
the package's Python files whose functions run, exactly (a new hop fails here), and with the job
struct's ctypes mirror and the C file of the row copy at most ``HOST_PATH_FILES``. The same lookup
on a CUDA device: ``tests/gpu/test_gpu_hot_path.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hot_path import MIRROR, c_files_defining, python_functions_crossed

import ple_um
from ple_um.lookup.host.gather import HostGather

HOST_PATH_FILES = 6
# The direct call: the table (its checks), the routing (the argument checks), the host path.
DIRECT = {"ple_um/table.py", "ple_um/lookup/paths.py", "ple_um/lookup/host/gather.py"}
# A float output: the staged rows dequantized (``decode_staged``).
DECODE = {"ple_um/lookup/decode.py"}
# The row copy in C and every way it is run (the host function, the direct call, the dispatcher).
ROW_COPY_C = {"ple_um/lookup/native/rowcopy.c"}


def test_the_row_copy_and_every_way_it_runs_are_one_c_file():
    assert c_files_defining() == ROW_COPY_C


# The direct call's Python, function by function: a new hop (a function that only forwards its
# arguments, say) fails here even within these files.
DIRECT_CALLS = {
    ("ple_um/table.py", "MappedTable.lookup"),
    ("ple_um/table.py", "MappedTable._enter"),
    ("ple_um/table.py", "MappedTable._out"),
    ("ple_um/table.py", "MappedTable._leave"),
    ("ple_um/lookup/paths.py", "check_args"),
    ("ple_um/lookup/paths.py", "check_ids"),
    ("ple_um/lookup/paths.py", "LookupPaths.route"),
    ("ple_um/lookup/host/gather.py", "HostGather.gather"),
    ("ple_um/lookup/host/gather.py", "HostGather.run_here"),
    ("ple_um/lookup/host/gather.py", "HostGather._fill"),
}
DECODE_CALLS = {("ple_um/lookup/decode.py", "decode_staged")}


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["raw", "dequantized"])
def test_an_eager_cpu_lookup_crosses_these_files_and_no_more(make_checkpoint, rng, check_rows, out_dtype):
    layout = make_checkpoint(
        num_rows=5000, row_dim=32, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30))
    )
    rows = (700, 4100)  # an owned range cutting shards: ids outside it and outside the table too
    ids = torch.from_numpy(rng.integers(-5, layout.num_rows + 5, 1000))
    with ple_um.open_table(layout.directory, rows=rows, mode="cpu", device="cpu") as table:
        assert isinstance(table.paths.host, HostGather), table.row_reads  # the C row copy, called directly
        table.lookup(ids, out_dtype=out_dtype)  # the warm-up
        got = []
        calls = python_functions_crossed(lambda: got.append(table.lookup(ids, out_dtype=out_dtype)))
        check_rows(got[0], layout, ids, rows=rows)
    assert calls == DIRECT_CALLS | (DECODE_CALLS if out_dtype is not None else set())
    crossed = {path for path, _ in calls}
    assert crossed == DIRECT | (DECODE if out_dtype is not None else set())
    # To the C row copy; a float output's dequantization runs after it (docs/DESIGN.md).
    assert len((crossed - DECODE) | {MIRROR} | ROW_COPY_C) <= HOST_PATH_FILES
