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


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: /proc/PID/stat's 22nd field), or None
    where there is none: with the pid, one process, never a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(") ")[-1].split()[19])
    except OSError:
        return None


def alive(pid: int, since: int | None = None) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not); with ``since``
    (``started(pid)`` when it was seen), only the process that started then, not one given its pid
    after it ended (pids wrap at /proc/sys/kernel/pid_max, 32 768 on many machines)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(") ")[-1]
    except OSError:
        return False
    return state[:1] != "Z" and (since is None or int(state.split()[19]) == since)
