"""GPU checks for the core engine, run on a CUDA host (the lent H200): correctness of every path
against bytes read from the files, CUDA graph capture, torch.compile, counters. Prints a table
last and writes JSON.

    python scripts/gpu_check.py --dir /tmp/ple-check --gib 8 --shards 64 --json $OUT/gpu_check.json
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
from ple_um.synthetic import write_checkpoint

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)


def file_rows(layout, ids: np.ndarray, rows=None) -> np.ndarray:
    """Reference: rows read with np.fromfile per row from the files (independent of ple_um's mapping);
    zeros outside [0, num_rows) and outside ``rows``."""
    lo, hi = rows if rows is not None else (0, layout.num_rows)
    out = np.zeros((ids.size, layout.row_bytes), dtype=np.uint8)
    S = layout.rows_per_shard
    handles = {}
    for k, i in enumerate(ids.tolist()):
        if not (0 <= i < layout.num_rows and lo <= i < hi):
            continue
        spec = layout.shards[i // S]
        f = handles.get(spec.path) or handles.setdefault(spec.path, open(spec.path, "rb"))
        f.seek(spec.offset + (i - (i // S) * S) * layout.row_bytes)
        out[k] = np.frombuffer(f.read(layout.row_bytes), dtype=np.uint8)
    for f in handles.values():
        f.close()
    return out


def dequant_ref(raw: np.ndarray, layout, out_dtype) -> torch.Tensor:
    rows = torch.from_numpy(raw).view(layout.dtype).float()
    if layout.scale is not None:
        rows = rows * torch.tensor(layout.scale, dtype=torch.float32)
    return rows.to(out_dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_ids(layout, n, rng, rows=None):
    """Random ids plus every shard boundary, out-of-table and (with rows) outside-owned ids."""
    S = layout.rows_per_shard
    edges = []
    for i in range(layout.parts):
        edges += [i * S - 1, i * S, i * S + 1]
    extra = np.array(
        edges + [-3, -1, layout.num_rows, layout.num_rows + 7, layout.num_rows - 1], dtype=np.int64
    )
    if rows is not None:
        extra = np.concatenate([extra, [rows[0] - 1, rows[0], rows[1] - 1, rows[1]]])
    rand = rng.integers(0, layout.num_rows, size=max(0, n - extra.size))
    ids = np.concatenate([extra, rand])
    rng.shuffle(ids)
    return ids


def check_table(dirpath, layout, label, rng, mode="auto", rows=None):
    t0 = time.perf_counter()
    with ple_um.open_table(dirpath, mode=mode, rows=rows) as table:
        opened = time.perf_counter() - t0
        record(f"{label}: open mode={table.mode}", True, f"{opened:.2f}s")
        ids_np = test_ids(layout, 20000, rng, rows)
        ref = file_rows(layout, ids_np, rows)
        ids = torch.from_numpy(ids_np).cuda()
        out = table.lookup(ids)
        record(
            f"{label}: raw rows == file bytes",
            same_bits(out.view(torch.uint8), torch.from_numpy(ref)),
            f"{ids_np.size} ids, bulk_rows={table.bulk_rows}",
        )
        calls = 1
        if table.bulk is not None:
            # Both eager paths of a GPU mode: the kernel alone, and the CPU bulk gather + one copy.
            saved = table.bulk_rows
            for path, rows_at in (("GPU kernel", None), ("CPU bulk", 1)):
                table.bulk_rows = rows_at
                got = table.lookup(ids)
                got16 = table.lookup(ids, out_dtype=torch.bfloat16)
                ok = same_bits(got.view(torch.uint8), torch.from_numpy(ref))
                ok &= same_bits(got16, dequant_ref(ref, layout, torch.bfloat16))
                record(f"{label}: {path} path raw + bf16 == reference", ok)
                calls += 2
            table.bulk_rows = saved
            record(f"{label}: bulk calibration (seconds)", True, str(table.bulk_calibration))
        for od in (torch.bfloat16, torch.float16, torch.float32):
            y = table.lookup(ids, out_dtype=od)
            record(f"{label}: dequant {od} == reference", same_bits(y, dequant_ref(ref, layout, od)))
        # ids as int32 and 2-D
        y2 = table.lookup(ids.to(torch.int32).view(4, -1))
        record(
            f"{label}: int32 2-D ids",
            same_bits(y2.view(-1, layout.row_dim).view(torch.uint8), torch.from_numpy(ref)),
        )
        oob = int(((ids_np < 0) | (ids_np >= layout.num_rows)).sum())
        st = table.stats()
        k = calls + 4
        record(
            f"{label}: counters",
            st["out_of_range"] == oob * k and st["rows"] == ids_np.size * k,
            f"rows={st['rows']} oob={st['out_of_range']} expected rows={ids_np.size * k} oob={oob * k}",
        )
        return table.mode


def check_graph_and_compile(dirpath, layout, rng):
    with ple_um.open_table(dirpath) as table:
        n = 4096
        ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        buf = torch.full((n, layout.row_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        raw = torch.empty((n, layout.row_dim), dtype=layout.dtype, device="cuda")
        ids.copy_(torch.from_numpy(test_ids(layout, n, rng)))
        table.lookup(ids, out=buf)
        table.lookup(ids, out=raw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            alloc_before = torch.cuda.memory_allocated()
            table.lookup(ids, out=buf)
            table.lookup(ids, out=raw)
            alloc_after = torch.cuda.memory_allocated()
        record(
            "graph: lookups inside the capture allocate nothing",
            alloc_after == alloc_before,
            f"{alloc_after - alloc_before} bytes",
        )
        before = table.stats()["rows"]
        ok = True
        for _ in range(5):
            new = test_ids(layout, n, rng)
            ids.copy_(torch.from_numpy(new))
            buf.fill_(float("nan"))
            raw.view(torch.uint8).fill_(0xAB)
            g.replay()
            torch.cuda.synchronize()
            ref = file_rows(layout, new)
            ok &= same_bits(raw.view(torch.uint8), torch.from_numpy(ref))
            ok &= same_bits(buf, dequant_ref(ref, layout, torch.bfloat16))
        record("graph: 5 replays with new ids == file bytes (raw + bf16)", ok)
        record("graph: replays counted on the device", table.stats()["rows"] - before == 5 * 2 * n)

        class PleLike(torch.nn.Module):
            """ids -> lookup -> dequant -> short projection, shaped like the PLE layer."""

            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(
                    layout.row_dim, 64, bias=False, dtype=torch.bfloat16, device="cuda"
                )

            def forward(self, ids):
                rows = table.lookup(ids, out_dtype=torch.bfloat16)
                return self.proj(rows).sum(dim=1)

        mod = PleLike()
        x = torch.from_numpy(rng.integers(0, layout.num_rows, size=(256, 16))).cuda()
        eager = mod(x)
        compiled = torch.compile(mod, fullgraph=True)
        got = compiled(x)
        record("torch.compile(fullgraph) == eager", same_bits(got, eager))
        x2 = torch.from_numpy(rng.integers(0, layout.num_rows, size=(256, 16))).cuda()
        record("torch.compile second input == eager", same_bits(compiled(x2), mod(x2)))

        static = torch.zeros((64, 16), dtype=torch.int64, device="cuda")
        mod(static)
        torch.cuda.synchronize()
        g2 = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mod(static)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g2):
            y_static = mod(static)
        ok = True
        for _ in range(3):
            static.copy_(torch.from_numpy(rng.integers(0, layout.num_rows, size=(64, 16))))
            g2.replay()
            ok &= same_bits(y_static, mod(static))
        record("PLE-shaped module (lookup->dequant->proj) graph replay == eager", ok)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ple-check")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(int(time.time()))
    report = ple_um.probe()
    print(report.describe())
    record("probe: auto picks registered on this host", report.mode == "registered", report.mode)
    record("probe: ats rejected with a reason", "ats" in report.reasons, report.reasons.get("ats", ""))
    tables = {}
    for label, dtype, gib in (("fp8", "F8_E4M3", args.gib), ("bf16", "BF16", min(args.gib, 2.0))):
        d = os.path.join(args.dir, label)
        rows = int(gib * (1 << 30)) // 160
        t0 = time.perf_counter()
        if not os.path.exists(os.path.join(d, "model.safetensors.index.json")):
            layout = write_checkpoint(
                d,
                num_rows=rows,
                row_dim=160 if dtype == "F8_E4M3" else 80,
                dtype=dtype,
                shards=args.shards + 1,
            )
        else:
            layout = ple_um.checkpoint.read_layout(d)
        print(
            f"{label}: {layout.num_rows} rows x {layout.row_bytes} B in {layout.parts} shards, "
            f"{layout.nbytes / (1 << 30):.2f} GiB, written in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        tables[label] = (d, layout)
    d, layout = tables["fp8"]
    mode = check_table(d, layout, "fp8 auto", rng)
    record("fp8 auto mode is registered", mode == "registered", mode)
    S = layout.rows_per_shard
    check_table(d, layout, "fp8 auto rows=[S+5, 40S-3)", rng, rows=(S + 5, 40 * S - 3))
    check_table(d, layout, "fp8 forced cpu", rng, mode="cpu")
    check_table(d, layout, "fp8 forced cpu rows", rng, mode="cpu", rows=(S + 5, 40 * S - 3))
    d2, layout2 = tables["bf16"]
    check_table(d2, layout2, "bf16 auto", rng)
    check_table(d2, layout2, "bf16 forced cpu", rng, mode="cpu")
    check_table(d2, layout2, "bf16 device", rng, mode="device")
    check_graph_and_compile(d, layout, rng)
    return summarize(args.json, probe=report.as_dict())


def summarize(json_path: str | None, **extra) -> int:
    """Print every check as a table and a closing count; write them as JSON; 1 if any failed."""
    failed = [r for r in RESULTS if not r[1]]
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in RESULTS:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail[:150]} |")
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    if json_path:
        results = [{"check": n, "ok": o, "detail": d} for n, o, d in RESULTS]
        with open(json_path, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "results": results,
                    **extra,
                },
                f,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
