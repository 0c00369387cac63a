"""A memory limit for the bench's child process: a memory cgroup made for it, where the machine
lets this process make one, page cache included and no swap; and the child run in it
(``run_limited``: ``python -m MODULE``, the request as JSON on its stdin, its figures as JSON on
its stdout, ``child_main`` its side).

cgroup v2: a group below this process's own (``memory.max``, ``memory.swap.max`` 0), the memory
controller enabled in the parent's ``cgroup.subtree_control`` where it is not yet, and turned off
again when the group is removed unless another group below the parent remains (``MemoryLimit.left``
then says what stays changed). cgroup v1: a
group below this process's own in the memory hierarchy (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` equal to it where swap is accounted). The child is moved into the
group by the pid it writes, between fork and exec (``preexec``), so everything it maps and reads is
charged to the group from its first instruction. Page cache a process reads is charged to the
group of the process that first reads it: the child must drop the table's pages before it starts.

Where no group can be made (no memory controller, no permission, a v2 parent that holds
processes), ``MemoryLimit.open`` returns a limit that is not enforced and says why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ple_um.access.memory import PROC_MOUNTINFO, cgroup_dir, mounts
from ple_um.bench.signals import DeferredSignals, terminate_as_interrupt
from ple_um.units import format_bytes

PROC_CGROUP = "/proc/self/cgroup"
# How long ``close`` waits for the processes of a group to leave it (a killed child's exit).
RMDIR_WAIT_S = 10.0
# The row cache's size knob: held to the limit when no cgroup can be.
ROW_CACHE_KNOB = "PLE_UM_ROW_CACHE"


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's memory cgroup lives: ``version`` 1 or 2, the directory of its group, and
    the hierarchy's top (its mount point)."""

    version: int
    group: str
    root: str = ""


def find_hierarchy(
    mountinfo: str = PROC_MOUNTINFO, cgroup: str = PROC_CGROUP
) -> tuple[Hierarchy | None, str]:
    """This process's memory cgroup (v2 preferred), or None and why there is none."""
    with open(cgroup) as f:
        memberships = [line.rstrip("\n").split(":", 2) for line in f if line.strip()]
    found = mounts(mountinfo)
    v2_path = next((path for hid, ctrl, path in memberships if hid == "0" and ctrl == ""), None)
    v2 = next((m for m in found if m[2] == "cgroup2"), None)
    if v2 is not None and v2_path is not None:
        controllers = _read(os.path.join(v2[0], "cgroup.controllers"))
        if "memory" in (controllers or "").split():
            return Hierarchy(2, cgroup_dir(v2[0], v2[1], v2_path), v2[0]), ""
    v1_path = next((path for _, ctrl, path in memberships if "memory" in ctrl.split(",")), None)
    v1 = next((m for m in found if m[2] == "cgroup" and "memory" in m[3].split(",")), None)
    if v1 is not None and v1_path is not None:
        return Hierarchy(1, cgroup_dir(v1[0], v1[1], v1_path), v1[0]), ""
    return None, "no memory cgroup controller is mounted for this process (neither cgroup v2 nor v1)"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclass
class MemoryLimit:
    """``limit`` bytes for one child process: ``enforced`` by the group at ``group`` (its
    mechanism in ``how``), or not (``why``). Owns the group: ``close()`` removes it (idempotent)."""

    limit: int
    enforced: bool
    how: str = ""
    why: str = ""
    group: str | None = None
    # What ``close`` left changed on the machine (a sentence; "" where nothing).
    left: str = ""
    _procs_fd: int | None = field(default=None, repr=False)
    # The parent group whose ``cgroup.subtree_control`` this limit turned the memory controller on in.
    _enabled_in: str | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls, limit: int, name: str, hierarchy: tuple[Hierarchy | None, str] | None = None
    ) -> MemoryLimit:
        """A group called ``name`` below this process's own, limited to ``limit`` bytes; where that
        group cannot be limited (cgroup v2 lets a group that holds processes hand no controller to
        its children: EBUSY), one at the top of the hierarchy; a limit that is not enforced where
        the machine allows neither."""
        found, why = find_hierarchy() if hierarchy is None else hierarchy
        if found is None:
            return cls(limit, enforced=False, why=why)
        made = cls._made_in(limit, found.group, name, found.version)
        if not made.enforced and found.root and os.path.normpath(found.root) != os.path.normpath(found.group):
            top = cls._made_in(limit, found.root, name, found.version)
            if top.enforced:
                top.how += f" (at the hierarchy's top: below {found.group}, {made.why})"
                return top
        return made

    @classmethod
    def _made_in(cls, limit: int, parent: str, name: str, version: int) -> MemoryLimit:
        group = os.path.join(parent, name)
        try:
            os.mkdir(group)
        except OSError as exc:
            return cls(limit, enforced=False, why=f"cannot make a cgroup in {parent}: {exc.strerror}")
        made = cls(limit, enforced=True, group=group)
        try:
            made.how = made._limit_v2(parent) if version == 2 else made._limit_v1()
            # The kernel makes the file with the group; O_CREAT only spares a test's plain folder.
            made._procs_fd = os.open(os.path.join(group, "cgroup.procs"), os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            made.close()
            return cls(limit, enforced=False, why=f"cannot limit the cgroup {group}: {exc.strerror or exc}")
        return made

    def _limit_v2(self, parent: str) -> str:
        if not os.path.exists(os.path.join(self.group, "memory.max")):
            # The parent must hand the memory controller to its children; a parent that holds
            # processes itself may not (cgroup v2's no-internal-process rule): EBUSY.
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
            self._enabled_in = parent  # turned off again by ``close`` where nothing else needs it
        _write(os.path.join(self.group, "memory.max"), str(self.limit))
        swap = os.path.join(self.group, "memory.swap.max")
        if os.path.exists(swap):
            _write(swap, "0")
        return f"cgroup v2 {self.group}: memory.max {self.limit}, memory.swap.max 0"

    def _limit_v1(self) -> str:
        _write(os.path.join(self.group, "memory.limit_in_bytes"), str(self.limit))
        how = f"cgroup v1 {self.group}: memory.limit_in_bytes {self.limit}"
        memsw = os.path.join(self.group, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            _write(memsw, str(self.limit))  # memory and swap together: no swap beyond the limit
            how += f", memory.memsw.limit_in_bytes {self.limit}"
        return how

    def preexec(self) -> None:
        """Run in the child between fork and exec: move it into the group. Only a write to a file
        descriptor opened before the fork (no allocation, no lock a parent thread may hold)."""
        if self._procs_fd is not None:
            os.write(self._procs_fd, b"0")  # "0": the writing process itself

    def peak(self) -> int | None:
        """The most bytes the group held (v2 memory.peak, v1 memory.max_usage_in_bytes), or None."""
        if self.group is None:
            return None
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            text = _read(os.path.join(self.group, name))
            if text is not None and text.isdigit():
                return int(text)
        return None

    def oom_kills(self) -> int | None:
        """The processes the group's OOM killer has killed (``oom_kill`` of v2 memory.events, of v1
        memory.oom_control), or None where the kernel does not count them."""
        if self.group is None:
            return None
        for name in ("memory.events", "memory.oom_control"):
            for line in (_read(os.path.join(self.group, name)) or "").splitlines():
                key, _, count = line.partition(" ")
                if key == "oom_kill" and count.strip().isdigit():
                    return int(count)
        return None

    def describe(self) -> str:
        return self.how if self.enforced else f"not enforced: {self.why}"

    def pids(self) -> list[int]:
        """The processes in the group now (its ``cgroup.procs``; none where there is no group)."""
        text = _read(os.path.join(self.group, "cgroup.procs")) if self.group is not None else None
        return [int(x) for x in (text or "").split() if x.isdigit()]

    def kill(self) -> None:
        """SIGKILL every process in the group: the child and whatever it started (an interrupted
        run's; every process in the group is the bench's own)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self, wait_s: float = RMDIR_WAIT_S) -> None:
        """Remove the group once its processes have exited (the kernel refuses, EBUSY, while a
        process killed a moment ago is still leaving it: tried again for up to ``wait_s``);
        idempotent. OSError naming the group where it still cannot be removed."""
        if self._procs_fd is not None:
            os.close(self._procs_fd)
            self._procs_fd = None
        if self.group is None:
            return
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.group)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise OSError(
                        exc.errno,
                        f"cannot remove the cgroup {self.group} ({exc.strerror}): rmdir it "
                        "once its processes have exited",
                    ) from None
                time.sleep(0.05)
        self.group = None
        self._disable_memory()

    def _disable_memory(self) -> None:
        """Turn the memory controller off again in the parent where this limit turned it on, once
        its group is gone, unless another group below the parent (another bench's, or anyone's)
        remains: that one may rely on it. Where it stays on, ``left`` says so and why."""
        parent, self._enabled_in = self._enabled_in, None
        if parent is None:
            return
        control = os.path.join(parent, "cgroup.subtree_control")
        with os.scandir(parent) as found:
            others = sorted(e.name for e in found if e.is_dir(follow_symlinks=False))
        if others:
            self.left = (
                f"the memory controller stays enabled in {control} (the bench turned it on): other "
                f"groups below {parent} may rely on it ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''})"
            )
            return
        try:
            _write(control, "-memory")
        except OSError as exc:
            self.left = (
                f"the memory controller stays enabled in {control} (the bench turned it on): turning "
                f"it off failed ({exc.strerror or exc})"
            )

    def __enter__(self) -> MemoryLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child_env(limit: MemoryLimit) -> dict[str, str]:
    env = dict(os.environ)
    # The steady state measures the row cache under the limit, whatever the table's size (one that
    # fits the limit would get none under PLE_UM_FIT=auto); the caller's setting wins.
    env.setdefault("PLE_UM_FIT", "spills")
    if not limit.enforced:
        env[ROW_CACHE_KNOB] = str(limit.limit)
    return env


def run_child(request: dict, limit: MemoryLimit, log: Callable[[str], None], module: str) -> dict:
    """One child (``python -m module``, the request on its stdin) under ``limit``: its figures (the
    JSON on its stdout), or why it gave none (killed, by the limit's OOM killer or not; an error;
    not moved into its group).
    The child leads a session of its own: an interrupt (Ctrl-C) reaches this process alone, which
    then kills the child and everything in its group (``stop_child``). The signals are held from
    before the child starts to after it is stopped (``DeferredSignals``), and act only while it is
    waited for: none comes between its start and the ``try`` that stops it, and a second Ctrl-C (or
    SIGTERM) does not cut the stop short."""
    with DeferredSignals() as deferred:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_child_env(limit),
                preexec_fn=limit.preexec if limit.enforced else None,
                start_new_session=True,
            )
        except subprocess.SubprocessError:  # preexec raised (Python passes on no more): the forked
            # process exited before exec, and nothing ran under the limit
            return {
                "failed": f"the child could not be moved into its cgroup {limit.group} (the write of its "
                "pid to cgroup.procs failed between fork and exec): no figures under this limit"
            }
        try:
            with deferred.let_through():
                stdout, stderr = proc.communicate(json.dumps(request))
        finally:  # finished or not: a process it left running would outlive it, and keep its group
            stop_child(proc, limit)
    for line in stderr.splitlines():
        log(f"  {line}")
    if proc.returncode == 0:
        try:
            return json.loads(stdout)
        except json.JSONDecodeError:
            first = stdout.strip().splitlines()[:1] or [""]
            return {"failed": f"the child's stdout is not its figures (JSON): {first[0][:200]}"}
    kills = limit.oom_kills() if proc.returncode == -9 else None
    if kills == 0:
        why = "the child was killed (SIGKILL) not by the limit: its OOM killer killed nothing"
    elif proc.returncode == -9 and limit.enforced:
        by = " by the limit's OOM killer" if kills else ", by the limit's OOM killer most likely"
        why = (
            f"the child was killed (SIGKILL){by}: {format_bytes(limit.limit)} must hold the process "
            "itself (the interpreter, torch, a CUDA context) besides the page cache"
        )
    else:
        tail = stderr.strip().splitlines()[-1:] or [""]
        why = f"the child exited with {proc.returncode}: {tail[0]}"
    return {"failed": why}


def stop_child(proc: subprocess.Popen, limit: MemoryLimit) -> None:
    """Kill a child (its session: it and what it started) and every process in its memory group,
    and reap it, so that the group can be removed: an unfinished child, or the processes a finished
    one left running (its session's id stays taken while they live, so no other process has it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    limit.kill()
    proc.kill()
    proc.wait()


def run_limited(
    limits: tuple[int, ...],
    request: dict,
    module: str,
    log: Callable[[str], None],
    hierarchy: tuple[Hierarchy | None, str] | None = None,
) -> dict[str, dict]:
    """For each of ``limits``, ``run_child`` (``request`` with its ``limit`` in bytes) in a memory
    group of its own held to that many bytes: str(limit) -> the limit (bytes, whether enforced and
    how, the group's peak) and the child's figures. Each group is removed whatever happens; on an
    interrupt (SIGINT, or SIGTERM and SIGHUP: ``Terminated``) a group that cannot be is named in a
    warning, and the interrupt is what is raised. ``hierarchy`` stands for the machine's memory
    cgroup (``find_hierarchy()``'s answer; ``(None, why)``: there is none). The signals are held
    from before a group is made to after it is removed (``DeferredSignals``), and act only while its
    child runs: none comes between the group's making and the ``try`` that removes it, nor cuts
    the removal short."""
    entries = {}
    with terminate_as_interrupt():
        for k, limit in enumerate(limits):
            with DeferredSignals() as deferred:
                held = MemoryLimit.open(limit, f"ple-um-bench-{os.getpid()}-{k}", hierarchy)
                try:
                    with deferred.let_through():
                        log(f"memory limit {format_bytes(limit)}: {held.describe()}")
                        found = run_child({**request, "limit": limit}, held, log, module)
                        entry = {"bytes": limit, "enforced": held.enforced, "how": held.describe()}
                        entry["peak_bytes"] = held.peak()
                except BaseException:
                    try:
                        held.close()
                    except OSError as exc:
                        log(f"warning: {exc.strerror}")
                    raise
                held.close()
            if held.left:
                entry["left"] = held.left
                log(f"note: {held.left}")
            if not held.enforced:
                entry["row_cache_knob"] = f"{ROW_CACHE_KNOB}={limit}"
            entries[str(limit)] = entry | found
    return entries


def memory_status() -> dict[str, str]:
    """This process's peak and anonymous memory, as ``/proc/self/status`` says them (``VmHWM``,
    ``RssAnon``: ``"123 kB"``)."""
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k in ("VmHWM", "RssAnon")}


def child_main(serve: Callable[[dict], dict]) -> None:
    """A child's side of ``run_child``: the request from stdin, ``serve(request)``'s figures with
    ``memory_status()`` as JSON on stdout."""
    out = serve(json.load(sys.stdin))
    out["status"] = memory_status()
    json.dump(out, sys.stdout)
