"""tools/profile_shared_table.py on the CPU: two processes looking up one table at once in one
real memory cgroup, once with their row caches and once with the page cache alone. Skipped where
no memory cgroup can be made or the files are tmpfs (their pages cannot be dropped)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers.cli import fs_type

from ple_um.bench.memlimit import MemoryLimit
from ple_um.synthetic import write_checkpoint

SCRIPT = pathlib.Path(__file__).parents[2] / "tools" / "profile_shared_table.py"


def test_two_processes_under_one_limit(tmp_path):
    probe = MemoryLimit.open(512 << 20, f"ple-um-probe-{os.getpid()}")
    probe.close()
    if not probe.enforced:
        pytest.skip(f"no memory cgroup here: {probe.why}")
    layout = write_checkpoint(tmp_path / "table", num_rows=200_000, row_dim=160, dtype="fp8", shards=8)
    if fs_type(layout.directory) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: nothing can drop them")
    out = tmp_path / "shared.json"
    command = [sys.executable, str(SCRIPT), "--dir", layout.directory, "--memory-limit", "768MiB"]
    command += ["--processes", "2", "--rows", "16,256", "--repeats", "3", "--warmup", "0.5"]
    command += ["--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {run["kept_in"]: run for run in result["runs"]}
    assert set(runs) == {"row cache", "page cache"}
    assert runs["page cache"]["knobs"] == {"PLE_UM_ROW_CACHE": "0"}
    for kept_in, run in runs.items():
        assert run["processes"] == 2 and run["how"].startswith("cgroup v")
        assert 0 < run["peak_bytes"] <= 768 << 20
        assert set(run["figures"]) == {"zipf:1.1 16", "zipf:1.1 256"}
        for procs in run["figures"].values():
            assert len(procs) == 2 and not [p for p in procs if "failed" in p], procs
            for p in procs:
                assert 0 < p["p10_us"] <= p["median_us"] <= p["p90_us"]
                assert (p["row_cache_bytes"] > 0) is (kept_in == "row cache")
                assert (p["row_cache_hits"] is not None) is (kept_in == "row cache")
                assert 0 <= p["page_cache_hits"] <= 1 and p["warmup"]["calls"] >= 10
        line = f"| 768.00 MiB | 2 | {kept_in} | 256 | zipf:1.1 | "
        assert any(row.startswith(line) for row in proc.stdout.splitlines()), proc.stdout
