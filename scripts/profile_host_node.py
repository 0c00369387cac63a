"""Profile the host paths on a CUDA host: the cpu mode's host path (eager through the dispatcher and
through host nodes, and graph-replayed), the GPU modes' host path for big batches, the overlap of a
prefetched lookup with GPU work, the host time of each CUDA call an eager lookup makes with the GPU
idle and busy, and a table whose pages are not resident; beside plain torch (the owned rows
resident in GPU memory, gathered with torch.index_select) and the registered mode's kernel, in one
run. Every output is compared with the resident copy of the rows (read from the files), fresh ids
at every call.

    python scripts/profile_host_node.py --size 16GiB --out $OUT/profile_host_node.json
    python scripts/profile_host_node.py --parts bulk,trace --schedules default   # the diagnostics

``--parts`` picks what runs (default paths, overlap, host_calls, cold): ``bulk`` times where a
131 072-row host-path lookup's time goes (the row copy alone, the rows' copies alone, just after the
row copy wrote them and on two streams, chunk schedules, the GPU timeline of one lookup); ``trace``
records the eager overlapped step under torch.profiler (docs/PERF_NOTES.md rows 20-24).

Prints a table last and writes JSON (medians and the 10th-90th percentile spread, microseconds).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import threading
import time

import numpy as np
import torch

import ple_um
from ple_um import units

SIZES = (16, 1024, 16384, 131072)
FAILURES: list[str] = []


def check(name: str, ok: bool) -> None:
    if not ok:
        FAILURES.append(name)
        print(f"WRONG: {name}", flush=True)


def spread(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e6
    return {
        "median_us": float(np.median(a)),
        "p10_us": float(np.percentile(a, 10)),
        "p90_us": float(np.percentile(a, 90)),
    }


def table_dir(args) -> str:
    """--dir, else the synthetic FP8 table of ``ple-um bench --size`` (written once, shared)."""
    if args.dir:
        return args.dir
    from ple_um.bench.config import Config, default_table

    return default_table(Config(size=units.parse_size(args.size)))


class Resident:
    """Plain torch: the table's rows in GPU memory, gathered with torch.index_select (the anchor and
    the reference: its rows were read from the mapped files)."""

    dtype = torch.uint8

    def __init__(self, table) -> None:
        layout = table.layout
        self.rows = torch.empty((layout.num_rows, layout.row_bytes), dtype=torch.uint8, device="cuda")
        start = 0
        for index in range(layout.parts):
            part = torch.from_numpy(table.mapping.shard_rows(index))
            self.rows[start : start + part.shape[0]].copy_(part)
            start += part.shape[0]

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        torch.index_select(self.rows, 0, ids, out=out)
        return out


class KernelCall:
    """The registered table's kernel path alone (GpuGather.gather): the host cost under lookup()."""

    def __init__(self, table) -> None:
        self.table, self.dtype = table, table.dtype

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return self.table.paths.gpu.gather(ids, out)


class HostNodes:
    """A table whose eager host-path lookups take host nodes instead of the dispatcher thread (as
    with PLE_UM_DISPATCHER=0), toggled around each call: the same table, side by side."""

    def __init__(self, table) -> None:
        self.table, self.dtype = table, table.dtype

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        host = self.table.paths.host
        saved, host.dispatcher = host.dispatcher, False
        try:
            return self.table.lookup(ids, out=out)
        finally:
            host.dispatcher = saved


def eager_synced(path, n, num_rows, reps, reference=None) -> dict:
    """Wall time per call, synchronized before and after, fresh ids each call."""
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    times = []
    for k in range(reps + 3):
        ids = torch.randint(0, num_rows, (n,), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        path.lookup(ids, out=out.view(path.dtype))
        torch.cuda.synchronize()
        if k >= 3:
            times.append(time.perf_counter() - t0)
        if reference is not None and k % 7 == 0:
            check(f"eager {type(path).__name__} {n}", torch.equal(out, reference.rows[ids]))
    return spread(times)


def host_cost(path, num_rows, calls=300) -> float:
    """Wall time per call of back-to-back eager 16-row calls into one out, one sync at the end."""
    out = torch.empty((16, 160), dtype=torch.uint8, device="cuda")
    batches = [torch.randint(0, num_rows, (16,), device="cuda") for _ in range(calls)]
    view = out.view(path.dtype)
    for ids in batches[:20]:
        path.lookup(ids, out=view)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids in batches:
        path.lookup(ids, out=view)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_replay(path, n, num_rows, reps, reference) -> dict:
    """Event-timed replays of a graph that captured one lookup; new ids copied in before each."""
    ids = torch.randint(0, num_rows, (n,), device="cuda")
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        path.lookup(ids, out=out.view(path.dtype))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        path.lookup(ids, out=out.view(path.dtype))

    def verify() -> None:
        check(f"graph {type(path).__name__} {n}", torch.equal(out, reference.rows[ids]))

    return spread(timed_replays(graph, ids, num_rows, reps, verify))


def timed_replays(graph, ids: torch.Tensor, num_rows: int, reps: int, verify=None) -> list[float]:
    """Seconds of ``reps`` event-timed replays of ``graph`` (after 3 untimed ones), new random ids
    copied into its ``ids`` before each; ``verify()``, when given, after each replay."""
    times = []
    for k in range(reps + 3):
        ids.copy_(torch.randint(0, num_rows, ids.shape, device="cuda"))
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if k >= 3:
            times.append(a.elapsed_time(b) * 1e-3)
        if verify is not None:
            verify()
    return times


def overlap(table, num_rows, reference, reps, shapes=((2048, 4), (2048, 8), (2048, 16)), priority=0) -> dict:
    """A PLE-shaped step: GPU work (a bf16 matmul chain), then a consumer of the work's result and of
    the lookup's rows. Four variants, each with the same consumer: the work alone (the consumer
    reads a stand-in for the rows), the lookup alone (the consumer reads a stand-in for the work),
    the two one after the other, and overlapped: the lookup forked onto a side stream before the
    work and joined after it, as the vLLM plugin's prefetch does. Graph replays are timed one by
    one (events); eager steps back to back, as a serving loop issues them (the ids of every step
    copied in first), time per step."""
    n = 1024
    ids = torch.randint(0, num_rows, (n,), device="cuda")
    fresh = torch.randint(0, num_rows, (64, n), device="cuda")
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    rows_stand_in = torch.empty_like(out)
    side = torch.cuda.Stream(priority=priority)
    results = {}

    def consume(x, rows):
        return x.float().mean() + rows.float().mean()

    for size, chain in shapes:
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        work_stand_in = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

        def work(chain=chain, a=a):
            x = a
            for _ in range(chain):
                x = x @ a
            return x

        spent = [0.0]  # host seconds inside lookup(): the caller's own cost of a queued lookup

        def lookup(spent=spent):
            t = time.perf_counter()
            table.lookup(ids, out=out.view(table.dtype))
            spent[0] += time.perf_counter() - t

        variants = {
            "work": lambda: consume(work(), rows_stand_in),
            "lookup": lambda work_stand_in=work_stand_in: (lookup(), consume(work_stand_in, out))[1],
            "serial": lambda: (lookup(), consume(work(), out))[1],
        }

        def overlapped():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                lookup()
            x = work()
            torch.cuda.current_stream().wait_stream(side)
            return consume(x, out)

        variants["overlapped"] = overlapped
        row = {}
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            steps, issued = [], []
            spent[0] = 0.0
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for k in range(fresh.shape[0]):
                    ids.copy_(fresh[k])
                    fn()
                issued.append((time.perf_counter() - t0) / fresh.shape[0])
                torch.cuda.synchronize()
                steps.append((time.perf_counter() - t0) / fresh.shape[0])
            if name in ("lookup", "overlapped"):
                check(f"overlap eager {name} {chain}", torch.equal(out, reference.rows[fresh[-1]]))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            checked = name in ("lookup", "overlapped")

            def verify(name=name, chain=chain) -> None:
                check(f"overlap graph {name} {chain}", torch.equal(out, reference.rows[ids]))

            replays = timed_replays(graph, ids, num_rows, reps, verify if checked else None)
            row[name] = {
                "eager": spread(steps),
                "graph": spread(replays),
                "eager_lookup_call_us": spent[0] / (reps * fresh.shape[0]) * 1e6,
                "eager_issue": spread(issued),  # host time to queue a step (the host's share)
            }
        for kind in ("eager", "graph"):
            floor = max(row["work"][kind]["median_us"], row["lookup"][kind]["median_us"])
            row[f"overlapped_over_max_{kind}"] = row["overlapped"][kind]["median_us"] / floor
        # The host's issue time is most of the step: the step is the host's, nothing to overlap on it.
        issue, step = ({k: row[k][key]["median_us"] for k in variants} for key in ("eager_issue", "eager"))
        row["host_bound_eager"] = {k: issue[k] >= 0.9 * step[k] for k in variants}
        results[f"matmuls_{chain}x{size}"] = row
    return results


def host_calls(reps: int = 20) -> dict:
    """Host time of each CUDA call an eager host-path lookup makes, with the GPU idle and with the
    call queued behind ~2 ms of GPU work (a sleep kernel on the same stream): where an eager lookup's
    host time goes when the device is busy (the overlap above). Medians of ``reps``, microseconds."""
    from ple_um.lookup.host_node import _Driver

    driver = _Driver.get()
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    word = driver.device_pointer(pinned.data_ptr()) if driver.mem_ops else None
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value  # a host function that does nothing

    calls = {
        "torch copy_ D2H 8 KiB into pinned": lambda: pinned[:8192].copy_(dev[:8192], non_blocking=True),
        "torch copy_ H2D 160 KiB from pinned": lambda: dev[:163840].copy_(pinned[:163840], non_blocking=True),
        "cuMemcpyDtoHAsync 8 KiB": lambda: driver.d2h(pinned.data_ptr(), dev.data_ptr(), 8192, stream),
        "cuMemcpyHtoDAsync 160 KiB": lambda: driver.h2d(dev.data_ptr(), pinned.data_ptr(), 163840, stream),
        "cuLaunchHostFunc (a no-op)": lambda: driver.launch_host_func(stream, free, None),
        "a torch kernel (add_)": lambda: dev[:1024].add_(1),
    }
    if word is not None:
        calls["cuStreamWriteValue32"] = lambda: driver.write_value(stream, word + 4096, 1)
        calls["cuStreamWaitValue32 (met)"] = lambda: driver.wait_value(stream, word + 4096, 0)
    out = {}
    if word is not None:  # how soon a stream waiting on pinned memory sees the host's write
        go = ctypes.c_uint32.from_address(pinned.data_ptr() + 8192)
        back = ctypes.c_uint32.from_address(pinned.data_ptr() + 8256)
        go.value = back.value = 0
        for waited in (0.0002, 0.002):
            times = []
            for k in range(1, reps + 3):
                driver.wait_value(stream, word + 8192, k)
                driver.write_value(stream, word + 8256, k)
                time.sleep(waited)  # the stream waits this long first
                t0 = time.perf_counter()
                go.value = k
                while back.value != k:
                    pass
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            key = f"signal round trip after {waited * 1e3:g} ms waiting"
            out[key] = spread(times[2:])["median_us"]
            print(f"host call {key}: {out[key]:.1f} us", flush=True)
    for name, call in calls.items():
        row = {}
        for busy in (False, True):
            times = []
            for _ in range(reps + 2):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(4_000_000)  # about 2 ms at the H200's clock
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            row["busy" if busy else "idle"] = spread(times[2:])["median_us"]
        out[name] = row
        print(f"host call {name}: idle {row['idle']:.1f} us, behind GPU work {row['busy']:.1f} us")
    return out


def bulk(name: str, table, num_rows: int, reference, reps: int, schedules=None) -> dict:
    """Where a 131 072-row host-path lookup's time goes (the registered mode's miss): the C row copy
    alone into pinned staging (host ids, the pool woken first, as a lookup does, or 0.3 ms ahead),
    the rows' copy to the device alone, each beside the other, the copies of staging just written
    (on one stream or two) against the same copies again, and the whole lookup, eager (synced) and
    replayed, with the chunk schedules of SCHEDULES (``schedules``: their labels, default all); then
    the GPU timeline of one lookup (torch.profiler: the ids' copy and each chunk's copy to the
    device, microseconds from the ids' copy's start)."""
    from ple_um.lookup import host_node, rowcopy

    host, n = table.paths.host, 131072
    rng = np.random.default_rng()
    staging = torch.empty((n, 160), dtype=torch.uint8, pin_memory=True)
    other = torch.empty((2 * n, 160), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty((2 * n, 160), dtype=torch.uint8, device="cuda")
    out: dict = {}

    def reads(woken_ahead: float = 0.0) -> float:
        ids = torch.from_numpy(rng.integers(0, num_rows, n))
        job = rowcopy.LookupStruct()
        host._fill(job, ids.data_ptr(), 0, n, [staging.data_ptr()])
        host.pool.wake()
        if woken_ahead:
            time.sleep(woken_ahead)  # the woken workers are spinning when the lookup comes
        t0 = time.perf_counter()
        host.lib.ple_lookup_run(ctypes.addressof(job))
        dt = time.perf_counter() - t0
        check(f"bulk reads {name}", torch.equal(staging[:64].cuda(), reference.rows[ids[:64].cuda()]))
        return dt

    second = torch.cuda.Stream()

    def copies(rows: int, pieces: int, streams: int = 1, src: torch.Tensor = staging) -> float:
        """``src``'s first rows, in pieces, to the device; with streams=2, every other piece on a
        second stream (forked and joined: two copies in flight)."""
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        second.wait_stream(torch.cuda.current_stream())
        for k in range(pieces):
            with torch.cuda.stream(second if streams == 2 and k % 2 else torch.cuda.current_stream()):
                dev[k * rows : (k + 1) * rows].copy_(src[k * rows : (k + 1) * rows], non_blocking=True)
        torch.cuda.current_stream().wait_stream(second)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3

    def after_reads(label: str, rows: int, pieces: int, streams: int = 1, again: bool = True) -> None:
        """The staging's copies just after the row copy wrote it, and (``again``) the same bytes
        copied once more right after."""
        fresh, repeated = [], []
        for _ in range(reps):
            reads()
            fresh.append(copies(rows, pieces, streams))
            if again:
                repeated.append(copies(rows, pieces, streams))
        out[f"h2d_{label}_just_written"] = spread(fresh)
        if again:
            out[f"h2d_{label}_again"] = spread(repeated)

    out["reads_alone"] = spread([reads() for _ in range(reps)])
    out["reads_alone, pool woken 0.3 ms ahead"] = spread([reads(woken_ahead=3e-4) for _ in range(reps)])
    out["h2d_21MB_alone"] = spread([copies(n, 1, src=other) for _ in range(reps)])
    during = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dev.copy_(other, non_blocking=True)  # 42 MB: longer than the reads
        during.append(reads())
    torch.cuda.synchronize()
    out["reads_during_h2d"] = spread(during)
    after_reads("4x32768", 32768, 4)
    after_reads("8x16384_two_streams", 16384, 8, streams=2)
    after_reads("8x16384_one_stream", 16384, 8, again=False)
    # Copies of rows not just written (``other``) while the row copy reads into ``staging``.
    during_reads = []
    for _ in range(reps):
        reader = threading.Thread(target=reads)
        reader.start()
        time.sleep(5e-5)
        during_reads.append(copies(32768, 4, src=other))
        reader.join()
    out["h2d_4x32768_not_just_written, while the row copy reads"] = spread(during_reads)
    out["h2d_1x131072_again"] = spread([copies(n, 1) for _ in range(reps)])
    out["h2d_32x4096_again"] = spread([copies(4096, 32) for _ in range(reps)])
    saved = host_node.chunks
    try:
        for label, sizes in SCHEDULES.items():
            if schedules and label not in schedules:
                continue
            if label != "default":
                host_node.chunks = lambda m, sizes=sizes: pieces_of(m, sizes, saved)
            out[f"eager {label}"] = eager_synced(table, n, num_rows, reps, reference)
            out[f"graph {label}"] = graph_replay(table, n, num_rows, reps, reference)
            host_node.chunks = saved
    finally:
        host_node.chunks = saved
    out["timeline"] = [lookup_timeline(table, n, num_rows) for _ in range(3)]
    for key, value in out.items():
        print(f"bulk {name} {key}: {value}", flush=True)
    return out


# Chunk schedules tried at 131 072 rows (the rows of each piece in turn; "default": the library's).
SCHEDULES = {
    "default": None,
    "65536+61440+4096": (65536, 61440, 4096),
    "65536+65536": (65536, 65536),
    "8192+16384+32768+69632+4096": (8192, 16384, 32768, 69632, 4096),
    "16384+49152+61440+4096": (16384, 49152, 61440, 4096),
    "8192+24576+49152+45056+4096": (8192, 24576, 49152, 45056, 4096),
    "4096+12288+45056+65536+4096": (4096, 12288, 45056, 65536, 4096),
    "16384x8": (16384,) * 8,
}


def pieces_of(n: int, sizes: tuple[int, ...], default) -> list[tuple[int, int]]:
    """[a, b) pieces of ``sizes`` for a lookup of their sum, else the library's ``default(n)``."""
    if n != sum(sizes):
        return default(n)
    bounds = np.cumsum((0, *sizes)).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def gpu_events(prof) -> list[dict]:
    """The GPU activities of a torch.profiler run: name, kind, stream, start and end (us)."""
    events = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            events.append(
                {
                    "name": e.name[:60],
                    "stream": getattr(e, "device_resource_id", None) or getattr(e, "thread", None),
                    "start": e.time_range.start,
                    "end": e.time_range.end,
                }
            )
    return sorted(events, key=lambda e: e["start"])


def lookup_timeline(table, n: int, num_rows: int) -> list:
    """One eager lookup of ``n`` fresh ids under torch.profiler: its GPU activities, microseconds
    from the first one's start."""
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    ids = torch.randint(0, num_rows, (n,), device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        table.lookup(ids, out=out.view(table.dtype))
        torch.cuda.synchronize()
    return relative(gpu_events(prof))


def relative(events: list[dict]) -> list:
    """(name, stream, start, end) of each event, microseconds from the first one's start."""
    t0 = events[0]["start"] if events else 0
    return [(e["name"], e["stream"], round(e["start"] - t0, 1), round(e["end"] - t0, 1)) for e in events]


def overlap_trace(table, num_rows: int, steps: int = 12, chain: int = 8) -> dict:
    """The eager overlapped step under torch.profiler (the miss): the GPU activities of ``steps``
    back-to-back steps (chain matmuls on the current stream, the 1 024-row lookup forked onto a side
    stream and joined), each with its stream, and the host time each step took to issue."""
    n = 1024
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, num_rows, (n,), device="cuda")
    fresh = torch.randint(0, num_rows, (steps, n), device="cuda")
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    result = {}
    for variant in ("overlapped", "serial"):

        def step(variant=variant):
            if variant == "overlapped":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    table.lookup(ids, out=out.view(table.dtype))
            else:
                table.lookup(ids, out=out.view(table.dtype))
            x = a
            for _ in range(chain):
                x = x @ a
            torch.cuda.current_stream().wait_stream(side)
            return x.float().mean() + out.float().mean()

        for k in range(3):
            ids.copy_(fresh[k])
            step()
        torch.cuda.synchronize()
        issue = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for k in range(steps):
                t = time.perf_counter()
                ids.copy_(fresh[k])
                step()
                issue.append(round((time.perf_counter() - t) * 1e6, 1))
            issued = time.perf_counter() - t0
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        events = gpu_events(prof)
        result[variant] = {
            "issue_us_per_step": issue,
            "issued_us": issued * 1e6,
            "total_us": total * 1e6,
            "gpu": relative(events),
        }
        print(
            f"overlap trace {variant}: issued {issued * 1e6 / steps:.1f} us/step, "
            f"total {total * 1e6 / steps:.1f} us/step; issue per step {issue}",
            flush=True,
        )
    return result


def drop_rows(table, ids: np.ndarray, libc) -> None:
    """Drop the pages of the rows of ``ids`` (a 4 KiB page each side of the row start): this
    process's page-table entries (MADV_DONTNEED) and the files' cached pages (POSIX_FADV_DONTNEED)."""
    layout, mapping = table.layout, table.mapping
    S, rb, page = layout.rows_per_shard, layout.row_bytes, 4096
    fds: dict[str, int] = {}
    try:
        for i in ids.tolist():
            shard, local = divmod(i, S)
            spec = layout.shards[shard]
            addr = mapping.shard_base(shard) + local * rb
            libc.madvise(addr - addr % page, 2 * page, 4)  # MADV_DONTNEED
            fd = fds.get(spec.path) or fds.setdefault(spec.path, os.open(spec.path, os.O_RDONLY))
            offset = spec.offset + local * rb
            os.posix_fadvise(fd, offset - offset % page, 2 * page, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds.values():
            os.close(fd)


def cold(table, num_rows, reference, reps) -> dict:
    """1 024-row graph replays whose rows' pages were dropped just before (this process's page-table
    entries and the files' cached pages): latency and the faults the host node served, beside warm
    replays (the same ids replayed again)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 1024
    ids = torch.randint(0, num_rows, (n,), device="cuda")
    out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    table.lookup(ids, out=out.view(table.dtype))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.lookup(ids, out=out.view(table.dtype))
    result = {"cold": [], "warm": []}
    faults = {"cold": [], "warm": []}
    for _ in range(reps):
        fresh = np.random.default_rng().integers(0, num_rows, n)
        drop_rows(table, fresh, libc)
        ids.copy_(torch.from_numpy(fresh))
        for kind in ("cold", "warm"):  # the same ids twice: first from the disk, then resident
            torch.cuda.synchronize()
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            result[kind].append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[kind].append((after.ru_minflt - before.ru_minflt, after.ru_majflt - before.ru_majflt))
            check(f"{kind} replay", torch.equal(out, reference.rows[ids]))
    return {
        kind: {
            **spread(result[kind]),
            "minor_faults": float(np.median([f[0] for f in faults[kind]])),
            "major_faults": float(np.median([f[1] for f in faults[kind]])),
        }
        for kind in result
    }


PARTS = ("paths", "overlap", "host_calls", "bulk", "trace", "cold")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="16GiB")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_host_node.json"))
    parser.add_argument("--skip-cold", action="store_true", help="the same as leaving 'cold' out of --parts")
    parser.add_argument(
        "--parts",
        default="paths,overlap,host_calls,cold",
        help=f"comma-separated, of {', '.join(PARTS)} (bulk: where a 131 072-row host-path lookup's "
        "time goes; trace: the eager overlapped step under torch.profiler)",
    )
    parser.add_argument(
        "--shapes",
        default="2048x4,2048x8,2048x16,4096x2,4096x4",
        help="the overlap's GPU work, comma-separated SIZExCHAIN: CHAIN bf16 matmuls of SIZE x SIZE",
    )
    parser.add_argument("--schedules", default="", help="bulk: the chunk schedules to time (default all)")
    parser.add_argument("--side-priority", type=int, default=0, help="the overlap's side stream priority")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"unknown parts {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    if args.skip_cold:
        parts.discard("cold")
    shapes = tuple(tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(","))
    directory = table_dir(args)
    os.environ["PLE_UM_BULK_ROWS"] = "auto"
    result: dict = {
        "size": args.size,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parts": sorted(parts),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "side_priority": args.side_priority,
    }
    t0 = time.perf_counter()
    cpu = ple_um.open_table(directory, mode="cpu")
    result["cpu_open_seconds"] = time.perf_counter() - t0
    result["cpu_row_reads"] = cpu.row_reads
    result["cpu_mapped_resident_bytes"] = cpu.mapped_resident
    registered = ple_um.open_table(directory, mode="registered")
    result["registered_bulk_rows"] = registered.bulk_rows
    result["registered_calibration_s"] = {str(k): v for k, v in registered.bulk_calibration.items()}
    result["cpu_dispatcher"] = cpu.host.dispatcher
    resident = Resident(cpu)
    num_rows = cpu.num_rows
    paths = {
        "torch resident": resident,
        "ple-um registered": registered,
        "ple-um registered, eager host nodes": HostNodes(registered),
        "ple-um cpu": cpu,
        "ple-um cpu, eager host nodes": HostNodes(cpu),
    }
    eager = {name: {} for name in paths}
    graphs = {name: {} for name in paths}
    if "paths" in parts:
        for n in SIZES:
            for name, path in paths.items():
                eager[name][n] = eager_synced(path, n, num_rows, args.reps, resident)
                graphs[name][n] = graph_replay(path, n, num_rows, args.reps, resident)
                print(
                    name,
                    n,
                    "eager",
                    round(eager[name][n]["median_us"], 1),
                    "graph",
                    round(graphs[name][n]["median_us"], 1),
                    flush=True,
                )
        result["eager"] = eager
        result["graph"] = graphs
        # The registered mode's kernel alone at the big size (its host path switched off for the call).
        saved, registered.bulk_rows = registered.bulk_rows, None
        kernel_only = eager_synced(registered, 131072, num_rows, args.reps, resident)
        result["registered_kernel_only_131072"] = kernel_only
        registered.bulk_rows = saved
        costs = {**paths, "GpuGather.gather alone (registered)": KernelCall(registered)}
        result["host_cost_us_16_rows"] = {name: host_cost(path, num_rows) for name, path in costs.items()}
        print("host cost", result["host_cost_us_16_rows"], flush=True)
    if "bulk" in parts:
        schedules = args.schedules.split(",") if args.schedules else None
        result["bulk_registered"] = bulk("registered", registered, num_rows, resident, args.reps, schedules)
        result["bulk_cpu"] = bulk("cpu", cpu, num_rows, resident, args.reps, schedules)
    if "overlap" in parts:
        result["overlap_cpu_mode"] = overlap(cpu, num_rows, resident, args.reps, shapes, args.side_priority)
        result["overlap_cpu_mode_host_nodes"] = overlap(
            HostNodes(cpu), num_rows, resident, args.reps, shapes, args.side_priority
        )
    if "trace" in parts:
        result["overlap_trace_dispatcher"] = overlap_trace(cpu, num_rows)
        result["overlap_trace_host_nodes"] = overlap_trace(HostNodes(cpu), num_rows)
    if "host_calls" in parts:
        try:
            result["host_calls_us"] = host_calls()
        except Exception as exc:  # noqa: BLE001 - recorded and printed, the run goes on
            result["host_calls_us"] = {"error": repr(exc)}
            print(f"host calls: {exc!r}")
    if "cold" in parts:
        result["cold_cpu_mode"] = cold(cpu, num_rows, resident, max(5, args.reps // 3))
    result["failures"] = FAILURES
    for table in (cpu, registered):
        table.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    if "paths" in parts:
        print("\n| path | " + " | ".join(f"{n} eager / graph (us)" for n in SIZES) + " | host cost 16 (us) |")
        print("| --- |" + " --- |" * (len(SIZES) + 1))
        for name in paths:
            cells = [f"{eager[name][n]['median_us']:.1f} / {graphs[name][n]['median_us']:.1f}" for n in SIZES]
            print(f"| {name} | " + " | ".join(cells) + f" | {result['host_cost_us_16_rows'][name]:.1f} |")
        k = result["registered_kernel_only_131072"]["median_us"]
        print(f"registered 131072 kernel only: {k:.1f} us; bulk_rows {result['registered_bulk_rows']}")
    for key in ("bulk_registered", "bulk_cpu"):
        if key in result:
            b = result[key]
            timed = {name: v for name, v in b.items() if isinstance(v, dict) and "median_us" in v}
            cells = [f"{name} {v['median_us']:.1f}" for name, v in timed.items()]
            print(f"{key} (median us): " + "; ".join(cells))
    names = ("work", "lookup", "overlapped", "serial")
    for key in ("overlap_cpu_mode", "overlap_cpu_mode_host_nodes"):
        for chain, row in result.get(key, {}).items():
            cells = [
                f"{kind} " + " / ".join(f"{row[name][kind]['median_us']:.1f}" for name in names)
                for kind in ("graph", "eager")
            ]
            issue = " / ".join(f"{row[name]['eager_issue']['median_us']:.1f}" for name in names)
            print(
                f"{key} {chain}, work / lookup / overlapped / serial (us): {'; '.join(cells)}; "
                f"overlapped/max: graph {row['overlapped_over_max_graph']:.2f}, "
                f"eager {row['overlapped_over_max_eager']:.2f}; eager lookup call (host) "
                f"{row['lookup']['eager_lookup_call_us']:.1f} us alone, "
                f"{row['overlapped']['eager_lookup_call_us']:.1f} us overlapped; "
                f"host issue per step {issue}; host-bound eager: {row['host_bound_eager']}"
            )
    if "cold_cpu_mode" in result:
        c = result["cold_cpu_mode"]["cold"]
        w = result["cold_cpu_mode"]["warm"]
        print(
            f"1024-row replays, rows dropped first: {c['median_us']:.1f} us ({c['minor_faults']:.0f} minor, "
            f"{c['major_faults']:.0f} major faults); again warm: {w['median_us']:.1f} us"
        )
    verdict = "all exact" if not FAILURES else f"{len(FAILURES)} WRONG: {FAILURES[:5]}"
    print(f"outputs checked: {verdict}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
