"""Decide by fit, and keep deciding (``ple_um/lookup/fit.py``, ``access.memory.fits``): on the
injected Grace (ATS) and HMM machines and the injected H200 (registered), the kernels under the
Triton interpreter, real files, real mmap. The memory this process may use is injected
(``memory_left``: MemAvailable and the cgroup's room as ``access.memory`` reads them), and once in a
child process under a real memory cgroup. Every row is compared with the reference reader, outputs
poisoned, shard edges, ids outside the owned range and the table included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from helpers.cgroup import run_limited
from helpers.machines import GH200, H200, HMM
from helpers.populate_fails import PopulateFails
from helpers.reference import drop_page_cache, fds_of, reference_rows
from helpers.rowcopy_jobs import boundary_ids, in_forked_child

import ple_um
from ple_um.access import memory
from ple_um.errors import KnobError
from ple_um.lookup import fit, fit_watch
from ple_um.lookup.fit import Verdict, choose
from ple_um.lookup.gpu_gather import GpuGather
from ple_um.mapping import PAGE
from ple_um.residency import evict_pages

MiB = 1 << 20
HMM_CPU = dataclasses.replace(HMM, device="cpu", name="NVIDIA RTX PRO 6000 (HMM, injected)")
OWNED = (1500, 18500)  # of 20 000 rows in 4 shards of 5 000: two shard edges inside, two outside


class MemoryLeft:
    """What ``access.memory`` reads as MemAvailable and the cgroups' room, set by the test;
    ``forced``: the fit's verdict itself (a registered table's pages are pinned: it always fits)."""

    def __init__(self, machine: int, group: int | None = None) -> None:
        self.machine, self.group = machine, group
        self.forced: tuple[bool, str] | None = None


@pytest.fixture
def memory_left(monkeypatch):
    left = MemoryLeft(64 << 30)
    fits = memory.fits
    monkeypatch.setattr(memory, "mem_available", lambda: left.machine)
    monkeypatch.setattr(memory, "cgroup_headroom", lambda *a, **k: left.group)
    monkeypatch.setattr(memory, "fits", lambda *a, **k: left.forced or fits(*a, **k))
    return left


@pytest.fixture
def table_files(make_checkpoint, rng):
    """FP8 rows of 160 bytes (a GX10 table's), 20 000 of them in 4 shards over 2 files: 3 MiB."""
    return make_checkpoint(
        num_rows=20000, row_dim=160, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )


def another_table(make_checkpoint, rng):
    """A table of ``table_files``' shape, other rows in other files."""
    return make_checkpoint(
        num_rows=20000, row_dim=160, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )


def evict(table) -> None:
    """The table's pages out of this process and out of the page cache."""
    for m in (table.mapping, table.scale_mapping):
        if m is not None:
            evict_pages(m.layout.files, m.regions)


def resident(table) -> int:
    return sum(r for _, r, _ in table.mapping.residency())


def planned_lookups(layout, rng, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` lookups of 16 ids (hot ids drawn again and again, plus the edges) and their rows
    from the reference reader (which reads through the page cache: read before any residency is)."""
    hot = rng.integers(OWNED[0], OWNED[1], 24)
    edges = boundary_ids(layout, rng, 0, OWNED)
    planned = []
    for _ in range(count):
        ids = np.concatenate([rng.choice(hot, 12), rng.choice(edges, 4)]).astype(np.int64)
        planned.append((ids, reference_rows(layout, ids, OWNED)))
    return planned


def run_lookups(table, layout, planned, poison) -> None:
    """Each planned lookup into a poisoned output, compared with its reference rows."""
    for k, (ids, expect) in enumerate(planned):
        out = poison(torch.empty((ids.size, layout.row_dim), dtype=layout.dtype))
        table.lookup(torch.from_numpy(ids), out=out)
        assert np.array_equal(out.view(torch.uint8).numpy(), expect), f"lookup {k} differs from the files"


def decode_lookups(table, layout, rng, poison, count: int) -> None:
    run_lookups(table, layout, planned_lookups(layout, rng, count), poison)


def wait_for(table, path: str, timeout: float = 60.0) -> dict:
    """The table's serving figures once its fit checks have switched it to ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        serving = table.stats()["serving"]
        if serving["path"] == path:
            return serving
        time.sleep(0.02)
    raise AssertionError(f"still {table.stats()['serving']} after {timeout} s")


# -- the rule ----------------------------------------------------------------------------------------
def test_fit_counts_machine_memory_the_cgroups_room_and_the_tables_own_pages(memory_left):
    memory_left.machine, memory_left.group = 100 * MiB, None
    assert memory.fits(100 * MiB, 0)[0] and not memory.fits(101 * MiB, 0)[0]
    assert memory.fits(120 * MiB, 0, pinned=20 * MiB)[0]  # pinned pages are not in MemAvailable
    memory_left.group = 10 * MiB  # the group's usage already counts the pages in memory
    assert memory.fits(50 * MiB, 40 * MiB)[0] and not memory.fits(50 * MiB, 39 * MiB)[0]
    ok, why = memory.fits(50 * MiB, 0)
    assert not ok and "do not fit" in why and "10.00 MiB" in why and "MemAvailable 100.00 MiB" in why


def _group_at_its_limit(tmp_path, version: str, mapped: int = 0):
    """A 6 GiB group at its limit, 3 GiB of it page cache on its file lists (v1: the hierarchical
    ``total_`` lines, not the group's own), ``mapped`` of that mapped by processes: its room."""
    GiB = 1 << 30
    group = tmp_path / "cgroup" / ("memory" if version == "v1" else "") / "pod"
    group.mkdir(parents=True)
    limit, usage = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if version == "v1"
        else ("memory.max", "memory.current")
    )
    (group / limit).write_text(str(6 * GiB))
    (group / usage).write_text(str(6 * GiB))
    prefix = "total_" if version == "v1" else ""
    stat = [f"anon {3 * GiB}", f"{prefix}active_file {GiB}", f"{prefix}inactive_file {2 * GiB}"]
    stat.append(f"file_mapped {mapped}" if version == "v2" else f"total_mapped_file {mapped}")
    if version == "v1":  # the group's own: not these
        stat += [f"active_file {GiB // 4}", f"inactive_file {GiB // 4}", f"mapped_file {GiB // 8}"]
    (group / "memory.stat").write_text("\n".join(stat) + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/pod\n" if version == "v1" else "0::/pod\n")
    return functools.partial(memory.cgroup_headroom, str(proc), str(tmp_path / "cgroup"))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroups_room_counts_the_page_cache_it_can_take_back(tmp_path, monkeypatch, version):
    """A group at its limit with 3 GiB of page cache, none mapped: 3 GiB of room; the table's own
    resident pages, which may be among that page cache, are not counted twice by the fit."""
    GiB = 1 << 30
    room = _group_at_its_limit(tmp_path, version)
    assert room() == 3 * GiB and room(resident=GiB) == 2 * GiB and room(resident=4 * GiB) == 0
    monkeypatch.setattr(memory, "cgroup_headroom", room)
    monkeypatch.setattr(memory, "mem_available", lambda: 64 * GiB)
    assert memory.available() == 3 * GiB
    # 3 GiB of the group's is anonymous: a 3 GiB table fits, resident or not, a larger one does not.
    assert (
        memory.fits(3 * GiB, 0)[0] and memory.fits(3 * GiB, 2 * GiB)[0] and memory.fits(3 * GiB, 3 * GiB)[0]
    )
    assert not memory.fits(3 * GiB + PAGE, 0)[0] and not memory.fits(3 * GiB + PAGE, 2 * GiB)[0]


def test_a_v2_groups_memory_high_bounds_its_room_as_its_max_does(tmp_path):
    """A cgroup v2 group throttled at ``memory.high`` (systemd's ``MemoryHigh=``) under its
    ``memory.max``, or with no max: its room is the high limit's, which the kernel reclaims and
    throttles the group's processes past, plus its page cache; the lower of the two binds."""
    GiB = 1 << 30
    room = _group_at_its_limit(tmp_path, "v2")  # 3 GiB of page cache on the file lists
    group = tmp_path / "cgroup" / "pod"
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text(str(4 * GiB))
    (group / "memory.high").write_text(str(5 * GiB))
    assert room() == GiB + 3 * GiB
    (group / "memory.max").write_text(str(8 * GiB))
    assert room() == GiB + 3 * GiB
    (group / "memory.high").write_text("max\n")
    assert room() == 4 * GiB + 3 * GiB
    (group / "memory.max").write_text("max\n")
    assert room() is None


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_page_cache_processes_map_is_not_room(tmp_path, version):
    """1 GiB of the group's 3 GiB of page cache mapped (a CUDA process's libraries and driver files,
    in use): 2 GiB of room; a table's resident pages, read through its mapping, are among the
    mapped ones: only what exceeds the mapped pages is taken off again."""
    GiB = 1 << 30
    room = _group_at_its_limit(tmp_path, version, mapped=GiB)
    assert room() == 2 * GiB
    assert room(resident=GiB // 2) == 2 * GiB and room(resident=2 * GiB) == GiB
    assert room(resident=4 * GiB) == 0
    mapped_all = _group_at_its_limit(tmp_path / "all", version, mapped=3 * GiB)
    assert mapped_all() == 0


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_hierarchy_is_found_where_it_is_mounted(tmp_path, version):
    """The hierarchies where /proc/self/mountinfo mounts them, not at a fixed /sys/fs/cgroup: a
    hybrid system's cgroup2 at ``.../unified`` (v2), the memory controller's own mount (v1), and
    a mount that shows only a part of the hierarchy (a container's: its root a group, whose path
    /proc/self/cgroup gives in full). A tmpfs at the usual place holds no group."""
    GiB = 1 << 30
    _group_at_its_limit(tmp_path, version)  # 3 GiB of room, in tmp_path/cgroup/[memory/]pod
    point = tmp_path / "cgroup" / ("memory" if version == "v1" else "")
    kind, options = ("cgroup", "rw,memory") if version == "v1" else ("cgroup2", "rw,nsdelegate")
    usual = tmp_path / "sys-fs-cgroup"
    (usual / "pod").mkdir(parents=True)  # what a fixed root would read: no limit there
    proc = tmp_path / "proc-cgroup"
    for shown, member in [("/", "/pod"), ("/kube", "/kube/pod")]:
        mountinfo = tmp_path / "mountinfo"
        mountinfo.write_text(
            f"25 1 0:22 / {usual} rw,nosuid - tmpfs tmpfs rw,mode=755\n"
            f"30 25 0:26 {shown} {point} rw,nosuid - {kind} cgroup {options}\n"
        )
        proc.write_text(f"4:memory:{member}\n" if version == "v1" else f"0::{member}\n")
        assert memory.cgroup_headroom(str(proc), mountinfo=str(mountinfo)) == 3 * GiB, shown
        assert memory.cgroup_headroom(str(proc), str(usual), mountinfo=str(mountinfo)) is None
    (tmp_path / "mountinfo").write_text(f"25 1 0:22 / {usual} rw,nosuid - tmpfs tmpfs rw,mode=755\n")
    assert memory.cgroup_headroom(str(proc), mountinfo=str(tmp_path / "mountinfo")) is None  # none mounted


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_hierarchy_mounted_at_a_path_with_blanks_is_found(tmp_path, version):
    """mountinfo writes a path's blanks, tabs and backslashes as octal escapes (``\\040``): the
    hierarchy is read where they say, its mount point and the root it shows both unescaped."""
    GiB = 1 << 30
    base = tmp_path / "a b\tc\\d"
    _group_at_its_limit(base, version)  # 3 GiB of room, in base/cgroup/[memory/]pod
    point = base / "cgroup" / ("memory" if version == "v1" else "")
    kind, options = ("cgroup", "rw,memory") if version == "v1" else ("cgroup2", "rw,nsdelegate")

    def escaped(path) -> str:
        return str(path).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 25 0:26 / {escaped(point)} rw,nosuid - {kind} cgroup {options}\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/pod\n" if version == "v1" else "0::/pod\n")
    assert memory.cgroup_headroom(str(proc), mountinfo=str(mountinfo)) == 3 * GiB
    # A container's mount showing a part of the hierarchy whose name has a blank in it.
    (point / "my pod").mkdir()
    for name in os.listdir(point / "pod"):
        (point / "my pod" / name).write_bytes((point / "pod" / name).read_bytes())
    mountinfo.write_text(f"30 25 0:26 /my\\040pod {escaped(point / 'my pod')} rw - {kind} cgroup {options}\n")
    proc.write_text("4:memory:/my pod\n" if version == "v1" else "0::/my pod\n")
    assert memory.cgroup_headroom(str(proc), mountinfo=str(mountinfo)) == 3 * GiB


def _verdict(fits: bool, margin: bool, share: float, exact: bool = False) -> Verdict:
    return Verdict(1000, int(1000 * share), fits, margin, "test", exact)


def test_the_rule_switches_with_hysteresis():
    kernel = choose(None, _verdict(True, True, 1.0, exact=True), touch_knob="auto", touch_here=True)
    assert (kernel.path, kernel.touch, kernel.switches) == ("kernel", False, 0)
    opened_out = choose(None, _verdict(True, True, 0.5, exact=True), touch_knob="auto", touch_here=True)
    assert (opened_out.path, opened_out.touch) == ("kernel", True)
    assert choose(None, _verdict(True, True, 0.5), touch_knob="auto", touch_here=False).touch is False
    assert choose(None, _verdict(True, True, 1.0), touch_knob="on", touch_here=False).touch is True
    # The kernel gives way as soon as the table does not fit.
    host = choose(kernel, _verdict(False, False, 1.0), touch_knob="auto", touch_here=True)
    assert (host.path, host.switches) == ("host", 1)
    # Back only with the margin to spare.
    assert choose(host, _verdict(True, False, 1.0), touch_knob="auto", touch_here=True).path == "host"
    back = choose(host, _verdict(True, True, 0.2), touch_knob="auto", touch_here=True)
    assert (back.path, back.touch, back.switches) == ("kernel", True, 2)
    # The sampled touch starts past TOUCH_FROM of the pages out, and stops only when none is.
    few_out = 1 - fit.TOUCH_FROM / 2
    assert choose(kernel, _verdict(True, True, few_out), touch_knob="auto", touch_here=True).touch is False
    assert choose(back, _verdict(True, True, few_out), touch_knob="auto", touch_here=True).touch is True
    assert choose(back, _verdict(True, True, 1.0), touch_knob="auto", touch_here=True).touch is False


def test_a_sample_of_pages_estimates_the_residency(make_checkpoint, rng, monkeypatch):
    monkeypatch.setattr(fit, "FULL_SCAN_PAGES", 64)  # sampled from 64 pages on
    layout = make_checkpoint(num_rows=40_000, row_dim=512, dtype="fp8", shards=3)  # 20 MiB
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        evict(table)
        half = table.mapping.regions[0]
        view = np.frombuffer((ctypes_buffer := memoryview_of(half)), dtype=np.uint8)
        int(view[::4096].sum())  # the first file's pages in
        exact, is_exact = fit.resident_bytes(table.mapping.regions)
        assert is_exact and exact >= half.length - 4096
        sampled, is_exact = fit.resident_bytes(
            table.mapping.regions, np.random.default_rng(int(rng.integers(1 << 30)))
        )
        assert not is_exact
        share, mapped = exact / table.mapping.mapped_bytes, table.mapping.mapped_bytes
        assert abs(sampled / mapped - share) < 0.2, (sampled, exact, mapped)
        del view, ctypes_buffer


def memoryview_of(region):
    import ctypes

    return (ctypes.c_ubyte * region.length).from_address(region.addr)


# -- a table larger than its memory --------------------------------------------------------------------
@pytest.mark.parametrize("caps", [GH200, HMM_CPU], ids=["ats", "hmm"])
def test_a_table_over_its_memory_serves_decode_lookups_on_the_host_path(
    table_files, caps, machine, memory_left, rng, poison
):
    layout = table_files
    memory_left.machine = 1 * MiB  # the owned rows (2.6 MiB) do not fit
    drop_page_cache(layout)
    machine(caps)
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and "do not fit" in serving["why"], serving
        assert table.stats()["row_cache"] is not None, table.row_reads
        planned = planned_lookups(layout, rng, 64)
        evict(table)
        before = resident(table)
        run_lookups(table, layout, planned, poison)
        stats = table.stats()
        cache = stats["row_cache"]
        assert cache["hits"] > 0 and cache["misses"] > 0 and stats["file_reads"] > 0, stats
        assert stats["host_lookups"] == 64 and stats["serving"]["page_touches"] == 0
        assert table.paths.gpu.read_counts()["rows"] == 0  # the kernel served none of them
        if table.paths.host.rows.reader.direct:  # misses read around the page cache: no page came in
            assert resident(table) <= before


def test_the_fit_counts_every_open_table_of_the_process(
    table_files, make_checkpoint, machine, memory_left, monkeypatch, rng, poison
):
    """Two tables of 2.6 MiB of owned rows each under 4 MiB of memory: each fits alone, not both. The
    first opened serves on the kernel; the second opened beside it does not fit (the why names
    both tables) and serves on the host path, and so does the first at its next check. The second
    closed, the first fits again, with its margin: the kernel. The bytes of a file that two tables
    map (the whole table beside the first's rows) are counted once; a table dropped without
    ``close`` is no longer counted. Every lookup exact."""
    import gc
    import re

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    first, second = (
        table_files,
        make_checkpoint(
            num_rows=20000, row_dim=160, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
        ),
    )
    machine(GH200)
    memory_left.machine = 4 * MiB
    with ple_um.open_table(first.directory, mode="ats", rows=OWNED) as a:
        assert a.paths.serving.path == "kernel", a.paths.serving
        with ple_um.open_table(first.directory, mode="ats") as same:  # all its rows: a's among them
            assert same.paths.serving.path == "kernel" and not a.paths.fit.check(), same.paths.serving
            assert "open tables" not in same.paths.serving.why and a.paths.serving.path == "kernel"
            whole = sum(r.length for r in same.mapping.regions)  # 3 MiB, with a's 2.6 MiB in it
            counted = re.search(r"2 open tables \(([0-9.]+) MiB", a.paths.serving.why)
            assert counted is not None, a.paths.serving
            # Counted once, but the part of a page an overlap ends inside (under a page a file).
            assert whole - 2 * PAGE - 0.01 * MiB <= float(counted[1]) * MiB <= whole, (counted[1], whole)
        with ple_um.open_table(second.directory, mode="ats", rows=OWNED) as b:
            serving = b.stats()["serving"]
            assert serving["path"] == "host" and "do not fit" in serving["why"], serving
            assert "the owned rows of this process's 2 open tables (5." in serving["why"], serving
            assert a.paths.fit.check() and a.paths.serving.path == "host", a.paths.serving
            decode_lookups(a, first, rng, poison, 4)
            decode_lookups(b, second, rng, poison, 4)
            assert a.paths.gpu.read_counts()["rows"] == 0 == b.paths.gpu.read_counts()["rows"]
        assert a.paths.fit.check() and a.paths.serving.path == "kernel", a.paths.serving
        dropped = ple_um.open_table(second.directory, mode="ats", rows=OWNED)
        assert dropped.paths.serving.path == "host"
        del dropped
        gc.collect()
        assert not a.paths.fit.check() and a.paths.serving.path == "kernel", a.paths.serving
        assert "open tables" not in a.paths.serving.why
        decode_lookups(a, first, rng, poison, 4)
        assert a.paths.gpu.read_counts()["rows"] == 4 * 16


def test_an_open_reads_a_bounded_number_of_the_other_tables_pages(
    make_checkpoint, memory_left, monkeypatch, rng, poison
):
    """Five tables of 3 MiB (800 pages) opened one after another, each counting those open before
    it: the pages each open asks the residency of (mincore, cachestat: its own, every one, and the
    others' as a check samples them, ``fit.FULL_SCAN_PAGES`` cut to 64 here) do not grow with the
    tables open (every page of every table open would: 800 more at each open). The decisions are
    those of the exact figures: evicted tables under a cgroup's room of 3.5 tables' bytes, the first
    three fit, the fourth and fifth do not, each naming the tables it counts. Every lookup exact."""
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")
    monkeypatch.setattr(fit, "FULL_SCAN_PAGES", 64)
    asked: list[int] = []
    count, pages = fit.resident_count, fit.resident_pages

    def counted_count(region):
        asked[-1] += -(-region.length // PAGE)
        return count(region)

    def counted_pages(region, first=0, n=None):
        asked[-1] += -(-region.length // PAGE) - first if n is None else n
        return pages(region, first, n)

    monkeypatch.setattr(fit, "resident_count", counted_count)
    monkeypatch.setattr(fit, "resident_pages", counted_pages)
    layouts = [another_table(make_checkpoint, rng) for _ in range(5)]
    size = sum(os.path.getsize(f) for f in layouts[0].files)
    memory_left.group = int(3.5 * size)
    with contextlib.ExitStack() as stack:
        tables = []
        for k, layout in enumerate(layouts):
            for each in tables:  # what an open read of its own rows (its self-test) out again
                evict(each)
            evict_pages(layout.files)
            asked.append(0)
            table = stack.enter_context(ple_um.open_table(layout.directory, mode="cpu", device="cpu"))
            tables.append(table)
            why = table.paths.serving.why
            assert ("do not fit" in why) == (k >= 3), (k, why)
            assert k == 0 or f"{k + 1} open tables" in why, (k, why)
        own = asked[0]
        assert all(n <= own + fit.SAMPLE_PAGES for n in asked), asked
        for table, layout in zip(tables, layouts, strict=True):
            ids = rng.integers(0, layout.num_rows, 64)
            out = poison(torch.empty((ids.size, layout.row_dim), dtype=layout.dtype))
            table.lookup(torch.from_numpy(ids), out=out)
            assert np.array_equal(out.view(torch.uint8).numpy(), reference_rows(layout, ids))


def test_two_tables_opened_at_once_each_count_the_other(
    table_files, make_checkpoint, memory_left, monkeypatch, rng, poison
):
    """Two tables of 2.6 MiB of owned rows each, under 4 MiB of memory, opened at once on two threads
    in the cpu mode (the kernel's interpreter runs one thread at a time), each open's fit measured
    while the other's is (a barrier in the fit's memory reading holds each until both are there):
    the one measured last counts the other, does not fit and gets a row cache; never both taken to
    fit. At the next check neither fits, and both have a row cache. Every lookup exact."""
    import threading

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    second = another_table(make_checkpoint, rng)
    memory_left.machine = 4 * MiB
    both_measure = threading.Barrier(2, timeout=30)
    waited: set[int] = set()
    fits = memory.fits

    def measured_together(*args, **kwargs):
        if threading.get_ident() not in waited:  # each open's first reading: both at once
            waited.add(threading.get_ident())
            both_measure.wait()
        return fits(*args, **kwargs)

    monkeypatch.setattr(memory, "fits", measured_together)
    opened: dict[str, object] = {}
    failed: list[BaseException] = []

    def open_(name, layout) -> None:
        try:
            opened[name] = ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED)
        except BaseException as exc:  # noqa: BLE001 - raised by the test below
            failed.append(exc)

    threads = [threading.Thread(target=open_, args=x) for x in (("a", table_files), ("b", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(memory, "fits", fits)  # the checks below, one thread
    try:
        assert not failed and len(waited) == 2, failed
        a, b = opened["a"], opened["b"]
        spilled = [t for t in (a, b) if "do not fit" in t.paths.serving.why]
        assert spilled, (a.paths.serving, b.paths.serving)
        assert all("2 open tables" in t.paths.serving.why and t.stats()["row_cache"] for t in spilled)
        for table in (a, b):
            table.paths.fit.check()
            assert "2 open tables" in table.paths.serving.why and "do not fit" in table.paths.serving.why
            assert table.stats()["row_cache"] is not None, table.paths.serving
        decode_lookups(a, table_files, rng, poison, 4)
        decode_lookups(b, second, rng, poison, 4)
    finally:
        for table in opened.values():
            table.close()


def test_an_open_that_fails_moves_no_serving_tables_path(
    table_files, make_checkpoint, machine, memory_left, monkeypatch, rng, poison
):
    """A table of 2.6 MiB of owned rows under 4 MiB of memory, and a second of 6.1 MiB. The
    second's open counts the first, does not fit, and is refused for its row cache
    (``PLE_UM_ROW_CACHE`` past the memory left) after its fit was measured; a check of the first
    made meanwhile (from inside the second's measure, once the second is counted) does not count a
    table whose open has not succeeded: the first stays on the kernel, with no row cache built,
    before the refusal and after it. A table whose open succeeds is counted at the first's next
    check. Every lookup exact."""
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    second = make_checkpoint(
        num_rows=40000, row_dim=160, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )
    machine(GH200)
    memory_left.machine = 4 * MiB
    fits = memory.fits
    seen: dict[str, object] = {}
    with ple_um.open_table(table_files.directory, mode="ats", rows=OWNED) as a:
        assert a.paths.serving.path == "kernel", a.paths.serving

        def check_first_meanwhile(*args, **kwargs):
            if "check" not in seen:
                seen["check"] = True
                seen["switched"] = a.paths.fit.check()
                seen["serving"] = a.paths.serving
            return fits(*args, **kwargs)

        monkeypatch.setattr(memory, "fits", check_first_meanwhile)
        monkeypatch.setenv("PLE_UM_ROW_CACHE", "8MiB")
        with pytest.raises(KnobError, match="PLE_UM_ROW_CACHE"):
            ple_um.open_table(second.directory, mode="ats")
        monkeypatch.setattr(memory, "fits", fits)
        monkeypatch.delenv("PLE_UM_ROW_CACHE")
        assert seen["check"] and not seen["switched"], seen
        assert seen["serving"].path == "kernel" and "open tables" not in seen["serving"].why, seen
        assert not a.paths.fit.check() and a.paths.serving.path == "kernel", a.paths.serving
        assert a.stats()["row_cache"] is None
        decode_lookups(a, table_files, rng, poison, 4)
        assert a.paths.gpu.read_counts()["rows"] == 4 * 16
        with ple_um.open_table(second.directory, mode="ats") as b:
            assert b.paths.serving.path == "host" and "2 open tables" in b.paths.serving.why
            assert a.paths.fit.check() and a.paths.serving.path == "host", a.paths.serving
            assert "2 open tables" in a.paths.serving.why, a.paths.serving
            decode_lookups(a, table_files, rng, poison, 4)
            ids = rng.integers(0, second.num_rows, 64)
            out = poison(torch.empty((ids.size, second.row_dim), dtype=second.dtype))
            b.lookup(torch.from_numpy(ids), out=out)
            assert np.array_equal(out.view(torch.uint8).numpy(), reference_rows(second, ids))


def test_a_measure_reads_the_other_tables_residency_without_holding_their_lock(
    table_files, make_checkpoint, memory_left, monkeypatch, rng, poison
):
    """While a fit check reads the residency of another open table (mincore: slow over a big table),
    a third table opens on another thread without waiting for it, and the other table's close
    waits only until that reading ends (its mappings stay mapped while they are read). The check's
    figures count the tables open when it began."""
    import threading

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    other, third = another_table(make_checkpoint, rng), another_table(make_checkpoint, rng)
    sampled = fit.resident_bytes
    seen: dict[str, object] = {}

    def open_third() -> None:
        seen["third"] = ple_um.open_table(third.directory, mode="cpu", device="cpu", rows=OWNED)

    with (
        ple_um.open_table(table_files.directory, mode="cpu", device="cpu", rows=OWNED) as a,
        ple_um.open_table(other.directory, mode="cpu", device="cpu", rows=OWNED) as b,
    ):
        theirs = {r.addr for r in b.mapping.regions}

        def reading(regions, rng=None):
            if seen or not regions or {r.addr for r in regions} != theirs:
                return sampled(regions, rng)
            seen["reading"] = True  # the third's own measure reads as it is
            opener = threading.Thread(target=open_third)
            opener.start()
            opener.join(10)
            seen["opened meanwhile"] = not opener.is_alive()
            closer = threading.Thread(target=b.close)
            closer.start()
            closer.join(0.3)
            seen["close waited"] = closer.is_alive()
            seen["closer"], seen["opener"] = closer, opener
            return sampled(regions, rng)  # b's mappings still mapped: read as they are

        monkeypatch.setattr(fit, "resident_bytes", reading)
        try:
            a.paths.fit.check()
        finally:
            monkeypatch.setattr(fit, "resident_bytes", sampled)
            for name in ("opener", "closer"):
                if name in seen:
                    seen[name].join(60)
        try:
            assert seen["opened meanwhile"] and seen["close waited"], seen
            assert b.closed and "2 open tables" in a.paths.serving.why, a.paths.serving
            a.paths.fit.check()  # b closed, the third open: counted
            assert "2 open tables" in a.paths.serving.why, a.paths.serving
            decode_lookups(a, table_files, rng, poison, 4)
            decode_lookups(seen["third"], third, rng, poison, 4)
        finally:
            if "third" in seen:
                seen["third"].close()


@contextlib.contextmanager
def held_by_another_thread(enter):
    """The context manager ``enter()`` makes, entered in another thread and held there while the
    with-block runs (a fork made in the block copies it held, by a thread the child lacks)."""
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def hold() -> None:
        with enter() as value:
            seen["value"] = value
            inside.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30)
        yield seen["value"]
    finally:
        done.set()
        holder.join(30)


def test_a_forked_child_waits_for_no_reading_of_its_parents_threads(table_files, make_checkpoint):
    """A process forked while another of its threads reads an open table's mappings (a fit check's
    ``OPEN_TABLES.others``): in the child, which has no such thread, that table's removal (its
    close) does not wait for the reading, nor for the lock, and the child counts the table no more."""
    from ple_um.lookup.open_tables import OPEN_TABLES

    with (
        ple_um.open_table(table_files.directory, mode="cpu", device="cpu", rows=OWNED) as a,
        ple_um.open_table(
            another_table(make_checkpoint, np.random.default_rng(1)).directory, mode="cpu"
        ) as b,
    ):
        (key,) = [k for k, (ms, _) in OPEN_TABLES._tables.items() if b.mapping in ms]
        with held_by_another_thread(lambda: OPEN_TABLES.others([a.mapping])) as read:
            assert any(b.mapping in ms for ms, _ in read)

            def child() -> bool:  # a removal that waits is killed (SIGALRM)
                OPEN_TABLES.remove(key)
                with OPEN_TABLES.others([a.mapping]) as others:
                    return not any(b.mapping in ms for ms, _ in others)

            assert in_forked_child(child) == 0


def test_a_forked_child_closes_a_table_whose_check_held_its_lock(table_files, monkeypatch):
    """A process forked while another of its threads makes a table's fit check (its lock held): in
    the child, which has no such thread, a check of that table can be made and its close waits for
    none of the parent's."""
    import threading
    import types

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test's thread
    holding, done = threading.Event(), threading.Event()

    def monotonic() -> float:  # the check's clock, read under its lock: held there until done
        if threading.current_thread().name == "checker" and not holding.is_set():
            holding.set()
            done.wait(60)
        return time.monotonic()

    with ple_um.open_table(table_files.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        monkeypatch.setattr(fit_watch, "time", types.SimpleNamespace(monotonic=monotonic))
        checker = threading.Thread(target=table.paths.fit.check, name="checker")
        checker.start()
        try:
            assert holding.wait(30) and table.paths.fit._lock.locked()

            def child() -> bool:  # a check or close that waits is killed (SIGALRM)
                table.paths.fit.check()
                table.close()
                return table.closed

            assert in_forked_child(child) == 0
        finally:
            done.set()
            checker.join(30)


def test_a_forked_child_closes_a_table_whose_paths_lock_a_thread_held(table_files):
    """A process forked while another of its threads holds a table's ``adopt`` lock (as the stats
    reporter does while it reads the counts): the child, which has no such thread, closes the
    table."""
    with ple_um.open_table(table_files.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        with held_by_another_thread(lambda: table.paths._lock):

            def child() -> bool:  # a close that waits is killed (SIGALRM)
                table.close()
                return table.closed

            assert in_forked_child(child) == 0


def test_a_forked_child_holds_not_the_sizing_lock_its_parents_build_held():
    """A process forked while another of its threads sizes a row cache (a fit check's build, the
    sizing lock held): once that thread lets the lock go, the parent takes it again at once while
    the child lives (the child's copy of the descriptor does not keep it held), and the child takes
    it at once too (it does not wait its bound out for its own copy)."""
    import signal

    from ple_um import cache_folder, envs
    from ple_um.lookup.host import misses

    path = os.path.join(envs.PLE_UM_CACHE_DIR, "row-cache.lock")
    go_r, go_w = os.pipe()
    with held_by_another_thread(misses.one_sizing_at_a_time) as held:
        assert held is None
        pid = os.fork()
        if pid == 0:  # the child: once the parent has let go and taken the lock again, take it
            code = 1
            try:
                signal.alarm(20)
                os.close(go_w)
                os.read(go_r, 1)
                t0 = time.monotonic()
                with cache_folder.locked(path, 5.0) as why:
                    code = 0 if why is None and time.monotonic() - t0 < 2.0 else 2
            finally:
                os._exit(code)
        os.close(go_r)
    try:  # the thread has let go; the child lives, holding whatever it inherited
        t0 = time.monotonic()
        with cache_folder.locked(path, 2.0) as why:
            waited = time.monotonic() - t0
        assert why is None and waited < 1.0, why
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_check_and_a_close_wait_for_no_host_path_in_build(table_files, machine, memory_left, monkeypatch):
    """The check's thread builds a host path (a row cache) for a table that stopped fitting, and its
    build waits for the sizing lock another process holds: a check made meanwhile (a capture's)
    returns at once, keeping what serves, and so does the table's close; the build, once it ends,
    adopts nothing and leaves no descriptor of the files open."""
    import fcntl
    import threading

    from ple_um import envs

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0.02")
    machine(GH200)
    layout = table_files
    lock = os.open(os.path.join(envs.PLE_UM_CACHE_DIR, "row-cache.lock"), os.O_RDONLY | os.O_CREAT, 0o600)
    guard, held = threading.Lock(), [True]

    def let_go() -> None:  # once: by the timer (a check or close that waits), or at the end
        with guard:
            if held[0]:
                held[0] = False
                os.close(lock)

    release = threading.Timer(8.0, let_go)
    try:
        with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
            paths, watch = table.paths, table.paths.fit
            assert paths.serving.path == "kernel" and paths.row_copy is None
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process's sizing, as the build sees it
            release.start()
            memory_left.machine, memory_left.group = 1 * MiB, None
            evict(table)
            deadline = time.monotonic() + 2
            while getattr(watch, "_builder", None) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            builder = watch._thread
            began = time.monotonic()
            assert watch.check() is False
            assert time.monotonic() - began < 2, "the check waited for the build"
            assert paths.serving.path == "kernel" and paths.row_copy is None
            assert watch._builder == builder.ident, "the check's thread is not building"
        assert time.monotonic() - began < 2, "the close waited for the build"
        assert held[0], "the sizing lock was let go before the close returned"
    finally:
        release.cancel()
        let_go()
    builder.join(30)
    assert not builder.is_alive() and paths.host is None and watch._builder is None
    assert fds_of(layout.files) == []


def test_files_of_two_filesystems_with_one_inode_number_are_both_counted(table_files, make_checkpoint, rng):
    """Two tables' files that share an inode number and modification time but not a filesystem (two
    mounts number their inodes apart): each file's bytes counted, not the second taken for the
    first. The regions are the real mappings, their identity set as two filesystems would give it."""
    import dataclasses as dc

    from ple_um.lookup.open_tables import uncovered

    other = another_table(make_checkpoint, rng)
    with (
        ple_um.open_table(table_files.directory, mode="cpu", device="cpu") as a,
        ple_um.open_table(other.directory, mode="cpu", device="cpu") as b,
    ):
        mine = a.mapping.regions
        theirs = [
            dc.replace(r, st_ino=m.st_ino, st_mtime_ns=m.st_mtime_ns, st_dev=m.st_dev + 1)
            for r, m in zip(b.mapping.regions, mine, strict=True)
        ]
        covered: dict = {}
        assert uncovered(mine, covered) == mine
        parts = uncovered(theirs, covered)
        assert sum(p.length for p in parts) == sum(r.length for r in theirs), (parts, theirs)
        same = [dc.replace(r, st_dev=m.st_dev) for r, m in zip(theirs, mine, strict=True)]
        assert sum(p.length for p in uncovered(same, covered)) < sum(r.length for r in same)  # one file


def test_a_table_that_fits_gets_the_kernel_and_no_row_cache(
    table_files, machine, memory_left, rng, poison, caplog
):
    layout = table_files
    drop_page_cache(layout)  # not in the page cache at open, but it fits
    machine(GH200)
    caplog.set_level(logging.INFO, logger="ple_um.opening")
    with ple_um.open_table(layout.directory, rows=OWNED) as table:
        assert table.mode == "ats"
        (line,) = [r.getMessage() for r in caplog.records if "opened in" in r.getMessage()]
        assert f"decode lookups: {table.stats()['serving']['why']}" in line and ": the kernel" in line
        stats = table.stats()
        assert stats["serving"]["path"] == "kernel" and " fit:" in stats["serving"]["why"], stats["serving"]
        assert stats["row_cache"] is None and table.paths.host is None, table.row_reads
        decode_lookups(table, layout, rng, poison, 8)
        assert table.paths.gpu.read_counts()["rows"] == 8 * 16


@pytest.mark.parametrize("caps", [GH200, HMM_CPU, H200], ids=["ats", "hmm", "registered"])
def test_an_eviction_after_open_switches_to_the_host_path_and_back(
    table_files, caps, machine, memory_left, monkeypatch, rng, poison
):
    """Open resident and fitting: the kernel. Memory runs short and the table is evicted: the fit
    check (its own thread) switches later lookups to a host path with a row cache built then; the
    memory back, the kernel again. Every lookup exact; each switch counted once."""
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0.02")
    layout = table_files
    machine(caps)
    mode = "registered" if caps is H200 else "ats"
    with ple_um.open_table(layout.directory, mode=mode, rows=OWNED) as table:
        table.mapping.populate()
        assert table.stats()["serving"]["path"] == "kernel"
        decode_lookups(table, layout, rng, poison, 4)
        kernel_rows = table.paths.gpu.read_counts()["rows"]
        assert kernel_rows == 4 * 16
        memory_left.machine, memory_left.group = 1 * MiB, 512 * 1024
        if mode == "registered":  # pinned: never evicted, so only a forced verdict spills it
            memory_left.forced = (False, "the owned rows do not fit (injected)")
        evict(table)
        serving = wait_for(table, "host")
        assert serving["switches"] == 1 and serving["page_touches"] == 0 and "do not fit" in serving["why"]
        assert "a row cache of" in serving["why"], serving
        host_before = table.stats()["host_lookups"]
        decode_lookups(table, layout, rng, poison, 32)
        stats = table.stats()
        assert (
            stats["host_lookups"] - host_before == 32 and table.paths.gpu.read_counts()["rows"] == kernel_rows
        )
        assert stats["row_cache"]["hits"] > 0 and stats["file_reads"] > 0, stats
        memory_left.machine, memory_left.group, memory_left.forced = 64 << 30, None, None
        serving = wait_for(table, "kernel")
        assert serving["switches"] == 2
        decode_lookups(table, layout, rng, poison, 4)
        assert table.paths.gpu.read_counts()["rows"] == kernel_rows + 4 * 16


class Capture:
    """``torch.cuda.is_current_stream_capturing`` as the test sets it (``on``); the host path's
    page touches as they are queued (``queued``: each one's live word), then run."""

    def __init__(self, monkeypatch) -> None:
        self.on, self.queued = False, []
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.on)

    def spy(self, host) -> None:
        touch = host.touch

        def queued(ids, live=None):
            self.queued.append(live)
            touch(ids, live=live)

        host.touch = queued


def ats_on_a_gpu(monkeypatch, machine) -> Capture:
    """The injected GH200, its device told a GPU (``fit.touch_setting``: the ats mode's touch and
    capture checks are a GPU's), captures injected (``Capture``)."""
    on_gpu = fit.touch_setting
    monkeypatch.setattr(fit, "touch_setting", lambda mode, cuda: on_gpu(mode, cuda=True))
    machine(GH200)
    return Capture(monkeypatch)


@pytest.mark.parametrize("knob", ["auto", "off", "on"])
def test_a_captured_kernel_lookup_holds_a_live_page_touch(
    table_files, machine, memory_left, monkeypatch, rng, poison, knob
):
    """The ats mode on a GPU (the injected GH200, whose kernel the interpreter runs, standing for
    its GPU: ``fit.touch_setting`` told the device is one), ``PLE_UM_ATS_PREFETCH=auto``: a lookup
    captured on the kernel queues the page touch whatever serves then, through the table's word;
    an eager one only while the touch is on. The word follows the fit checks: clear while the
    table is all in memory, set once it is evicted and while it is served on the host path (a
    graph captured on the kernel still runs it). ``off``: no touch; ``on``: always, no word."""
    monkeypatch.setenv("PLE_UM_ATS_PREFETCH", knob)
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    capture = ats_on_a_gpu(monkeypatch, machine)
    layout = table_files
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        table.mapping.populate()
        paths.fit.check()  # all in memory: the touch is off (on: always on)
        assert paths.serving.path == "kernel" and paths.serving.touch == (knob == "on")
        live = paths.touch_live
        assert (live is not None) == (knob == "auto") and (live is None or live[0] == 0)
        if paths.host is None:  # off: none for big lookups on the CPU, which a GPU's open builds
            paths.adopt(paths.fit.host_for(False))
        capture.spy(paths.host)
        decode_lookups(table, layout, rng, poison, 2)  # eager
        assert capture.queued == {"auto": [], "off": [], "on": [None, None]}[knob]
        capture.on = True
        decode_lookups(table, layout, rng, poison, 2)  # captured
        capture.on = False
        assert capture.queued == {"auto": [live, live], "off": [], "on": [None] * 4}[knob]
        # Run at once here (no CUDA): the live ones with their word clear touched nothing.
        assert table.stats()["serving"]["page_touches"] == {"auto": 0, "off": 0, "on": 4}[knob]
        if knob != "auto":
            return
        # Evicted: the next check sets the word; a captured touch runs now.
        evict(table)
        assert paths.fit.check() and paths.serving.touch and live[0] == 1
        capture.on = True
        decode_lookups(table, layout, rng, poison, 1)
        capture.on = False
        assert capture.queued[-1] is live and table.stats()["serving"]["page_touches"] == 1
        # Memory short: the host path serves; the word stays set for graphs captured on the kernel.
        memory_left.machine = 1 * MiB
        assert paths.fit.check() and paths.serving.path == "host" and live[0] == 1
        capture.spy(paths.host)  # the host path built for it, with a row cache
        queued = len(capture.queued)
        capture.on = True
        decode_lookups(table, layout, rng, poison, 2)  # captured on the host path: no touch
        capture.on = False
        assert len(capture.queued) == queued
        # Back in memory and fitting: the kernel, the word clear again.
        memory_left.machine = 64 << 30
        table.mapping.populate()
        assert paths.fit.check() and paths.serving.path == "kernel" and live[0] == 0

def test_failed_checks_and_touch_flips_are_logged_at_most_once_a_minute(
    table_files, machine, memory_left, monkeypatch, caplog
):
    """A table evicted and faulted back in again and again flips its page touch at each check: the
    first flip is logged, the next ones within ``SAY_EVERY_S`` are not, and the first one after it
    says how many were left out. A check that fails at every interval (``tick_failed``, where the
    thread hands a failed check) the same, apart from the touch's."""
    import types

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    ats_on_a_gpu(monkeypatch, machine)
    clock = [1000.0]
    caplog.set_level(logging.INFO, logger=fit_watch.logger.name)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == fit_watch.logger.name]

    with ple_um.open_table(table_files.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        table.mapping.populate()
        monkeypatch.setattr(fit_watch, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
        caplog.clear()
        for _ in range(4):
            evict(table)
            assert paths.fit.check() and paths.serving.touch and paths.serving.path == "kernel"
            table.mapping.populate()
            assert paths.fit.check() and not paths.serving.touch
        assert len(said()) == 1 and "a page touch before it" in said()[0], said()
        clock[0] += fit_watch.SAY_EVERY_S
        evict(table)
        assert paths.fit.check() and paths.serving.touch
        assert len(said()) == 2 and said()[1].endswith("(7 more like it in the last 60 s left out)"), said()
        caplog.clear()
        for k in range(5):
            paths.fit.tick_failed(OSError(5, f"injected {k}"))
        assert len(said()) == 1 and "failed (OSError: [Errno 5] injected 0)" in said()[0], said()
        clock[0] += fit_watch.SAY_EVERY_S / 2
        paths.fit.tick_failed(OSError(5, "injected 5"))
        assert len(said()) == 1
        clock[0] += fit_watch.SAY_EVERY_S / 2
        paths.fit.tick_failed(OSError(5, "injected 6"))
        assert said()[1].endswith("injected 6); the path stays (5 more like it in the last 60 s left out)")
        # The memory short: a switch of path is always said, the touch's limit aside.
        memory_left.machine = 1 * MiB
        assert paths.fit.check() and paths.serving.path == "host" and len(said()) == 3
        levels = [r.levelno for r in caplog.records if r.name == fit_watch.logger.name]
        assert levels == [logging.WARNING, logging.WARNING, logging.INFO]



def test_a_capture_checks_the_fit_first_and_takes_the_host_path_it_switched_to(
    table_files, machine, memory_left, monkeypatch, rng, poison
):
    """The injected GH200's ats mode on a GPU (``touch_setting`` told so), fit checks every hour:
    the memory runs short between two checks, as an engine's KV cache takes it right before the
    engine captures its graphs. An eager lookup keeps the kernel until the next check; the first
    lookup captured on the kernel checks first, and it and the later ones are captured on the host
    path with its row cache, every row exact. A check younger than ``CAPTURE_CHECK_AGE`` is not
    made again, nor is one where checks are off (``PLE_UM_FIT_CHECK_SEC=0``)."""
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "3600")  # the thread's checks never come here
    capture = ats_on_a_gpu(monkeypatch, machine)
    layout = table_files
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        assert paths.capture_checks and paths.serving.path == "kernel"
        table.mapping.populate()
        decode_lookups(table, layout, rng, poison, 1)
        memory_left.machine = 1 * MiB  # short now; no check has seen it
        decode_lookups(table, layout, rng, poison, 2)  # eager: the kernel, no check
        checks = paths.fit.checks
        assert paths.serving.path == "kernel" and checks == 0
        monkeypatch.setattr(fit_watch, "CAPTURE_CHECK_AGE", 3600.0)  # the open's measure is fresh
        capture.on = True
        decode_lookups(table, layout, rng, poison, 1)
        assert paths.fit.checks == 0 and paths.serving.path == "kernel"
        monkeypatch.setattr(fit_watch, "CAPTURE_CHECK_AGE", 0.0)
        kernel_rows = paths.gpu.read_counts()["rows"]
        host_before = table.stats()["host_lookups"]
        decode_lookups(table, layout, rng, poison, 8)  # captured: the first checks and switches
        capture.on = False
        serving = table.stats()["serving"]
        assert paths.fit.checks == 1 and serving["path"] == "host" and serving["switches"] == 1, serving
        assert "a row cache of" in serving["why"], serving
        stats = table.stats()
        assert stats["host_lookups"] - host_before == 8 and paths.gpu.read_counts()["rows"] == kernel_rows
        assert stats["row_cache"]["hits"] > 0, stats


def test_no_capture_check_where_checks_are_off(table_files, machine, memory_left, monkeypatch, rng, poison):
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")
    monkeypatch.setattr(fit_watch, "CAPTURE_CHECK_AGE", 0.0)
    capture = ats_on_a_gpu(monkeypatch, machine)
    with ple_um.open_table(table_files.directory, mode="ats", rows=OWNED) as table:
        memory_left.machine = 1 * MiB
        capture.on = True
        decode_lookups(table, table_files, rng, poison, 2)
        assert table.paths.fit.checks == 0 and table.paths.serving.path == "kernel"


def test_the_cpu_mode_gains_a_row_cache_when_the_table_stops_fitting(
    table_files, memory_left, monkeypatch, rng, poison
):
    layout = table_files
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        assert table.stats()["row_cache"] is None and table.paths.fit is not None
        decode_lookups(table, layout, rng, poison, 4)
        memory_left.machine = 1 * MiB
        evict(table)
        assert table.paths.fit.check()  # the check the thread would make, here and now
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 1 and "row cache" in serving["why"]
        decode_lookups(table, layout, rng, poison, 32)
        stats = table.stats()
        assert stats["row_cache"]["hits"] > 0 and stats["file_reads"] > 0
        assert not table.paths.fit.check()  # nothing changes while it still does not fit


def test_a_host_path_that_serves_on_says_what_holds_now(table_files, machine, memory_left, rng, poison):
    """A host path that goes on serving, nothing rebuilt, says what the last check found: the cpu
    mode's (a table not resident at open: a reader of misses already) once the table stops fitting
    with no room left for a row cache, and the ats mode's once a table over its memory fits again
    but without the margin the kernel needs back. No change of what serves is counted."""
    layout = table_files
    drop_page_cache(layout)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        paths = table.paths
        assert " fit:" in paths.serving.why and paths.row_copy.rows.reader is not None, paths.serving
        memory_left.machine, memory_left.group = 1 * MiB, 0
        assert not paths.fit.check()
        serving = table.stats()["serving"]
        assert serving["switches"] == 0 and "do not fit" in serving["why"], serving
        assert "no row cache" in serving["why"] and "1.00 MiB" in serving["why"], serving
        decode_lookups(table, layout, rng, poison, 4)
    machine(GH200)
    memory_left.machine, memory_left.group = 1 * MiB, None
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        assert paths.serving.path == "host" and "do not fit" in paths.serving.why, paths.serving
        owned = sum(r.length for r in table.mapping.regions)
        memory_left.machine = int(owned * 1.05)  # fits, but not with a tenth to spare
        assert not paths.fit.check()
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 0, serving
        verdict, _, host = serving["why"].partition(": the host path, ")
        assert ") fit: MemAvailable" in verdict and "do not fit" not in verdict, serving
        assert host.startswith("a row cache of "), serving  # built when it did not fit: said so
        decode_lookups(table, layout, rng, poison, 4)


@pytest.mark.parametrize("caps", [None, GH200], ids=["cpu", "ats"])
def test_a_check_with_no_room_for_a_row_cache_builds_no_host_path_again_and_again(
    table_files, caps, machine, memory_left, rng, poison
):
    """The table stops fitting while its memory cgroup is full (the page cache it read fills the
    limit): no room for a row cache. The checks build a host path once where the one there is lacks
    a reader of misses (the cpu mode's, of a table resident at open) or where there is none (a GPU
    mode's), and then keep it: never a host path more each check, which would hold its descriptors
    and buffers until the table closes."""
    layout = table_files
    if caps is not None:
        machine(caps)
    mode, device = ("cpu", "cpu") if caps is None else ("ats", None)
    with ple_um.open_table(layout.directory, mode=mode, device=device, rows=OWNED) as table:
        paths = table.paths
        had = paths.row_copy is not None and paths.row_copy.rows.reader is not None
        memory_left.machine, memory_left.group = 1 * MiB, 0
        evict(table)
        changed = [paths.fit.check() for _ in range(6)]
        assert changed == [not had] + [False] * 5, changed
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == int(not had), serving
        assert "no row cache" in serving["why"] and table.stats()["row_cache"] is None, serving
        assert len(paths._hosts()) == 1 + int(caps is None and not had), paths.row_reads
        assert paths.row_copy.rows.reader is not None and "a row cache of" not in paths.row_reads
        decode_lookups(table, layout, rng, poison, 8)


@pytest.mark.parametrize("reads", ["auto", "mmap"])
def test_a_check_with_no_room_for_a_row_cache_builds_nothing(
    table_files, memory_left, monkeypatch, rng, poison, reads
):
    """The cpu mode's table, not resident at open (a reader of misses already; under
    ``PLE_UM_FILE_READS=mmap`` none, nor would a new one have one), stops fitting with no room left
    for a row cache: the checks tell so before building (``misses.row_cache``) and build no host
    path at all, not one built and closed again at each check (its reader's descriptors, an O_DIRECT
    probe, the sizing lock). Once room comes back, the next check builds one, with a row cache."""
    monkeypatch.setenv("PLE_UM_FILE_READS", reads)
    layout = table_files
    drop_page_cache(layout)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        paths = table.paths
        built = []
        host_for = paths.fit.host_for

        def counted(*args, **kwargs):
            built.append(host_for(*args, **kwargs))
            return built[-1]

        paths.fit.host_for = counted
        memory_left.machine, memory_left.group = 1 * MiB, 0
        assert [paths.fit.check() for _ in range(4)] == [False] * 4
        assert built == [] and len(paths._hosts()) == 1 and table.stats()["row_cache"] is None
        decode_lookups(table, layout, rng, poison, 4)
        memory_left.group = None  # half of the 1 MiB left: a row cache
        assert paths.fit.check() and len(built) == 1 and paths.host is built[0]
        assert table.stats()["row_cache"] is not None
        decode_lookups(table, layout, rng, poison, 4)


def test_a_small_row_cache_is_built_again_bigger_once_memory_frees_up(
    table_files, memory_left, monkeypatch, rng, poison
):
    """The cpu mode's table opened over its memory cgroup's room with little of it left: a small row
    cache. Room frees up (the table still does not fit): no check builds again before
    ``REGROW_AFTER_S`` since the last build; after it, the next check builds a host path with a
    row cache of at least ``REGROW_FACTOR`` times the slots and serves through it (a switch), the
    old one kept for captured graphs; the checks after it, the room the same, build nothing more.
    Every lookup exact."""
    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    layout = table_files
    drop_page_cache(layout)
    memory_left.group = 256 * 1024
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        paths = table.paths
        small = paths.host.misses.slots
        assert small > 0 and table.stats()["row_cache"]["bytes"] <= 128 * 1024, table.stats()["row_cache"]
        decode_lookups(table, layout, rng, poison, 4)
        memory_left.group = int(1.5 * MiB)  # the 2.6 MiB not in memory still do not fit
        assert [paths.fit.check() for _ in range(3)] == [False] * 3  # the open built just now
        assert paths.host.misses.slots == small and len(paths._hosts()) == 1
        monkeypatch.setattr(fit_watch, "REGROW_AFTER_S", 0.0)
        assert paths.fit.check()
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 1 and "do not fit" in serving["why"]
        assert paths.host.misses.slots >= fit_watch.REGROW_FACTOR * small and len(paths._hosts()) == 2
        assert "a row cache of 768.00 KiB" in serving["why"], serving
        assert [paths.fit.check() for _ in range(3)] == [False] * 3 and len(paths._hosts()) == 2
        decode_lookups(table, layout, rng, poison, 8)
        assert table.stats()["row_cache"]["hits"] > 0


def test_a_row_cache_sized_past_the_memory_left_is_cut_when_a_check_builds_it(
    table_files, machine, memory_left, monkeypatch, rng, poison, caplog
):
    """An explicit PLE_UM_ROW_CACHE past the memory left once the table stops fitting after open:
    no open is there to refuse it, so the check builds the host path with the share
    ``PLE_UM_ROW_CACHE=auto`` takes of that memory, says so once (its log line, the serving's why)
    and switches; later checks raise nothing, change nothing and log nothing. Every lookup exact."""
    from ple_um.units import format_bytes

    monkeypatch.setenv("PLE_UM_ROW_CACHE", "2MiB")  # the owned rows' cache needs 2.6 MiB
    machine(GH200)
    layout = table_files
    caplog.set_level(logging.INFO, logger=fit_watch.logger.name)
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        assert paths.serving.path == "kernel" and paths.row_copy is None
        memory_left.machine, memory_left.group = 1 * MiB, None
        evict(table)
        assert [paths.fit.check() for _ in range(5)] == [True] + [False] * 4
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 1, serving
        cut = int(MiB * 0.5)  # PLE_UM_ROW_CACHE_FRACTION's default of the 1 MiB left
        said = f"a row cache of {format_bytes(cut)} (PLE_UM_ROW_CACHE='2MiB' asks 2.00 MiB, past the 1.00 MiB"
        assert said in serving["why"], serving
        lines = [r.getMessage() for r in caplog.records if r.name == fit_watch.logger.name]
        assert lines == [f"ple-um: decode-sized lookups of {layout.directory}: {serving['why']}"], lines
        assert 0 < table.stats()["row_cache"]["bytes"] <= cut
        decode_lookups(table, layout, rng, poison, 16)
        assert table.stats()["host_lookups"] == 16 and paths.gpu.read_counts()["rows"] == 0


@pytest.mark.parametrize("fraction", [None, "0.9"], ids=["half", "most"])
def test_an_explicit_row_cache_cut_by_a_check_grows_back_to_its_size(
    table_files, machine, memory_left, monkeypatch, rng, poison, fraction
):
    """``PLE_UM_ROW_CACHE=2MiB`` in the ats mode: the table fits at open. Memory runs short: a check
    builds the host path, its row cache cut to ``PLE_UM_ROW_CACHE_FRACTION`` of the memory left.
    Memory comes back, the table still over it: no check builds again before ``REGROW_AFTER_S``;
    after it, the next check builds a cache of the size asked, its ceiling, also where that is less
    than ``REGROW_FACTOR`` times the cut one's slots (a fraction of 0.9), and serves through it (a
    switch); the checks after it build nothing more. Every lookup exact."""
    from ple_um.lookup.host.row_cache import slots_for

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "2MiB")  # the owned rows' cache needs 2.6 MiB
    if fraction is not None:
        monkeypatch.setenv("PLE_UM_ROW_CACHE_FRACTION", fraction)
    machine(GH200)
    layout = table_files
    with ple_um.open_table(layout.directory, mode="ats", rows=OWNED) as table:
        paths = table.paths
        assert paths.serving.path == "kernel" and paths.row_copy is None
        memory_left.machine = int(1.5 * MiB)
        evict(table)
        assert paths.fit.check() and paths.serving.path == "host"
        cut, full = paths.host.misses.slots, slots_for(2 * MiB, layout.row_bytes)
        assert 0 < cut < full and "past the 1.50 MiB" in paths.serving.why, paths.serving
        decode_lookups(table, layout, rng, poison, 4)
        memory_left.machine = int(2.5 * MiB)  # room for the 2 MiB; the 2.6 MiB table does not fit
        assert [paths.fit.check() for _ in range(3)] == [False] * 3  # built just now
        assert paths.host.misses.slots == cut and len(paths._hosts()) == 1
        monkeypatch.setattr(fit_watch, "REGROW_AFTER_S", 0.0)
        assert paths.fit.check()
        serving = table.stats()["serving"]
        assert serving["path"] == "host" and serving["switches"] == 2 and "do not fit" in serving["why"]
        assert paths.host.misses.slots == full and len(paths._hosts()) == 2, paths.host.misses
        assert "a row cache of 2.00 MiB;" in serving["why"], serving
        assert [paths.fit.check() for _ in range(3)] == [False] * 3 and len(paths._hosts()) == 2
        decode_lookups(table, layout, rng, poison, 8)
        assert table.stats()["row_cache"]["hits"] > 0 and paths.gpu.read_counts()["rows"] == 0


@pytest.mark.parametrize("knob", [None, "0"], ids=["auto", "none"])
def test_a_spilled_gpu_mode_says_what_its_host_path_has(table_files, machine, memory_left, monkeypatch, knob):
    """A table over its memory in the ats mode: the serving's why (and the probe's) says the host
    path has a row cache where one is built, and no row cache under PLE_UM_ROW_CACHE=0."""
    if knob is not None:
        monkeypatch.setenv("PLE_UM_ROW_CACHE", knob)
    memory_left.machine = 1 * MiB
    machine(GH200)
    said = fit.at_open(table_files, "ats", cuda=False)
    with ple_um.open_table(table_files.directory, mode="ats", rows=OWNED) as table:
        serving, cache = table.stats()["serving"], table.stats()["row_cache"]
    assert serving["path"] == "host" and said.path == "host", (serving, said)
    if knob == "0":
        assert cache is None and "no row cache" in serving["why"], serving
        assert "a row cache of" not in serving["why"], serving
        assert said.why.endswith(": the host path, no row cache (PLE_UM_ROW_CACHE=0)"), said.why
    else:
        assert cache is not None and "no row cache" not in serving["why"], serving
        assert "a row cache of" in serving["why"], serving
        assert ": the host path, a row cache of " in said.why, said.why
        words = said.why.split(": the host path, ")[1]  # the open's own words (its rows are OWNED's)
        assert f": the host path, {words}; misses read by " in serving["why"], (serving, said.why)


@pytest.mark.parametrize(("knob", "path"), [("spills", "host"), ("fits", "kernel")])
def test_the_decision_can_be_forced(table_files, machine, memory_left, monkeypatch, rng, poison, knob, path):
    monkeypatch.setenv("PLE_UM_FIT", knob)
    memory_left.machine = 1 * MiB if knob == "fits" else 64 << 30  # the other way round from auto
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1GiB")  # not a fraction of the 1 MiB: registered opens
    machine(H200)
    layout = table_files
    with ple_um.open_table(layout.directory, mode="registered", rows=OWNED) as table:
        serving = table.stats()["serving"]
        assert serving["path"] == path and "PLE_UM_FIT" in serving["why"] and table.paths.fit is None
        decode_lookups(table, layout, rng, poison, 8)
        kernel = table.paths.gpu.read_counts()["rows"]
        assert kernel == (8 * 16 if path == "kernel" else 0)


@pytest.mark.parametrize("room", [64 << 30, MiB, 2048], ids=["fits", "spills", "no-room"])
@pytest.mark.parametrize("knob", [None, "0", "512KiB", "1KiB"], ids=["auto", "none", "sized", "too-small"])
def test_the_probe_of_a_table_says_what_its_open_serves(table_files, memory_left, monkeypatch, room, knob):
    """``fit.at_open`` (``ple-um probe DIR``) says whether the cpu mode's host path has a row cache as
    the open then builds it (``misses.row_cache``): by the fit under ``PLE_UM_ROW_CACHE=auto``, as the
    knob says else, and none where the size (or the memory left's share, under auto) holds not one
    set of slots; in the open's own words."""
    if knob is not None:
        monkeypatch.setenv("PLE_UM_ROW_CACHE", knob)
    memory_left.machine = room
    said = fit.at_open(table_files, "cpu", cuda=False)
    if knob == "512KiB" and room == 2048:  # a size past the memory left: the open refuses it
        with pytest.raises(KnobError, match="PLE_UM_ROW_CACHE='512KiB'") as refused:
            ple_um.open_table(table_files.directory, mode="cpu", device="cpu")
        assert said.why.endswith(f"host path, an open now would be refused: {refused.value}"), said.why
        return
    with ple_um.open_table(table_files.directory, mode="cpu", device="cpu") as table:
        cached = table.stats()["row_cache"] is not None
        plan = table.paths.row_copy.misses
    too_small = knob == "1KiB" or knob is None and room == 2048
    assert cached == (knob == "512KiB" or knob is None and room == MiB), (cached, said.why)
    assert ("a row cache of" in said.why) == cached and ("no row cache" in said.why) != cached, said.why
    assert ("holds not one set of rows" in said.why) == too_small, said.why
    words = said.why.split(": the cpu mode's host path, ")[1]
    assert plan is None or plan.why.startswith(f"{words}; misses read by "), (plan, said.why)
    assert plan is not None or not cached


def held_by_this_process() -> dict:
    """What this process holds that a table's build can make: threads, descriptors, mappings, kernels,
    entries of the tables counted in the fits."""
    from ple_um.lookup.open_tables import OPEN_TABLES

    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {
        "counted": len(OPEN_TABLES._tables),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "maps": maps,
        "kernels": sum(type(o) is GpuGather for o in gc.get_objects()),
    }


@pytest.mark.parametrize("mode", ["cpu", "ats", "registered"])
def test_an_open_refused_for_its_row_cache_keeps_nothing_it_built(
    table_files, machine, memory_left, monkeypatch, mode
):
    """A row cache past the memory left refuses the open (KnobError) once the mode is built and, in a
    GPU mode, its kernel (``build_paths``): what the open built is released then, not when the
    refusal is let go (its traceback holds the build's frames while the caller holds it): no thread,
    descriptor, mapping, kernel or table counted in the fits more than before, the refusal still
    held."""
    machine(GH200 if mode == "ats" else H200)
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "1GiB")
    memory_left.forced = (False, "injected: the owned rows do not fit") if mode == "registered" else None
    with ple_um.open_table(table_files.directory, mode=mode, device="cpu") as table:
        assert table.mode == mode  # what a first open makes once is made
    del table
    gc.collect()
    before = held_by_this_process()
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "512KiB")
    memory_left.machine = 2048
    with pytest.raises(KnobError, match="PLE_UM_ROW_CACHE='512KiB'") as refused:
        ple_um.open_table(table_files.directory, mode=mode, device="cpu")
    assert refused.value.__traceback__ is not None and held_by_this_process() == before, before


@pytest.mark.parametrize("room", [64 << 30, MiB, 2048], ids=["fits", "spills", "no-room"])
@pytest.mark.parametrize("knob", [None, "512KiB"], ids=["auto", "sized"])
@pytest.mark.parametrize("mode", ["cpu", "ats"])
def test_the_probe_without_the_c_row_copy_says_what_its_open_serves(
    table_files, machine, memory_left, monkeypatch, room, knob, mode
):
    """Where the C row copy cannot be had (``PLE_UM_ROWCOPY=0``), ``fit.at_open`` (``ple-um probe
    DIR``) says what the open then serves with: the cpu mode's synchronous path and no row cache
    (never one sized by the fit or the knob, never a refusal the open does not make); in the ats
    mode the kernel, no host path, in the open's own words; no page touch on a GPU."""
    monkeypatch.setenv("PLE_UM_ROWCOPY", "0")
    if knob is not None:
        monkeypatch.setenv("PLE_UM_ROW_CACHE", knob)
    memory_left.machine = room
    machine(GH200)
    said = fit.at_open(table_files, mode, cuda=False)
    with ple_um.open_table(table_files.directory, mode=mode, device="cpu") as table:
        serving, cache, reads = table.stats()["serving"], table.stats()["row_cache"], table.row_reads
    assert cache is None and "row cache of" not in said.why and "refused" not in said.why, said.why
    assert (said.path, said.touch) == (serving["path"], serving["page_touch"]), (said, serving)
    if mode == "cpu":
        assert said.why == f"{serving['why']}, no row cache: {reads}", (said.why, serving, reads)
        assert reads == "torch.index_select, synchronous (PLE_UM_ROWCOPY=0)", reads
    else:
        assert said.why == serving["why"] and said.path == "kernel", (said.why, serving)
        assert ("no host path here: PLE_UM_ROWCOPY=0" in said.why) == (room != 64 << 30), said.why
    if mode == "ats":  # on a GPU the touch would be queued on the host path: there is none
        monkeypatch.setenv("PLE_UM_ATS_PREFETCH", "on")
        said = fit.at_open(table_files, mode, cuda=True)
        assert said.path == "kernel" and not said.touch, said
        gave_up = "no page touch before it (no host path here: PLE_UM_ROWCOPY=0)"
        assert room != 64 << 30 or said.why.endswith(gave_up), said.why


# -- a real memory cgroup ------------------------------------------------------------------------------
# The start of a child under a real memory cgroup: the ats mode's first read (a child process) made
# before the limit, then the limit: what this process holds now and 24 MiB more, under the table's
# 61 MiB; ``lookups(table, rng, count)``: decode-sized lookups of hot ids and ids outside the table
# into poisoned outputs, the number that differ from the files.
LIMITED = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    group = {group!r}
    def read(name):
        with open(os.path.join(group, name)) as f:
            return int(f.read())
    import numpy as np, torch
    import ple_um, ple_um.kernels
    from helpers.machines import GH200, injected_machine
    from helpers.reference import reference_rows
    with injected_machine(GH200):
        assert ple_um.probe(path={directory!r}).mode == "ats"
    usage = read("memory.current") if {v2} else read("memory.usage_in_bytes")
    with open(os.path.join(group, "memory.max" if {v2} else "memory.limit_in_bytes"), "w") as f:
        f.write(str(usage + (24 << 20)))
    def lookups(table, rng, count):
        hot, bad = rng.integers(0, {rows}, 40), 0
        for k in range(count):
            ids = np.concatenate([rng.choice(hot, 12), rng.integers(-2, {rows} + 2, 4)]).astype(np.int64)
            out = torch.full((16, {dim}), 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)
            table.lookup(torch.from_numpy(ids), out=out)
            bad += not np.array_equal(out.view(torch.uint8).numpy(), reference_rows(table.layout, ids))
        return bad
    """
)
CHILD = LIMITED + textwrap.dedent(
    """
    if {filler!r}:  # another file read first: its page cache fills the group up to its limit
        with open({filler!r}, "rb") as f:
            while f.read(1 << 20):
                pass
    rng = np.random.default_rng({seed})
    with injected_machine(GH200), ple_um.open_table({directory!r}, mode="ats") as table:
        serving = table.stats()["serving"]
        bad = lookups(table, rng, 64)
        stats = table.stats()
        print(json.dumps(dict(serving=serving, bad=bad, stats=dict(
            host_lookups=stats["host_lookups"], file_reads=stats["file_reads"],
            row_cache=stats["row_cache"], kernel_rows=table.paths.gpu.read_counts()["rows"]))))
    """
)


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled-by-another-file"])
def test_a_table_over_a_real_cgroups_limit_is_served_on_the_host_path(make_checkpoint, tmp_path, rng, filled):
    """Also where another file read before the open filled the group's page cache up to its limit
    (a server's model weights): that page cache is room the kernel takes back, and the row cache
    is sized from it (a quarter of the limit's 24 MiB at least), not from the few bytes left."""
    rows, dim = 400_000, 160  # 61 MiB
    layout = make_checkpoint(
        num_rows=rows, row_dim=dim, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    drop_page_cache(layout)
    filler = ""
    if filled:
        filler = str(tmp_path / "weights.bin")
        with open(filler, "wb") as f:
            f.write(os.urandom(48 * MiB))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read by the child, charged there
    seed = int(rng.integers(1 << 30))
    tests = os.path.dirname(os.path.dirname(__file__))
    result = run_limited(
        "ple-um-fit",
        lambda group, v2: CHILD.format(
            tests=tests,
            group=group,
            v2=v2,
            seed=seed,
            directory=layout.directory,
            rows=rows,
            dim=dim,
            filler=filler,
        ),
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    serving, stats = result["serving"], result["stats"]
    assert serving["path"] == "host" and "cgroup" in serving["why"] and "do not fit" in serving["why"], (
        serving
    )
    assert result["bad"] == 0
    assert stats["host_lookups"] == 64 and stats["kernel_rows"] == 0
    assert stats["row_cache"]["hits"] > 0 and stats["file_reads"] > 0, stats
    assert stats["row_cache"]["bytes"] >= 6 * MiB, stats["row_cache"]


GAINS_A_CACHE = LIMITED + textwrap.dedent(
    """
    os.environ["PLE_UM_FIT_CHECK_SEC"] = "0"  # the checks made here
    os.environ["PLE_UM_ROW_CACHE_FRACTION"] = "0"  # no room given to a row cache at open
    rng = np.random.default_rng({seed})
    with injected_machine(GH200), ple_um.open_table({directory!r}, mode="ats") as table:
        opened = table.stats()["serving"]
        os.environ["PLE_UM_ROW_CACHE_FRACTION"] = "0.5"  # room for one now
        changed = table.paths.fit.check()
        bad = lookups(table, rng, 32)
        stats = table.stats()
        print(json.dumps(dict(opened=opened, changed=changed, serving=stats["serving"], bad=bad,
                              row_cache=stats["row_cache"], row_reads=table.row_reads)))
    """
)


def test_a_gpu_mode_on_the_host_path_that_gains_a_row_cache_says_so(make_checkpoint, rng):
    """The ats mode (the injected GH200) over a real cgroup's limit, opened with no room given to a
    row cache: the host path serves, without one. A later check that builds one (room given) and
    serves through it is a change of what serves, as in the cpu mode: the check says it changed,
    the serving's ``why`` names the row cache, the switch is counted. Every lookup exact."""
    rows, dim = 400_000, 160  # 61 MiB
    layout = make_checkpoint(
        num_rows=rows, row_dim=dim, dtype="fp8", shards=4, seed=int(rng.integers(1 << 30))
    )
    drop_page_cache(layout)
    tests = os.path.dirname(os.path.dirname(__file__))
    seed = int(rng.integers(1 << 30))
    result = run_limited(
        "ple-um-fit-gains",
        lambda group, v2: GAINS_A_CACHE.format(
            tests=tests, group=group, v2=v2, seed=seed, directory=layout.directory, rows=rows, dim=dim
        ),
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    opened, serving = result["opened"], result["serving"]
    assert opened["path"] == "host" and "no row cache" in opened["why"], opened
    assert result["row_cache"] is not None and "a row cache of" in result["row_reads"], result
    assert result["changed"] and serving["switches"] == opened["switches"] + 1, result
    assert serving["path"] == "host" and "a row cache of" in serving["why"], serving
    assert "no row cache" not in serving["why"], serving
    assert result["row_cache"]["hits"] > 0 and result["bad"] == 0, result


def test_the_counts_read_while_a_host_path_is_adopted_count_each_path_once(table_files, rng, poison):
    """The stats reporter reads a table's counts on its own thread while the fit check's thread may
    adopt a new host path. A reading made at any point of the adoption counts every host path
    once: a host path counted twice (or not at all) for one reading would be added to the
    Prometheus counters for good (``LookupMetrics.absorb`` adds each rise). The adoption is stopped
    at each of its lines (``sys.settrace``) while another thread reads."""
    import sys
    import threading

    layout = table_files
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu", rows=OWNED) as table:
        paths = table.paths
        decode_lookups(table, layout, rng, poison, 4)
        rows = paths.read_counts()["rows"]
        assert rows == 4 * 16
        built = paths.fit.host_for(False)
        readers: list[threading.Thread] = []
        seen: list[int] = []

        def read() -> None:
            seen.append(paths.read_counts()["rows"])

        def each_line(frame, event, arg):
            if event == "line":
                reader = threading.Thread(target=read)
                reader.start()
                reader.join(0.05)  # it may wait for the adoption to finish
                readers.append(reader)
            return each_line

        def calls(frame, event, arg):
            return each_line if frame.f_code is type(paths).adopt.__code__ else None

        sys.settrace(calls)
        try:
            paths.adopt(built)
        finally:
            sys.settrace(None)
        for reader in readers:
            reader.join()
        assert len(seen) == len(readers) >= 2 and seen == [rows] * len(seen), seen
        assert paths.read_counts()["rows"] == rows and paths.host is built
        decode_lookups(table, layout, rng, poison, 2)
        assert paths.read_counts()["rows"] == rows + 2 * 16


def test_the_touch_keeps_its_hysteresis_where_every_page_is_counted():
    """A table of at most ``FULL_SCAN_PAGES`` pages is measured exactly at each check (every page,
    not a sample): the touch still starts only past ``TOUCH_FROM`` of its pages out and stops only
    when none is, as for a sampled one. A page or two that the kernel reclaims from a table that
    fits do not turn on a host node before every kernel (and a log line at every check that sees
    them come and go). At open, any page out turns it on, as before."""
    kind = dict(touch_knob="auto", touch_here=True)
    resident = choose(None, _verdict(True, True, 1.0, exact=True), **kind)
    assert resident.touch is False
    assert choose(None, _verdict(True, True, 0.999, exact=True), **kind).touch is True  # at open
    one_out = choose(resident, _verdict(True, True, 0.999, exact=True), **kind)
    assert one_out.touch is False and one_out == resident
    many_out = choose(resident, _verdict(True, True, 1 - 2 * fit.TOUCH_FROM, exact=True), **kind)
    assert many_out.touch is True
    assert choose(many_out, _verdict(True, True, 0.999, exact=True), **kind).touch is True
    assert choose(many_out, _verdict(True, True, 1.0, exact=True), **kind).touch is False


def test_a_capture_check_whose_row_cache_memory_ran_out_for_keeps_what_serves(
    table_files, machine, memory_left, monkeypatch, rng, poison, caplog
):
    """A check made at a capture that would switch to a host path with a row cache, whose memory
    then cannot be faulted in (MADV_POPULATE_WRITE: ENOMEM): the capture's lookup is not failed by
    it; the check is said to have failed, the kernel goes on serving, and the next check, the
    memory there, switches. Every lookup exact."""
    import errno

    from ple_um.lookup.host import row_cache

    monkeypatch.setenv("PLE_UM_FIT_CHECK_SEC", "0")  # checked here, by the test
    machine(GH200)
    with ple_um.open_table(table_files.directory, mode="ats", rows=OWNED) as table:
        watch = table.paths.fit
        assert table.paths.serving.path == "kernel", table.paths.serving
        memory_left.machine = 1 * MiB  # the table no longer fits: a check builds a host path
        monkeypatch.setattr(row_cache, "_libc", PopulateFails(errno.ENOMEM))
        watch.interval, watch.checked_at = 60.0, 0.0  # checks at captures, the last one long ago
        with caplog.at_level(logging.WARNING, logger="ple_um"):
            watch.check_at_capture()  # raises nothing
        assert "fit check" in caplog.text and "MemoryError" in caplog.text and "ENOMEM" in caplog.text
        assert table.paths.serving.path == "kernel", table.paths.serving
        decode_lookups(table, table_files, rng, poison, 4)
        monkeypatch.setattr(row_cache, "_libc", PopulateFails(errno.EINVAL))  # written page by page
        assert watch.check() and table.paths.serving.path == "host", table.paths.serving
        assert table.stats()["row_cache"]["bytes"] > 0
        decode_lookups(table, table_files, rng, poison, 4)
