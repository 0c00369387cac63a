"""Reliability: faults at open and while serving, close() racing lookups, the pin budget.

Real files and real mmaps throughout. What is injected: the machine (``DeviceCapabilities`` of an
H200, read by ``open_table``) and cudaHostRegister, through ``InjectedRegistration``: it maps each
registered range a second time (read-only, shared) and hands that alias out as the "device
pointer", as on the H200 where the kernel reads the registered pages through the pointer
cudaHostGetDevicePointer returns; unregistering unmaps the alias. Under the Triton interpreter the
real kernel then reads the alias, so the registered mode runs end to end on the CPU. Failures of
register or of the device-pointer call are injected at a chosen region.

Hostile headers and index files are fuzzed in tests/checkpoint/test_fuzz.py; a write through the
mapping faulting in test_mapping.py; the bad-id cases are in test_reliability_ids.py beside this
file; threads, page-cache eviction and the file digests after long runs in test_reliability_load.py. See
docs/RELIABILITY.md.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from helpers.dropped_tables import drain
from helpers.machines import GH200, H200, InjectedRegistration
from helpers.reference import fds_of, maps_of, reference_rows

import ple_um
import ple_um.table
from ple_um import dropped, ops
from ple_um.access.build import RegisteredMapping
from ple_um.access.capabilities import triton_interpreter
from ple_um.access.machine import RegistrationError
from ple_um.checkpoint import read_layout
from ple_um.errors import CheckpointError, ModeUnavailableError, TableClosedError
from ple_um.mapping import MappedShards
from ple_um.synthetic import write_checkpoint

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="GPU paths run on the CPU under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]


def nothing_left(layout, before_tables: int) -> None:
    assert not maps_of(layout.files), "a mapping survived the failed open"
    assert not fds_of(layout.files), "a file descriptor survived the failed open"
    assert len(ops._TABLES) == before_tables, "a table handle survived the failed open"


def all_ids(layout) -> torch.Tensor:
    return torch.arange(-3, layout.num_rows + 3)


# -- cudaHostRegister failing part-way -------------------------------------------------------------
@pytest.mark.parametrize("fail_at", [0, 1, 3])
@pytest.mark.parametrize("call", ["register", "device_pointer"])
def test_registration_failing_part_way_releases_the_earlier_ones(layout, call, fail_at):
    injected = InjectedRegistration(**{"fail_register" if call == "register" else "fail_pointer": fail_at})
    with MappedShards(layout) as mapping:
        assert len(mapping.regions) == 4  # one per file: four registrations to make
        with pytest.raises(RegistrationError) as info:
            RegisteredMapping(
                mapping,
                torch.device("cpu"),
                calls=injected.calls,
            )
        if call == "register":
            # The message names the file whose registration failed.
            assert f"for {mapping.regions[fail_at].path}" in str(info.value)
            done = fail_at
        else:
            assert "cudaHostGetDevicePointer" in str(info.value)
            done = fail_at + 1  # its region was registered before its pointer was asked for
        assert injected.registered == [r.addr for r in mapping.regions[:done]]
        # Every registration made was released, in reverse order, while the mapping was open.
        assert injected.unregistered == injected.registered[::-1]
        assert injected.live == {} and all(injected.mapping_open_at_unregister)
        # The mapping itself is untouched.
        for index in mapping.owned:
            start = index * layout.rows_per_shard + mapping.owned[index].lo
            expect = reference_rows(layout, range(start, start + mapping.owned[index].rows))
            assert np.array_equal(mapping.shard_rows(index), expect)


def test_any_exception_during_registration_releases_the_earlier_ones(layout):
    # Not only RegistrationError: an interrupt or a bug in a callable must not leak pinned pages.
    injected = InjectedRegistration(fail_register=2, error=KeyboardInterrupt)
    with MappedShards(layout) as mapping:
        with pytest.raises(KeyboardInterrupt):
            RegisteredMapping(
                mapping,
                torch.device("cpu"),
                calls=injected.calls,
            )
        assert len(injected.registered) == 2 and injected.unregistered == injected.registered[::-1]


@pytest.mark.parametrize("fail_at", [0, 2])
def test_an_unregister_that_fails_leaves_no_other_range_registered(layout, fail_at):
    # The other ranges are unregistered all the same, the first failure raised after them; a
    # second close has nothing left to do.
    injected = InjectedRegistration(fail_unregister=fail_at)
    with MappedShards(layout) as mapping:
        registered = RegisteredMapping(mapping, torch.device("cpu"), calls=injected.calls)
        assert len(injected.live) == 4
        with pytest.raises(RegistrationError, match="cudaHostUnregister"):
            registered.close()
        order = [r.addr for r in mapping.regions][::-1]
        assert injected.unregistered == order[:fail_at] + order[fail_at + 1 :]
        assert injected.live == {} and injected.unregister_calls == 4
        registered.close()
        assert injected.unregister_calls == 4


def test_registered_mode_serves_through_the_device_pointers(layout, machine, check_rows):
    injected = machine(H200)
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "registered"
        assert "PageableMemoryAccessUsesHostPageTables" in table.report.reasons["ats"]
        assert len(injected.live) == 4
        # The kernel's bases point into the aliases, not into the table's own mapping.
        aliases = [(a, a + n) for a, n in injected.live.values()]
        for index, owned in table.mapping.owned.items():
            base = int(table.paths.gpu.bases[index]) + owned.lo * layout.row_bytes
            assert any(a <= base < b for a, b in aliases)
        for out_dtype in (None, torch.bfloat16, torch.float32):
            check_rows(table.lookup(all_ids(layout), out_dtype=out_dtype), layout, all_ids(layout))
        assert table.stats()["pinned_bytes"] == table.mapping.mapped_bytes
    # close(): unregistered in reverse order, before the mapping went away.
    assert injected.live == {} and injected.unregistered == injected.registered[::-1]
    assert injected.mapping_open_at_unregister == [True] * 4


@pytest.mark.parametrize("call", ["register", "device_pointer"])
def test_auto_falls_back_to_cpu_when_registration_fails(layout, machine, call, check_rows):
    injected = machine(H200, **{"fail_register" if call == "register" else "fail_pointer": 2})
    before = len(ops._TABLES)
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu"
        why = table.report.reasons["registered"]
        assert why.startswith("RegistrationError: ")
        if call == "register":
            assert "cudaHostRegister" in why and layout.files[2] in why
        else:
            assert "cudaHostGetDevicePointer" in why
        assert injected.live == {} and injected.unregistered == injected.registered[::-1]
        assert len(ops._TABLES) == before + 1  # the rejected attempt's handle is gone
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
        assert table.stats()["pinned_bytes"] == 0
        # The rejected try, now garbage, releases nothing of the mappings it shared with this table.
        gc.collect()
        assert drain(60)
        assert not table.mapping.closed
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))


def test_forced_registered_mode_whose_registration_fails_is_unavailable(layout, machine, monkeypatch):
    before = len(ops._TABLES)
    for how in ("argument", "knob"):
        injected = machine(H200, fail_register=3)
        if how == "knob":
            monkeypatch.setenv("PLE_UM_MODE", "registered")
        with pytest.raises(ModeUnavailableError) as info:
            ple_um.open_table(layout.directory, **({"mode": "registered"} if how == "argument" else {}))
        assert info.value.mode == "registered"
        assert info.value.reason.startswith("RegistrationError: cudaHostRegister")
        assert layout.files[3] in info.value.reason
        assert injected.live == {}
        nothing_left(layout, before)


# -- the pin budget --------------------------------------------------------------------------------
def test_a_table_over_the_pin_budget_is_not_registered(layout, machine, monkeypatch, check_rows):
    # decide()'s side is in tests/access/test_probe.py (test_table_over_the_pin_budget_falls_back_to_cpu,
    # test_forced_registered_over_budget_raises); this goes through open_table and the knob.
    injected = machine(H200)
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1KiB")
    with ple_um.open_table(layout.directory) as table:
        assert table.mapping.mapped_bytes > 1024
        assert table.mode == "cpu" and table.report.pin_budget == 1024
        why = table.report.reasons["registered"]
        assert "pin budget" in why and "PLE_UM_PIN_BUDGET" in why and "PLE_UM_PIN_FRACTION" in why
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
    before = len(ops._TABLES)
    with pytest.raises(ModeUnavailableError, match="PLE_UM_PIN_BUDGET") as info:
        ple_um.open_table(layout.directory, mode="registered")
    assert "pin budget" in info.value.reason
    assert injected.register_calls == 0  # refused before anything was pinned
    nothing_left(layout, before)
    # A budget the table fits in lets it register.
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1MiB")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "registered"


def test_the_pin_budget_reason_tells_the_two_sizes_apart(layout, machine, monkeypatch):
    machine(H200)
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1KiB")
    with ple_um.open_table(layout.directory) as table:
        why = table.report.reasons["registered"]
    table_size = why.split("the table (", 1)[1].split(")", 1)[0]
    budget = why.split("pin budget (", 1)[1].split(")", 1)[0]
    assert table_size != budget, why


# -- a shard file missing or unreadable at open ----------------------------------------------------
def _make_special(path: str, kind: str) -> None:
    os.unlink(path)
    if kind == "dangling symlink":
        os.symlink(path + ".gone", path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        raise AssertionError(kind)


def outcome_unless_blocked(call, fifo: str, *, what: str, patience: float = 60.0):
    """What ``call()`` returns or raises, run in a thread. A call still running after ``patience``
    seconds is blocked (an open of ``fifo`` without O_NONBLOCK waits for a writer forever): the
    test fails, after opening ``fifo`` for writing, which releases the open so the thread ends."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=patience)
    blocked = worker.is_alive()
    if blocked and stat.S_ISFIFO(os.lstat(fifo).st_mode):
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        worker.join(timeout=patience)
        os.close(fd)
    assert not blocked, f"{what} blocked"
    return outcome[0]


@pytest.mark.parametrize("kind", ["missing", "dangling symlink", "directory", "fifo"])
def test_a_shard_file_missing_or_unreadable_at_open(layout, kind):
    # Permission bits cannot be tested here (root reads any file); a directory, a dangling symlink
    # and a FIFO in the file's place fail the same open/fstat checks a permission error would.
    path = layout.files[2]
    if kind == "missing":
        os.unlink(path)
    else:
        _make_special(path, kind)
    before = len(ops._TABLES)
    for mode in ("auto", "cpu", "ats", "device"):
        error = outcome_unless_blocked(
            lambda mode=mode: ple_um.open_table(layout.directory, mode=mode, device="cpu"),
            path,
            what=f"open_table(mode={mode!r}) with a {kind} in place of a shard file",
        )
        assert isinstance(error, CheckpointError), error
        # Named: the file itself, or the index entry that names it (missing files are found there).
        assert os.path.basename(path) in str(error)
        assert error.path in (path, os.path.join(layout.directory, "model.safetensors.index.json"))
        assert isinstance(error, ValueError)
    nothing_left(layout, before)


@pytest.mark.parametrize("kind", ["dangling symlink", "directory"])
def test_a_shard_file_gone_between_header_and_mapping(layout, kind):
    # The headers were read (read_layout), then the third file went away before it was mapped: the
    # first two mappings and their descriptors are released.
    path = layout.files[2]
    _make_special(path, kind)
    with pytest.raises(CheckpointError) as info:
        MappedShards(layout)
    assert info.value.path == path
    assert not maps_of(layout.files) and not fds_of(layout.files)


def test_a_fifo_in_place_of_a_shard_after_its_header_was_read_does_not_block(layout):
    path = layout.files[2]
    _make_special(path, "fifo")
    outcome = outcome_unless_blocked(lambda: MappedShards(layout).close(), path, what="MappedShards")
    assert isinstance(outcome, CheckpointError), outcome


def test_an_open_whose_fit_thread_cannot_start_raises_that_and_releases_all(layout, monkeypatch):
    """An open whose fit-check thread cannot start (a process out of threads: ``Thread.start``
    refused, injected in the standard library) raises that error and releases what it built: no
    mapping, descriptor or handle is left, and no release is said to have failed (its join of the
    thread that never started raised, and the release kept the mappings until exit)."""
    start = threading.Thread.start

    def start_unless_fit(self):
        if self.name == "ple-um-fit":
            raise RuntimeError("can't start new thread (injected)")
        return start(self)

    monkeypatch.setenv("PLE_UM_FIT", "auto")
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "1")
    monkeypatch.setattr(threading.Thread, "start", start_unless_fit)
    before, kept = len(ops._TABLES), len(ple_um.table._KEPT_AFTER_FAILED_CLOSE)
    with pytest.raises(RuntimeError, match=r"can't start new thread \(injected\)"):
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    nothing_left(layout, before)
    assert len(ple_um.table._KEPT_AFTER_FAILED_CLOSE) == kept


_RELEASE_THREAD_REFUSED = """
import gc, sys, threading, ple_um
sys.path.insert(0, sys.argv[2])
from helpers.dropped_tables import drain
start = threading.Thread.start
def start_unless_release(self):
    if self.name == "ple-um-dropped":
        raise RuntimeError("can't start new thread (injected)")
    return start(self)
threading.Thread.start = start_unless_release
try:
    ple_um.open_table(sys.argv[1], mode="cpu", device="cpu")
except RuntimeError as exc:
    print("open failed:", exc, flush=True)
threading.Thread.start = start
table = ple_um.open_table(sys.argv[1], mode="cpu", device="cpu")
del table
gc.collect()
print("dropped table released:", drain(timeout=30), flush=True)
"""


def test_a_release_thread_that_could_not_start_is_started_later(layout):
    """The thread that releases tables dropped without ``close()`` starts with a process's first
    table. Where it cannot start (``Thread.start`` refused, injected in the standard library) that
    open raises the error; the thread is not taken as running: the next open starts it, and a table
    dropped then is released (no release thread ran, and nothing dropped was ever released). In a
    child process, whose first table this is."""
    env = {**os.environ, "PLE_UM_SELF_TEST_ROWS": "0"}
    env.pop("TRITON_INTERPRET", None)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _RELEASE_THREAD_REFUSED, layout.directory, tests],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert "open failed: can't start new thread (injected)" in done.stdout
    assert "dropped table released: True" in done.stdout, done.stdout


# -- the files replaced, rewritten or truncated after open -----------------------------------------
def _flip(data: bytearray, layout, path: str) -> bytearray:
    for spec in layout.shards:
        if spec.path == path:
            for k in range(spec.offset, spec.offset + spec.rows * layout.row_bytes):
                data[k] ^= 0x01
    return data


def _swap(layout, path: str, *, rewrite: bool = False) -> None:
    """Put another file in ``path``: the same header, other rows; renamed into place (a new inode),
    or with ``rewrite`` written over the same inode (a new modification time)."""
    with open(path, "rb") as f:
        data = _flip(bytearray(f.read()), layout, path)
    if rewrite:
        time.sleep(0.01)  # a modification time the clock can tell from the first
        with open(path, "r+b") as f:
            f.write(data)
        return
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


@pytest.mark.parametrize("rewrite", [False, True], ids=["renamed", "rewritten"])
@pytest.mark.parametrize("mode", ["cpu", "ats", "device"])
def test_a_file_swapped_between_header_and_mapping_is_refused(layout, mode, rewrite, monkeypatch):
    """The mapping maps the file whose header was read: another file put in its place between the
    two (the same header, other rows) is a CheckpointError naming it, not a table serving other
    rows under the old header's offsets."""
    path = layout.files[1]
    read = ple_um.opening.read_layout

    def read_then_swap(directory, layer=None):
        found = read(directory, layer)
        _swap(found, path, rewrite=rewrite)
        return found

    monkeypatch.setattr(ple_um.opening, "read_layout", read_then_swap)
    before = len(ops._TABLES)
    with pytest.raises(
        CheckpointError, match=r"changed after its header was read \((inode|mtime_ns)"
    ) as info:
        ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert info.value.path == path
    assert not maps_of(layout.files) and not fds_of(layout.files) and len(ops._TABLES) == before


def test_a_file_swapped_before_its_scale_is_read_is_refused(layout, monkeypatch):
    """The global scale's bytes come from the file whose header named them, too."""
    from ple_um.checkpoint import validation

    read_bytes = validation.read_bytes

    def swap_then_read(path, offset, length, *identity):
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[offset : offset + length] = bytes(length)  # a scale of 0.0, where it is read
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)
        return read_bytes(path, offset, length, *identity)

    monkeypatch.setattr(validation, "read_bytes", swap_then_read)
    with pytest.raises(CheckpointError, match=r"cannot read the scale: .*changed after its header was read"):
        read_layout(layout.directory)


@pytest.mark.parametrize("mode", ["cpu", "ats", "device", "registered"])
def test_a_file_replaced_after_open_keeps_serving_the_bytes_mapped(layout, mode, machine, expected_rows):
    # A re-download or a sync that replaces the file by rename gives it a new inode: the mapping
    # (and the registration's alias, and the device copy) keep the old one. Nothing can tear.
    if mode == "registered":
        machine(H200)
    ids = all_ids(layout)
    old = expected_rows(layout, ids)
    path = layout.files[1]
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        with open(path, "rb") as f:
            data = _flip(bytearray(f.read()), layout, path)
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)
        assert table.mapping.changed_files() == [path]  # detectable without reading the data
        assert not torch.equal(expected_rows(layout, ids).view(torch.uint8), old.view(torch.uint8))
        for _ in range(3):
            assert torch.equal(table.lookup(ids).view(torch.uint8), old.view(torch.uint8))
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:  # reopened: the new bytes
        assert torch.equal(table.lookup(ids).view(torch.uint8), expected_rows(layout, ids).view(torch.uint8))


@pytest.mark.parametrize("mode", ["cpu", "ats"])
def test_a_file_rewritten_in_place_after_open_is_seen_and_detected(layout, mode, check_rows):
    # Writing into the same inode changes the shared page cache that the mapping shows: rows read
    # afterwards are the new bytes (rows read while the write runs may be torn). The change shows
    # in the modification time.
    path = layout.files[0]
    with ple_um.open_table(layout.directory, mode=mode, device="cpu") as table:
        with open(path, "rb") as f:
            data = _flip(bytearray(f.read()), layout, path)
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse clocks: make it differ
        assert table.mapping.changed_files() == [path]
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))


def test_a_file_truncated_after_open_is_detected_and_kills_only_the_reader(make_checkpoint, tmp_path):
    # The one fault open-time checks cannot catch: pages of a shared file mapping that now lie past
    # the end of the file raise SIGBUS when read. A child process opens the table, truncates the
    # file and looks up rows past the new end; it must die of SIGBUS. The parent, which has the
    # same file mapped, sees the change through changed_files() and is fine as long as it reads
    # only rows still inside the file.
    layout = make_checkpoint(num_rows=2048, row_dim=512, dtype="fp8", shards=4, files=1)
    (path,) = layout.files
    keep = layout.shards[0].offset + 1024 * layout.row_bytes  # rows >= 1024 lie past the new end
    child = textwrap.dedent(
        f"""
        import os, torch, ple_um
        table = ple_um.open_table({layout.directory!r}, mode="cpu", device="cpu")
        ids = torch.arange(1500, 1600)
        table.lookup(ids)
        print("read before truncation", flush=True)
        os.truncate({path!r}, {keep})
        print("changed:", table.mapping.changed_files(), flush=True)
        table.lookup(ids)
        print("read after truncation", flush=True)
        """
    )
    env = {**os.environ, "PLE_UM_SELF_TEST_ROWS": "0"}
    env.pop("TRITON_INTERPRET", None)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        done = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr[-3000:])
        assert "read before truncation" in done.stdout
        assert f"changed: [{path!r}]" in done.stdout
        assert "read after truncation" not in done.stdout
        # The parent: the change is detected, the rows still in the file read right, close is clean.
        assert os.path.getsize(path) == keep
        assert table.mapping.changed_files() == [path]
        ids = torch.arange(0, 1000)
        assert np.array_equal(table.lookup(ids).view(torch.uint8).numpy(), reference_rows(layout, ids))
    # Reopening refuses the short file, naming it.
    with pytest.raises(CheckpointError) as info:
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    assert info.value.path == path


# -- tables dropped without close() ----------------------------------------------------------------
def _fds_and_maps() -> tuple[int, int]:
    with open("/proc/self/maps") as f:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in f)


def _settled(files: list[str], limit: tuple[int, int] = (1 << 30, 1 << 30), patience: float = 60.0):
    """The counts once no descriptor or mapping of ``files`` is left and they are back within
    ``limit`` (dropped tables are released on a thread of their own, a moment later: on a busy
    machine, many moments), or as they are after ``patience`` seconds."""
    end = time.monotonic() + patience
    while True:
        gc.collect()
        now = _fds_and_maps()
        released = not fds_of(files) and not maps_of(files)
        if (released and now[0] <= limit[0] and now[1] <= limit[1]) or time.monotonic() > end:
            return now
        time.sleep(0.05)


def test_tables_dropped_without_close_are_released(layout, expected_rows):
    """200 tables opened, looked up in and dropped (no close()): descriptors and mappings stay flat,
    the dropped tables' handles raise TableClosedError through the torch ops, a live one's serve."""
    ids = torch.arange(layout.num_rows)
    want = expected_rows(layout, ids).view(torch.uint8)

    def cycle() -> int:
        table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")
        assert torch.equal(table.lookup(ids).view(torch.uint8), want)
        handle = table.handle
        del table
        gc.collect()
        return handle

    for _ in range(3):  # what the first opens of a process make once (the row copy's library, ...)
        cycle()
    # Counted once the last of those is released: counted while its release is under way, the
    # figures would hold its descriptors and mappings, and the 200 tables' could be left over.
    before = _settled(layout.files)
    handles = [cycle() for _ in range(200)]
    # Flat: a few map lines of slack for thread stacks and malloc arenas the C library keeps.
    after = _settled(layout.files, (before[0], before[1] + 16))
    assert after[0] <= before[0] and after[1] <= before[1] + 16, (before, after)
    assert not fds_of(layout.files) and not maps_of(layout.files)
    for handle in handles[-3:]:
        with pytest.raises(TableClosedError):
            ops.lookup(ids, handle, layout.dtype)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as live:
        assert torch.equal(ops.lookup(ids, live.handle, layout.dtype).view(torch.uint8), want)


@pytest.mark.parametrize("mode", ["ats", "device"])
def test_a_table_of_any_mode_dropped_without_close_is_released(layout, mode):
    table = ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert maps_of(layout.files)
    del table
    gc.collect()
    deadline = time.monotonic() + 60
    while (maps_of(layout.files) or fds_of(layout.files)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not maps_of(layout.files) and not fds_of(layout.files)


# -- close() racing lookups --------------------------------------------------------------------------
def test_use_after_close_and_double_close(layout):
    # Every mode, and the torch ops by handle, are in test_table.py::test_close; this adds a close
    # from several threads at once.
    table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def close() -> None:
        barrier.wait()
        try:
            table.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and table.closed
    assert not maps_of(layout.files) and not fds_of(layout.files)
    table.close()
    with pytest.raises(TableClosedError):
        table.lookup(torch.tensor([1]))


def test_a_close_that_fails_keeps_the_mappings(layout, monkeypatch):
    """close() whose release fails (injected in the host path's release, as a CUDA error would):
    the error reaches the caller and the files stay mapped (a host thread may still read them);
    the table is closed to new lookups, and a second close() returns."""
    from ple_um import table as table_module

    monkeypatch.setattr(table_module, "_KEPT_AFTER_FAILED_CLOSE", [])
    table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")

    def failing() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(table.paths.host, "close", failing)  # inside the release, as a CUDA error would
    with pytest.raises(RuntimeError, match="injected"):
        table.close()
    assert table.closed and maps_of(layout.files)
    assert [kept[1] for kept in table_module._KEPT_AFTER_FAILED_CLOSE] == [table.mapping]
    assert not table.mapping.closed
    table.close()
    with pytest.raises(TableClosedError):
        table.lookup(torch.tensor([1]))
    table.mapping.close()  # (the test's own clean-up: the process goes on)


@pytest.mark.parametrize("fails", ["LookupMetrics", "watch"])
def test_a_table_that_fails_to_finish_is_released_once(layout, monkeypatch, fails):
    """MappedTable failing as it finishes (its metrics, its watch: injected): the open releases the
    mode and the mappings once; no handle stays registered, no release is left to run when the
    half-made table is dropped."""
    from ple_um import metrics, opening
    from ple_um import table as table_module

    releases, finalizers = [], []
    release_mode, on_drop = table_module.release_mode, dropped.on_drop

    def counted(*args):
        releases.append(args)
        release_mode(*args)

    def failing(*args, **kwargs):
        raise RuntimeError(f"{fails} failed (injected)")

    monkeypatch.setattr(opening, "release_mode", counted)
    monkeypatch.setattr(table_module, "release_mode", counted)
    monkeypatch.setattr(
        dropped, "on_drop", lambda *a, **k: finalizers.append(on_drop(*a, **k)) or finalizers[-1]
    )
    monkeypatch.setattr(metrics, fails, failing)
    before = len(ops._TABLES)
    with pytest.raises(RuntimeError, match="injected") as caught:  # its traceback holds the table
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    assert not any(f.alive for f in finalizers), "a release is left for the half-made table"
    del caught
    gc.collect()
    assert drain(60)
    assert len(releases) == 1
    nothing_left(layout, before)


def test_a_blocked_stream_at_open_is_raised_without_a_release(layout, monkeypatch):
    """The dispatcher's check found a stream blocked for good (injected here): open_table raises
    it at once, no other mode tried, and never releases through the device (its synchronize would
    wait for ever): the mode it built is released waiting for no stream (nothing of it is queued);
    the files are unmapped (no host thread reads them)."""
    from ple_um import opening
    from ple_um.lookup.host.cuda import StreamBlockedError

    released, built = [], []

    def blocked(access, *args, **kwargs):
        built.append(access.mode)
        raise StreamBlockedError("a stream ... stays blocked (injected)")

    def release(device, access, paths, *mappings, streams=None):
        released.append((access.mode, streams))
        access.close()

    monkeypatch.setattr(opening, "build_paths", blocked)  # where the host gather checks the signals
    monkeypatch.setattr(opening, "release_mode", release)
    for mode in ("auto", "cpu"):
        with pytest.raises(StreamBlockedError, match="injected"):
            ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert len(built) == 2 and released == [(m, set()) for m in built]
    assert not maps_of(layout.files)


@pytest.mark.parametrize("mode", ["registered", "cpu"])
def test_a_blocked_stream_at_open_leaves_nothing_the_mode_built(layout, machine, monkeypatch, mode):
    """The signals' check finds a stream blocked for good (injected in the build where it comes on a
    GPU: before the fit checks are made, the paths built): the open raises it once what the mode
    built is released, with no wait for the device: the registrations undone before the files are
    unmapped, the host path's reader of misses closed (no descriptor of the files, no reader
    thread), the table counted in no fit; checked while the error, with the frames of the open, is
    still held."""
    from helpers.rowcopy_jobs import reader_threads

    from ple_um.lookup import fit_watch
    from ple_um.lookup.host.cuda import StreamBlockedError
    from ple_um.lookup.open_tables import OPEN_TABLES

    injected = machine(H200)
    monkeypatch.setenv("PLE_UM_FILE_READS", "threads")  # the cpu mode's reader holds the files open
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "64KiB")

    def blocked(*args, **kwargs):
        raise StreamBlockedError("a stream ... stays blocked (injected)")

    monkeypatch.setattr(fit_watch, "FitWatch", blocked)
    before, counted = len(ops._TABLES), len(OPEN_TABLES._tables)
    with pytest.raises(StreamBlockedError, match="injected") as caught:
        ple_um.open_table(layout.directory, mode=mode, device="cpu")
    assert caught.traceback  # held: what only its frames kept would be left still
    assert bool(injected.registered) == (mode == "registered")
    assert injected.unregistered == injected.registered[::-1], "a registration survived the failed open"
    assert all(injected.mapping_open_at_unregister)
    nothing_left(layout, before)
    assert len(OPEN_TABLES._tables) == counted and reader_threads() == 0


def test_a_rejected_mode_whose_release_fails_keeps_the_mappings(layout, monkeypatch):
    """As close() does: a release that fails (a CUDA error) leaves the files mapped until exit."""
    from ple_um import opening
    from ple_um import table as table_module
    from ple_um.access.build import ModeAccess

    monkeypatch.setattr(table_module, "_KEPT_AFTER_FAILED_CLOSE", [])

    def failing_close(self):
        raise RuntimeError("CUDA error (injected)")  # a release that fails, as after a CUDA error

    def rejected(*args, **kwargs):
        raise ValueError("this mode does not build (injected)")

    monkeypatch.setattr(ModeAccess, "close", failing_close)
    monkeypatch.setattr(opening, "build_paths", rejected)
    with pytest.raises(RuntimeError, match="CUDA error"):
        ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    assert maps_of(layout.files) and len(table_module._KEPT_AFTER_FAILED_CLOSE) == 1
    for _, mapping, _ in table_module._KEPT_AFTER_FAILED_CLOSE:
        mapping.close()  # (the test's own clean-up)


class _HeldLibrary:
    """The C row copy with its lookup held at the start (the real copy, started a little late)."""

    def __init__(self, lib, held):
        self._lib, self._held = lib, held

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def ple_lookup_run(self, job):
        self._held()
        return self._lib.ple_lookup_run(job)


@pytest.mark.parametrize("rowcopy", ["1", "0"])
def test_close_waits_for_a_lookup_in_flight(make_checkpoint, check_rows, monkeypatch, rowcopy):
    # The lookup is held inside its read of the mapping (the real read, started a little late) while
    # close() runs in another thread. Allowed outcomes: the lookup finishes with the right rows (close
    # waited), or it raises TableClosedError. Nothing else. Both host paths: the C row copy and the
    # synchronous one.
    monkeypatch.setenv("PLE_UM_ROWCOPY", rowcopy)
    layout = make_checkpoint(num_rows=3000, row_dim=16, dtype="bf16", shards=6, files=3)
    table = ple_um.open_table(layout.directory, mode="cpu", device="cpu")
    inside, closing = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        closing.wait(10)
        time.sleep(0.3)  # close() has run by now, unless it waits for this lookup

    if rowcopy == "1":
        table.paths.host.lib = _HeldLibrary(table.paths.host.lib, hold)
    else:
        read = table.paths.host.rows.read

        def held_read(ids):
            hold()
            return read(ids)

        table.paths.host.rows.read = held_read
    ids = torch.arange(0, 3000, 7)
    outcome: list = []

    def look() -> None:
        try:
            outcome.append(table.lookup(ids))
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    worker = threading.Thread(target=look)
    worker.start()
    assert inside.wait(30)
    closing.set()
    table.close()
    worker.join(timeout=60)
    assert table.closed and not maps_of(layout.files)
    (result,) = outcome
    if isinstance(result, torch.Tensor):
        check_rows(result, layout, ids)
    else:
        assert isinstance(result, TableClosedError), repr(result)


_CLOSE_RACE = """
import collections, json, sys, threading, time
import torch, ple_um
directory, seconds = sys.argv[1], float(sys.argv[2])
seen = collections.Counter()
end = time.monotonic() + seconds
rounds = 0
# Big lookups (the C copy's pool) first, then small ones (read on the calling thread).
for n in (20000, 300):
    while time.monotonic() < end and set(seen) <= {"TableClosedError"}:
        rounds += 1
        table = ple_um.open_table(directory, mode="cpu", device="cpu")
        started = threading.Barrier(5)
        def look(seed):
            g = torch.Generator().manual_seed(seed)
            started.wait()
            while True:
                try:
                    table.lookup(torch.randint(0, 200000, (n,), generator=g))
                except Exception as exc:
                    seen[type(exc).__name__] += 1
                    return
        threads = [threading.Thread(target=look, args=(rounds * 8 + k,)) for k in range(4)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.02)
        table.close()
        for t in threads:
            t.join()
    end += seconds / 2
print(json.dumps({"rounds": rounds, "errors": dict(seen)}), flush=True)
"""


def test_close_during_concurrent_lookups_never_crashes(tmp_path):
    # A child process (a crash must not take the test run with it) opens a 200,000-row table, starts
    # 4 threads looking up without pause, closes the table under them, and repeats for a few seconds.
    # Every lookup must either succeed or raise TableClosedError, and the child must exit normally.
    write_checkpoint(tmp_path / "ckpt", num_rows=200000, row_dim=64, dtype="fp8", shards=8)
    env = {**os.environ, "PLE_UM_SELF_TEST_ROWS": "0", "PLE_UM_CPU_THREADS": "2"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_RACE, str(tmp_path / "ckpt"), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, f"child died with {done.returncode}: {done.stderr[-2000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["errors"]) <= {"TableClosedError"}, result


def test_prefetch_futures_outlive_close_safely(make_checkpoint, monkeypatch):
    # close() waits for the prefetch threads: a prefetch submitted just before close has finished
    # (or failed with TableClosedError), never read unmapped memory or a released row cache (the
    # cpu mode's prefetch with a row cache reads the rows into it).
    layout = make_checkpoint(num_rows=20000, row_dim=64, dtype="fp8", shards=4, files=2)
    for mode, row_cache in (("cpu", "0"), ("cpu", "1MiB"), ("ats", "0")):
        monkeypatch.setenv("PLE_UM_ROW_CACHE", row_cache)
        table = ple_um.open_table(layout.directory, mode=mode, device="cpu")
        assert (table.stats()["row_cache"] is not None) is (row_cache != "0")
        futures = [table.prefetch(torch.arange(k, 20000, 3)) for k in range(8)]
        table.close()
        for future in futures:
            assert future.done()
            assert future.exception() is None or isinstance(future.exception(), TableClosedError)
        with pytest.raises(TableClosedError):
            table.prefetch(torch.arange(10))


# -- knobs that disagree with the machine ------------------------------------------------------------
def test_ats_populate_registers_and_releases_on_a_coherent_machine(layout, machine, monkeypatch, check_rows):
    # PLE_UM_ATS_POPULATE: on a Grace system registration only populates. The ats kernel keeps
    # reading the mapping's host addresses; the registration is released at close.
    injected = machine(GH200)
    monkeypatch.setenv("PLE_UM_ATS_POPULATE", "1")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "ats" and len(injected.live) == 4
        assert table.paths.gpu.bases.tolist() == table.mapping.host_bases()
        check_rows(table.lookup(all_ids(layout)), layout, all_ids(layout))
        assert table.stats()["pinned_bytes"] == 0  # counted as pinned only in registered mode
    assert injected.live == {} and injected.mapping_open_at_unregister == [True] * 4
    # Populate failing is the ats mode failing: auto falls through to registered, then cpu.
    injected = machine(GH200, fail_register="all")
    with ple_um.open_table(layout.directory) as table:
        assert table.mode == "cpu"
        assert table.report.reasons["ats"].startswith("RegistrationError")
        assert table.report.reasons["registered"].startswith("RegistrationError")
    assert injected.live == {}


def test_a_checkpoint_directory_removed_after_open_keeps_serving(layout, check_rows):
    # The mapping holds the inodes: removing the whole directory changes nothing for the open table.
    ids = all_ids(layout)
    copy = layout.directory + ".copy"
    shutil.copytree(layout.directory, copy)
    moved = read_layout(copy)
    with ple_um.open_table(copy, mode="cpu", device="cpu") as table:
        expect = reference_rows(moved, ids)
        shutil.rmtree(copy)
        assert sorted(table.mapping.changed_files()) == sorted(moved.files)
        assert np.array_equal(table.lookup(ids).view(torch.uint8).numpy(), expect)
