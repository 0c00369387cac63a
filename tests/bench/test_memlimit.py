"""The memory limit of the bench's child: the cgroup hierarchies found from /proc's own files (as
given here), the files a limit writes in a v2 and a v1 group (plain folders standing for the
cgroup filesystem), the child moved into its group between fork and exec; and, where this machine
lets a group be made, a real limit holding a child's page cache and killing a child that
allocates past it."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.cgroup import alive
from helpers.cli import fs_type

from ple_um.bench.memlimit import Hierarchy, MemoryLimit, find_hierarchy, run_child, run_limited
from ple_um.residency import evict_file_pages, resident_bytes

MiB = 1 << 20


def _proc_files(tmp_path, mountinfo: str, cgroup: str) -> tuple[str, str]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_find_hierarchy_v2_with_the_memory_controller(tmp_path):
    root = tmp_path / "cg2"
    (root / "user.slice" / "me").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    files = _proc_files(
        tmp_path,
        f"30 24 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "31 24 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
        "4:memory:/user.slice/me\n0::/user.slice/me\n",
    )
    assert find_hierarchy(*files) == (Hierarchy(2, str(root / "user.slice" / "me"), str(root)), "")


def test_find_hierarchy_v1_where_v2_has_no_memory_controller(tmp_path):
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("\n")
    files = _proc_files(
        tmp_path,
        f"30 24 0:26 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
        "31 24 0:27 /outer /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n",
        "4:memory:/outer/job/1\n0::/\n",
    )
    assert find_hierarchy(*files) == (
        Hierarchy(1, "/sys/fs/cgroup/memory/job/1", "/sys/fs/cgroup/memory"),
        "",
    )


def test_find_hierarchy_without_a_memory_controller(tmp_path):
    files = _proc_files(tmp_path, "22 1 0:20 / /proc rw - proc proc rw\n", "0::/\n")
    found, why = find_hierarchy(*files)
    assert found is None and "no memory cgroup controller" in why


def test_a_v2_limit_writes_its_files_and_moves_the_child(tmp_path):
    parent = tmp_path / "me"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text("")
    with MemoryLimit.open(64 * MiB, "bench-1", (Hierarchy(2, str(parent)), "")) as limit:
        group = parent / "bench-1"
        assert limit.enforced and limit.group == str(group)
        assert (parent / "cgroup.subtree_control").read_text() == "+memory"
        assert (group / "memory.max").read_text() == str(64 * MiB)
        assert not (group / "memory.swap.max").exists()  # written only where the kernel made it
        assert limit.describe() == f"cgroup v2 {group}: memory.max {64 * MiB}, memory.swap.max 0"
        done = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=limit.preexec, timeout=60)
        assert done.returncode == 0
        assert (group / "cgroup.procs").read_text() == "0"  # "0": the writing process, the child
        for name in os.listdir(group):  # a plain folder: the control files must go first
            os.unlink(group / name)
    assert not group.exists() and limit.group is None
    # The controller the limit turned on is turned off with its group (nothing else below the parent).
    assert (parent / "cgroup.subtree_control").read_text() == "-memory" and limit.left == ""
    limit.close()  # idempotent
    assert (parent / "cgroup.subtree_control").read_text() == "-memory"


def test_a_v2_controller_another_group_may_need_stays_on_and_is_said_so(tmp_path):
    """Another group below the parent (another bench's, or anyone's) may rely on the memory
    controller the limit turned on: it stays on, and ``left`` (the limit's entry, the report) says
    so, naming the file and why."""
    from ple_um.bench import report

    parent = tmp_path / "me"
    (parent / "someone-else").mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text("")
    with MemoryLimit.open(64 * MiB, "bench-2", (Hierarchy(2, str(parent)), "")) as limit:
        assert limit.enforced and (parent / "cgroup.subtree_control").read_text() == "+memory"
        for name in os.listdir(parent / "bench-2"):
            os.unlink(parent / "bench-2" / name)
    assert not (parent / "bench-2").exists()
    assert (parent / "cgroup.subtree_control").read_text() == "+memory"
    control = parent / "cgroup.subtree_control"
    assert limit.left == (
        f"the memory controller stays enabled in {control} (the bench turned it on): other groups "
        f"below {parent} may rely on it (someone-else)"
    )
    entry = {"bytes": 64 * MiB, "enforced": True, "how": limit.how, "left": limit.left, "failed": "x"}
    assert f"  note: {limit.left}" in report._limit_lines(entry, {})


def test_a_v2_group_that_cannot_delegate_takes_the_hierarchys_top(tmp_path):
    """cgroup v2: a group that holds processes hands no controller to its children (EBUSY, here a
    subtree_control that cannot be written); the limit's group is then made at the top."""
    top = tmp_path / "cg2"
    own = top / "process_api" / "me"
    own.mkdir(parents=True)
    (own / "cgroup.subtree_control").mkdir()  # writing it fails, as the kernel's EBUSY would
    (top / "cgroup.subtree_control").write_text("")
    with MemoryLimit.open(64 * MiB, "bench-3", (Hierarchy(2, str(own), str(top)), "")) as limit:
        assert limit.enforced and limit.group == str(top / "bench-3")
        assert (top / "bench-3" / "memory.max").read_text() == str(64 * MiB)
        assert f"at the hierarchy's top: below {own}" in limit.describe()
        for name in os.listdir(top / "bench-3"):
            os.unlink(top / "bench-3" / name)
    assert not (own / "bench-3").exists() and not (top / "bench-3").exists()


def test_a_v1_limit_forbids_swap_where_it_is_accounted(tmp_path):
    parent = tmp_path / "memory" / "job"
    parent.mkdir(parents=True)
    limit = MemoryLimit.open(32 * MiB, "bench-2", (Hierarchy(1, str(parent)), ""))
    group = parent / "bench-2"
    assert (group / "memory.limit_in_bytes").read_text() == str(32 * MiB)
    assert "memory.memsw.limit_in_bytes" not in limit.describe()
    for name in os.listdir(group):
        os.unlink(group / name)
    limit.close()
    assert not group.exists()


def test_no_group_no_limit_and_why(tmp_path):
    limit = MemoryLimit.open(1 << 30, "x", (None, "no memory cgroup controller is mounted"))
    assert not limit.enforced and limit.describe() == "not enforced: no memory cgroup controller is mounted"
    limit.preexec()  # nothing to do
    assert limit.peak() is None
    limit.close()
    missing = MemoryLimit.open(1 << 30, "x", (Hierarchy(2, str(tmp_path / "gone")), ""))
    assert not missing.enforced and missing.why.startswith(f"cannot make a cgroup in {tmp_path / 'gone'}: ")


def _real_limit(limit: int) -> MemoryLimit:
    held = MemoryLimit.open(limit, f"ple-um-test-{os.getpid()}")
    if not held.enforced:
        pytest.skip(f"no memory cgroup here: {held.why}")
    return held


def test_a_real_limit_holds_the_childs_page_cache(tmp_path):
    """A child in a 64 MiB group reads a 160 MiB file: at most the limit of it stays in the page
    cache (the rest is reclaimed as it reads), and the group's peak is within the limit."""
    if fs_type(str(tmp_path)) == "tmpfs":
        pytest.skip("tmpfs files are their page cache, charged to the writer")
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, 160 * MiB, dtype=np.uint8).tobytes())
        os.fsync(f.fileno())
    evict_file_pages(str(path))
    reader = f"f = open({str(path)!r}, 'rb', buffering=0)\nwhile f.read(1 << 20): pass\n"
    with _real_limit(64 * MiB) as limit:
        if os.path.exists(os.path.join(limit.group, "memory.memsw.limit_in_bytes")):  # v1, swap accounted
            assert f"memory.memsw.limit_in_bytes {64 * MiB}" in limit.describe()
        done = subprocess.run([sys.executable, "-c", reader], preexec_fn=limit.preexec, timeout=120)
        assert done.returncode == 0
        peak = limit.peak()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        view = np.frombuffer(m, dtype=np.uint8)
        resident = resident_bytes(view.ctypes.data, view.size)
        del view
        m.close()
    assert resident <= 64 * MiB, resident
    assert peak is None or peak <= 64 * MiB


def test_a_real_limit_kills_a_child_that_allocates_past_it():
    allocate = "import numpy as np\nx = np.ones(256 << 20, dtype=np.uint8)\nprint(int(x.sum()))\n"
    with _real_limit(64 * MiB) as limit:
        done = subprocess.run(
            [sys.executable, "-c", allocate], preexec_fn=limit.preexec, capture_output=True, timeout=120
        )
    assert done.returncode == -9, done


# A child that starts a process of its own (as ple-um's first read or a compiler would), says its
# pid and fails, leaving that process running.
_LEAVES_A_PROCESS = """
import subprocess, sys
left = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
print(f"left {left.pid}", file=sys.stderr)
sys.exit(1)
"""


@pytest.mark.parametrize("grouped", [True, False], ids=["cgroup", "no cgroup"])
def test_a_child_that_fails_leaving_a_process_leaves_nothing(tmp_path, monkeypatch, grouped):
    """The child fails midway with a process of its own still running: the run reports the
    failure, that process is killed and the group removed (a process left in it would keep the
    group, and its rmdir would fail the whole run)."""
    (tmp_path / "leaves_a_process.py").write_text(_LEAVES_A_PROCESS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    hierarchy = None if grouped else (None, "no memory cgroup in this test")
    lines: list[str] = []
    entries = run_limited((256 * MiB,), {}, "leaves_a_process", lines.append, hierarchy)
    (entry,) = entries.values()
    if grouped and not entry["enforced"]:
        pytest.skip(f"no memory cgroup here: {entry['how']}")
    assert entry["failed"] == "the child exited with 1: left " + lines[-1].split()[-1]
    left, deadline = int(lines[-1].split()[-1]), time.monotonic() + 10
    while alive(left) and time.monotonic() < deadline:  # SIGKILL is sent; its exit takes a moment
        time.sleep(0.05)
    assert not alive(left)
    if grouped:
        assert not os.path.exists(entry["how"].split()[2].rstrip(":"))


@pytest.mark.parametrize(
    "child,who",
    [
        ("import numpy as np\nx = np.ones(512 << 20, dtype=np.uint8)\nprint(int(x.sum()))\n", "by the limit"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "not by the limit"),
    ],
    ids=["past the limit", "killed by another"],
)
def test_a_killed_child_is_said_to_be_killed_by_the_limit_only_where_it_was(
    tmp_path, monkeypatch, child, who
):
    """A child killed (SIGKILL) by the limit's OOM killer, or by something else: the figures' why
    says which, from the group's own count of its OOM kills."""
    (tmp_path / "killed_child.py").write_text(child)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (entry,) = run_limited((256 * MiB,), {}, "killed_child", lambda line: None).values()
    if not entry["enforced"]:
        pytest.skip(f"no memory cgroup here: {entry['how']}")
    assert entry["failed"].startswith(f"the child was killed (SIGKILL) {who}")


def test_a_child_whose_stdout_is_not_its_figures_is_a_failure_not_a_crash(tmp_path, monkeypatch):
    """A child that exits 0 with something else than its JSON on stdout (a library that prints):
    the limit's entry says so, and the other limits' figures are not lost with a traceback."""
    (tmp_path / "prints.py").write_text("print('a warning on stdout')\nprint('{}')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    entries = run_limited((256 * MiB,), {}, "prints", lambda line: None, (None, "no cgroup in this test"))
    (entry,) = entries.values()
    assert entry["failed"] == "the child's stdout is not its figures (JSON): a warning on stdout"


def test_a_child_its_group_refuses_is_a_failure_not_a_crash(tmp_path):
    """Where the write that moves the child into its group fails between fork and exec (a
    cgroup.procs the kernel refuses: /dev/full here), Popen raises; the limit's entry says why and
    names the group, and no child runs."""
    full = os.open("/dev/full", os.O_WRONLY)
    held = MemoryLimit(256 * MiB, enforced=True, how="a test", group=str(tmp_path), _procs_fd=full)
    try:
        found = run_child({}, held, lambda line: None, "ple_um.bench.cold")
    finally:
        os.close(full)
    assert found == {
        "failed": f"the child could not be moved into its cgroup {tmp_path} (the write of its pid to "
        "cgroup.procs failed between fork and exec): no figures under this limit"
    }


# A child that reads its request, starts a process of its own in its session (as a compiler
# would), writes that one's pid to the file PIDS names, and gives its figures: its session outlives
# it unless the run kills it.
_STARTS_A_PROCESS = """
import os, subprocess, sys
sys.stdin.read()
left = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{left.pid}\\n")
print("{}")
"""


def _run_signalled_at(target: int, *args) -> tuple[int, BaseException | None]:
    """``run_limited(*args)`` with SIGTERM raised at the ``target``-th line it or ``run_child`` runs
    (from a trace function: a signal that comes just then; 0: none): the lines run, and what the
    run raised. SIGTERM raises ``Terminated`` also at the lines outside the run's own
    ``terminate_as_interrupt`` (where it would end this process)."""
    from ple_um.bench import memlimit
    from ple_um.bench.signals import terminate_as_interrupt

    codes = {memlimit.run_limited.__code__, memlimit.run_child.__code__}
    lines = 0

    def line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines == target:
                signal.raise_signal(signal.SIGTERM)
        return line

    before = sys.gettrace()
    sys.settrace(lambda frame, event, arg: line if frame.f_code in codes else None)
    try:
        with terminate_as_interrupt():
            memlimit.run_limited(*args)
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return lines, exc
    finally:
        sys.settrace(before)
    return lines, None


@pytest.mark.parametrize("grouped", [True, False], ids=["cgroup", "no cgroup"])
def test_a_sigterm_at_any_line_of_a_limited_run_leaves_nothing(tmp_path, monkeypatch, grouped):
    """SIGTERM at each line that ``run_limited`` and ``run_child`` run, in turn (the group made, the
    child started, waited for, stopped, the group removed, and between them): the run ends in
    ``Terminated`` every time, its child ended and reaped, no process of the child's session alive,
    its group removed. A signal that came between a child's start (or a group's making) and the
    ``try`` that stops it (removes it) would leave it."""
    from ple_um.bench.signals import Terminated

    group = None
    if grouped:
        found, why = find_hierarchy()
        if found is None:
            pytest.skip(f"no memory cgroup here: {why}")
        group = os.path.join(found.group, f"ple-um-bench-{os.getpid()}-0")
    (tmp_path / "starts_a_process.py").write_text(_STARTS_A_PROCESS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):  # the children the run starts, each as it starts
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    args = ((256 * MiB,), {}, "starts_a_process", lambda line: None, None if grouped else (None, "none here"))
    lines, raised = _run_signalled_at(0, *args)
    assert raised is None and len(started) == 1 and started[0].returncode == 0, raised
    try:
        for target in range(1, lines + 1):
            started.clear()
            pids.write_text("")
            _, raised = _run_signalled_at(target, *args)
            assert isinstance(raised, Terminated), (target, raised)
            # A child left running waits for its request (its stdin held open here).
            assert [c.poll() for c in started if c.poll() is None] == [], target
            left, deadline = [int(p) for p in pids.read_text().split()], time.monotonic() + 10
            while any(alive(p) for p in left) and time.monotonic() < deadline:  # SIGKILL sent
                time.sleep(0.05)
            assert not [p for p in left if alive(p)], target
            assert group is None or not os.path.exists(group), target
    finally:
        for child in started:  # one left by a failure above: not past the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.kill()
            child.wait()
