"""Where the CPU bulk path's time goes on a GPU host: each phase of a 131072-row lookup timed
alone, next to a plain torch.index_select over one file's rows (the FACTS.md measurement).

    python scripts/profile_bulk.py /tmp/ple-prof 8
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import ple_um
from ple_um.synthetic import write_checkpoint


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main(directory: str, gib: float) -> None:
    rows = int(gib * (1 << 30)) // 160
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        write_checkpoint(directory, num_rows=rows, row_dim=160, dtype="fp8", shards=128, files=4)
    print("torch threads", torch.get_num_threads(), "cpus", os.cpu_count())
    n = 131072
    rng = np.random.default_rng(0)
    with ple_um.open_table(directory, mode="cpu", device="cuda") as t:
        g = t.cpu
        ids_dev = torch.from_numpy(rng.integers(0, t.num_rows, n)).cuda()
        out = torch.empty((n, 160), dtype=torch.uint8, device="cuda")
        res = {}
        res["lookup total"] = timed(lambda: t.lookup(ids_dev, out=out.view(t.dtype)))
        res["ids D2H"] = timed(lambda: ids_dev.to("cpu"))
        host = ids_dev.cpu()
        owned = (host >= 0) & (host < t.num_rows)
        res["owned mask"] = timed(lambda: (host >= 0) & (host < t.num_rows))
        res["gather() total"] = timed(lambda: g.gather(host, owned, out))
        S = g.rows_per_shard
        res["plan: shard+space"] = timed(
            lambda: (
                torch.where(owned, g.space_of_shard_t[torch.where(owned, host // S, 0)], -1)
                .numpy()
                .astype(np.int16)
            )
        )
        sp = torch.where(owned, g.space_of_shard_t[host // S], -1).numpy().astype(np.int16)
        res["plan: radix argsort"] = timed(lambda: np.argsort(sp, kind="stable"))
        space0 = g.space_tensors[0]
        idx = torch.from_numpy(rng.integers(0, space0.shape[0] - 1, n))
        stage = torch.empty((n, 160), dtype=torch.uint8, pin_memory=True)
        for threads in (torch.get_num_threads(), 16, 8):
            torch.set_num_threads(threads)
            res[f"index_select 131072 rows, one space, {threads} threads"] = timed(
                lambda: torch.index_select(space0, 0, idx, out=stage)
            )
        res["H2D 131072 rows"] = timed(lambda: out.copy_(stage, non_blocking=True))
        res["np.take 131072 rows, 1 thread"] = timed(
            lambda: np.take(space0.numpy(), idx.numpy(), axis=0, out=stage.numpy(), mode="clip")
        )
        torch.set_num_threads(16)
        res["gather() total, 16 torch threads"] = timed(lambda: g.gather(host, owned, out))
        print(t.stats()["phase_seconds"])
    for k, v in res.items():
        print(f"| {k} | {v:.3f} ms |")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
