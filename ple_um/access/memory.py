"""How much memory this process can still take: what sizes the row cache (``PLE_UM_ROW_CACHE=auto``)
and decides whether a table's owned rows fit (``fits``: the path of decode-sized lookups).

Two limits can bind: the machine's (``MemAvailable`` in ``/proc/meminfo``: free memory plus what
the kernel can reclaim) and the memory cgroup the process runs in (cgroup v2's ``memory.max``, or
its ``memory.high`` where lower, less ``memory.current``, or v1's ``memory.limit_in_bytes`` less
``memory.usage_in_bytes``, plus the group's page cache the kernel can take back, for the
process's group and every group above it,
read where ``/proc/self/mountinfo`` mounts their hierarchy). The smaller is what is left. The page
cache taken back is the group's file LRU lists in ``memory.stat`` less what processes map
(``file_mapped``; v1 ``total_mapped_file``): the libraries and driver files a CUDA process runs
from are mapped and in use, and reclaiming them only brings them back, so a
row cache sized on them leaves the group nothing for its lookups' buffers. A container or a batch
system's memory limit is a cgroup's, so a limit there is seen even where ``MemAvailable`` shows
the whole machine. A group's usage counts the page cache its processes read (the model's weights,
the table itself), which fills it up to its limit and which the kernel reclaims as MemAvailable
says it would: without it a group that read more files than its limit would seem to have no room.
"""

from __future__ import annotations

import os
import re

from ple_um.units import format_bytes

CGROUP_ROOT = "/sys/fs/cgroup"  # where the hierarchies are, where /proc/self/mountinfo cannot be read
PROC_MOUNTINFO = "/proc/self/mountinfo"
_OCTAL = re.compile(rb"\\([0-7]{3})")  # an octal escape of /proc/self/mountinfo


def mount_path(field: bytes) -> str:
    """A path field of /proc/self/mountinfo (a mount point, a root within a hierarchy) as a path:
    mountinfo writes a path's blanks, tabs, newlines and backslashes as octal escapes (``\\040``)
    and its other bytes as they are, so a name as ``os.path.realpath`` gives it."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8)]), field))


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("max", "") else int(text) if text.isdigit() else None


def mounts(mountinfo: str = PROC_MOUNTINFO) -> list[tuple[str, str, str, str]]:
    """(mount point, root within the hierarchy, fs type, super options) of each mount in
    ``mountinfo``, its paths unescaped (``mount_path``); OSError where it cannot be read."""
    found = []
    with open(mountinfo, "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                kind, options = (t.decode(errors="replace") for t in (tail[0], tail[2]))
                found.append((mount_path(fields[4]), mount_path(fields[3]), kind, options))
    return found


def cgroup_dir(point: str, root: str, path: str) -> str:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``point`` showing ``root``."""
    rel = os.path.relpath(path, root)
    return os.path.normpath(point if rel == "." else os.path.join(point, rel))


def _hierarchies(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Where the memory cgroups are, by version: (mount point, root within the hierarchy) of the
    cgroup2 mount (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid system) and of
    the v1 memory controller's mount, as ``mountinfo`` lists them; the usual places under
    ``CGROUP_ROOT`` where it cannot be read."""
    try:
        found = mounts(mountinfo)
    except OSError:
        return {"v2": (CGROUP_ROOT, "/"), "v1": (os.path.join(CGROUP_ROOT, "memory"), "/")}
    where = {}
    for point, root, kind, options in found:
        if kind == "cgroup2":
            where.setdefault("v2", (point, root))
        elif kind == "cgroup" and "memory" in options.split(","):
            where.setdefault("v1", (point, root))
    return where


def _groups(proc_cgroup: str, root: str | None, mountinfo: str) -> list[tuple[str, str]]:
    """(folder, version) of this process's memory cgroup and every group above it that its mount
    shows, nearest first. ``root``: the hierarchies are there (v1's in ``memory/``) instead of
    where ``mountinfo`` mounts them."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    if root is None:
        bases = _hierarchies(mountinfo)
    else:
        bases = {"v2": (root, "/"), "v1": (os.path.join(root, "memory"), "/")}
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            version = "v2"
        elif "memory" in controllers.split(","):
            version = "v1"
        else:
            continue
        if version not in bases:
            continue
        point, shown = bases[version]
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):
            group = "/" + "/".join(parts[:k])
            if os.path.relpath(group, shown).startswith(".."):  # above what the mount shows
                break
            found.append((cgroup_dir(point, shown, group), version))
    return found


def _page_cache(folder: str, version: str) -> tuple[int, int]:
    """The group's page cache on its file LRU lists and the part of it processes map, its groups
    below included (v2's ``memory.stat`` counts them; v1's ``total_`` lines); zeros where
    unreadable."""
    prefix = "" if version == "v2" else "total_"
    lists = (f"{prefix}active_file", f"{prefix}inactive_file")
    mapped_name = "file_mapped" if version == "v2" else "total_mapped_file"
    cached = mapped = 0
    try:
        with open(f"{folder}/memory.stat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if not value.strip().isdigit():
                    continue
                if name in lists:
                    cached += int(value)
                elif name == mapped_name:
                    mapped = int(value)
    except OSError:
        return 0, 0
    return cached, mapped


def cgroup_headroom(
    proc_cgroup: str = "/proc/self/cgroup",
    root: str | None = None,
    *,
    resident: int = 0,
    mountinfo: str = PROC_MOUNTINFO,
) -> int | None:
    """Bytes this process's memory cgroups let it take still (the tightest of them): each group's
    limit less its usage, plus its page cache the kernel can take back: the file LRU lists less
    what is mapped, or less ``resident`` (a table's own pages in memory, which a caller counts
    apart) where that is more (a table read through its mapping is among the mapped pages); None
    where no group has a limit. ``proc_cgroup`` names the groups, ``mountinfo`` says where their
    hierarchies are mounted (``root``: there instead)."""
    best = None
    for folder, version in _groups(proc_cgroup, root, mountinfo):
        if version == "v2":  # memory.high too: past it the kernel reclaims and throttles the group
            limits = [_read_int(f"{folder}/memory.{name}") for name in ("max", "high")]
            limit = min((x for x in limits if x is not None), default=None)
            used = _read_int(f"{folder}/memory.current")
        else:
            limit = _read_int(f"{folder}/memory.limit_in_bytes")
            used = _read_int(f"{folder}/memory.usage_in_bytes")
        if limit is None or used is None or limit >= 1 << 60:  # v1 says "no limit" with a huge number
            continue
        cached, mapped = _page_cache(folder, version)
        room = max(0, limit - used) + max(0, cached - max(mapped, resident))
        best = room if best is None else min(best, room)
    return best


def available() -> int:
    """The bytes this process can still take: the smaller of MemAvailable and its cgroups' room."""
    machine = mem_available()
    group = cgroup_headroom()
    if group is None:
        return machine
    return min(group, machine) if machine else group


def fits(owned: int, resident: int, pinned: int = 0, *, what: str = "the owned rows") -> tuple[bool, str]:
    """Whether a table of ``owned`` bytes, ``resident`` of them in memory now and ``pinned`` of
    those pinned (the registered mode), fits the memory this process may use, and why, in words.

    Two terms, both must hold. The machine: the whole table within MemAvailable plus its pinned
    bytes (MemAvailable already counts the table's evictable page cache as memory the kernel can
    take back, but not pinned pages). Each memory cgroup with a limit: the bytes not yet in memory
    within its room (its usage already counts the table's pages charged to it, so its page cache
    counts as room less the table's resident pages, which may be among it). ``what``: the bytes
    counted, in the words."""
    machine, group = mem_available(), cgroup_headroom(resident=resident)
    missing = max(0, owned - resident)
    terms = []
    ok = True
    if machine:
        ok = owned <= machine + pinned
        extra = f" + {format_bytes(pinned)} pinned" if pinned else ""
        terms.append(f"MemAvailable {format_bytes(machine)}{extra}")
    if group is not None:
        ok = ok and missing <= group
        terms.append(f"{format_bytes(missing)} not in memory against the cgroup's room {format_bytes(group)}")
    verdict = "fit" if ok else "do not fit"
    against = "; ".join(terms) or "no limit known"
    return (
        ok,
        f"{what} ({format_bytes(owned)}, {format_bytes(resident)} in memory) {verdict}: {against}",
    )
