"""Concurrent lookups on a CUDA host (the lent H200): threads on two CUDA streams looking up at
once, through the GPU kernel and the CPU bulk path, raw and bf16, every output poisoned first and
compared element by element with the rows read from the files; then a captured graph replayed on
one stream while eager lookups run on the other. The device counters must add up exactly. Prints
a table last and writes JSON (scripts/gpu_check.py's summary).

    python scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 --threads 8 --json $OUT/conc.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
import torch

import ple_um
from ple_um.synthetic import write_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (record, summarize, dequant_ref, same_bits)


def whole_table(layout) -> np.ndarray:
    """Every row read from the files with plain reads (not ple_um's mappings): the reference."""
    table = np.empty((layout.num_rows, layout.row_bytes), dtype=np.uint8)
    pos = 0
    for spec in layout.shards:
        with open(spec.path, "rb") as f:
            f.seek(spec.offset)
            data = f.read(spec.rows * layout.row_bytes)
        table[pos : pos + spec.rows] = np.frombuffer(data, dtype=np.uint8).reshape(spec.rows, -1)
        pos += spec.rows
    return table


def expected(ref: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of ``ids``; zeros for ids outside the table."""
    ok = (ids >= 0) & (ids < ref.shape[0])
    rows = ref[np.where(ok, ids, 0)]
    rows[~ok] = 0
    return rows


def make_ids(rng, layout, n: int) -> np.ndarray:
    """Random ids with every shard boundary and a few ids outside the table mixed in."""
    S = layout.rows_per_shard
    edges = [x for i in range(1, layout.parts) for x in (i * S - 1, i * S)]
    extra = np.array(edges[: max(0, n // 4)] + [-1, layout.num_rows, layout.num_rows + 9], dtype=np.int64)
    ids = np.concatenate([extra, rng.integers(0, layout.num_rows, size=max(0, n - extra.size))])[:n]
    rng.shuffle(ids)
    return ids


def worker(table, layout, ref, stream, seed, sizes, iterations, tally, failures) -> None:
    rng = np.random.default_rng(seed)
    rows = bad = 0
    with torch.cuda.stream(stream):
        for it in range(iterations):
            for n in sizes:
                ids_np = make_ids(rng, layout, n)
                want = expected(ref, ids_np)
                ids = torch.from_numpy(ids_np).to("cuda", non_blocking=False)
                raw = torch.empty((n, layout.row_dim), dtype=layout.dtype, device="cuda")
                raw.view(torch.uint8).fill_(0xAB)
                bf = torch.full((n, layout.row_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
                table.lookup(ids, out=raw)
                table.lookup(ids, out=bf)
                fresh = table.lookup(ids, out_dtype=torch.bfloat16)  # allocated by the lookup
                stream.synchronize()
                got = raw.view(torch.uint8).cpu().numpy()
                want16 = gpu_check.dequant_ref(want, layout, torch.bfloat16)
                if not np.array_equal(got, want):
                    differ = int((got != want).any(axis=1).sum())
                    failures.append(f"seed {seed} it {it} n {n}: {differ} raw rows differ")
                if not gpu_check.same_bits(bf, want16) or not gpu_check.same_bits(fresh, want16):
                    failures.append(f"seed {seed} it {it} n {n}: bf16 rows differ")
                rows += 3 * n
                bad += 3 * int(((ids_np < 0) | (ids_np >= layout.num_rows)).sum())
    with tally[0]:
        tally[1] += rows
        tally[2] += bad


def run_threads(table, layout, ref, threads: int, sizes, iterations: int, label: str) -> None:
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    before = table.stats()
    tally = [threading.Lock(), 0, 0]
    failures: list[str] = []
    pool = [
        threading.Thread(
            target=worker,
            args=(table, layout, ref, streams[i % 2], 1000 + i, sizes, iterations, tally, failures),
        )
        for i in range(threads)
    ]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    after = table.stats()
    lookups = threads * iterations * len(sizes) * 3
    gpu_check.record(
        f"{label}: {threads} threads x 2 streams, {lookups} lookups == file rows (raw, bf16 out=, bf16)",
        not failures,
        f"{seconds:.1f}s; " + ("; ".join(failures[:3]) if failures else "all equal"),
    )
    rows, bad = after["rows"] - before["rows"], after["out_of_range"] - before["out_of_range"]
    gpu_check.record(
        f"{label}: device counters exact",
        rows == tally[1] and bad == tally[2],
        f"rows {rows} (expected {tally[1]}), out of range {bad} (expected {tally[2]})",
    )


def graph_beside_eager(table, layout, ref, rng) -> None:
    """A graph of the kernel replayed on one stream while another thread's eager lookups (kernel and
    bulk) run on a second stream."""
    n = 1024
    side = torch.cuda.Stream()
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")
    out = torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(side):
        table.lookup(ids, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        table.lookup(ids, out=out)
    failures: list[str] = []
    tally = [threading.Lock(), 0, 0]
    eager = threading.Thread(
        target=worker,
        args=(table, layout, ref, torch.cuda.Stream(), 7, (1024, 4 * n * 8), 6, tally, failures),
    )
    eager.start()
    ok = True
    with torch.cuda.stream(side):
        for _ in range(40):
            new = make_ids(rng, layout, n)
            ids.copy_(torch.from_numpy(new))
            out.fill_(float("nan"))
            graph.replay()
            side.synchronize()
            ok &= gpu_check.same_bits(out, gpu_check.dequant_ref(expected(ref, new), layout, torch.bfloat16))
    eager.join()
    gpu_check.record(
        "graph replays on one stream beside eager lookups on another == file rows",
        ok and not failures,
        "; ".join(failures[:3]) if failures else "40 replays, eager thread equal",
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ple-conc")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(int(time.time()))
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        rows = int(args.gib * (1 << 30)) // 160
        write_checkpoint(args.dir, num_rows=rows, row_dim=160, dtype="F8_E4M3", shards=args.shards)
    layout = ple_um.checkpoint.read_layout(args.dir)
    ref = whole_table(layout)
    with ple_um.open_table(args.dir) as table:
        gpu_check.record("open: auto mode", table.mode == "registered", table.mode)
        # Batches of 1 024 take the kernel; 32 768 the CPU bulk path (whatever the calibration chose).
        table.bulk_rows = 16384
        run_threads(table, layout, ref, args.threads, (1024, 32768), args.iterations, "kernel + bulk")
        table.bulk_rows = None
        run_threads(table, layout, ref, args.threads, (64, 4096, 32768), args.iterations, "kernel only")
        table.bulk_rows = 16384
        graph_beside_eager(table, layout, ref, rng)
    with ple_um.open_table(args.dir, mode="cpu") as table:
        run_threads(table, layout, ref, args.threads, (1024, 32768), 3, "cpu mode")
    return gpu_check.summarize(args.json)


if __name__ == "__main__":
    sys.exit(main())
