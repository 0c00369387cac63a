"""The bench for tables larger than memory (``ple-um bench --memory-limit SIZE,...``): for each
limit, ple-um's lookups run in a child process held to that many bytes by a memory cgroup
(``bench/memlimit.py``; where none can be made, the child runs unlimited and the figures say so,
and only ple-um's own memory, its row cache, is held to the limit through ``PLE_UM_ROW_CACHE``),
timed cold and in the steady state; the storage's ceiling measured in the same run
(``bench/storage.py``) and every cold figure's ratio to it.

Only the modes that read the table where it lies can be cold: ``cpu`` and ``ats``. ``registered``
pins the table and ``device`` copies it into GPU memory, so neither is run here.

The child (``serve``) runs as ``python -m ple_um.bench.cold``: the request as JSON on stdin, the
figures as JSON on stdout (``memlimit.child_main``); ``tools/profile_shared_table.py`` runs its
steady state (``timed_runs``) in several processes at once. It opens the table in each mode asked
for and times lookups cold (every page of the table dropped before each call, in a table without a
row cache) and in the steady state (after a warm-up under the limit, in a table opened as the
environment says, its row cache included). Before each cold call the table's pages are dropped
inside this process, the one that maps them: ``MADV_DONTNEED`` over its own mappings of the files
(from ``/proc/self/maps``), then ``POSIX_FADV_DONTNEED`` on each file (pages another process maps
stay in the page cache). Before each timed call, the share of its rows already in the page cache
(mincore) and, where the table has a row cache (``stats()["row_cache"]``), that cache's hit rate
over the timed calls (its counters' differences around them). The cold calls' table is opened with
``PLE_UM_ROW_CACHE=0`` (``cold_knobs``): a row cache is not dropped with the pages, and it would
serve a cold call the rows of earlier ones (and of the self-test at open). Its misses are read as
the steady table's are (O_DIRECT beside a row cache), so the cold figures are those of the reads a
table opened with the defaults makes; it is taken to fit (``PLE_UM_FIT=fits``), so that in the
``ats`` mode its kernel faults the rows in, where the steady table, which spills (the child's
``PLE_UM_FIT=spills``, ``memlimit._child_env``), serves every lookup by the host path.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from ple_um.access.capabilities import on_device, read_capabilities, resolve_device
from ple_um.access.probe import reason_if_unsatisfied
from ple_um.bench import storage
from ple_um.bench.config import Config, bench_layout, child_request, open_ple_um
from ple_um.bench.ids import parse_ids
from ple_um.bench.memlimit import ROW_CACHE_KNOB, Hierarchy, child_main, run_limited
from ple_um.bench.runner import read_bytes, run_header
from ple_um.bench.timing import Timer, capture, lookup_output, row_cache_hits, summary
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.lookup.rowcopy import INLINE_ROWS
from ple_um.mapping import MappedShards
from ple_um.operating import resident_rows, row_cache_plan
from ple_um.residency import FileMapping, evict_pages, file_mappings
from ple_um.units import format_bytes

COLD_MODES = ("cpu", "ats")


def cold_modes(asked: tuple[str, ...] | None, device: torch.device) -> tuple[tuple[str, ...], dict[str, str]]:
    """The modes to run (those asked, else every cold mode this device can run) and why the
    others asked for are left out."""
    caps = read_capabilities(device)
    left_out: dict[str, str] = {}
    chosen = []
    for mode in asked or COLD_MODES:
        if mode not in COLD_MODES:
            left_out[mode] = "it holds the table in memory (pinned, or copied to the GPU): it cannot be cold"
            continue
        why = reason_if_unsatisfied(mode, caps, None, None)
        if why is None:
            chosen.append(mode)
        elif asked:
            left_out[mode] = why
    return tuple(chosen), left_out


def _describe(cfg: Config, layout: ShardLayout, device: torch.device) -> dict:
    cuda, warmup_s = device.type == "cuda", cfg.warmup_s
    return {
        **run_header(cfg, layout, device),
        "method": {
            "cold": "every page of the table dropped before each call (MADV_DONTNEED on the child's own "
            f"mappings, then POSIX_FADV_DONTNEED), in a table opened with {ROW_CACHE_KNOB}=0 (no row cache "
            "to hold the rows of earlier calls), its misses read as the steady table's (O_DIRECT beside a "
            "row cache)",
            "steady": f"the pages dropped, then at least {warmup_s:g} s of lookups of the largest batch "
            "under the limit, then every batch size",
            "timing": "CUDA graph replays" if cuda else "eager calls, perf_counter",
            "ceiling": "rows / the storage's 4 KiB random reads per second at depth 64",
            "timed_calls": cfg.repeats,
            "warmup_s": warmup_s,
        },
    }


def run(
    cfg: Config, log: Callable[[str], None] = print, hierarchy: tuple[Hierarchy | None, str] | None = None
) -> dict:
    """The figures for every limit in ``cfg.memory_limits`` (``hierarchy``: as ``memlimit.run_limited``)."""
    device = resolve_device(cfg.device)
    layout = bench_layout(cfg)
    modes, left_out = cold_modes(cfg.modes, device)
    result = _describe(cfg, layout, device)
    result["left_out"] = left_out
    log(f"table: {format_bytes(layout.nbytes)} in {layout.parts} shards ({layout.directory})")
    log(f"modes: {', '.join(modes) or 'none'}")
    log("storage: random reads from the table's files ...")
    result["storage"] = storage.ceiling(table_files(layout))
    request = child_request(cfg, layout, device, modes) | {"rows": list(cfg.rows)}
    result["limits"] = run_limited(cfg.memory_limits, request, "ple_um.bench.cold", log, hierarchy)
    vs_ceiling(result)
    return result


def vs_ceiling(result: dict) -> None:
    """Add ``vs_ceiling`` to every cold figure: its median over the storage's ceiling for as many
    rows (one 4 KiB read each at depth 64)."""
    for entry in result["limits"].values():
        for runs in entry.get("modes", {}).values():
            for dist in result["ids"]:
                for n, row in runs.get(dist, {}).items():
                    ceiling = storage.ceiling_us(result["storage"], int(n))
                    if ceiling:
                        row["cold"]["ceiling_us"] = ceiling
                        row["cold"]["vs_ceiling"] = row["cold"]["median_us"] / ceiling


# The knobs of the steady state without a row cache: the page cache alone holds the rows read (and
# a GPU mode's kernel reads them there: the table taken to fit, ``lookup.fit``).
PAGE_CACHE_KNOBS = {"PLE_UM_ROW_CACHE": "0", "PLE_UM_DIRECT_READS": "off", "PLE_UM_FIT": "fits"}


def own_mappings(paths: set[str]) -> list[FileMapping]:
    """Every mapping of this process of one of ``paths`` (/proc/self/maps)."""
    return [m for m in file_mappings() if m.path in paths]


def table_files(layout: ShardLayout) -> list[str]:
    """The files a lookup of ``layout`` reads: its shards', and an NVFP4 table's block scales'."""
    return list(layout.files) + (list(layout.scale_layout().files) if layout.is_nvfp4 else [])


def drop_table_pages(files: list[str]) -> None:
    """Drop the table's pages: this process's mappings of ``files`` emptied (MADV_DONTNEED), then
    the files' pages evicted from the page cache, written back first (a table just written);
    pages another process maps stay (``residency.evict_pages``)."""
    evict_pages(files, own_mappings(set(files)))


def cold_knobs(probe: MappedShards) -> dict[str, str]:
    """The knobs of the cold calls' table: no row cache, so that none of a cold call's rows is in
    memory, and misses read as the steady table, opened now under the environment's knobs, would
    read its own (``operating.row_cache_plan`` over ``probe``, a mapping of the table's rows: O_DIRECT
    beside a row cache, as ``PLE_UM_DIRECT_READS=auto`` does)."""
    direct = row_cache_plan(probe, None).get("direct", False)
    return PAGE_CACHE_KNOBS | {"PLE_UM_DIRECT_READS": "on" if direct else "off"}


class _Lookup:
    """One batch size's lookup into a buffer allocated once: eager, or its CUDA graph replayed."""

    def __init__(self, table, layout: ShardLayout, n: int, device: torch.device, graph: bool) -> None:
        self.table, self.device = table, device
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.out = lookup_output(table, layout, n, device)
        self.graph = capture(self.call)[0] if graph else None

    def call(self) -> None:
        self.table.lookup(self.ids, out=self.out)

    def load(self, ids: np.ndarray) -> None:
        """The call's ids into its buffer (outside the timed call)."""
        self.ids.copy_(torch.from_numpy(ids))

    def go(self, _k: int = 0) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.call()


def _reads(table, stats: dict) -> tuple[int, float] | None:
    """The table's reads from its files so far, and the seconds its reading threads waited for them
    (added up over the threads), from its ``stats()``; None where its lookups read no row through the
    reader of misses, which counts them: a GPU mode (its kernel faults rows in; its host path serves
    only big lookups), or misses faulted in through the mapping."""
    if table.mode != "cpu" or stats["file_reader"] is None:
        return None
    return int(stats["file_reads"]), float(stats["file_read_seconds"])


def _timed(call: _Lookup, draws, table, probe: MappedShards, timer: Timer, drop_files, nbytes: int) -> dict:
    """Time one call per id set of ``draws``: its seconds, the share of its rows in the page cache
    before it, the row cache's hit rate over all of them, and per call (means, from the counters'
    differences around the calls) the reads from the files (an NVFP4 table's block scales are reads
    of their own) and, for a call one thread reads (at most ``INLINE_ROWS`` ids), the time it
    waited for them; a bigger call's reads are spread over the pool, whose waits add up past the
    call's own time (``read_thread_us``). ``drop_files``: drop the table's pages before each call
    (cold)."""
    times, resident = [], []
    before = table.stats()
    for ids in draws:
        if drop_files:
            drop_table_pages(drop_files)
        resident.append(float(resident_rows(probe, ids).mean()))
        call.load(ids)
        times.append(timer.once(call.go, 0))
    row = summary(times, nbytes)
    row["page_cache_hits"] = float(np.mean(resident))
    after = table.stats()
    row["row_cache_hits"] = row_cache_hits(before, after)
    reads_before = _reads(table, before)
    if reads_before is not None:
        reads, waited = (b - a for a, b in zip(reads_before, _reads(table, after), strict=True))
        row["file_reads_per_call"] = reads / len(draws)
        key = "read_wait_us" if call.ids.numel() <= INLINE_ROWS else "read_thread_us"
        row[key] = waited / len(draws) * 1e6
    return row


def _warm_up(call: _Lookup, dist, rng, layout, probe, timer, seconds: float) -> dict:
    """Lookups of ``call``'s batch size, fresh ids each, for at least ``seconds`` (and 10 calls):
    the table's hot rows come into memory as far as the limit lets them. The share of a call's
    rows already in the page cache, first and last, and the row cache's hit rate over the warm-up
    say whether it settled."""
    t0, calls, shares = time.perf_counter(), 0, []
    before = call.table.stats()
    n = call.ids.numel()
    while calls < 10 or time.perf_counter() - t0 < seconds:
        ids = dist.draw(rng, layout.num_rows, n)
        if calls < 10 or calls % 10 == 0:
            shares.append(float(resident_rows(probe, ids).mean()))
        call.load(ids)
        call.go()
        calls += 1
    timer.sync()
    return {
        "calls": calls,
        "rows": calls * n,
        "seconds": time.perf_counter() - t0,
        "first_hits": shares[0],
        "last_hits": shares[-1],
        "row_cache_hits": row_cache_hits(before, call.table.stats()),
    }


def open_with(layout: ShardLayout, mode: str, device: torch.device, knobs: dict[str, str]):
    """``layout``'s table in ``mode``, opened with the environment knobs ``knobs`` set (a table
    reads them at open; the environment is restored after)."""
    saved = {name: os.environ.get(name) for name in knobs}
    os.environ.update(knobs)
    try:
        return open_ple_um(layout, device, mode)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _mode(mode: str, layout: ShardLayout, request: dict, device: torch.device) -> dict:
    """Every batch size cold, in a table without a row cache; then the steady state
    (``timed_runs``) in a table opened as the environment says and, where that table has a row
    cache, again in one without (the page cache alone under the same limit)."""
    files = table_files(layout)
    with MappedShards(layout) as probe:
        drop_table_pages(files)
        with open_with(layout, mode, device, cold_knobs(probe)) as table:
            graph = device.type == "cuda" and table.capture_safe
            entry: dict = {"capture_safe": table.capture_safe, "timing": "graph replay" if graph else "eager"}
            entry["cold_row_reads"] = table.row_reads
            rng = np.random.default_rng(request["seed"])
            timed_runs(table, layout, request, device, graph, probe, files, rng, entry, "cold")
        # The steady state: a failure of it leaves the cold figures standing, and says why.
        what, rng = "the steady state", np.random.default_rng(request["seed"] + 1)
        try:
            graph, with_cache = _steady(mode, layout, request, device, graph, probe, files, rng, entry)
            if with_cache:  # the same limit's memory left to the page cache alone, for comparison
                what = "the steady state without its row cache"
                drop_table_pages(files)
                with open_with(layout, mode, device, PAGE_CACHE_KNOBS) as table:
                    timed_runs(
                        table, layout, request, device, graph, probe, files, rng, entry, "steady_page_cache"
                    )
        except Exception as exc:  # noqa: BLE001 - reported beside the cold figures, which stand
            entry["steady_failed"] = f"{what}: {type(exc).__name__}: {exc}"
    return entry


def _steady(mode, layout, request, device, graph: bool, probe, files, rng, entry: dict) -> tuple[bool, bool]:
    """The steady state into ``entry``, in a table opened as the environment says, its ids drawn
    from ``rng`` (not the cold calls': those ids are not repeated): whether its calls were graph
    replays, and whether that table has a row cache."""
    drop_table_pages(files)  # opened out of the page cache, as a table larger than memory is
    with open_with(layout, mode, device, {}) as table:
        if graph and not table.capture_safe:
            graph, entry["timing"] = False, "graph replay cold, eager steady"
        entry["row_reads"] = table.row_reads
        with_cache = table.stats().get("row_cache") is not None
        timed_runs(table, layout, request, device, graph, probe, files, rng, entry, "steady")
    return graph, with_cache


# The key of each steady state's warm-up in a mode's figures: ``entry[key][dist]``.
WARMUPS = {"steady": "warmup", "steady_page_cache": "warmup_page_cache"}


def timed_runs(table, layout, request, device, graph: bool, probe, files, rng, entry: dict, key: str) -> None:
    """Per id distribution, every batch size timed, as ``entry[dist][n][key]``: ``cold``, the
    table's pages (``files``) dropped before each call; a steady state (``WARMUPS``), the pages
    dropped once (where ``files`` are given), then a warm-up at the largest batch size, then the
    timed calls."""
    timer = Timer(device)
    calls = {n: _Lookup(table, layout, n, device, graph) for n in request["rows"]}
    for dist in parse_ids(request["ids"]):
        if key in WARMUPS:
            if files:
                drop_table_pages(files)  # the steady state grows from nothing, under the limit
            entry.setdefault(WARMUPS[key], {})[dist.name] = _warm_up(
                calls[max(calls)], dist, rng, layout, probe, timer, request["warmup_s"]
            )
        for n, call in calls.items():
            draws = [dist.draw(rng, layout.num_rows, n) for _ in range(request["repeats"])]
            row = entry.setdefault(dist.name, {}).setdefault(str(n), {})
            dropped = files if key == "cold" else None
            row[key] = _timed(call, draws, table, probe, timer, dropped, n * read_bytes(layout))
            times = ", ".join(f"{k.replace('_', ' ')} {v['median_us']:.1f} us" for k, v in row.items())
            print(f"{table.mode} {dist.name} {n} rows: {times}", file=sys.stderr, flush=True)


def serve(request: dict) -> dict:
    """Every mode of ``request`` (``_mode``); a mode this process cannot run is reported as
    skipped."""
    device = torch.device(request["device"])
    layout = read_layout(request["directory"], request["layer"])
    out: dict = {"pid": os.getpid(), "modes": {}}
    with on_device(device):  # the events and graphs of the timed calls: the device's
        for mode in request["modes"]:
            try:
                out["modes"][mode] = _mode(mode, layout, request, device)
            except Exception as exc:  # noqa: BLE001 - a mode this child cannot run is reported, not fatal
                out["modes"][mode] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


if __name__ == "__main__":
    child_main(serve)
