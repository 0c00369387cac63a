"""GPU checks of the other storage formats, run on a CUDA host: BF16 on a table of at least 8 GiB
in at least 64 shards, F16, and NVFP4 decoded on the device against an independent NumPy decoder
(tests/reference.py), including a CUDA graph capture. Prints a table last and writes JSON.

    python scripts/gpu_check_formats.py --dir /tmp/ple-formats --json $OUT/gpu_check_formats.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um.synthetic import write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import gpu_check  # noqa: E402  (the core checks' helpers: record, check_table, test_ids, same_bits)
from reference import reference_nvfp4  # noqa: E402  (plain NumPy NVFP4 decoder)


def check_nvfp4(directory: str, layout, rng) -> None:
    S = layout.rows_per_shard
    for mode, rows in (("auto", None), ("auto", (S + 3, 30 * S - 1)), ("cpu", None), ("device", None)):
        label = f"nvfp4 {mode} rows={rows}"
        with ple_um.open_table(directory, mode=mode, rows=rows) as table:
            ids_np = gpu_check.test_ids(layout, 8192, rng, rows)
            ids = torch.from_numpy(ids_np).cuda()
            for od in (torch.bfloat16, torch.float16, torch.float32):
                got = table.lookup(ids, out_dtype=od)
                want = reference_nvfp4(layout, ids_np, rows=rows, out_dtype=od)
                gpu_check.record(
                    f"{label} [{table.mode}]: decoded {od} == NumPy decoder", gpu_check.same_bits(got, want)
                )
            packed, scales = table.lookup_packed(ids)
            gpu_check.record(
                f"{label}: packed rows == file bytes",
                gpu_check.same_bits(packed, torch.from_numpy(gpu_check.file_rows(layout, ids_np, rows))),
            )
            gpu_check.record(
                f"{label}: block scales == file bytes",
                gpu_check.same_bits(
                    scales.view(torch.uint8),
                    torch.from_numpy(gpu_check.file_rows(layout.scale_layout(), ids_np, rows)),
                ),
            )
            if table.capture_safe:
                static = torch.zeros(4096, dtype=torch.int64, device="cuda")
                buf = torch.empty((4096, layout.row_dim), dtype=torch.bfloat16, device="cuda")
                table.lookup(static, out=buf)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    table.lookup(static, out=buf)
                ok = True
                for _ in range(3):
                    new = gpu_check.test_ids(layout, 4096, rng, rows)
                    static.copy_(torch.from_numpy(new))
                    buf.fill_(float("nan"))
                    g.replay()
                    ok &= gpu_check.same_bits(
                        buf, reference_nvfp4(layout, new, rows=rows, out_dtype=torch.bfloat16)
                    )
                gpu_check.record(f"{label}: graph replays with new ids == NumPy decoder", ok)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ple-formats")
    ap.add_argument("--bf16-gib", type=float, default=8.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", default="bf16,f16,nvfp4", help="which of bf16, f16, nvfp4 to check")
    args = ap.parse_args()
    rng = np.random.default_rng(int(time.time()))
    specs = (
        ("bf16", "BF16", 80, args.bf16_gib, 65),
        ("f16", "F16", 80, 0.25, 64),
        ("nvfp4", "nvfp4", 160, 0.5, 64),
    )
    tables = {}
    wanted = args.formats.split(",")
    for label, dtype, dim, gib, shards in (spec for spec in specs if spec[0] in wanted):
        d = os.path.join(args.dir, label)
        row_bytes = dim // 2 + dim // 16 if dtype == "nvfp4" else dim * 2
        t0 = time.perf_counter()
        layout = write_checkpoint(
            d, num_rows=int(gib * (1 << 30)) // row_bytes, row_dim=dim, dtype=dtype, shards=shards
        )
        print(
            f"{label}: {layout.num_rows} rows x {layout.row_dim} in {layout.parts} shards, "
            f"{layout.nbytes / (1 << 30):.2f} GiB, written in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        tables[label] = (d, layout)
    for label in (x for x in ("bf16", "f16") if x in tables):
        d, layout = tables[label]
        mode = gpu_check.check_table(d, layout, f"{label} auto", rng)
        gpu_check.record(f"{label} auto mode is registered", mode == "registered", mode)
        S = layout.rows_per_shard
        gpu_check.check_table(d, layout, f"{label} auto rows=[S+5, 40S-3)", rng, rows=(S + 5, 40 * S - 3))
    if "nvfp4" in tables:
        check_nvfp4(*tables["nvfp4"], rng)
    return gpu_check.summarize(args.json)


if __name__ == "__main__":
    sys.exit(main())
