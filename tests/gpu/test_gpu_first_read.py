"""The first-read guard on a real GPU: a guarded mode's first read made in a fresh child process,
with the real CUDA context, registration and compiled kernel (tests/access/test_first_read.py runs
the same guard on the Triton interpreter, every cache case included).

A device without ATS and HMM (an H200 in an x86 host, say) never tries the direct read (``ats``), so
these tests guard ``registered`` too (``PLE_UM_FIRST_READ_CHECK=ats,registered``); the guarded mode
is the one the open picks here. The first open runs the child once and caches its verdict; later
opens read the verdict and start no child; ``recheck`` runs the child again and replaces the file. A
child that crashes (SIGSEGV), fails with an error, exits, corrupts its rows or hangs
(``PLE_UM_FIRST_READ_FAULT``, the child's test hook) rejects the guarded mode with that reason, and
the open goes on to ``cpu``, whose rows equal the files', in a process whose CUDA context still
works. Open times are printed (``-s``), never asserted.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import ple_um

GATHERING = "while gathering rows through the kernel"
# Seconds the hanging child gets: well above what a child takes to reach its gather (importing
# torch, the CUDA context, the sample's open), so that the injected hang, not the start, runs out.
HANG_TIMEOUT = 20
FAULTS = {
    "segv": f"the child was killed by SIGSEGV {GATHERING}",
    "error": f"{GATHERING}: RuntimeError: CUDA error: an illegal memory access was encountered",
    "exit": f"the child exited with status 3 {GATHERING}",
    "corrupt": "sample rows read through the kernel differ from the file (first: row ",
    "hang": f"no answer within {HANG_TIMEOUT} s (PLE_UM_FIRST_READ_TIMEOUT) {GATHERING}; killed",
}


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("first-read-cache")


@pytest.fixture
def verdicts(module_cache, monkeypatch):
    """The folder of the first-read verdicts, empty: PLE_UM_CACHE_DIR is a folder of this module
    (the C row copy compiled there once) whose ``first-read/`` is removed before each test.
    ``registered`` is guarded as ``ats`` is; no bulk crossover is measured at open (it only costs
    time here)."""
    shutil.rmtree(module_cache / "first-read", ignore_errors=True)
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(module_cache))
    monkeypatch.setenv("PLE_UM_FIRST_READ_CHECK", "ats,registered")
    monkeypatch.setenv("PLE_UM_BULK_ROWS", "0")
    return module_cache / "first-read"


def verdict_files(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.json")))


def children_on(directory: str) -> list[int]:
    """Pids of first-read children (``ple_um.first_read_child``) still running on ``directory``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "ple_um.first_read_child" in cmd and directory in cmd:
            found.append(int(pid))
    return found


@pytest.fixture
def guarded(tables, device):
    """The mode an open of the fp8 table picks here, which the tests guard."""
    mode = ple_um.probe(device, table_bytes=tables["fp8"].nbytes).mode
    if mode not in ("ats", "registered"):
        pytest.skip(f"the open picks {mode} here, in which the GPU reads no address of the mapping")
    return mode


@pytest.fixture
def rows_equal_the_files(ids_for, rng, poison, check_rows):
    """``rows_equal_the_files(table)``: 4096 ids (shard boundaries, ids outside the table) looked up
    into a poisoned output, every row compared with the files."""

    def check(table) -> None:
        layout = table.layout
        ids_np = ids_for(layout, 4096, rng)
        out = poison(torch.empty((ids_np.size, layout.row_dim), dtype=layout.dtype, device=table.device))
        table.lookup(torch.from_numpy(ids_np).to(table.device), out=out)
        check_rows(out, layout, ids_np)

    return check


def test_the_first_open_reads_in_a_child_once_then_opens_read_the_cache(
    tables, verdicts, guarded, device, monkeypatch, rows_equal_the_files
):
    layout = tables["fp8"]
    opens = []
    with ple_um.open_table(layout.directory, device=device) as table:
        assert table.mode == guarded
        (first,) = table.report.first_read
        assert (first.mode, first.status, first.source) == (guarded, "passed", "child"), first.as_dict()
        assert first.child_seconds > 0
        assert f"first read: {guarded}" in table.report.describe()
        assert "passed in a child process (a fresh child run, " in table.report.describe()
        rows_equal_the_files(table)
        opens.append(("first open (child)", table.open_seconds))
    (path,) = verdict_files(verdicts)
    assert first.path == path and os.path.basename(path).startswith(guarded + "-"), path
    before = os.stat(path)
    # A child would crash now: the later opens must start none, and trust the file.
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "segv")
    for k in range(2):
        with ple_um.open_table(layout.directory, device=device) as table:
            assert table.mode == guarded
            (verdict,) = table.report.first_read
            assert (verdict.status, verdict.source) == ("passed", "cache"), verdict.as_dict()
            assert (verdict.path, verdict.checked_at) == (path, first.checked_at)
            if k == 0:
                rows_equal_the_files(table)
            opens.append((f"open {k + 2} (cached verdict)", table.open_seconds))
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    monkeypatch.delenv("PLE_UM_FIRST_READ_FAULT")
    report = ple_um.probe(device, path=layout.directory, mode=guarded, recheck=True)
    (fresh,) = report.first_read
    assert (fresh.status, fresh.source, fresh.path) == ("passed", "child", path), fresh.as_dict()
    assert verdict_files(verdicts) == [path] and os.stat(path).st_ino != before.st_ino  # replaced
    with ple_um.open_table(layout.directory, device=device) as table:
        (verdict,) = table.report.first_read
        assert table.mode == guarded and (verdict.source, verdict.path) == ("cache", path)
        assert verdict.checked_at == fresh.checked_at
    print(f"{layout.nbytes / 2**20:.0f} MiB table, {guarded} guarded; child {first.child_seconds:.2f} s")
    for what, seconds in opens:
        print(f"  {what}: {seconds:.3f} s")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_child_that_fails_rejects_the_guarded_mode_and_cpu_serves(
    tables, verdicts, guarded, device, fault, monkeypatch, rows_equal_the_files
):
    layout = tables["fp8"]
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", fault)
    if fault == "hang":
        monkeypatch.setenv("PLE_UM_FIRST_READ_TIMEOUT", str(HANG_TIMEOUT))
    with ple_um.open_table(layout.directory, device=device) as table:
        assert table.mode == "cpu", table.report.describe()
        why = table.report.reasons[guarded]
        assert why.startswith("FirstReadRejected: first read in a child process failed: "), why
        assert FAULTS[fault] in why and "(a fresh child run, " in why, why
        assert table.report.first_read[0].status == "not needed"  # the cpu mode's
        rows_equal_the_files(table)
        x = torch.arange(1 << 20, device=device, dtype=torch.float64)
        assert float((x * 2).sum()) == float((1 << 20) * ((1 << 20) - 1))  # this process's CUDA works
    stored = verdict_files(verdicts)
    if fault == "hang":
        assert children_on(layout.directory) == []  # killed with its process group
        assert stored == []  # a timeout is not cached: the next open tries again
        return
    (path,) = [p for p in stored if os.path.basename(p).startswith(guarded + "-")]
    # The rejection is cached: with the fault gone the guarded mode is still rejected, from the file.
    monkeypatch.delenv("PLE_UM_FIRST_READ_FAULT")
    with ple_um.open_table(layout.directory, device=device) as table:
        why = table.report.reasons[guarded]
        assert table.mode == "cpu" and FAULTS[fault] in why and f"cache file {path}" in why, why
        assert "`ple-um probe DIR --recheck` runs it again" in why
        rows_equal_the_files(table)
