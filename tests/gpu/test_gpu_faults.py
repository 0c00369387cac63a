"""A fault inside the host path's row copy: a shard file truncated under the mapping makes the C row
copy's read raise SIGBUS on the thread that runs it (the dispatcher's, or the CUDA driver's for a host
node), where Python cannot catch it. Shown in a child process, for both:
the process that looked up the lost rows dies of SIGBUS (no wrong row is ever returned), and the
parent, which maps the same files, goes on serving (docs/RELIABILITY.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ple_um

CHILD = textwrap.dedent(
    """
    import os, sys, torch, ple_um
    directory, victim = sys.argv[1], sys.argv[2]
    table = ple_um.open_table(directory, mode="cpu", device="cuda")
    assert table.capture_safe, table.row_reads
    assert table.paths.host.dispatcher == (os.environ["PLE_UM_DISPATCHER"] == "1"), table.row_reads
    spec = [s for s in table.layout.shards if s.path == victim][-1]
    first = spec.index * table.layout.rows_per_shard
    ids = torch.arange(first, first + spec.rows, device="cuda")
    os.truncate(victim, spec.offset)  # the last shard of the file loses every row
    out = table.lookup(ids)
    torch.cuda.synchronize()
    print("SURVIVED", int(out.view(torch.uint8).sum()), flush=True)
    """
)


@pytest.mark.parametrize("dispatcher", ["1", "0"])
def test_a_file_truncated_under_the_row_copy_kills_only_the_reader(tables, tmp_path, rng, dispatcher):
    layout = tables["fp8"]
    copy = tmp_path / "table"
    shutil.copytree(layout.directory, copy)
    victim = str(copy / os.path.basename(layout.shards[-1].path))
    with ple_um.open_table(str(copy), mode="cpu", device="cuda") as table:  # the parent maps the files too
        ids = torch.arange(0, 1000, device="cuda")
        before = table.lookup(ids).cpu()
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(copy), victim],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PLE_UM_DISPATCHER": dispatcher},
        )
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        assert "SURVIVED" not in done.stdout
        # The parent's rows of the untouched files still read as before.
        assert torch.equal(table.lookup(ids).cpu(), before)
