"""Every lookup path on a real GPU, against rows read from the files: each mode the machine allows
(the cpu mode through its host node and through its synchronous fallback), raw and dequantized,
every storage dtype, owned sub-ranges, shard boundaries and bad ids, poisoned outputs, counters;
CUDA graphs captured and replayed with new ids (host nodes and kernels, big chunked lookups
included), torch.compile, two streams and two tables at once, graphs replayed after the eager
buffers were reused, the host path of the GPU modes, the page touch, no host sync.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.reference import bits_differ, reference_nvfp4, reference_rows

import ple_um
from ple_um.access.capabilities import read_capabilities
from ple_um.lookup.host.gather import HostGather, chunks
from ple_um.lookup.sync_gather import SyncGather

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# (mode, rowcopy): "1" the C row copy (eager lookups of the host path by the dispatcher thread,
# captured ones as host nodes), "node" the same with eager lookups as host nodes too
# (PLE_UM_DISPATCHER=0), "0" the cpu mode's synchronous path (PLE_UM_ROWCOPY=0).
MODES = [("registered", "1"), ("device", "1"), ("cpu", "1"), ("cpu", "node"), ("cpu", "0"), ("ats", "1")]


class Expected:
    """What a lookup of ``ids`` must return, read from the files once (``reference_rows``, or
    ``reference_nvfp4`` decoded in float32), in any output dtype."""

    def __init__(self, layout, ids: np.ndarray, rows=None) -> None:
        self.layout = layout
        if layout.is_nvfp4:
            self.value = reference_nvfp4(layout, ids, rows, out_dtype=torch.float32)
        else:
            raw = torch.from_numpy(reference_rows(layout, ids, rows)).view(layout.dtype)
            self.raw = raw.reshape(*np.shape(ids), -1)
            self.value = self.raw.float()
            if layout.scale is not None:
                self.value = self.value * torch.tensor(layout.scale, dtype=torch.float32)

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        return self.raw if dtype == self.layout.dtype else self.value.to(dtype)


def expected(layout, ids: np.ndarray, dtype: torch.dtype, rows=None) -> torch.Tensor:
    return Expected(layout, ids, rows)(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits (a NaN need only be a NaN where the output is dequantized)."""
    return bits_differ(got, want, raw=not (want.is_floating_point() and want.element_size() > 1)) is None


def poisoned(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    out.view(torch.uint8).fill_(0xAB)
    return out


@pytest.fixture
def open_mode(monkeypatch, device):
    """``open_mode(layout, mode, rowcopy, rows=None, **env)``: the table (a skip where the machine
    lacks the mode)."""
    caps = read_capabilities(device)

    def open_(layout, mode, rowcopy, rows=None, **env):
        if mode == "ats" and not caps.pageable_memory_access_uses_host_page_tables:
            pytest.skip("no ATS on this device (PageableMemoryAccessUsesHostPageTables = 0)")
        monkeypatch.setenv("PLE_UM_ROWCOPY", "0" if rowcopy == "0" else "1")
        monkeypatch.setenv("PLE_UM_DISPATCHER", "0" if rowcopy == "node" else "1")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        table = ple_um.open_table(layout.directory, mode=mode, rows=rows, device=device)
        if mode == "cpu":
            assert isinstance(table.paths.host, SyncGather if rowcopy == "0" else HostGather), table.row_reads
            assert table.capture_safe == (rowcopy != "0")
        if isinstance(table.paths.host, HostGather):
            assert table.paths.host.dispatcher == (rowcopy == "1"), table.row_reads
        return table

    return open_


@pytest.mark.parametrize("mode,rowcopy", MODES)
@pytest.mark.parametrize("name", ["fp8", "bf16", "f16", "nvfp4"])
def test_every_mode_equals_the_files(tables, name, mode, rowcopy, open_mode, ids_for, rng, device):
    layout = tables[name]
    S = layout.rows_per_shard
    for rows in (None, (S + 5, 4 * S - 3)):
        with open_mode(layout, mode, rowcopy, rows) as table:
            expect_rows = expect_oob = 0
            for n in (16, 1000, 40_000):  # 40 000: chunked on the host path, the bulk path's side
                ids_np = ids_for(layout, n, rng, rows).reshape(4, -1)  # 2-D ids: shapes kept
                ids = torch.from_numpy(ids_np).to(device)
                as_int32 = ids_np.astype(np.int32)  # wraps as torch's .int() does (2**40 -> 0)
                want, want32 = Expected(layout, ids_np, rows), Expected(layout, as_int32, rows)
                dtypes = FLOATS if layout.is_nvfp4 else (layout.dtype, *FLOATS)
                for dtype in dtypes:
                    out = poisoned((*ids.shape, layout.row_dim), dtype, device)
                    table.lookup(ids, out=out)
                    assert same(out, want(dtype)), (n, dtype, rows)
                    got = table.lookup(ids.int(), out_dtype=dtype)  # int32 ids, allocated out
                    assert same(got, want32(dtype)), (n, dtype, "int32")
                    expect_rows += 2 * ids.numel()
                    expect_oob += int(((ids_np < 0) | (ids_np >= layout.num_rows)).sum())
                    expect_oob += int(((as_int32 < 0) | (as_int32 >= layout.num_rows)).sum())
            stats = table.stats()
            assert (stats["rows"], stats["out_of_range"]) == (expect_rows, expect_oob)
            assert stats["broken_rows"] == 0


@pytest.mark.parametrize("mode,rowcopy", [m for m in MODES if m not in (("cpu", "0"), ("cpu", "node"))])
@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_graphs_replay_with_new_ids(tables, name, mode, rowcopy, open_mode, ids_for, rng, device):
    layout = tables[name]
    rows = (layout.rows_per_shard - 2, layout.num_rows - 100)
    # 20 000 ids in the GPU modes take the host path (bulk_rows below it): a captured host node.
    with open_mode(layout, mode, rowcopy, rows, PLE_UM_BULK_ROWS="20000") as table:
        assert table.capture_safe
        dtype = torch.bfloat16
        graphs = []
        for n in (16, 1024, 20_000, 70_000):
            ids = torch.from_numpy(ids_for(layout, n, rng, rows)).to(device)
            out = poisoned((n, layout.row_dim), dtype, device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                table.lookup(ids, out=out)  # warm-up outside the capture (buffers, compiled kernels)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                table.lookup(ids, out=out)
            graphs.append((graph, ids, out))
        before = table.stats()["rows"]
        replayed = 0
        for _ in range(4):
            for graph, ids, out in graphs:
                fresh = ids_for(layout, ids.numel(), rng, rows)
                ids.copy_(torch.from_numpy(fresh))
                out.view(torch.uint8).fill_(0xAB)
                graph.replay()
                torch.cuda.synchronize()
                assert same(out, expected(layout, fresh, dtype, rows)), (ids.numel(), mode)
                replayed += ids.numel()
        assert table.stats()["rows"] - before == replayed  # replays are counted, in every path


def test_two_streams_two_tables_and_graphs_after_the_eager_buffers_grew(
    tables, open_mode, ids_for, rng, device
):
    """A cpu-mode table (host nodes) and a registered one: graphs of three sizes captured on one
    stream, replayed interleaved with eager lookups of both tables on two other streams, before and
    after the eager buffers were regrown by a bigger lookup; every output exact."""
    fp8, bf16 = tables["fp8"], tables["bf16"]
    with open_mode(fp8, "cpu", "1") as host_table, open_mode(bf16, "registered", "1") as kernel_table:
        capture_stream = torch.cuda.Stream()
        graphs = []
        for n in (16, 1024, 5000):
            ids = torch.from_numpy(ids_for(fp8, n, rng)).to(device)
            out = poisoned((n, fp8.row_dim), fp8.dtype, device)
            with torch.cuda.stream(capture_stream):
                host_table.lookup(ids, out=out)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=capture_stream):
                host_table.lookup(ids, out=out)
            graphs.append((graph, ids, out))
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for round_ in range(6):
            eager = []
            for k, stream in enumerate(streams):
                table, layout = (host_table, fp8) if k == 0 else (kernel_table, bf16)
                n = 100_000 if round_ == 3 else int(rng.integers(1, 3000))  # round 3 regrows the buffers
                ids_np = ids_for(layout, n, rng)
                with torch.cuda.stream(stream):
                    ids = torch.from_numpy(ids_np).to(device, non_blocking=False)
                    out = poisoned((n, layout.row_dim), torch.float32, device)
                    table.lookup(ids, out=out)
                eager.append((out, layout, ids_np))
            for graph, ids, out in graphs:
                fresh = ids_for(fp8, ids.numel(), rng)
                with torch.cuda.stream(capture_stream):
                    ids.copy_(torch.from_numpy(fresh))
                    out.view(torch.uint8).fill_(0xAB)
                    graph.replay()
                eager.append((out, fp8, fresh))
            torch.cuda.synchronize()
            for out, layout, ids_np in eager:
                assert same(out, expected(layout, ids_np, out.dtype)), (round_, out.shape)


@pytest.mark.parametrize("mode", ["cpu", "registered"])
def test_torch_compile_fullgraph(tables, mode, open_mode, ids_for, rng, device):
    layout = tables["fp8"]
    with open_mode(layout, mode, "1") as table:

        def step(ids, out):
            table.lookup(ids, out=out)
            return out.float().sum(dim=-1)

        compiled = torch.compile(step, fullgraph=True)
        for n in (64, 64, 4096):
            ids_np = ids_for(layout, n, rng)
            ids = torch.from_numpy(ids_np).to(device)
            out = poisoned((n, layout.row_dim), torch.bfloat16, device)
            sums = compiled(ids, out)
            want = expected(layout, ids_np, torch.bfloat16)
            assert same(out, want)
            # The rows are exact (above); the sums differ only by the order of float additions.
            assert torch.allclose(sums.cpu(), want.float().sum(dim=-1), rtol=1e-4, atol=1e-3)


def test_a_host_node_lookup_does_not_wait_for_the_device(tables, open_mode, ids_for, rng, device):
    """Queued behind 200 ms of GPU work, an eager cpu-mode lookup returns while that work still runs."""
    layout = tables["fp8"]
    with open_mode(layout, "cpu", "1") as table:
        ids_np = ids_for(layout, 1024, rng)
        ids = torch.from_numpy(ids_np).to(device)
        out = poisoned((1024, layout.row_dim), layout.dtype, device)
        table.lookup(ids, out=out)  # buffers made
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # cycles: about 0.2 s at the H200's 1.98 GHz
        busy = torch.cuda.Event()
        busy.record()
        out.view(torch.uint8).fill_(0xAB)
        table.lookup(ids, out=out)
        assert not busy.query()  # the lookup was queued, the GPU is still asleep
        torch.cuda.synchronize()
        assert same(out, expected(layout, ids_np, layout.dtype))


@pytest.mark.parametrize("rowcopy", ["1", "node"])
@pytest.mark.parametrize("n", [1024, 70_000])
def test_an_eager_lookup_does_not_hold_up_work_queued_after_it_on_other_streams(
    tables, open_mode, ids_for, rng, device, n, rowcopy
):
    """Behind 200 ms of GPU work on its stream, an eager cpu-mode lookup (the dispatcher, or host
    nodes) leaves a kernel queued after it on another stream free to run at once; the lookup's rows
    are exact once the work is done."""
    layout = tables["fp8"]
    with open_mode(layout, "cpu", rowcopy) as table:
        ids_np = ids_for(layout, n, rng)
        ids = torch.from_numpy(ids_np).to(device)
        out = poisoned((n, layout.row_dim), torch.bfloat16, device)
        busy, other = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.ones(1024, device=device)
        with torch.cuda.stream(busy):
            table.lookup(ids, out=out)  # buffers made
        with torch.cuda.stream(other):
            x.mul_(1)  # loaded now: a kernel's first launch may wait for the device (lazy loading)
        torch.cuda.synchronize()
        counted = table.paths.host.read_counts()["lookups"]
        with torch.cuda.stream(busy):
            torch.cuda._sleep(400_000_000)  # about 0.2 s
            asleep = torch.cuda.Event()
            asleep.record()
            out.view(torch.uint8).fill_(0xAB)
            table.lookup(ids, out=out)
        with torch.cuda.stream(other):
            x.mul_(2)
            later = torch.cuda.Event()
            later.record()
        deadline = time.monotonic() + 0.1
        while not later.query() and time.monotonic() < deadline:
            time.sleep(1e-4)
        assert later.query() and not asleep.query()  # the other stream ran while the lookup waited
        torch.cuda.synchronize()
        assert same(out, expected(layout, ids_np, torch.bfloat16)) and int(x[0]) == 2
        assert table.paths.host.read_counts()["lookups"] - counted == 1  # one lookup, in chunks or not


class _NoDispatcher:
    """The row copy library as a forked child sees it: every post refused (-1), and counted."""

    def __init__(self, lib) -> None:
        self._lib = lib
        self.refused = 0

    def ple_dispatch_post(self, job) -> int:
        self.refused += 1
        return -1

    def __getattr__(self, name):
        return getattr(self._lib, name)


def test_a_lookup_that_cannot_be_posted_takes_host_nodes(tables, open_mode, ids_for, rng, device):
    """A job the dispatcher refuses becomes a host node queued before the copies: exact, counted."""
    layout = tables["fp8"]
    with open_mode(layout, "cpu", "1") as table:
        assert table.paths.host.dispatcher
        lib = table.paths.host.lib = _NoDispatcher(table.paths.host.lib)
        total, lookups = table.paths.host.read_counts()["rows"], table.paths.host.read_counts()["lookups"]
        for n in (16, 5000, 70_000):  # inline, pooled, chunked
            ids_np = ids_for(layout, n, rng)
            out = poisoned((n, layout.row_dim), layout.dtype, device)
            refused = lib.refused
            table.lookup(torch.from_numpy(ids_np).to(device), out=out)
            assert lib.refused - refused == len(chunks(n)), n  # every job was offered, and refused
            assert same(out, expected(layout, ids_np, layout.dtype)), n
            total += n
        assert table.paths.host.read_counts()["rows"] == total
        assert table.paths.host.read_counts()["lookups"] - lookups == 3  # a chunked lookup counts once


def test_the_page_touch_runs_before_the_kernel(tables, open_mode, ids_for, rng, device):
    """PLE_UM_ATS_PREFETCH=on puts the ats mode's page touch (a host node) before every kernel
    lookup; here in the registered mode, which runs the same code. Outputs exact, the touch ran
    (host-node time rose) and counted no rows (the kernel counts the lookup)."""
    layout = tables["fp8"]
    with open_mode(layout, "registered", "1", PLE_UM_ATS_PREFETCH="on", PLE_UM_BULK_ROWS="0") as table:
        assert table.paths.touch_pages and isinstance(table.paths.host, HostGather)
        ns0 = table.paths.host.counts.read()["ns"]
        for n in (16, 5000):
            ids_np = ids_for(layout, n, rng)
            out = poisoned((n, layout.row_dim), torch.float16, device)
            table.lookup(torch.from_numpy(ids_np).to(device), out=out)
            assert same(out, expected(layout, ids_np, torch.float16))
        counts = table.paths.host.counts.read()
        assert counts["ns"] > ns0 and counts["rows"] == 0 and counts["lookups"] == 0
        assert table.stats()["rows"] == 5016


def test_the_direct_launch_equals_tritons_own(tables, open_mode, ids_for, rng, device, monkeypatch):
    layout = tables["bf16"]
    outs = []
    ids_np = ids_for(layout, 3000, rng)
    for direct in ("1", "0"):
        with open_mode(layout, "registered", "1", PLE_UM_DIRECT_LAUNCH=direct, PLE_UM_BULK_ROWS="0") as table:
            assert (table.paths.gpu.launch.startswith("direct")) == (direct == "1"), table.paths.gpu.launch
            for _ in range(3):  # the first call compiles through Triton, the next ones launch directly
                out = poisoned((3000, layout.row_dim), torch.float32, device)
                table.lookup(torch.from_numpy(ids_np).to(device), out=out)
            assert bool(table.paths.gpu._bound) == (direct == "1")  # a bound launcher served the later calls
            outs.append(out.cpu())
    assert same(outs[0], expected(layout, ids_np, torch.float32)) and same(outs[1], outs[0])


def test_bound_launchers_are_kept_apart_by_every_argument_they_were_compiled_for(
    tables, open_mode, ids_for, rng, device
):
    """The direct launch reused across calls that change what its compiled kernel took: ids of
    each dtype (uint8 255 is a row, int8 -1 is not), raw and dequantized outputs, outputs at every
    address mod 8 (raw words shrink there), batches of 1, ROWS - 1, ROWS + 1; each call exact,
    and the kinds revisited after the others, so that a bound launcher reused for the wrong kind
    shows."""
    layout = tables["fp8"]
    row_bytes = layout.row_bytes
    with open_mode(layout, "registered", "1", PLE_UM_BULK_ROWS="0") as table:
        assert table.paths.gpu.launch.startswith("direct"), table.paths.gpu.launch
        for _ in range(2):
            for id_dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
                info = torch.iinfo(id_dtype)
                for dtype in (layout.dtype, torch.bfloat16, torch.float32):
                    for shift in range(8):  # the output's address mod 8, as a view into a buffer
                        for n in (1, 15, 17):
                            ids_np = ids_for(layout, n, rng).clip(info.min, info.max)
                            ids_np[0] = info.max if shift % 2 else info.min  # 255 / -1 and the like
                            ids = torch.from_numpy(ids_np).to(id_dtype).to(device)
                            buf = poisoned((n * row_bytes * 4 + 8,), torch.uint8, device)
                            nbytes = n * layout.row_dim * dtype.itemsize
                            if shift % dtype.itemsize:  # no such view of a float output
                                continue
                            out = buf[shift : shift + nbytes].view(dtype).view(n, layout.row_dim)
                            assert out.data_ptr() % 8 == shift
                            table.lookup(ids, out=out)
                            want = expected(layout, ids.cpu().to(torch.int64).numpy(), dtype)
                            assert same(out.cpu(), want), (id_dtype, dtype, shift, n)
                            assert (buf[:shift] == 0xAB).all() and (buf[shift + nbytes :] == 0xAB).all()
        assert len(table.paths.gpu._bound) > 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_a_lookup_while_another_device_is_current_runs_on_the_tables(tables, name, ids_for, rng):
    """A table on cuda:1 looked up while cuda:0 is current: the kernel runs on the table's device
    (its current stream), never on the current one, which cannot read the table's memory."""
    layout, n = tables[name], 1000
    with ple_um.open_table(layout.directory, mode="registered", device="cuda:1") as table:
        torch.cuda.set_device(0)
        ids_np = ids_for(layout, n, rng)
        ids = torch.from_numpy(ids_np).to("cuda:1")
        for dtype in FLOATS * 2:  # the second time through the bound launchers
            out = poisoned((n, layout.row_dim), dtype, "cuda:1")
            table.lookup(ids, out=out)
            assert torch.cuda.current_device() == 0
            torch.cuda.synchronize(1)
            assert same(out.cpu(), expected(layout, ids_np, dtype)), dtype
        if layout.is_nvfp4:
            packed, scales = table.lookup_packed(ids)
            torch.cuda.synchronize(1)
            assert np.array_equal(packed.cpu().numpy(), reference_rows(layout, ids_np))
            assert np.array_equal(
                scales.view(torch.uint8).cpu().numpy(), reference_rows(layout.scale_layout(), ids_np)
            )


def test_graph_replays_serve_a_table_whose_pages_were_dropped(tables, open_mode, ids_for, rng, device):
    """The page cache dropped between replays (our page-table entries, then the files' pages): the
    host node's reads fault the rows back in from the disk; every replay exact."""
    from ple_um.residency import evict_pages

    layout = tables["fp8"]
    with open_mode(layout, "cpu", "1") as table:
        n = 4096
        ids = torch.from_numpy(ids_for(layout, n, rng)).to(device)
        out = poisoned((n, layout.row_dim), torch.bfloat16, device)
        table.lookup(ids, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(ids, out=out)
        for _ in range(3):
            evict_pages(layout.files, table.mapping.regions)
            fresh = ids_for(layout, n, rng)
            ids.copy_(torch.from_numpy(fresh))
            graph.replay()
            torch.cuda.synchronize()
            assert same(out, expected(layout, fresh, torch.bfloat16))


@pytest.mark.parametrize("mode", ["cpu", "registered"])
def test_a_lookup_from_a_fresh_thread(tables, mode, open_mode, ids_for, rng, device):
    """A thread that has made no CUDA call yet: the host path makes the device's context current
    itself before its driver calls, and the kernel path's launcher does too."""
    import threading

    layout = tables["fp8"]
    with open_mode(layout, mode, "1", PLE_UM_BULK_ROWS="1000") as table:
        calls = {}
        for n in (16, 5000):  # the kernel and, in the registered mode, its host path
            ids_np = ids_for(layout, n, rng)
            ids = torch.from_numpy(ids_np).to(device)
            out = poisoned((n, layout.row_dim), layout.dtype, device)
            torch.cuda.synchronize()
            # The thread's only CUDA work is the lookup itself (on the default stream).
            worker = threading.Thread(target=table.lookup, args=(ids,), kwargs={"out": out})
            worker.start()
            worker.join(60)
            calls[n] = (out, ids_np)
        torch.cuda.synchronize()
        results = {n: same(out, expected(layout, ids_np, layout.dtype)) for n, (out, ids_np) in calls.items()}
        assert results == {16: True, 5000: True}
