"""The bench for tables larger than memory (``ple-um bench --memory-limit SIZE,...``): for each
limit, ple-um's lookups run in a child process held to that many bytes by a memory cgroup
(``bench/memlimit.py``; where none can be made, the child runs unlimited and the figures say so,
and only ple-um's own memory, its row cache, is held to the limit through ``PLE_UM_ROW_CACHE``),
timed cold and in the steady state (``bench/cold_child.py``); the storage's ceiling measured in the
same run (``bench/storage.py``) and every cold figure's ratio to it.

Only the modes that read the table where it lies can be cold: ``cpu`` and ``ats``. ``registered``
pins the table and ``device`` copies it into GPU memory, so neither is run here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ple_um.access.capabilities import read_capabilities, resolve_device
from ple_um.access.probe import reason_if_unsatisfied
from ple_um.bench import storage
from ple_um.bench.cold_child import table_files
from ple_um.bench.config import Config, bench_layout, child_request
from ple_um.bench.memlimit import ROW_CACHE_KNOB, Hierarchy, run_limited
from ple_um.bench.runner import run_header
from ple_um.checkpoint import ShardLayout
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
    result["limits"] = run_limited(cfg.memory_limits, request, "ple_um.bench.cold_child", log, hierarchy)
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
