"""GPU check of tables whose tensors start at odd bytes (issue 18), run on a CUDA host: BF16, F16,
FP8 and NVFP4 tables with odd header padding and odd-sized tensors ahead of the shards, in the
registered, device and cpu modes, raw and dequantized (NVFP4: decoded, and its packed rows and block
scales), eager and replayed in a CUDA graph with new ids, against what the ``safetensors`` package
reads of the same files. A GPU faults on a misaligned load where the interpreter does not, so this
is the check the CPU tests cannot be. (The aligned formats are in tests/gpu.) Prints a table last
and writes JSON.

    python scripts/check_unaligned.py --dir /tmp/ple-unaligned --json $OUT/unaligned.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um.checkpoint import read_layout
from ple_um.synthetic import write_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.reference import decode_nvfp4, misalign_checkpoint, safetensors_table  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_ids(layout, n, rng) -> np.ndarray:
    """Random ids plus every shard boundary and ids outside the table, shuffled."""
    S = layout.rows_per_shard
    edges = [k * S + d for k in range(layout.parts) for d in (-1, 0, 1)]
    extra = np.array(
        edges + [-3, -1, layout.num_rows, layout.num_rows + 7, layout.num_rows - 1], dtype=np.int64
    )
    ids = np.concatenate([extra, rng.integers(0, layout.num_rows, size=max(0, n - extra.size))])
    rng.shuffle(ids)
    return ids


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
        record(
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
                    ids_np = test_ids(layout, 8192, rng)
                    ids = torch.from_numpy(ids_np).cuda()
                    if nvfp4:
                        got_packed, got_blocks = table.lookup_packed(ids)
                        ok = same_bits(got_packed, _expected(packed, ids_np))
                        ok &= same_bits(got_blocks.view(torch.uint8), _expected(blocks, ids_np))
                        record(f"{label}: packed rows and block scales == safetensors", ok)
                    else:
                        raw = table.lookup(ids)
                        record(
                            f"{label}: raw rows == safetensors",
                            same_bits(raw, _expected(st["rows"], ids_np)),
                        )
                    for od in (torch.bfloat16, torch.float16, torch.float32):
                        got = table.lookup(ids, out_dtype=od)
                        want = _expected(values.to(od), ids_np)
                        record(f"{label}: {od} == safetensors", same_bits(got, want))
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
                            new = test_ids(layout, 4096, rng)
                            static.copy_(torch.from_numpy(new))
                            buf.fill_(float("nan"))
                            g.replay()
                            ok &= same_bits(buf, _expected(values.to(torch.bfloat16), new))
                        record(f"{label}: graph replays with new ids == safetensors", ok)
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a misaligned load surfaces here as a CUDA error
                record(f"{label}: runs", False, f"{type(exc).__name__}: {exc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ple-unaligned")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seed = int(time.time())
    print(f"seed {seed}", flush=True)
    check_unaligned(args.dir, np.random.default_rng(seed), seed)
    failed = [r for r in RESULTS if not r[1]]
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in RESULTS:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail[:150]} |")
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            results = [{"check": n, "ok": o, "detail": d} for n, o, d in RESULTS]
            json.dump({"device": torch.cuda.get_device_name(), "seed": seed, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
