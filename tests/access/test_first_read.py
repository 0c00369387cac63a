"""ple_um.access.first_read: the first read of a mapping made in a child process, its verdict cached.

Real children throughout: each is a fresh interpreter running ``ple_um.first_read_child`` that opens
a few rows of the real checkpoint files in the mode and gathers them through the kernel, which the
Triton interpreter runs here on the mapping's host addresses (the parent's TRITON_INTERPRET=1 is in
the child's environment). What is injected: the machine the parent sees (``DeviceCapabilities``),
and the child's failure, through the hook it honours (PLE_UM_FIRST_READ_FAULT: a SIGSEGV, an abort,
a hang, an exit, a CUDA-like error, rows corrupted before the comparison). A child costs a fresh
interpreter's start, most of it importing torch."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers.machines import ATS, DISCRETE, HMM
from helpers.reference import reference_rows

import ple_um
from ple_um import _testing, cli, envs
from ple_um.access import first_read, verdict_cache
from ple_um.access.capabilities import read_capabilities, triton_interpreter
from ple_um.access.first_read import first_read_verdict, sample_windows
from ple_um.access.verdict_cache import (
    FORMAT,
    FORMAT_VERSION,
    read_verdict,
    verdict_key,
    verdict_path,
    write_verdict,
)
from ple_um.errors import ModeUnavailableError

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="the child reads through the interpreted kernel"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

CPU = torch.device("cpu")
INJECTED = {"ats": dataclasses.replace(ATS, device="cpu"), "hmm": dataclasses.replace(HMM, device="cpu")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh PLE_UM_CACHE_DIR (every other knob at its default: the root conftest)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(path))
    return path


def verdict_files(cache) -> list[str]:
    return sorted(glob.glob(str(cache / "first-read" / "*.json")))


def all_ids(layout) -> torch.Tensor:
    return torch.arange(-3, layout.num_rows + 3)


def child_processes(directory: str) -> list[int]:
    """Pids of first-read children still running on ``directory``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "ple_um.first_read_child" in cmd and directory in cmd:
            found.append(int(pid))
    return found


# -- the sample ------------------------------------------------------------------------------------
def test_the_sample_covers_the_first_and_last_rows_and_a_boundary_between_files(layout):
    # 120 rows in 5 shards of 24 over 4 files (conftest's layout).
    S = layout.rows_per_shard
    windows = sample_windows(layout, (0, layout.num_rows))
    assert windows[0] == (0, 8) and windows[-1] == (layout.num_rows - 8, layout.num_rows)
    (middle,) = windows[1:-1]
    boundary = middle[0] + 4
    assert boundary % S == 0 and middle == (boundary - 4, boundary + 4)
    assert layout.shards[boundary // S - 1].path != layout.shards[boundary // S].path
    # A rank's range: inside it, overlaps merged; none for a rank that owns nothing.
    assert sample_windows(layout, (30, 40)) == [(30, 40)]
    assert all(30 <= lo < hi <= 70 for lo, hi in sample_windows(layout, (30, 70)))
    assert sample_windows(layout, (50, 50)) == []


# -- the first open runs the child, later opens read the verdict -----------------------------------
def test_the_first_open_reads_in_a_child_and_later_opens_read_the_cached_verdict(
    layout, cache, monkeypatch, check_rows
):
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats"
        (verdict,) = table.report.first_read
        assert (verdict.status, verdict.source) == ("passed", "child") and verdict.child_seconds > 0
        assert "passed in a child process (a fresh child run" in table.report.describe()
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    (path,) = verdict_files(cache)
    assert verdict.path == path
    with open(path) as f:
        record = json.load(f)
    assert (record["format"], record["version"], record["passed"]) == (FORMAT, FORMAT_VERSION, True)
    key = verdict_key(read_capabilities("cpu"), "ats", layout.files)
    assert record["key"] == key and path == verdict_path(key)
    assert set(key) == {"device", "driver", "kernel", "mode", "direct_read", "filesystem", "ple_um"}
    assert key["kernel"] == os.uname().release and key["ple_um"].startswith(ple_um.__version__ + "+kernels.")
    assert record["sample"]["windows"] == [list(w) for w in sample_windows(layout, (0, layout.num_rows))]
    before = os.stat(path)
    # A child would crash now: the second open must start none, and trust the file.
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "segv")
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats"
        (verdict,) = table.report.first_read
        assert (verdict.source, verdict.path, verdict.checked_at) == ("cache", path, record["checked_at"])
        assert f"(cache file {path}, checked {record['checked_at']})" in table.report.describe()
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# -- a child that fails ----------------------------------------------------------------------------
GATHERING = "while gathering rows through the kernel"


@pytest.mark.parametrize(
    ("fault", "needle"),
    [
        ("segv", f"the child was killed by SIGSEGV {GATHERING}"),
        ("abort", f"the child was killed by SIGABRT {GATHERING}"),
        ("exit", f"the child exited with status 3 {GATHERING}"),
        ("error", f"{GATHERING}: RuntimeError: CUDA error: an illegal memory access was encountered"),
        ("corrupt", "sample rows read through the kernel differ from the file (first: row "),
    ],
)
def test_a_child_that_fails_rejects_the_mode_and_the_open_goes_on(
    layout, cache, monkeypatch, check_rows, fault, needle
):
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", fault)
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "cpu"  # registered needs CUDA: the next mode that works here
        why = table.report.reasons["ats"]
        assert why.startswith("FirstReadRejected: first read in a child process failed: "), why
        assert needle in why and "(a fresh child run, " in why
        assert table.report.first_read[0].status == "not needed"  # the cpu mode's
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    # The rejection is cached: with the fault gone, ats is still rejected, and the reason says
    # where from and how to run the child again.
    monkeypatch.delenv("PLE_UM_FIRST_READ_FAULT")
    (path,) = verdict_files(cache)
    with ple_um.open_table(layout.directory, device="cpu") as table:
        why = table.report.reasons["ats"]
        assert table.mode == "cpu" and needle in why
        assert f"cache file {path}" in why and "`ple-um probe DIR --recheck` runs it again" in why
    with pytest.raises(ModeUnavailableError, match="first read in a child process failed") as info:
        ple_um.open_table(layout.directory, mode="ats", device="cpu")
    assert info.value.mode == "ats" and needle in info.value.reason


def test_a_child_that_hangs_is_killed_at_the_timeout_and_the_timeout_is_not_cached(
    layout, cache, monkeypatch, check_rows
):
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "hang")
    monkeypatch.setenv("PLE_UM_FIRST_READ_TIMEOUT", "12")
    t0 = time.monotonic()
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert time.monotonic() - t0 < 12 + 20
        assert table.mode == "cpu"
        why = table.report.reasons["ats"]
        assert f"no answer within 12 s (PLE_UM_FIRST_READ_TIMEOUT) {GATHERING}; killed" in why
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    assert child_processes(layout.directory) == []  # killed with its process group
    assert verdict_files(cache) == []  # a loaded machine can time out: the next open tries again
    monkeypatch.delenv("PLE_UM_FIRST_READ_FAULT")
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats" and table.report.first_read[0].source == "child"


def test_a_killed_child_whose_output_stays_open_does_not_hold_the_open(layout, cache, monkeypatch, tmp_path):
    # A child the kill cannot end at once (one stuck in the driver: uninterruptible) keeps its
    # pipes open; so does, here, a process it started in a session of its own. The wait for its
    # last output is bounded: the open goes on with a timeout's rejection.
    pid_file = tmp_path / "holder.pid"
    holder = (
        "import os, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(40)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
        f"print('{first_read.MARK} stage gather', flush=True); "
        "time.sleep(120)"
    )
    monkeypatch.setattr(first_read, "_CHILD", holder)
    try:
        t0 = time.monotonic()
        outcome = first_read.run_child(layout, [(0, 8)], "ats", CPU, timeout=2)
        assert time.monotonic() - t0 < 2 + first_read.REAP_SECONDS + 10
        assert not outcome.passed and not outcome.cacheable
        why = f"no answer within 2 s (PLE_UM_FIRST_READ_TIMEOUT) {GATHERING}; killed"
        assert outcome.reason.startswith(why), outcome.reason
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_an_open_interrupted_while_its_child_reads_takes_the_child_with_it(layout, cache):
    """Ctrl-C while the first-read child runs: the child runs in a session of its own (a timeout
    kills its whole group), out of the terminal's reach, so the open kills it on the way out rather
    than leave it behind, here hung in its read."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import ple_um; ple_um.open_table({layout.directory!r}, device='cpu')"

    def maps_a_shard(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/maps") as f:
                return layout.files[0] in f.read()
        except OSError:
            return False

    env = {**os.environ, "PLE_UM_FIRST_READ_FAULT": "hang", "PYTHONPATH": repo}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(maps_a_shard(pid) for pid in child_processes(layout.directory)):
            assert parent.poll() is None and time.monotonic() < deadline, "no first-read child opened"
            time.sleep(0.2)
        time.sleep(2)  # the child has opened its sample: in its read, hung, printing no more
        parent.send_signal(signal.SIGINT)
        _, err = parent.communicate(timeout=60)
        assert "KeyboardInterrupt" in err
        deadline = time.monotonic() + 10
        while child_processes(layout.directory) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child_processes(layout.directory) == []
    finally:
        parent.kill()
        for pid in child_processes(layout.directory):
            os.kill(pid, signal.SIGKILL)


# -- the machines: hardware coherent, HMM, neither -------------------------------------------------
@pytest.mark.parametrize(("kind", "named"), [("ats", "hardware coherent (ATS)"), ("hmm", "HMM")])
def test_the_direct_read_is_checked_and_named_on_ats_and_hmm_machines(
    layout, cache, monkeypatch, check_rows, machine, kind, named
):
    machine(INJECTED[kind], register=False)
    if kind == "hmm":
        # HMM tries registered first; a table over the pin budget takes the direct read.
        monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1KiB")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "ats" and table.report.direct_read == named
        (verdict,) = table.report.first_read
        assert verdict.source == "child" and verdict.direct_read == named
        assert verdict.key["direct_read"] == named and verdict.key["device"] == INJECTED[kind].uuid
        assert verdict.key["driver"] == INJECTED[kind].driver_version
        assert f"direct read: {named}\n" in table.report.describe() + "\n"
        assert f"first read: ats ({named}) passed" in table.report.describe()
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "segv")
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(cache / "other"))
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu" and "killed by SIGSEGV" in table.report.reasons["ats"]


def test_hmm_takes_the_direct_read_when_registration_fails(layout, cache, monkeypatch, check_rows, machine):
    # Within the pin budget HMM tries registered first; here cudaHostRegister fails (no driver on
    # this host), so the open rejects it and goes on to the direct read, checked in a child.
    machine(INJECTED["hmm"], register=False)
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "ats" and table.report.direct_read == "HMM"
        assert table.report.reasons["registered"].startswith("RegistrationError: ")
        assert table.report.first_read[0].source == "child"
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))


def test_a_device_without_a_direct_read_starts_no_child(layout, cache, monkeypatch, machine):
    machine(dataclasses.replace(DISCRETE, device="cpu"), register=False)
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1KiB")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu" and table.report.direct_read is None
        assert "neither PageableMemoryAccessUsesHostPageTables" in table.report.reasons["ats"]
        assert table.report.first_read[0].status == "not needed"
    assert verdict_files(cache) == []


def test_registered_is_checked_in_a_child_when_asked(layout, cache, monkeypatch, machine):
    # PLE_UM_FIRST_READ_CHECK=ats,registered: registered's first use runs a child too. This host
    # has no CUDA, so the child's registered open fails there, never in this process.
    machine(dataclasses.replace(DISCRETE, device="cpu"), register=False)
    monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", "ats,registered")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu"
        why = table.report.reasons["registered"]
        assert "first read in a child process failed: while opening the sample: ModeUnavailableError" in why
    (path,) = verdict_files(cache)
    assert os.path.basename(path).startswith("registered-")


def test_modes_and_tables_that_need_no_child(layout, cache, monkeypatch):
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        assert (
            table.report.first_read[0].reason
            == "the cpu mode has the GPU dereference no address of the mapping"
        )
    with ple_um.open_table(layout.directory, rows=(50, 50), device="cpu") as table:
        assert table.mode == "ats"
        assert table.report.first_read[0].reason == "this process owns no rows of the table"
    monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", "off")
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats"
        assert (
            table.report.first_read[0].describe()
            == "first read: not needed (ats is not in PLE_UM_FIRST_READ_CHECK)"
        )
    assert verdict_files(cache) == []


def test_an_nvfp4_rank_is_checked_on_its_own_rows(make_checkpoint, cache):
    # The child compares the packed rows and the block scales; a rank's sample lies in its range.
    layout = make_checkpoint(dtype="nvfp4", num_rows=90, row_dim=32, shards=3, files=3, seed=5)
    rows = (20, 75)
    with ple_um.open_table(layout.directory, rows=rows, device="cpu") as table:
        assert table.mode == "ats" and table.report.first_read[0].source == "child"
        ids = all_ids(layout)
        packed, scales = table.lookup_packed(ids)
        assert np.array_equal(packed.numpy(), reference_rows(layout, ids, rows=rows))
        assert np.array_equal(
            scales.view(torch.uint8).numpy(), reference_rows(layout.scale_layout(), ids, rows=rows)
        )
    (path,) = verdict_files(cache)
    with open(path) as f:
        windows = json.load(f)["sample"]["windows"]
    assert windows[0][0] == 20 and windows[-1][1] == 75 and all(20 <= lo < hi <= 75 for lo, hi in windows)


# -- the cache: key, corrupt and foreign files, races -----------------------------------------------
def test_each_part_of_the_key_names_its_own_verdict(layout, cache, monkeypatch):
    caps = read_capabilities("cpu")
    key = verdict_key(caps, "ats", layout.files)
    changed = [
        verdict_key(dataclasses.replace(caps, uuid="GPU-another"), "ats", layout.files),
        verdict_key(dataclasses.replace(caps, driver_version="999.1"), "ats", layout.files),
        verdict_key(caps, "registered", layout.files),
        verdict_key(dataclasses.replace(caps, pageable_memory_access=True), "ats", layout.files),  # HMM
    ]
    monkeypatch.setattr(verdict_cache.platform, "release", lambda: "9.9.9-another")
    changed.append(verdict_key(caps, "ats", layout.files))
    monkeypatch.undo()
    monkeypatch.setattr(verdict_cache, "ple_um_version", lambda: "0.2.0+kernels.another")
    changed.append(verdict_key(caps, "ats", layout.files))
    monkeypatch.setattr(verdict_cache, "filesystems", lambda paths: "nfs4")
    changed.append(verdict_key(caps, "ats", layout.files))
    paths = {verdict_path(k) for k in (key, *changed)}
    assert len(paths) == 1 + len(changed)


def test_the_filesystem_of_a_mount_point_named_with_blanks_or_non_ascii_letters(tmp_path, monkeypatch):
    # mountinfo writes a mount point's blanks and backslashes as octal escapes and its other bytes
    # as they are (UTF-8 here): a table on such a mount is keyed by that mount's filesystem.
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        b"40 22 0:50 / /mnt/donn\xc3\xa9es\\040\\134x rw,relatime shared:9 - nfs4 srv:/t rw\n"
    )
    points = verdict_cache._mount_points(str(mountinfo))
    assert points == [("/mnt/donn\u00e9es \\x", "nfs4"), ("/", "ext4")]
    monkeypatch.setattr(verdict_cache, "_mount_points", lambda: points)
    assert verdict_cache.filesystems(["/mnt/donn\u00e9es \\x/model.safetensors"]) == "nfs4"
    assert verdict_cache.filesystems(["/mnt/donn\u00e9es/model.safetensors", "/srv/a"]) == "ext4"


def test_the_filesystem_of_a_mount_point_mounted_over_is_the_one_on_top(tmp_path, monkeypatch):
    # A mount point mounted twice shows the later mount (its line comes after the first's).
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        b"40 22 8:2 / /models rw,relatime shared:9 - xfs /dev/sdb1 rw\n"
        b"41 40 0:50 / /models rw,relatime shared:10 - nfs4 srv:/m rw\n"
    )
    points = verdict_cache._mount_points(str(mountinfo))
    monkeypatch.setattr(verdict_cache, "_mount_points", lambda: points)
    assert verdict_cache.filesystems(["/models/model.safetensors"]) == "nfs4"


def test_a_changed_key_runs_the_child_again(layout, cache):
    caps = read_capabilities("cpu")
    rows = (0, layout.num_rows)
    first = first_read_verdict("ats", caps, layout, rows, CPU)
    assert first.source == "child"
    assert first_read_verdict("ats", caps, layout, rows, CPU).source == "cache"
    other = first_read_verdict("ats", dataclasses.replace(caps, driver_version="999.1"), layout, rows, CPU)
    assert other.source == "child" and other.path != first.path
    assert len(verdict_files(cache)) == 2


def _record(for_key, **changes) -> dict:
    record = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "key": for_key,
        "passed": True,
        "reason": None,
        "checked_at": "2026-12-01 10:00:00 UTC",
        "child_seconds": 1.0,
    }
    record.update(changes)
    return record


@pytest.mark.parametrize(
    ("content", "warning"),
    [
        ("{not json", "unreadable"),
        ("", "unreadable"),
        ('["a list"]', "not a JSON object but list"),
        ({"format": "another tool's cache"}, "not a ple-um first-read verdict"),
        ({"version": 2}, "format version 2; this ple-um reads version 1"),
        ({"key": {"device": "GPU-another"}}, "written for another key"),
        ({"passed": "yes"}, "no passed/rejected verdict"),
        ({"passed": False, "reason": None}, "a rejection without a reason"),
        ({"checked_at": None}, "no checked_at time"),
    ],
)
def test_a_corrupt_or_foreign_verdict_file_is_ignored_with_a_warning(layout, cache, caplog, content, warning):
    key = verdict_key(read_capabilities("cpu"), "ats", layout.files)
    path = verdict_path(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(_record(key, **content)))
    with caplog.at_level(logging.WARNING, logger="ple_um.access.first_read"):
        assert read_verdict(path, key) is None
    assert f"ignoring the first-read verdict file {path}: " in caplog.text and warning in caplog.text
    # The well-formed record for this key is trusted.
    write_verdict(path, _record(key))
    assert read_verdict(path, key) == _record(key)


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"format": FORMAT, "version": 99, "passed": True})]
)
def test_a_corrupt_or_foreign_file_is_never_trusted_the_child_runs_and_replaces_it(
    layout, cache, monkeypatch, caplog, content
):
    # A file that says "passed" but cannot be trusted: the child runs, and its verdict (here a
    # rejection, injected) replaces the file.
    key = verdict_key(read_capabilities("cpu"), "ats", layout.files)
    path = verdict_path(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(content)
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "corrupt")
    with caplog.at_level(logging.WARNING, logger="ple_um.access.first_read"):
        verdict = first_read_verdict("ats", read_capabilities("cpu"), layout, (0, layout.num_rows), CPU)
    assert "ignoring the first-read verdict file" in caplog.text
    assert (verdict.status, verdict.source) == ("rejected", "child")
    record = read_verdict(path, key)
    assert record is not None and record["passed"] is False and "differ from the file" in record["reason"]


def test_writers_racing_never_leave_a_partial_file(tmp_path):
    # Two processes rewrite one verdict 150 times each (records of about 200 KB, so a plain write
    # would be seen half done) while this one reads it: every read is a whole record.
    path = str(tmp_path / "first-read" / "ats-race.json")
    writer = textwrap.dedent(
        f"""
        import sys
        from ple_um.access.verdict_cache import FORMAT, write_verdict
        for i in range(150):
            write_verdict({path!r}, {{"format": FORMAT, "version": 1, "key": {{}}, "passed": True,
                "checked_at": "now", "writer": sys.argv[1], "i": i, "pad": sys.argv[1] * 200_000}})
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", writer, name]) for name in ("a", "b")]
    reads = bad = 0
    while any(p.poll() is None for p in procs):
        try:
            with open(path) as f:
                record = json.load(f)
        except FileNotFoundError:
            continue
        except ValueError:
            bad += 1
            continue
        reads += 1
        if record["pad"] != record["writer"] * 200_000:
            bad += 1
    assert [p.wait() for p in procs] == [0, 0]
    assert bad == 0 and reads > 0
    assert os.listdir(os.path.dirname(path)) == ["ats-race.json"]  # no temporary file left


def test_ranks_starting_at_once_run_one_child(layout, cache):
    # Two processes ask for the same verdict at once: one runs the child under the lock, the other
    # waits for it and reads the file.
    script = textwrap.dedent(
        f"""
        import torch
        from ple_um.access.capabilities import read_capabilities
        from ple_um.access.first_read import first_read_verdict
        from ple_um.checkpoint import read_layout
        layout = read_layout({layout.directory!r})
        caps, rows = read_capabilities("cpu"), (0, layout.num_rows)
        v = first_read_verdict("ats", caps, layout, rows, torch.device("cpu"))
        print(v.status, v.source)
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert outs == ["passed cache", "passed child"]
    assert len(verdict_files(cache)) == 1


# -- ple-um probe ----------------------------------------------------------------------------------
def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_probe_shows_the_verdict_and_where_it_came_from(layout, cache, monkeypatch, capsys):
    code, out, _ = run(capsys, "probe")
    assert code == 0 and "mode: ats" in out
    assert "direct read: Triton interpreter: the host is the device" in out
    assert (
        "first read: ats (Triton interpreter: the host is the device) not checked on this machine yet" in out
    )
    code, out, _ = run(capsys, "probe", layout.directory)
    assert code == 0 and "first read: ats (Triton interpreter: the host is the device) passed" in out
    assert "(a fresh child run, " in out
    (path,) = verdict_files(cache)
    code, out, _ = run(capsys, "probe", layout.directory)
    assert f"(cache file {path}, checked " in out
    # Without a table: the verdicts cached on this machine, with the filesystem they concern.
    code, out, _ = run(capsys, "probe")
    fs = verdict_cache.filesystems(layout.files)
    assert f"passed in a child process on {fs} (cache file {path}, checked " in out
    code, out, _ = run(capsys, "probe", layout.directory, "--json")
    (verdict,) = json.loads(out)["first_read"]
    assert (verdict["status"], verdict["source"], verdict["path"]) == ("passed", "cache", path)
    # --recheck runs the child whatever the cache says, and stores what it finds.
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "corrupt")
    code, out, _ = run(capsys, "probe", layout.directory, "--recheck", "--json")
    data = json.loads(out)
    assert data["mode"] == "cpu" and "differ from the file" in data["reasons"]["ats"]
    assert "a fresh child run" in data["reasons"]["ats"]
    monkeypatch.delenv("PLE_UM_FIRST_READ_FAULT")
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "cpu" and f"cache file {path}" in table.report.reasons["ats"]
    code, out, _ = run(capsys, "probe", layout.directory, "--recheck")
    assert "mode: ats" in out and "(a fresh child run, " in out
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "ats" and table.report.first_read[0].source == "cache"
    # --recheck needs the table: the child reads its files.
    code, _, err = run(capsys, "probe", "--recheck")
    assert code == 2 and "--recheck needs DIR" in err


@pytest.mark.parametrize("drop", ["every field", "mode"])
def test_a_cached_verdict_whose_key_lacks_a_field_is_ignored_by_a_probe(layout, cache, caplog, capsys, drop):
    """A probe without a table reads every verdict of the mode with no key to match it against: a
    well-formed record whose key lacks a key's fields is ignored with a warning, as any record that
    cannot be trusted is, not a traceback."""
    key = verdict_key(read_capabilities("cpu"), "ats", layout.files)
    path = verdict_path(key)
    broken = {} if drop == "every field" else {k: v for k, v in key.items() if k != drop}
    write_verdict(path, _record(broken))
    with caplog.at_level(logging.WARNING):
        code, out, _ = run(capsys, "probe")
    assert code == 0 and "first read: ats (Triton interpreter: the host is the device) not checked" in out
    assert f"ignoring the first-read verdict file {path}: " in caplog.text
    assert "not the fields of a verdict's key" in caplog.text


def test_probe_of_a_forced_mode_whose_first_read_fails(layout, cache, monkeypatch, capsys):
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "exit")
    monkeypatch.setenv("PLE_UM_MODE", "ats")
    code, out, err = run(capsys, "probe", layout.directory)
    assert code == 1 and out == ""
    assert "ats" in err and "the child exited with status 3 while gathering rows" in err


# -- the knobs -------------------------------------------------------------------------------------
def test_the_first_read_knobs(monkeypatch):
    assert envs.PLE_UM_FIRST_READ_CHECK == ("ats",)
    assert envs.PLE_UM_FIRST_READ_TIMEOUT == 120.0 and _testing.first_read_fault() is None
    for text, modes in (("ats,registered", ("ats", "registered")), (" Registered ", ("registered",))):
        monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", text)
        assert envs.PLE_UM_FIRST_READ_CHECK == modes
    for text in ("off", "none", "0", ""):
        monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", text)
        assert envs.PLE_UM_FIRST_READ_CHECK == ()
    monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", "ats,cpu")
    with pytest.raises(ValueError, match="PLE_UM_FIRST_READ_CHECK='ats,cpu'"):
        envs.PLE_UM_FIRST_READ_CHECK  # noqa: B018
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("PLE_UM_FIRST_READ_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PLE_UM_FIRST_READ_TIMEOUT"):
            envs.PLE_UM_FIRST_READ_TIMEOUT  # noqa: B018
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "melt")
    with pytest.raises(ValueError, match="PLE_UM_FIRST_READ_FAULT='melt'"):
        _testing.first_read_fault()
    assert "PLE_UM_FIRST_READ_FAULT" not in envs.KNOBS  # a test hook, not a knob users see
