"""The bench for tables larger than memory, on the CPU: the child's page drop (its own mappings,
then the page cache), the rows found resident by mincore, the modes that can be cold, and whole
runs through the real child process, under a real memory cgroup where this machine allows one and
with none (the fallback, injected as the hierarchy's answer): every figure's bookkeeping, the
ratios to the storage's ceiling, the row cache column (the steady table's row cache, none in the cold
calls' table), the report and the plot."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.cli import fs_type

from ple_um import envs
from ple_um.bench import cold, report, storage
from ple_um.bench.cold import PAGE_CACHE_KNOBS, cold_knobs, drop_table_pages, own_mappings
from ple_um.bench.config import Config
from ple_um.bench.ids import parse_ids
from ple_um.bench.memlimit import MemoryLimit
from ple_um.lookup.host.row_cache import SLOT_OVERHEAD
from ple_um.mapping import MappedShards
from ple_um.operating import resident_rows
from ple_um.residency import resident_pages
from ple_um.units import format_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")


def _skip_on_tmpfs(path):
    if fs_type(str(path)) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: nothing can drop them")


def test_drop_table_pages_empties_this_process_and_the_page_cache(make_checkpoint):
    layout = make_checkpoint(num_rows=20000, row_dim=160, shards=5, files=3)
    _skip_on_tmpfs(layout.directory)
    with MappedShards(layout) as mapping:
        assert sorted((m.addr, m.path) for m in own_mappings(set(layout.files))) == sorted(
            (r.addr, r.path) for r in mapping.regions
        )
        for region in mapping.regions:
            region.array().sum()  # every page read, through this mapping
        ids = np.arange(layout.num_rows)
        assert resident_rows(mapping, ids).all()
        drop_table_pages(list(layout.files))
        assert not resident_rows(mapping, ids).any()
        rss = [line for line in open("/proc/self/smaps") if line.startswith("Rss:")]
        assert rss  # the mapping is still there, only emptied


def test_resident_rows_follows_the_pages_of_each_row(make_checkpoint, rng):
    """Rows of 160 B straddle pages: a row reads as resident only when all its pages are; rows at
    shard edges and in every file; ids the mapping does not own read as absent."""
    layout = make_checkpoint(num_rows=20000, row_dim=160, shards=5, files=3)
    _skip_on_tmpfs(layout.directory)
    S = layout.rows_per_shard
    with MappedShards(layout, rows=(0, 3 * S)) as mapping:
        drop_table_pages(list(layout.files))
        picked = np.array([0, S - 1, S, 2 * S + 7, 3 * S - 1])
        for row in picked:  # bring in the pages of these rows, readahead off
            shard, local = divmod(int(row), S)
            spec = layout.shards[shard]
            fd = os.open(spec.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, layout.row_bytes, spec.offset + local * layout.row_bytes)
            os.close(fd)
        everything = np.arange(layout.num_rows)
        found = resident_rows(mapping, everything)
        assert found[picked].all()
        # A row's own pages give the same answer as whole files', for any ids, owned or not, and
        # so does the choice between them (a few ids ask row by row).
        for ids in (
            everything,
            np.concatenate([picked, rng.integers(0, layout.num_rows, 300), [-1]]),
            np.append(picked, [3 * S, -1]),
        ):
            by_row = resident_rows(mapping, ids, whole_files=False)
            assert np.array_equal(by_row, resident_rows(mapping, ids, whole_files=True))
            assert np.array_equal(by_row, resident_rows(mapping, ids))
            assert np.array_equal(by_row, found[np.clip(ids, 0, None)] & (ids >= 0))
        assert not found[3 * S :].any()  # not owned
        # Readahead may bring in neighbours, never more than a small share of the rest.
        assert found.sum() < 0.5 * 3 * S


@pytest.mark.parametrize("whole_files", [True, False])
def test_a_row_over_several_pages_is_resident_only_with_every_page(make_checkpoint, whole_files):
    """Rows of 12 KiB (BF16, 6 144 values) span three or four pages: one whose first and last page
    are in the page cache but not one between them is not resident."""
    layout = make_checkpoint(num_rows=64, row_dim=6144, dtype="bf16", shards=2, files=1)
    _skip_on_tmpfs(layout.directory)
    rb, spec = layout.row_bytes, layout.shards[0]
    with MappedShards(layout) as mapping:
        drop_table_pages(list(layout.files))
        row = 5
        start = spec.offset + row * rb
        first, last = start // PAGE, (start + rb - 1) // PAGE
        assert last - first >= 2  # a page between the first and the last
        fd = os.open(spec.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only the pages read
            for page in (first, last):
                os.pread(fd, 1, page * PAGE)
            ids = np.array([row])
            region = mapping.regions[0]  # the file from file_offset on, as mincore sees it
            pages = resident_pages(region)[first - region.file_offset // PAGE :][: last - first + 1]
            assert pages[0] and pages[-1]
            if pages[1:-1].any():
                pytest.skip("the page cache brought in the pages between (readahead despite RANDOM)")
            assert not resident_rows(mapping, ids, whole_files=whole_files)[0]
            for page in range(first + 1, last):
                os.pread(fd, 1, page * PAGE)
            assert resident_rows(mapping, ids, whole_files=whole_files)[0]
        finally:
            os.close(fd)


def test_only_the_modes_that_read_the_table_where_it_lies_can_be_cold():
    modes, left_out = cold.cold_modes(("cpu", "registered", "device"), torch.device("cpu"))
    assert modes == ("cpu",)
    assert set(left_out) == {"registered", "device"}
    assert "cannot be cold" in left_out["registered"]
    modes, left_out = cold.cold_modes(None, torch.device("cpu"))
    assert "cpu" in modes and left_out == {}


def test_the_knobs_the_bench_sets_are_ple_ums(make_checkpoint, monkeypatch):
    """The cold table's knobs: no row cache, and misses read as the steady table, opened now under
    the same environment, would read its own (O_DIRECT beside a row cache)."""
    layout = make_checkpoint(num_rows=20000, row_dim=160, shards=5, files=3)
    _skip_on_tmpfs(layout.directory)  # a table in the page cache at open gets no row cache
    assert cold.ROW_CACHE_KNOB in envs.KNOBS
    monkeypatch.delenv("PLE_UM_ROW_CACHE", raising=False)
    monkeypatch.delenv("PLE_UM_DIRECT_READS", raising=False)
    with MappedShards(layout) as probe:
        drop_table_pages(list(layout.files))
        for knobs in (cold_knobs(probe), PAGE_CACHE_KNOBS):
            assert set(knobs) <= set(envs.KNOBS)
            for name, text in knobs.items():
                envs.KNOBS[name].parse(text)  # raises on a value the knob refuses
            assert envs.KNOBS["PLE_UM_ROW_CACHE"].parse(knobs["PLE_UM_ROW_CACHE"]) == 0  # no row cache
        assert PAGE_CACHE_KNOBS["PLE_UM_DIRECT_READS"] == "off"  # the page cache holds the rows read
        monkeypatch.setenv("PLE_UM_FIT", "spills")  # as the bench's child runs (memlimit._child_env)
        for row_cache, direct, expected in (
            (None, None, "on"),  # the defaults: a row cache, its misses read O_DIRECT
            ("0", None, "off"),
            ("0", "on", "on"),
            ("1MiB", "off", "off"),
            ("1KiB", None, "off"),  # a size that holds not one set of rows: no cache after all
        ):
            for name, value in (("PLE_UM_ROW_CACHE", row_cache), ("PLE_UM_DIRECT_READS", direct)):
                if value is None:
                    monkeypatch.delenv(name, raising=False)
                else:
                    monkeypatch.setenv(name, value)
            assert cold_knobs(probe)["PLE_UM_DIRECT_READS"] == expected, (row_cache, direct)


def _run(make_checkpoint, hierarchy, limits, dtype="fp8"):
    layout = make_checkpoint(num_rows=30000, row_dim=160, dtype=dtype, shards=8, files=4)
    cfg = Config(directory=layout.directory, rows=(16, 256), ids=parse_ids("uniform,zipf:1.1"), repeats=3)
    cfg.modes, cfg.device, cfg.memory_limits, cfg.warmup_s = ("cpu",), "cpu", limits, 0.2
    lines: list[str] = []
    result = cold.run(cfg, log=lines.append, hierarchy=hierarchy)
    return layout, result, lines


def _check_figures(result, layout, enforced: bool, row_cache: bool) -> None:
    """Every figure's bookkeeping; ``row_cache``: the steady table has one (the cold one never)."""
    assert list(result["ids"]) == ["uniform", "zipf:1.1"]
    rate = result["storage"]["sizes"]["4096"]["64"]["reads_per_s"]
    for key, entry in result["limits"].items():
        assert entry["bytes"] == int(key) and entry["enforced"] is enforced, entry
        runs = entry["modes"]["cpu"]
        assert runs["timing"] == "eager"
        assert "no row cache" in runs["cold_row_reads"], runs["cold_row_reads"]
        # The cold table's misses are read as the steady table's: O_DIRECT beside a row cache.
        assert ("O_DIRECT" in runs["cold_row_reads"]) is ("O_DIRECT" in runs["row_reads"]), runs
        assert ("a row cache of" in runs["row_reads"]) is row_cache, runs["row_reads"]
        for dist in ("uniform", "zipf:1.1"):
            assert (
                runs["warmup"][dist]["calls"] >= 10
                and runs["warmup"][dist]["rows"] == 256 * runs["warmup"][dist]["calls"]
            )
            for n in ("16", "256"):
                c, s = runs[dist][n]["cold"], runs[dist][n]["steady"]
                assert c["calls"] == s["calls"] == 3
                assert c["p10_us"] <= c["median_us"] <= c["p90_us"]
                assert c["ceiling_us"] == pytest.approx(int(n) / rate * 1e6)
                assert c["vs_ceiling"] == pytest.approx(c["median_us"] / c["ceiling_us"])
                assert 0 <= s["page_cache_hits"] <= 1
                if fs_type(layout.directory) != "tmpfs":
                    assert c["page_cache_hits"] == 0  # dropped before each cold call
                assert c["row_cache_hits"] is None  # the cold calls' table has no row cache
                # A cold call reads its rows from the files (its pages dropped), each id once (an
                # NVFP4 table's block scales too), on one thread (at most INLINE_ROWS ids), and
                # waits for the reads within its own time: their mean is at most the mean call,
                # which for 3 calls is at most their p90.
                if fs_type(layout.directory) != "tmpfs":
                    assert 0 < c["file_reads_per_call"] <= int(n) * (2 if layout.is_nvfp4 else 1)
                    assert 0 < c["read_wait_us"] <= c["p90_us"] and "read_thread_us" not in c
                alone = runs[dist][n].get("steady_page_cache")
                if row_cache:
                    assert 0 <= s["row_cache_hits"] <= 1
                    if dist == "zipf:1.1":
                        assert s["row_cache_hits"] > 0  # hot rows come again
                    # The same limit without the row cache: the page cache alone, timed as steady.
                    assert alone["calls"] == 3 and alone["row_cache_hits"] is None
                    assert alone["p10_us"] <= alone["median_us"] <= alone["p90_us"]
                    assert 0 <= alone["page_cache_hits"] <= 1
                else:
                    assert s["row_cache_hits"] is None
                    assert alone is None  # the steady table is the page cache's already
            warm = runs["warmup"][dist]["row_cache_hits"]
            assert (warm is not None and 0 <= warm <= 1) if row_cache else warm is None
            alone = runs.get("warmup_page_cache", {}).get(dist)
            assert (alone["calls"] >= 10 and alone["row_cache_hits"] is None) if row_cache else alone is None


def test_a_run_under_a_real_memory_cgroup(make_checkpoint):
    probe = MemoryLimit.open(512 << 20, f"ple-um-probe-{os.getpid()}")
    probe.close()
    if not probe.enforced:
        pytest.skip(f"no memory cgroup here: {probe.why}")
    layout, result, lines = _run(make_checkpoint, None, (768 << 20,))
    # The child runs under PLE_UM_FIT=spills (ple_um/bench/memlimit.py): PLE_UM_ROW_CACHE=auto gives it
    # a row cache (none on tmpfs).
    row_cache = fs_type(layout.directory) != "tmpfs"
    _check_figures(result, layout, enforced=True, row_cache=row_cache)
    (entry,) = result["limits"].values()
    assert entry["how"].startswith("cgroup v") and 0 < entry["peak_bytes"] <= 768 << 20
    assert entry["status"]["RssAnon"].endswith("kB")
    assert any(line.startswith("memory limit 768.00 MiB: cgroup v") for line in lines)
    text = report.format_report(result)
    steady = entry["modes"]["cpu"]["zipf:1.1"]["16"]["steady"]
    share = f"{100 * steady['row_cache_hits']:.1f}%" if row_cache else "-"
    assert (
        "| ple-um cpu (eager) | 16 |" in text
        and f"{100 * steady['page_cache_hits']:.1f}% | {share} |" in text
    )
    assert f"ple-um cpu, steady state: {entry['modes']['cpu']['row_reads']}" in text
    assert f"memory limit 768.00 MiB: {entry['how']}, peak " in text
    group = entry["how"].split()[2].rstrip(":")
    assert not os.path.exists(group)  # the group is gone


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])  # rows of 1 and of 2 bytes a value
def test_a_run_where_no_cgroup_can_be_made_says_so(make_checkpoint, tmp_path, dtype):
    no_group = (None, "injected: no memory controller")
    layout, result, _ = _run(make_checkpoint, no_group, (1 << 30, 2 << 30), dtype=dtype)
    # The row cache is held to the limit instead: PLE_UM_ROW_CACHE=<limit> in the child.
    _check_figures(result, layout, enforced=False, row_cache=True)
    for entry in result["limits"].values():
        assert entry["how"] == "not enforced: injected: no memory controller"
        assert entry["peak_bytes"] is None
        assert entry["row_cache_knob"] == f"PLE_UM_ROW_CACHE={entry['bytes']}"
        held = min(entry["bytes"], layout.num_rows * (layout.row_bytes + SLOT_OVERHEAD))  # at most the table
        assert f"a row cache of {format_bytes(held)}" in entry["modes"]["cpu"]["row_reads"]
    text = report.format_report(result)
    assert "memory limit 1.00 GiB: not enforced: injected: no memory controller" in text
    assert "the page cache is the machine's here: only ple-um's row cache is held to the limit" in text
    assert (
        "x storage: the cold median over rows / the storage's 4 KiB random reads per second at depth 64 "
        "(below 1x: faster than it, above 1x: slower)" in text
    )
    assert text.count("| ple-um cpu (eager) | 256 |") == 4  # 2 limits x 2 id distributions
    alone = next(iter(result["limits"].values()))["modes"]["cpu"]["uniform"]["256"]["steady_page_cache"]
    assert f"| {report.cell(alone, rate=False)} | {100 * alone['page_cache_hits']:.1f}% |" in text
    assert "page cache only: steady us [p10-p90] | its page cache hits |" in text
    from ple_um.bench.plot import draw

    draw(result, str(tmp_path / "limits.png"))
    assert (tmp_path / "limits.png").read_bytes().startswith(b"\x89PNG")
    assert storage.ceiling_us(result["storage"], 1024) > 0


def test_a_child_killed_by_its_limit_is_said_so(make_checkpoint):
    """A limit too small for the interpreter itself: the OOM killer ends the child, the figures
    say why instead of a traceback."""
    probe = MemoryLimit.open(512 << 20, f"ple-um-probe-{os.getpid()}")
    probe.close()
    if not probe.enforced:
        pytest.skip(f"no memory cgroup here: {probe.why}")
    _, result, _ = _run(make_checkpoint, None, (32 << 20,))
    (entry,) = result["limits"].values()
    assert "OOM killer" in entry["failed"] and "modes" not in entry
    assert "no figures: the child was killed (SIGKILL)" in report.format_report(result)


def _serve(layout, **extra) -> dict:
    """The child's side of a run (``cold.serve``) in this process: the cpu mode, 16 and 64 rows."""
    request = {
        "directory": layout.directory,
        "layer": layout.layer,
        "device": "cpu",
        "modes": ["cpu"],
        "ids": "uniform",
        "repeats": 3,
        "warmup_s": 0.0,
        "seed": 0,
        "rows": [16, 64],
    }
    return cold.serve(request | extra)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_a_cold_calls_bytes_per_second_count_what_it_reads(make_checkpoint, dtype):
    """A call's bytes are a row's and its block scales' (an NVFP4 table's): the rule of the other
    runs' figures (``runner.read_bytes``), cold and steady alike."""
    from ple_um.bench.runner import read_bytes

    layout = make_checkpoint(num_rows=4000, row_dim=64, dtype=dtype, shards=4)
    per_row = layout.row_bytes + (layout.scale_layout().row_bytes if layout.is_nvfp4 else 0)
    assert read_bytes(layout) == per_row
    runs = _serve(layout)["modes"]["cpu"]["uniform"]
    for n, row in runs.items():
        for key in ("cold", "steady"):
            fig = row[key]
            assert fig["gbps"] == pytest.approx(int(n) * per_row / (fig["median_us"] * 1e-6) / 1e9), (n, key)


def test_a_steady_state_that_fails_keeps_the_cold_figures_and_says_why(
    make_checkpoint, monkeypatch, tmp_path
):
    """The steady table opens as the environment says; a knob there it refuses fails the steady
    state alone: the cold figures (their own knobs) stand, the failure is named in the figures, the
    report and the CLI's list of what was not measured (which makes it exit 4)."""
    from ple_um.cli.bench import unmeasured

    layout = make_checkpoint(num_rows=4000, row_dim=64, dtype="fp8", shards=4)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "lots")
    runs = _serve(layout)["modes"]["cpu"]
    assert "skipped" not in runs, runs
    assert runs["steady_failed"].startswith("the steady state: "), runs
    assert "PLE_UM_ROW_CACHE" in runs["steady_failed"]
    for n in ("16", "64"):
        assert runs["uniform"][n]["cold"]["calls"] == 3 and "steady" not in runs["uniform"][n]
    result = {
        "ids": {"uniform": {}},
        "storage": {"sizes": {"4096": {"how": "x", "64": {"reads_per_s": 1e5, "us_per_read": 10.0}}}},
        "limits": {
            "1024": {"bytes": 1024, "enforced": False, "how": "not enforced: none", "modes": {"cpu": runs}}
        },
    }
    text = "\n".join(report._limit_lines(result["limits"]["1024"], result["ids"]))
    assert f"ple-um cpu: failed (its cold figures stand): {runs['steady_failed']}" in text
    assert "| ple-um cpu (eager) | 64 |" in text
    assert unmeasured(result, ("cpu",)) == [f"ple-um cpu under not enforced: none: {runs['steady_failed']}"]
    from ple_um.bench.plot import plot_limits

    plot_limits(result | {"device": "cpu", "table": {"bytes": layout.nbytes}}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_the_plot_draws_each_curve_in_the_order_of_its_limits(tmp_path):
    """--memory-limit 4G,1G,2G runs the limits in the order given; each curve of the plot joins its
    points from the smallest limit to the largest, each time at its own limit (a line drawn in the
    order given would run 4 -> 1 -> 2 GiB, back over itself, and miss the 2 -> 4 segment)."""
    pytest.importorskip("matplotlib")
    from ple_um.bench import plot

    def figures(us: float) -> dict:
        return {"uniform": {"16": {"cold": {"median_us": us}, "steady": {"median_us": us / 10}}}}

    given = (4, 1, 2)
    limits = {str(g << 30): {"bytes": g << 30, "modes": {"cpu": figures(100.0 * g)}} for g in given}
    result = {"ids": {"uniform": {}}, "limits": limits, "device": "cpu", "table": {"bytes": 1 << 20}}
    curves = plot.limit_curves(result)
    assert list(curves) == [("cpu", "uniform", "16")]
    line = curves["cpu", "uniform", "16"]
    assert line["x"] == [1.0, 2.0, 4.0]
    assert line["cold"] == [100.0, 200.0, 400.0] and line["steady"] == [10.0, 20.0, 40.0]
    assert all(v != v for v in line["alone"])  # no page-cache-only figure: NaN, not drawn
    plot.plot_limits(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_cold_calls_that_found_their_rows_in_the_page_cache_are_marked(make_checkpoint):
    """A page another process maps stays in the page cache when the child drops the table's pages
    (a server serving the same checkpoint; on tmpfs the files are their page cache): its cold calls
    then find their rows in memory, and the report says so beside the figure (the share is the
    JSON's ``page_cache_hits``), not a cold figure that is not one."""
    import mmap

    layout = make_checkpoint(num_rows=30000, row_dim=160, dtype="fp8", shards=8, files=4)
    cfg = Config(directory=layout.directory, rows=(16,), ids=parse_ids("uniform"), repeats=3)
    cfg.modes, cfg.device, cfg.memory_limits, cfg.warmup_s = ("cpu",), "cpu", (1 << 30,), 0.0
    held = []
    try:
        for path in layout.files:  # every page mapped and touched here, as a server would hold them
            with open(path, "rb") as f:
                held.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            sum(held[-1][i] for i in range(0, len(held[-1]), PAGE))
        result = cold.run(cfg, log=lambda line: None, hierarchy=(None, "injected: no memory controller"))
    finally:
        for m in held:
            m.close()
    c = result["limits"][str(1 << 30)]["modes"]["cpu"]["uniform"]["16"]["cold"]
    assert c["page_cache_hits"] == 1.0
    text = report.format_report(result)
    mark = f"{report.cell(c, rate=False)} (100.0% of its rows in the page cache: not cold)"
    assert f"| ple-um cpu (eager) | 16 | {mark} |" in text
