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

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import torch

from ple_um.access.capabilities import read_capabilities, resolve_device
from ple_um.access.probe import reason_if_unsatisfied
from ple_um.bench import storage
from ple_um.bench.config import Config, default_table
from ple_um.bench.memlimit import Hierarchy, MemoryLimit
from ple_um.bench.runner import run_header
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.units import format_bytes

COLD_MODES = ("cpu", "ats")
COLD_ROWS = (16, 1024, 16384)
# Seconds of lookups before the steady state is timed (and at least 10 calls).
WARMUP_S = 5.0
# The row cache's size knob: held to the limit when no cgroup can be.
ROW_CACHE_KNOB = "PLE_UM_ROW_CACHE"


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


def _child_env(limit: MemoryLimit) -> dict[str, str]:
    env = dict(os.environ)
    # The steady state measures the row cache under the limit, whatever the table's size (one that
    # fits the limit would get none under PLE_UM_FIT=auto); the caller's setting wins.
    env.setdefault("PLE_UM_FIT", "spills")
    if not limit.enforced:
        env[ROW_CACHE_KNOB] = str(limit.limit)
    return env


def run_child(
    request: dict, limit: MemoryLimit, log: Callable[[str], None], module: str = "ple_um.bench.cold_child"
) -> dict:
    """One child (``python -m module``, the request on its stdin) under ``limit``: its figures (the
    JSON on its stdout), or why it gave none (killed by the limit's OOM killer, an error). The child
    leads a session of its own: an interrupt (Ctrl-C) reaches this process alone, which then kills
    the child and everything in its group (``stop_child``)."""
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
    try:
        stdout, stderr = proc.communicate(json.dumps(request))
    except BaseException:
        stop_child(proc, limit)
        raise
    for line in stderr.splitlines():
        log(f"  {line}")
    if proc.returncode == 0:
        return json.loads(stdout)
    if proc.returncode == -9 and limit.enforced:
        why = (
            "the child was killed (SIGKILL), by the limit's OOM killer most likely: "
            f"{format_bytes(limit.limit)} must hold the process itself (the interpreter, torch, a CUDA "
            "context) besides the page cache"
        )
    else:
        tail = stderr.strip().splitlines()[-1:] or [""]
        why = f"the child exited with {proc.returncode}: {tail[0]}"
    return {"failed": why}


def run_limited(
    limit: int,
    name: str,
    hierarchy: tuple[Hierarchy | None, str] | None,
    request: dict,
    log: Callable[[str], None],
    module: str = "ple_um.bench.cold_child",
) -> dict:
    """``run_child`` in a memory group called ``name`` held to ``limit`` bytes: the limit (bytes,
    whether enforced and how, the group's peak) and the child's figures. The group is removed
    whatever happens; on an interrupt a group that cannot be is named in a warning, and the
    interrupt is what is raised."""
    held = MemoryLimit.open(limit, name, hierarchy)
    try:
        log(f"memory limit {format_bytes(limit)}: {held.describe()}")
        found = run_child(request, held, log, module)
        entry = {"bytes": limit, "enforced": held.enforced, "how": held.describe(), "peak_bytes": held.peak()}
    except BaseException:
        try:
            held.close()
        except OSError as exc:
            log(f"warning: {exc.strerror}")
        raise
    held.close()
    if not held.enforced:
        entry["row_cache_knob"] = f"{ROW_CACHE_KNOB}={limit}"
    entry.update(found)
    return entry


def stop_child(proc: subprocess.Popen, limit: MemoryLimit) -> None:
    """Kill an unfinished child (its session: it and what it started) and every process in its
    memory group, and reap it, so that the group can be removed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    limit.kill()
    proc.kill()
    proc.wait()


def _describe(cfg: Config, layout: ShardLayout, device: torch.device, warmup_s: float) -> dict:
    cuda = device.type == "cuda"
    return {
        **run_header(cfg, layout, device),
        "ids": {dist.name: dist.describe() for dist in cfg.ids},
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
    cfg: Config,
    limits: tuple[int, ...],
    log: Callable[[str], None] = print,
    *,
    warmup_s: float = WARMUP_S,
    hierarchy: tuple[Hierarchy | None, str] | None = None,
) -> dict:
    """The figures for every limit in ``limits``. ``hierarchy`` stands for the machine's memory
    cgroup (``memlimit.find_hierarchy()``'s answer; ``(None, why)``: there is none)."""
    device = resolve_device(cfg.device)
    layout = read_layout(cfg.directory or default_table(cfg), cfg.layer)
    modes, left_out = cold_modes(cfg.modes, device)
    result = _describe(cfg, layout, device, warmup_s)
    result["left_out"] = left_out
    files = list(layout.files) + (list(layout.scale_layout().files) if layout.is_nvfp4 else [])
    log(f"table: {format_bytes(layout.nbytes)} in {layout.parts} shards ({layout.directory})")
    log(f"modes: {', '.join(modes) or 'none'}")
    log("storage: random reads from the table's files ...")
    result["storage"] = storage.ceiling(files)
    request = {
        "directory": layout.directory,
        "layer": layout.layer,
        "modes": list(modes),
        "device": str(device),
        "rows": list(cfg.rows),
        "ids": cfg.ids_text or ",".join(dist.name for dist in cfg.ids),
        "repeats": cfg.repeats,
        "warmup_s": warmup_s,
        "seed": cfg.seed,
    }
    result["limits"] = {}
    for k, limit in enumerate(limits):
        name = f"ple-um-bench-{os.getpid()}-{k}"
        result["limits"][str(limit)] = run_limited(limit, name, hierarchy, request, log)
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
