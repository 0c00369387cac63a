"""Bad ids on the GPU paths under ``compute-sanitizer --tool memcheck``: a child process runs every
bad-id case of docs/RELIABILITY.md in the registered mode over the whole table and over an
owned sub-range, and in the device mode over a sub-range, with int64 and int32 ids, raw and bf16
outputs, poisoned and allocated: ids below 0 and far below, at and past the end of the table,
``2**62``, one below and at the end of the owned range, shard boundaries; empty ids; strided ids;
float ids; a strict lookup of an id outside the table. The sanitizer must exit cleanly (no invalid
access: exit code 3 otherwise), and this process checks what the child returned: every row against
the rows read from the files (zeros outside the owned range and the table), the errors raised, and
the counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ple_um
from ple_um.synthetic import write_checkpoint

SANITIZER = ["--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "3"]

CHILD = textwrap.dedent(
    """
    import json, sys, torch, ple_um
    directory, results, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    found = []
    for mode, rows in cases:
        rows = tuple(rows) if rows else None
        with ple_um.open_table(directory, mode=mode, rows=rows, device="cuda") as table:
            N, S, dim = table.layout.num_rows, table.layout.rows_per_shard, table.layout.row_dim
            lo, hi = rows or (0, N)
            bad = torch.tensor(
                [-1, -(2**40), N, N + 1, 2**62, lo - 1, hi, 0, N - 1, S, S - 1, S + 1], device="cuda"
            )
            lookups = []
            for ids in (bad, bad.clamp(-(2**31), 2**31 - 1).int()):
                for dtype in (table.dtype, torch.bfloat16):
                    out = torch.empty((ids.numel(), dim), dtype=dtype, device="cuda")
                    out.view(torch.uint8).fill_(0xAB)
                    table.lookup(ids, out=out)
                    lookups.append((ids.cpu(), out.cpu()))
                    lookups.append((ids.cpu(), table.lookup(ids, out_dtype=dtype).cpu()))
            window = torch.arange(lo, min(hi, lo + 128), device="cuda")
            strided = window[::2]
            lookups.append((strided.cpu(), table.lookup(strided).cpu()))
            empty = table.lookup(torch.empty(0, dtype=torch.int64, device="cuda"))
            errors = {}
            for name, ids, strict in (
                ("float ids", torch.zeros(4, device="cuda"), None),
                ("strict, outside the table", torch.tensor([N + 5], device="cuda"), True),
            ):
                try:
                    table.lookup(ids, strict=strict)
                    errors[name] = None
                except Exception as exc:
                    errors[name] = type(exc).__name__
            torch.cuda.synchronize()
            stats = table.stats()
            found.append(
                {
                    "mode": table.mode,
                    "lookups": lookups,
                    "strided": not strided.is_contiguous(),
                    "window": (window.cpu(), torch.arange(lo, min(hi, lo + 128))),
                    "empty": list(empty.shape),
                    "errors": errors,
                    "stats": {k: stats[k] for k in ("rows", "out_of_range", "broken_rows")},
                }
            )
    torch.save(found, results)
    print("CHILD DONE", flush=True)
    """
)


def test_bad_ids_under_memcheck_give_their_documented_results(tmp_path, rng, check_rows):
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on the PATH (it ships with the CUDA toolkit, in its bin/)")
    seed = int(rng.integers(1 << 30))
    layout = write_checkpoint(
        tmp_path / "table", num_rows=20_000, row_dim=160, dtype="fp8", shards=9, seed=seed
    )
    S = layout.rows_per_shard
    cases = [("registered", None), ("registered", (S + 3, 5 * S - 2)), ("device", (S, 2 * S))]
    results = tmp_path / "results.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(ple_um.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        # Every lookup here is the kernel's: no bulk crossover measured (timed lookups of up to
        # 262 144 ids, which only cost time under memcheck).
        "PLE_UM_BULK_ROWS": "0",
    }
    child = [sys.executable, "-c", CHILD, layout.directory, str(results), json.dumps(cases)]
    done = subprocess.run(
        [sanitizer, *SANITIZER, *child],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    said = (done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0, (done.returncode, *said)  # 3: memcheck reported an error
    assert "CHILD DONE" in done.stdout and "ERROR SUMMARY: 0 errors" in done.stdout + done.stderr, said
    found = torch.load(results, weights_only=True)
    assert [f["mode"] for f in found] == [mode for mode, _ in cases]
    for (mode, rows), f in zip(cases, found, strict=True):
        for ids, out in f["lookups"]:
            assert out.shape == (ids.numel(), layout.row_dim), (mode, rows, out.shape)
            check_rows(out, layout, ids, rows)  # zeros outside the owned range and the table
        assert f["strided"] and torch.equal(*f["window"]), (mode, rows)  # the caller's ids untouched
        assert f["empty"] == [0, layout.row_dim], (mode, rows)
        assert f["errors"] == {"float ids": "TypeError", "strict, outside the table": "IndexError"}
        every = torch.cat([ids.long() for ids, _ in f["lookups"]])
        outside = int(((every < 0) | (every >= layout.num_rows)).sum())
        assert f["stats"] == {"rows": every.numel(), "out_of_range": outside, "broken_rows": 0}, (mode, rows)
