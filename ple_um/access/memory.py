"""How much memory this process can still take: what sizes the row cache (``PLE_UM_ROW_CACHE=auto``).

Two limits can bind: the machine's (``MemAvailable`` in ``/proc/meminfo``: free memory plus what
the kernel can reclaim) and the memory cgroup the process runs in (cgroup v2's ``memory.max`` less
``memory.current``, or v1's ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``, for the
process's group and every group above it). The smaller is what is left. A container or a batch
system's memory limit is a cgroup's, so a limit there is seen even where ``MemAvailable`` shows
the whole machine.
"""

from __future__ import annotations

import os

from ple_um.access.probe import mem_available

CGROUP_ROOT = "/sys/fs/cgroup"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("max", "") else int(text) if text.isdigit() else None


def _groups(proc_cgroup: str, root: str) -> list[tuple[str, str]]:
    """(folder, version) of this process's memory cgroup and every group above it, nearest first."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            base, version = root, "v2"
        elif "memory" in controllers.split(","):
            base, version = os.path.join(root, "memory"), "v1"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):
            found.append((os.path.join(base, *parts[:k]), version))
    return found


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroups let it take still (the tightest of them), or None
    where no group has a limit. ``proc_cgroup`` names the groups, ``root`` is where they are."""
    best = None
    for folder, version in _groups(proc_cgroup, root):
        if version == "v2":
            limit, used = _read_int(f"{folder}/memory.max"), _read_int(f"{folder}/memory.current")
        else:
            limit = _read_int(f"{folder}/memory.limit_in_bytes")
            used = _read_int(f"{folder}/memory.usage_in_bytes")
        if limit is None or used is None or limit >= 1 << 60:  # v1 says "no limit" with a huge number
            continue
        room = max(0, limit - used)
        best = room if best is None else min(best, room)
    return best


def available() -> int:
    """The bytes this process can still take: the smaller of MemAvailable and its cgroups' room."""
    machine = mem_available()
    group = cgroup_headroom()
    if group is None:
        return machine
    return min(group, machine) if machine else group
