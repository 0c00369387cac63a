"""Decide by fit, and keep deciding, on a real GPU (``ple_um/lookup/fit.py``): in the registered and
cpu modes, a table that fits at open, a CUDA graph captured, then a forced "does not fit" verdict
(``access.memory.fits`` replaced, the check run here): the switch takes effect between lookups; a
graph captured before keeps its path, one captured after takes the host path with a row cache, and
both replay exactly with new ids, as do eager lookups. Every output poisoned first and compared
with the rows read from the files. And the live page touch's host node, replayed while its word
flips.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from helpers.reference import bits_differ, reference_rows

import ple_um
from ple_um.access import memory


def want(layout, ids_np: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.from_numpy(reference_rows(layout, ids_np)).view(layout.dtype)
    if dtype == layout.dtype:
        return raw
    return (raw.float() * (layout.scale if layout.scale is not None else 1.0)).to(dtype)


def same(got: torch.Tensor, expect: torch.Tensor) -> bool:
    return bits_differ(got.cpu(), expect, raw=got.element_size() == 1) is None


def capture(table, ids: torch.Tensor, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    table.lookup(ids, out=out)  # warm: buffers and launchers made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.lookup(ids, out=out)
    return graph


@pytest.mark.parametrize("mode", ["registered", "cpu"])
@pytest.mark.parametrize("n", [16, 1024])
@pytest.mark.parametrize("dtype", ["raw", "bf16"])
def test_graphs_captured_before_and_after_a_switch_both_replay_exactly(
    tables, mode, n, dtype, ids_for, rng, device, monkeypatch
):
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # no thread: the check is run here
    monkeypatch.setenv("PLE_UM_BULK_ROWS", "100000")  # every lookup here is decode-sized
    layout = tables["fp8"]
    out_dtype = layout.dtype if dtype == "raw" else torch.bfloat16
    with ple_um.open_table(layout.directory, mode=mode, device=device) as table:
        serving = table.stats()["serving"]
        assert serving["path"] == ("kernel" if mode == "registered" else "host"), serving
        assert table.stats()["row_cache"] is None, table.row_reads  # it fits: no row cache
        ids = torch.zeros(n, dtype=torch.int64, device=device)
        before, after = (torch.empty((n, layout.row_dim), dtype=out_dtype, device=device) for _ in range(2))
        graph_before = capture(table, ids, before)

        monkeypatch.setattr(memory, "fits", lambda *a, **k: (False, "the owned rows do not fit (forced)"))
        assert table.paths.fit.check()
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 1, serving
        assert table.stats()["row_cache"] is not None, table.row_reads
        graph_after = capture(table, ids, after)

        kernel_rows = table.paths.gpu.read_counts()["rows"] if table.paths.gpu is not None else 0
        cache_before = table.stats()["row_cache"]
        hot = rng.integers(0, layout.num_rows, 64)
        for k in range(6):
            ids_np = ids_for(layout, n, rng) if k % 2 else rng.choice(hot, n)
            ids.copy_(torch.from_numpy(ids_np))
            for out in (before, after):
                out.view(torch.uint8).fill_(0xAB)
            graph_before.replay()
            graph_after.replay()
            torch.cuda.synchronize()
            expect = want(layout, ids_np, out_dtype)
            assert same(before, expect), f"the graph captured before the switch, replay {k}"
            assert same(after, expect), f"the graph captured after the switch, replay {k}"
            width = layout.row_dim * out_dtype.itemsize  # poisoned bytes of n rows of out_dtype
            eager = torch.full((n, width), 0xAB, dtype=torch.uint8, device=device).view(out_dtype)
            table.lookup(torch.from_numpy(ids_np).to(device), out=eager)
            assert same(eager, expect), f"an eager lookup after the switch, {k}"
        stats = table.stats()
        cache = stats["row_cache"]
        assert cache["hits"] + cache["misses"] > cache_before["hits"] + cache_before["misses"]
        if mode == "registered":  # the graph captured before still ran the kernel, and only it
            assert table.paths.gpu.read_counts()["rows"] == kernel_rows + 6 * n
            assert stats["serving"]["page_touches"] == 0


@pytest.mark.parametrize("n", [16, 1024])
def test_a_capture_checks_the_fit_and_captures_the_host_path_it_built(
    tables, n, ids_for, rng, device, monkeypatch
):
    """The table stops fitting between two fit checks (checks every hour here), as an engine's KV
    cache takes the memory right before it captures its graphs: the capture's first lookup checks
    again (``FitWatch.check_at_capture``; the ats mode's captures do, which this GPU has not: the
    registered mode's are watched here by setting ``capture_checks``), builds the host path with a
    row cache inside the real capture, which stays intact, and captures it; its replays with new
    ids are exact and run the host path, never the kernel."""
    from ple_um.lookup import fit_watch

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "3600")
    monkeypatch.setenv("PLE_UM_BULK_ROWS", "100000")  # every lookup here is decode-sized
    monkeypatch.setattr(fit_watch, "CAPTURE_CHECK_AGE", 0.0)
    layout = tables["fp8"]
    with ple_um.open_table(layout.directory, mode="registered", device=device) as table:
        assert table.stats()["serving"]["path"] == "kernel" and table.stats()["row_cache"] is None
        table.paths.capture_checks = True
        ids = torch.zeros(n, dtype=torch.int64, device=device)
        out = torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device=device)
        table.lookup(ids, out=out)  # warm, on the kernel
        torch.cuda.synchronize()
        monkeypatch.setattr(memory, "fits", lambda *a, **k: (False, "the owned rows do not fit (forced)"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(ids, out=out)
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 1 and table.paths.fit.checks == 1, serving
        assert table.stats()["row_cache"] is not None, table.row_reads
        kernel_rows = table.paths.gpu.read_counts()["rows"]
        host_lookups = table.stats()["host_lookups"]
        hot = rng.integers(0, layout.num_rows, 64)
        for k in range(6):
            ids_np = ids_for(layout, n, rng) if k % 2 else rng.choice(hot, n)
            ids.copy_(torch.from_numpy(ids_np))
            out.view(torch.uint8).fill_(0xAB)
            graph.replay()
            torch.cuda.synchronize()
            assert same(out, want(layout, ids_np, torch.bfloat16)), f"replay {k}"
        stats = table.stats()
        assert table.paths.gpu.read_counts()["rows"] == kernel_rows  # the kernel captured nothing
        assert stats["host_lookups"] == host_lookups + 6
        assert stats["row_cache"]["hits"] > 0, stats


def test_a_captured_page_touch_reads_its_word_at_each_replay(make_checkpoint, rng, device):
    """The ats mode's live touch (``LookupPaths.touch_live``) as a CUDA graph replays it: the host
    node of a touch captured once, replayed with new ids while its word is flipped, the table's
    pages dropped before each replay. Clear: none of the rows' pages comes in and no touch is
    counted; set: every one comes in, counted. The ats mode itself needs ATS (not on an H200): the
    touch is the host path's, the same in every mode, here the cpu mode's on this GPU."""
    from helpers.rowcopy_jobs import rows_in_memory

    from ple_um.residency import evict_pages

    layout = make_checkpoint(num_rows=16384, row_dim=256, dtype="fp8", shards=3, files=1)
    with ple_um.open_table(layout.directory, mode="cpu", device=device) as table:
        host, mapping = table.paths.row_copy, table.mapping
        mapping.advise("random")  # no readahead: only the pages touched come in
        live = np.ones(1, dtype=np.int32)
        ids = torch.zeros(64, dtype=torch.int64, device=device)
        host.touch(ids, live=live)  # warm: buffers made outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            host.touch(ids, live=live)
        touches = host.counts.read()["touches"]
        for word in (0, 1, 0, 0, 1):
            ids_np = rng.choice(layout.num_rows, 64, replace=False)
            ids.copy_(torch.from_numpy(ids_np))
            torch.cuda.synchronize()
            evict_pages(layout.files, mapping.regions)
            assert not any(rows_in_memory(mapping, ids_np)), "the pages were not dropped"
            live[0] = word
            graph.replay()
            torch.cuda.synchronize()
            touches += word
            inside = rows_in_memory(mapping, ids_np)
            assert all(inside) if word else not any(inside), (word, inside)
            assert host.counts.read()["touches"] == touches
        assert table.stats()["serving"]["page_touches"] == touches


FIRST_HOST_PATH_CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    sys.path.insert(0, sys.argv[2])
    import numpy as np, torch
    import ple_um
    from helpers.reference import reference_rows
    from ple_um.access import memory
    from ple_um.lookup import decode
    from ple_um.lookup.host import signal_check
    device = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(int(sys.argv[3]))
    with ple_um.open_table(sys.argv[1], mode="registered", device=device) as table:
        no_host = table.paths.host is None
        prepared = device.index in signal_check._verdicts and device in decode._on_device
        n = 64
        ids = torch.zeros(n, dtype=torch.int64, device=device)
        out = torch.empty((n, table.row_dim), dtype=table.dtype, device=device)
        table.lookup(ids, out=out)  # warm: the kernel's launcher made outside the capture
        torch.cuda.synchronize()
        memory.fits = lambda *a, **k: (False, "the owned rows do not fit (forced)")
        checked = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the fit check's thread builds the first host path meanwhile
            table.lookup(ids, out=out)
            worker = threading.Thread(target=lambda: checked.append(table.paths.fit.check()))
            worker.start()
            worker.join()
        bad = 0
        for k in range(4):
            ids_np = rng.integers(-2, table.num_rows + 2, n)
            ids.copy_(torch.from_numpy(ids_np))
            out.view(torch.uint8).fill_(0xAB)
            graph.replay()  # the kernel, as captured
            eager = table.lookup(ids)  # the host path now
            torch.cuda.synchronize()
            expect = reference_rows(table.layout, ids_np)
            for got in (out, eager):
                bad += not np.array_equal(got.view(torch.uint8).cpu().numpy(), expect)
        stats = table.stats()
        print(json.dumps(dict(no_host=no_host, prepared=prepared, checked=checked, bad=bad,
                              serving=stats["serving"], row_cache=stats["row_cache"])))
    """
)


def test_the_fit_checks_first_host_path_makes_no_cuda_call_on_its_thread(tables, rng):
    """``PLE_UM_BULK_ROWS=0`` in the registered mode: a table that fits has no host path at open,
    so the fit check's thread builds the first one. What a host path needs of the device once (the
    E2M1 values, the dispatcher's signals check: allocations, a pinned buffer, a stream, stream
    queries) is made at open, on the opening thread, with the device current: the check's build,
    made here while the main thread captures a CUDA graph, leaves the capture intact. In a fresh
    process, where nothing of the device was made before: the graph captured then replays exactly,
    and so do the eager lookups on the host path built."""
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(__file__))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FIRST_HOST_PATH_CHILD,
            tables["fp8"].directory,
            tests,
            str(rng.integers(1 << 30)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PLE_UM_FIT_CHECK_SEC": "0", "PLE_UM_BULK_ROWS": "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["no_host"] and result["prepared"], result
    assert result["checked"] == [True] and result["serving"]["path"] == "host", result
    assert result["row_cache"] is not None and result["bad"] == 0, result
