"""GPU checks of the other storage formats, run on a CUDA host: BF16 on a table of at least 8 GiB
in at least 64 shards, F16, and NVFP4 decoded on the device against an independent NumPy decoder
(tests/reference.py), including a CUDA graph capture; and ``unaligned``: BF16, F16, FP8 and NVFP4
tables whose tensors start at odd bytes (a GPU faults on a misaligned load, the interpreter does
not) in the registered, device and cpu modes against what the ``safetensors`` package reads of the
same files. Prints a table last and writes JSON.

    python scripts/gpu_check_formats.py --dir /tmp/ple-formats --json $OUT/gpu_check_formats.json
    python scripts/gpu_check_formats.py --dir /tmp/ple-formats --formats unaligned --json $OUT/unaligned.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um.checkpoint import read_layout
from ple_um.synthetic import write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import gpu_check  # noqa: E402  (the core checks' helpers: record, check_table, test_ids, same_bits)
from reference import (  # noqa: E402  (NumPy NVFP4 decoder, odd-offset writer, safetensors' reading)
    decode_nvfp4,
    misalign_checkpoint,
    reference_nvfp4,
    safetensors_table,
)


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


def _expected(values: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """``values[ids]`` on the host, zeros for ids outside the table."""
    ids = torch.from_numpy(ids)
    inside = (ids >= 0) & (ids < values.shape[0])
    out = torch.zeros((ids.numel(), *values.shape[1:]), dtype=values.dtype)
    out[inside] = values[ids[inside]]
    return out


def check_unaligned(root: str, rng, seed: int) -> None:
    """Tables of 100 003 rows in 16 shards over 4 files whose data sections start at 7, 1, 2 and 4
    mod 8 after 3, 0, 5 and 1 bytes of another tensor (misalign_checkpoint): every mode that a
    discrete GPU has, raw and dequantized (NVFP4: decoded, and its packed rows and block scales),
    eager and replayed in a CUDA graph with new ids, against the safetensors package's reading."""
    for dtype, dim in (("bf16", 80), ("f16", 80), ("fp8", 160), ("nvfp4", 160)):
        d = os.path.join(root, f"unaligned-{dtype}")
        write_checkpoint(d, num_rows=100_003, row_dim=dim, dtype=dtype, shards=16, files=4, seed=seed)
        misalign_checkpoint(d)
        layout = read_layout(d)
        offsets = sorted({s.offset % 8 for s in (*layout.shards, *layout.block_scales)})
        gpu_check.record(
            f"unaligned {dtype}: shard offsets mod 8 include odd ones",
            any(o % 2 for o in offsets),
            str(offsets),
        )
        st = safetensors_table(layout)
        nvfp4 = layout.is_nvfp4
        if nvfp4:
            packed, blocks = st["rows"], st["block_scales"].view(torch.uint8)
            values = torch.from_numpy(decode_nvfp4(packed.numpy(), blocks.numpy(), st["scale"].item()))
        else:
            values = st["rows"].float() * st["scale"] if "scale" in st else st["rows"].float()
        for mode in ("registered", "device", "cpu"):
            label = f"unaligned {dtype} {mode}"
            try:
                with ple_um.open_table(d, mode=mode) as table:
                    ids_np = gpu_check.test_ids(layout, 8192, rng)
                    ids = torch.from_numpy(ids_np).cuda()
                    if nvfp4:
                        got_packed, got_blocks = table.lookup_packed(ids)
                        ok = gpu_check.same_bits(got_packed, _expected(packed, ids_np))
                        ok &= gpu_check.same_bits(got_blocks.view(torch.uint8), _expected(blocks, ids_np))
                        gpu_check.record(f"{label}: packed rows and block scales == safetensors", ok)
                    else:
                        raw = table.lookup(ids)
                        gpu_check.record(
                            f"{label}: raw rows == safetensors",
                            gpu_check.same_bits(raw, _expected(st["rows"], ids_np)),
                        )
                    for od in (torch.bfloat16, torch.float16, torch.float32):
                        got = table.lookup(ids, out_dtype=od)
                        want = _expected(values.to(od), ids_np)
                        gpu_check.record(f"{label}: {od} == safetensors", gpu_check.same_bits(got, want))
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
                            new = gpu_check.test_ids(layout, 4096, rng)
                            static.copy_(torch.from_numpy(new))
                            buf.fill_(float("nan"))
                            g.replay()
                            ok &= gpu_check.same_bits(buf, _expected(values.to(torch.bfloat16), new))
                        gpu_check.record(f"{label}: graph replays with new ids == safetensors", ok)
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a misaligned load surfaces here as a CUDA error
                gpu_check.record(f"{label}: runs", False, f"{type(exc).__name__}: {exc}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ple-formats")
    ap.add_argument("--bf16-gib", type=float, default=8.0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--formats", default="bf16,f16,nvfp4,unaligned", help="which of bf16, f16, nvfp4, unaligned to check"
    )
    args = ap.parse_args()
    seed = int(time.time())
    print(f"seed {seed}", flush=True)
    rng = np.random.default_rng(seed)
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
    if "unaligned" in wanted:
        check_unaligned(args.dir, rng, seed)
    return gpu_check.summarize(args.json)


if __name__ == "__main__":
    sys.exit(main())
