"""A Python child process held to a memory cgroup made for it (``ple_um.bench.memlimit``): the tests
of a table larger than the memory of the process that serves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from ple_um.bench.memlimit import MemoryLimit


def run_limited(name: str, code_for: Callable[[str, bool], str], env: dict | None = None) -> dict:
    """``python -c code_for(group, v2)`` in a memory cgroup of its own (4 GiB until the child sets
    its limit; skipped where no group can be made here), v2 whether the group is cgroup v2's: the
    JSON object the child prints last, once it has exited 0 and left the group."""
    with MemoryLimit.open(4 << 30, f"{name}-{os.getpid()}") as limit:
        if not limit.enforced:
            pytest.skip(f"no memory cgroup can be made here: {limit.why}")
        code = code_for(limit.group, os.path.exists(os.path.join(limit.group, "memory.max")))
        done = subprocess.run(
            [sys.executable, "-c", code],
            preexec_fn=limit.preexec,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        procs = os.path.join(limit.group, "cgroup.procs")
        deadline = time.monotonic() + 30  # an exited child leaves the group a moment later
        while time.monotonic() < deadline and open(procs).read().strip():
            time.sleep(0.05)
    assert done.returncode == 0, f"exit {done.returncode} (-9: killed, out of memory?): {done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
