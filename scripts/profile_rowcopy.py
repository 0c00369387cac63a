"""Profile: the host bulk gather's row reads, torch.index_select against the C row copy
(ple_um/lookup/rowcopy.c) with prefetch distances and one or 16 threads, on one file's rows of the
bench's 16 GiB table with fresh rows every call; then the whole bulk path at 131 072 rows with
index_select, the C copy of a plan grouped by file, and the C copy by id in batch order, next to the
vLLM-style pinned kernel, in the same run, every output checked against the pinned copy.

    python scripts/profile_rowcopy.py --size-gib 16 --json $OUT/rowcopy.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um import envs
from ple_um.bench.contenders import VllmPinnedHost
from ple_um.bench.runner import Config, _warm_cache, default_table
from ple_um.checkpoint import read_layout
from ple_um.lookup import rowcopy


def timed(fn, sets) -> float:
    """Median us of fn(s) over the sets (the first two are warm-up)."""
    ts = []
    for s in sets:
        t = time.perf_counter()
        fn(s)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts[2:])) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bulk-only", action="store_true", help="only the whole bulk path (part 2)")
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "copy": {}, "bulk": {}}
    cfg = Config(size=int(args.size_gib * (1 << 30)))
    directory = default_table(cfg, progress=False)
    layout = read_layout(directory)
    _warm_cache(layout)
    rng = np.random.default_rng(1)
    dev = torch.device("cuda")
    lib, why = rowcopy.load(envs.PLE_UM_CACHE_DIR)
    print("rowcopy:", why, flush=True)
    if lib is None:
        return 1
    reg = ple_um.open_table(directory, mode="registered")
    print(f"registered: bulk_rows={reg.bulk_rows} calibration={reg.bulk_calibration}", flush=True)
    spaces = reg.bulk.space_tensors
    rb = layout.row_bytes
    threads = torch.get_num_threads()

    # -- 1. the row copy alone, one file, fresh rows ---------------------------------------------
    lines = ["| rows | copy | us | ns/row |", "| --- | --- | --- | --- |"]

    def fresh_rows(n: int, k: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for j in range(k):
            space = spaces[j % len(spaces)]
            out.append((space, torch.from_numpy(rng.integers(0, space.shape[0], size=n))))
        return out

    def row(n, name, us):
        result["copy"][f"{n} {name}"] = us
        lines.append(f"| {n} | {name} | {us:.1f} | {us * 1e3 / n:.2f} |")
        print(lines[-1], flush=True)

    for n in () if args.bulk_only else (16384, 32768, 131072):
        stage = torch.empty((n, rb), dtype=torch.uint8, pin_memory=True)
        row(
            n,
            f"index_select ({threads} threads)",
            timed(lambda s, o=stage: torch.index_select(s[0], 0, s[1], out=o), fresh_rows(n)),
        )
        if n == 16384:
            torch.set_num_threads(1)
            row(
                n,
                "index_select (1 thread)",
                timed(lambda s, o=stage: torch.index_select(s[0], 0, s[1], out=o), fresh_rows(n, 6)),
            )
            torch.set_num_threads(threads)
            for ahead in (0, 8, 16, 32):
                rc = rowcopy.RowCopy(lib, 1, ahead=ahead)
                copy = lambda s, rc=rc, o=stage: rc.copy(s[0], s[1], o)
                row(n, f"C 1 thread ahead={ahead}", timed(copy, fresh_rows(n, 6)))
        for ahead in (0, 16, 32):
            rc = rowcopy.RowCopy(lib, threads, ahead=ahead)
            copy = lambda s, rc=rc, o=stage: rc.copy(s[0], s[1], o)
            row(n, f"C {threads} threads ahead={ahead}", timed(copy, fresh_rows(n)))

    # -- 2. the whole bulk path, 131 072 rows ----------------------------------------------------
    n = 131072
    pinned = VllmPinnedHost(layout, dev)
    out = torch.empty((n, layout.row_dim), dtype=layout.dtype, device=dev)

    def event_us(fn, gap_s: float = 0.0) -> tuple[float, list[dict]]:
        """Median us of fn over 20 calls with fresh ids, each timed alone; ``gap_s`` of idle host
        before each call (a serving step's cadence: the pool's workers have gone to sleep)."""
        sets = [torch.from_numpy(rng.integers(0, layout.num_rows, size=n)).to(dev) for _ in range(23)]
        phases = []
        for i in sets[:3]:
            fn(i)
        torch.cuda.synchronize()
        ts = []
        for i in sets[3:]:
            if gap_s:
                time.sleep(gap_s)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(i)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
            phases.append(dict(reg.bulk.last_phases))
        return float(np.median(ts)), phases

    def bulk(i):
        reg._bulk_lookup(i, out)

    blines = ["| 131072 rows | us | phases ms (plan/read/stage/wait) |", "| --- | --- | --- |"]
    # (C row copy, rows read by id): by id in batch order, or planned on the device and grouped by file
    variants = {"index_select": (None, False), "C planned": (reg.bulk.rowcopy, False)}
    variants["C by id"] = (reg.bulk.rowcopy, True)
    result["bulk_equal"] = {}
    for rep in range(2):
        for gap in (0.0, 0.005):
            for name, (copier, by_id) in variants.items():
                reg.bulk.rowcopy, reg.bulk.read_by_id = copier, by_id
                us, ph = event_us(bulk, gap)
                med = {k: float(np.median([p[k] for p in ph])) * 1e3 for k in ph[0]}
                label = f"{name}, {'5 ms apart' if gap else 'back to back'} #{rep}"
                result["bulk"][label] = {"us": us, "phases_ms": med}
                blines.append(
                    f"| bulk, {label} | {us:.1f} | "
                    + "/".join(f"{med[k]:.2f}" for k in ("dedup", "gather", "stage", "wait"))
                    + " |"
                )
                print(blines[-1], flush=True)
                if rep == 0 and gap == 0.0:
                    check = torch.from_numpy(rng.integers(0, layout.num_rows, size=n)).to(dev)
                    poisoned = torch.full((n, rb), 0xAB, dtype=torch.uint8, device=dev)
                    got = reg._bulk_lookup(check, poisoned.view(layout.dtype)).view(torch.uint8).cpu()
                    result["bulk_equal"][name] = bool(torch.equal(got, pinned.host[check.cpu()]))
        us, _ = event_us(lambda i: pinned.lookup(i, out.view(torch.uint8)))
        result["bulk"][f"vllm pinned-host #{rep}"] = {"us": us}
        blines.append(f"| vllm pinned-host #{rep} | {us:.1f} | |")
        print(blines[-1], flush=True)
    blines.append(f"| every output == the pinned copy's rows | {all(result['bulk_equal'].values())} | |")
    reg.close()
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(blines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
