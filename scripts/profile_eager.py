"""Where an eager lookup's host time goes, on a CUDA host: the time per call of 2 000 back-to-back
16-row calls (one sync at the end) of each layer of a lookup, from ``table.lookup`` down to the bound
kernel launcher, beside plain torch (index_select on a resident copy) and a trivial Triton kernel;
then cProfile's top functions of the registered and cpu modes' lookups.

    python scripts/profile_eager.py --size 1GiB --out $OUT/profile_eager.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

import ple_um
from ple_um import units
from ple_um.kernels.launch import hooks_set


@triton.jit
def _trivial(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs, mask=offs < n)


def per_call(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def top(fn, calls: int, lines: int = 18) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_eager.json"))
    args = parser.parse_args()
    from ple_um.bench.config import Config, default_table

    directory = default_table(Config(size=units.parse_size(args.size)), progress=False)
    registered = ple_um.open_table(directory, mode="registered")
    cpu = ple_um.open_table(directory, mode="cpu")
    n = 16
    ids = torch.randint(0, registered.num_rows, (n,), device="cuda")
    out = torch.empty((n, registered.row_dim), dtype=registered.dtype, device="cuda")
    resident = torch.randint(0, 255, (1 << 20, 160), dtype=torch.uint8, device="cuda")
    small_ids = torch.randint(0, 1 << 20, (n,), device="cuda")
    raw = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
    x = torch.empty(64, dtype=torch.int32, device="cuda")
    registered.lookup(ids, out=out)
    cpu.lookup(ids, out=out)
    gpu = registered.gpu
    key = (ids.dtype, out.dtype, out.data_ptr() & 7, False)
    bound = gpu._bound.get(key)
    result = {
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "hooks_set": hooks_set(),
        "launch": gpu.launch,
        "bound_kinds": [str(k) for k in gpu._bound],
        "bound_for_this_call": bound is not None,
    }
    layers = {
        "torch.index_select (resident)": lambda: torch.index_select(resident, 0, small_ids, out=raw),
        "trivial Triton kernel": lambda: _trivial[(1,)](x, 64, BLOCK=64),
        "bound launcher alone": (lambda: bound(ids.data_ptr(), out.data_ptr(), n)) if bound else None,
        "GpuGather.gather": lambda: gpu.gather(ids, out),
        "GpuGather._gather (Triton's launch)": lambda: gpu._gather(ids, out, key, {}),
        "registered table.lookup": lambda: registered.lookup(ids, out=out),
        "cpu HostGather.gather": lambda: cpu.host.gather(ids, out),
        "cpu table.lookup": lambda: cpu.lookup(ids, out=out),
    }
    result["us_per_call"] = {
        name: per_call(fn, args.calls) if fn is not None else None for name, fn in layers.items()
    }
    result["cprofile_registered"] = top(lambda: registered.lookup(ids, out=out), args.calls)
    result["cprofile_cpu"] = top(lambda: cpu.lookup(ids, out=out), args.calls)
    for table in (registered, cpu):
        table.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(result["cprofile_registered"][:3000])
    print(result["cprofile_cpu"][:3000])
    print({k: result[k] for k in ("triton", "hooks_set", "launch", "bound_for_this_call", "bound_kinds")})
    print("\n| layer (16 rows, back to back) | us per call |\n| --- | --- |")
    for name, value in result["us_per_call"].items():
        print(f"| {name} | {'-' if value is None else f'{value:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
