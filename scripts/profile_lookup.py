"""Where a lookup's time goes on a CUDA host, side by side in one run (docs/PERF_NOTES.md):

1. the gather kernel over registered memory for each program shape (rows per program, warps) and
   batch size, next to the same kernel on the table resident in GPU memory and the vLLM-style
   pinned-host kernel: each call timed alone with CUDA events (host launch + GPU, as the bench
   times it) and 20 calls queued back to back (the GPU's own rate);
2. the host's launch work per eager call (GPU idle, 200 calls queued, no sync).

The host paths (the cpu mode's host node, the GPU modes' host path for big batches) are profiled
by ``scripts/profile_host_node.py``.

    python scripts/profile_lookup.py --size-gib 16 --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um.bench.config import Config, default_table, read_cache
from ple_um.bench.contenders import VllmPinnedHost
from ple_um.checkpoint import read_layout

SHAPES = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (8, 4), (16, 4), (16, 8)]
SIZES = (16, 256, 1024, 4096, 16384, 131072)


def events(fn, ids, calls=20, warmup=3) -> tuple[float, float]:
    """(median us of one call timed alone, us per call with ``calls`` queued back to back); every
    call gets its own id set (``ids`` holds warmup + 2 * calls of them)."""
    sets = iter(ids)
    for _ in range(warmup):
        fn(next(sets))
    torch.cuda.synchronize()
    alone = []
    for _ in range(calls):
        i = next(sets)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        e.synchronize()
        alone.append(s.elapsed_time(e) * 1e3)
    queued = [next(sets) for _ in range(calls)]
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in queued:
        fn(i)
    e.record()
    e.synchronize()
    return float(np.median(alone)), s.elapsed_time(e) * 1e3 / calls


def kernel(table, rpp, warps):
    """The table's GPU gather with the program shape given."""
    return lambda ids, out: table.paths.gpu.gather(ids, out, rows_per_program=rpp, num_warps=warps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "kernel": {}, "host_us": {}}
    cfg = Config(size=int(args.size_gib * (1 << 30)))
    directory = default_table(cfg, progress=False)
    layout = read_layout(directory)
    read_cache(layout)
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    reg = ple_um.open_table(directory, mode="registered")
    result["registered_open_s"] = time.perf_counter() - t0
    result["bulk_rows"] = reg.bulk_rows
    result["bulk_calibration_s"] = {str(k): v for k, v in reg.bulk_calibration.items()}
    print(f"registered: bulk_rows={reg.bulk_rows} calibration={reg.bulk_calibration}", flush=True)
    res = ple_um.open_table(directory, mode="device")
    pinned = VllmPinnedHost(layout, dev)
    print(f"opened all in {time.perf_counter() - t0:.1f}s", flush=True)

    # -- 1. kernel shapes -------------------------------------------------------------------
    lines = ["| rows | path | alone us | queued us/call |", "| --- | --- | --- | --- |"]

    def fresh(n: int) -> list[torch.Tensor]:
        """Ids never used before in this run: rows read earlier could still sit in the GPU's L2."""
        return [torch.from_numpy(rng.integers(0, layout.num_rows, size=n)).to(dev) for _ in range(43)]

    for n in SIZES:
        out = torch.empty((n, layout.row_dim), dtype=layout.dtype, device=dev)
        raw = out.view(torch.uint8)
        paths = {f"registered rpp={r} w={w}": kernel(reg, r, w) for r, w in SHAPES}
        paths["registered default"] = lambda i, o: reg.gpu.gather(i, o)
        paths["registered lookup(out=)"] = lambda i, o: reg.lookup(i, out=o)
        paths["resident default"] = lambda i, o: res.gpu.gather(i, o)
        paths["resident rpp=16 w=4"] = kernel(res, 16, 4)
        paths["resident lookup(out=)"] = lambda i, o: res.lookup(i, out=o)
        paths["vllm pinned-host"] = lambda i, o, r=raw: pinned.lookup(i, r)
        for name, fn in paths.items():
            alone, queued = events(lambda i, f=fn, o=out: f(i, o), fresh(n))
            result["kernel"][f"{n} {name}"] = {"alone_us": alone, "queued_us": queued}
            lines.append(f"| {n} | {name} | {alone:.1f} | {queued:.1f} |")
        print("\n".join(lines[-len(paths) :]), flush=True)

    # -- 2. host launch work ------------------------------------------------------------------
    ids16 = torch.from_numpy(rng.integers(0, layout.num_rows, size=16)).to(dev)
    out16 = torch.empty((16, layout.row_dim), dtype=layout.dtype, device=dev)
    bf16 = torch.empty((16, layout.row_dim), dtype=torch.bfloat16, device=dev)
    host = {
        "torch fill_ (one small kernel)": lambda: out16.view(torch.uint8).fill_(0),
        "vllm pinned-host kernel": lambda: pinned.lookup(ids16, out16.view(torch.uint8)),
        "gather_rows rpp=16": lambda: kernel(res, 16, 4)(ids16, out16),
        "GpuGather.gather": lambda: res.gpu.gather(ids16, out16),
        "table.lookup(out=raw)": lambda: res.lookup(ids16, out=out16),
        "table.lookup(out=bf16)": lambda: res.lookup(ids16, out=bf16),
        "table.lookup() allocating": lambda: res.lookup(ids16),
    }
    lines += ["", "| host work per eager call (16 rows, resident) | us |", "| --- | --- |"]
    for name, fn in host.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        reps = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            reps.append((time.perf_counter() - t) / 200 * 1e6)
            torch.cuda.synchronize()
        result["host_us"][name] = float(np.median(reps))
        lines.append(f"| {name} | {result['host_us'][name]:.1f} |")
    print("\n".join(lines[-len(host) :]), flush=True)

    for t in (reg, res, pinned):
        t.close()
    print("\n" + "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
