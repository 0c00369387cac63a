"""Bad ids on the GPU paths, meant to run under `compute-sanitizer --tool memcheck`: every case
must give its documented result (zeros and a count, or a typed error) and the sanitizer must
report no invalid access.

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
        python scripts/gpu_sanitize.py /tmp/ple-san
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import ple_um
from ple_um.synthetic import write_checkpoint


def main(directory: str) -> int:
    layout = write_checkpoint(directory, num_rows=20000, row_dim=160, dtype="fp8", shards=9)
    S, N = layout.rows_per_shard, layout.num_rows
    failures = []
    for mode, rows in (("registered", None), ("registered", (S + 3, 5 * S - 2)), ("device", (S, 2 * S))):
        with ple_um.open_table(directory, mode=mode, rows=rows) as table:
            lo, hi = rows or (0, N)
            bad = torch.tensor([-1, -(2**40), N, N + 1, 2**62, lo - 1, hi, 0, N - 1, S, S - 1], device="cuda")
            for dtype in (torch.int64, torch.int32):
                ids = bad.to(dtype) if dtype == torch.int64 else bad.clamp(-(2**31), 2**31 - 1).to(dtype)
                for out_dtype in (None, torch.bfloat16):
                    y = table.lookup(ids, out_dtype=out_dtype)
                    host = ids.cpu().numpy().astype(np.int64)
                    outside = (host < lo) | (host >= hi)
                    if not bool((y[torch.from_numpy(outside).cuda()].float() == 0).all()):
                        failures.append(
                            f"{mode} {rows} {dtype} {out_dtype}: rows outside the owned range not zero"
                        )
            empty = table.lookup(torch.empty(0, dtype=torch.int64, device="cuda"))
            if empty.shape != (0, layout.row_dim):
                failures.append(f"{mode}: empty ids gave {tuple(empty.shape)}")
            strided = torch.arange(0, 2 * min(hi - lo, 64), device="cuda")[::2] + lo
            table.lookup(strided)  # non-contiguous ids are copied
            try:
                table.lookup(torch.zeros(4, device="cuda"))
                failures.append(f"{mode}: float ids accepted")
            except TypeError:
                pass
            try:
                table.lookup(torch.tensor([N + 5], device="cuda"), strict=True)
                failures.append(f"{mode}: strict lookup accepted an id outside the table")
            except IndexError:
                pass
            torch.cuda.synchronize()
            print(mode, rows, table.stats())
    print("\n".join(failures) if failures else "all bad-id cases gave their documented result")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ple-sanitize"))
