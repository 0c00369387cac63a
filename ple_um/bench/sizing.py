"""Whether a bench run fits this machine, before anything is written or timed (``check_fits``):
the synthetic table against the free disk and the file-size limit, the run's peak against the
memory free (the table's copies, the largest batch's buffers), a memory limit against what its
child holds before it reads a row. Each refusal (BenchRefused) names what holds the bytes and
the option to change."""

from __future__ import annotations

import os
import resource
import shutil

from ple_um.bench.config import ENGRAM_HEAD_DIM, MATMUL_SIZE, POOL_STEPS, Config, table_path, table_written
from ple_um.checkpoint import ShardLayout
from ple_um.errors import PleUmError
from ple_um.synthetic import MAX_FILES
from ple_um.units import format_bytes

# Host memory a run holds besides the table and its copies: the interpreter, torch, the id sets
# drawn ahead and the outputs of the largest batch.
RUN_OVERHEAD_BYTES = 1 << 30
# Free disk kept beside a written table, so that the bench never fills the filesystem.
DISK_MARGIN_BYTES = 256 << 20


class BenchRefused(PleUmError, RuntimeError):
    """The bench would not fit this machine (disk, file-size limit, memory); nothing was written."""


def _existing_parent(path: str) -> str:
    """``path`` or its nearest ancestor that exists (where a folder would be created)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def largest_file_bytes(cfg: Config) -> int:
    """The largest file of the synthetic table: the shards are split into ``synthetic.MAX_FILES``
    contiguous runs, as ``write_checkpoint`` splits them (the header and the scale add a few KiB)."""
    per_shard = -(-cfg.num_rows // cfg.shards)
    most_shards = -(-cfg.shards // min(cfg.shards, MAX_FILES))
    return most_shards * per_shard * cfg.row_bytes + (64 << 10)


def check_disk(cfg: Config) -> None:
    """Refuse (BenchRefused) a synthetic table that the cache folder's filesystem, or the process's
    file-size limit (``ulimit -f``), cannot hold; nothing to check when it is already written."""
    path = table_path(cfg)
    if table_written(path):
        return
    table_bytes = cfg.table_bytes(None)
    where = _existing_parent(path)
    free = shutil.disk_usage(where).free
    if table_bytes + DISK_MARGIN_BYTES > free:
        raise BenchRefused(
            f"the synthetic table ({format_bytes(table_bytes)}, --size) does not fit the free disk of "
            f"{where} ({format_bytes(free)} free, {format_bytes(DISK_MARGIN_BYTES)} kept free): give a "
            "smaller --size, or PLE_UM_CACHE_DIR on a larger filesystem"
        )
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    largest = largest_file_bytes(cfg)
    if limit != resource.RLIM_INFINITY and largest > limit:
        raise BenchRefused(
            f"the synthetic table's largest file ({format_bytes(largest)}) is over this process's "
            f"file-size limit ({format_bytes(limit)}, ulimit -f): give a smaller --size, or raise the limit"
        )


def memory_needed(
    table_bytes: int, cuda: bool, modes: tuple[str, ...], nvfp4: bool = False, processes: int = 0
) -> dict:
    """Bytes the run holds at its peak, by kind of memory, and what holds them.

    Every contender is open at once. Host memory: the table in the page cache (its lookups are
    timed warm), the torch anchor's copy on a machine without CUDA or vLLM's pinned copy with it
    (neither for an NVFP4 table; with ``processes`` N >= 2 on CUDA, N pinned copies are open at
    the end of the processes' figure), and RUN_OVERHEAD_BYTES. GPU memory: the anchor's copy and
    the ``device`` mode's."""
    host = {"the table in the page cache": table_bytes, "the run itself": RUN_OVERHEAD_BYTES}
    gpu: dict[str, int] = {}
    if not nvfp4:
        if cuda:
            copies = max(1, processes)
            what = "copy" if copies == 1 else f"copies in {copies} processes"
            host[f"vllm pinned-host's {what}"] = copies * table_bytes
            gpu["the torch anchor's copy"] = table_bytes
        else:
            host["the torch anchor's copy"] = table_bytes
    if cuda and "device" in modes:
        gpu["the device mode's copy"] = table_bytes
    return {"host": host, "gpu": gpu}


def add_batches(
    needed: dict, rows: tuple[int, ...], row_bytes: int, calls: int, paths: int, cuda: bool
) -> dict:
    """``needed`` (from ``memory_needed``) with what the largest batch size's calls hold besides
    the table: each of ``paths`` paths gets ``calls`` sets of ids drawn ahead (8 B an id) and one
    output on the device (host memory without CUDA), and a call's rows gathered on the host (the
    host path's pinned staging, the seeds' gather buffer) with the draw's temporaries. Batch sizes
    run one after the other, so the largest is the peak."""
    n = max(rows)
    device = needed["gpu"] if cuda else needed["host"]
    device[f"--rows {n}: the ids drawn ahead ({paths} paths x {calls} calls)"] = paths * calls * n * 8
    device[f"--rows {n}: the outputs ({paths} paths)"] = paths * n * row_bytes
    needed["host"][f"--rows {n}: a call's rows gathered on the host"] = n * (row_bytes + 8) + 4 * n * 8
    return needed


def path_count(modes: tuple[str, ...], cuda: bool, nvfp4: bool, seeds: bool = True) -> int:
    """How many paths the bench times side by side (``runner._contenders``, ``runner._open``): the
    anchor, vLLM's pinned-host copy on a GPU and the seeds' gather where ``seeds`` (none for an
    NVFP4 table), each mode, and a GPU mode's kernel-only view."""
    kernel_only = sum(1 for m in modes if m in ("ats", "registered")) if cuda else 0
    return len(modes) + kernel_only + (0 if nvfp4 else 1 + cuda + seeds)


# What the bench's child process under --memory-limit holds before it reads a row (keyed by CUDA or
# not): the interpreter, numpy, torch and ple-um imported (about 0.3 GiB of anonymous memory with
# torch 2.14 on x86-64; their libraries' pages are in the page cache already, charged to whoever read
# them first), and a CUDA context's host memory where it runs on a GPU.
CHILD_BASE_BYTES = {False: 320 << 20, True: 512 << 20}


def _batches(rows: tuple[int, ...], serving: bool, every: bool = False) -> str:
    """How a refusal names the largest batch (``every``: all of them): by --rows, or, for the
    serving loop, which takes no --rows, by what its lookups are."""
    if not serving:
        return f"--rows {','.join(map(str, rows)) if every else max(rows)}"
    if every:
        return f"the serving step's lookups of {' and '.join(map(str, rows))} ids"
    return f"the serving step's lookup of {max(rows)} ids"


def child_memory(
    rows: tuple[int, ...], row_bytes: int, repeats: int, cuda: bool, serving: bool = False
) -> dict:
    """Bytes the bench under a memory limit holds besides the table, by kind of memory: the parent
    (RUN_OVERHEAD_BYTES) and its child, whose lookups of every batch size are open at once (ids and
    an output each, on the device), one batch size's ids drawn ahead (``repeats`` sets, on the host)
    and a call's rows gathered on the host. ``serving``: ``rows`` are the serving step's lookups."""
    n, largest = max(rows), _batches(rows, serving)
    host = {
        "the run itself": RUN_OVERHEAD_BYTES,
        "the child process itself": CHILD_BASE_BYTES[cuda],
        f"{largest}: the ids drawn ahead ({repeats} calls)": repeats * n * 8,
        f"{largest}: a call's rows gathered on the host": n * (row_bytes + 8) + 4 * n * 8,
    }
    device = {f"{_batches(rows, serving, every=True)}: the ids and outputs": sum(rows) * (8 + row_bytes)}
    if cuda:
        return {"host": host, "gpu": device}
    host.update(device)
    return {"host": host, "gpu": {}}


def serving_memory(table_bytes: int, sizes: tuple[int, ...], row_bytes: int, limited: bool) -> dict:
    """Bytes the serving loop holds, by kind of memory: on the GPU the resident table's copy, the id
    pools (POOL_STEPS batches of every lookup), the lookups' outputs and the GPU work's
    matrices; on the host the run itself, and its child process under --memory-limit."""
    host = {"the run itself": RUN_OVERHEAD_BYTES}
    if limited:
        host["the child process under --memory-limit"] = CHILD_BASE_BYTES[True]
    gpu = {
        "the resident table's copy (device mode)": table_bytes,
        "the id pools and the lookups' outputs": sum(sizes) * (POOL_STEPS * 8 + 8 + 2 * row_bytes),
        "the GPU work's matrices": 3 * MATMUL_SIZE**2 * 2,
    }
    return {"host": host, "gpu": gpu}


def check_limits(
    limits: tuple[int, ...],
    rows: tuple[int, ...],
    row_bytes: int,
    repeats: int,
    cuda: bool,
    serving: bool = False,
) -> None:
    """Refuse (BenchRefused) a memory limit that cannot hold the child process itself before it
    holds a row of the table: its run would be killed, or measure nothing of the table.
    ``serving``: ``rows`` are the serving step's lookups, which --prefill-tokens sizes."""
    needed = child_memory(rows, row_bytes, repeats, cuda, serving)["host"]
    needed.pop("the run itself")
    floor = sum(needed.values())
    small = [x for x in limits if x < floor]
    if small:
        held = ", ".join(f"{name} {format_bytes(n)}" for name, n in needed.items())
        raise BenchRefused(
            f"--memory-limit {','.join(format_bytes(x) for x in small)}: less than the child process "
            f"holds before it holds a row of the table ({format_bytes(floor)}: {held}): give at least "
            f"{format_bytes(floor)} (and room for the table's rows), or "
            + ("fewer --prefill-tokens" if serving else "smaller --rows")
        )


def check_fits(cfg: Config, layout: ShardLayout | None, cuda: bool, gpu_free: int | None) -> None:
    """Refuse (BenchRefused) a run that does not fit this machine: the synthetic table (``layout``
    None; else DIR's table) the disk, a memory limit its child, the run's peak the memory free (the
    table's copies and the largest batch's buffers, every contender's of ``cfg.run_modes``)."""
    from ple_um.access.memory import mem_available

    table_bytes, limits = cfg.table_bytes(layout), cfg.memory_limits
    row_bytes = layout.row_bytes if layout is not None else cfg.row_bytes
    if layout is None:
        check_disk(cfg)
    # The options that shrink the peak, for a refusal to name: every contender of the side-by-side
    # run is open at once; a child under a limit, and the serving loop, hold no copy of the table
    # beside its own (the resident configuration's) and open their modes one after the other.
    advice = "give a smaller --size or --rows (or fewer --modes)"
    if cfg.serving:
        sizes = tuple(cfg.serving_lookups.values())
        if limits:
            check_limits(limits, sizes, row_bytes, POOL_STEPS, cuda, serving=True)
        needed = serving_memory(table_bytes, sizes, row_bytes, bool(limits))
        advice = "give a smaller --size or --prefill-tokens"
    elif limits:  # the bench under a limit holds no copy of the table: its child's batches
        check_limits(limits, cfg.rows, row_bytes, cfg.repeats, cuda)
        needed = child_memory(cfg.rows, row_bytes, cfg.repeats, cuda)
        advice = "give smaller --rows or --repeats"
    else:
        nvfp4, engram = layout is not None and layout.is_nvfp4, cfg.engram
        modes = cfg.run_modes(cuda)
        needed = memory_needed(table_bytes, cuda, modes, nvfp4=nvfp4, processes=cfg.processes)
        paths = path_count(modes, cuda, nvfp4, seeds=not engram)
        if engram:  # every contender decodes to bf16
            row_bytes = 2 * (layout.row_dim if layout is not None else ENGRAM_HEAD_DIM)
        add_batches(needed, cfg.rows, row_bytes, cfg.repeats + cfg.warmup, paths, cuda)
    check_memory(needed, mem_available(), gpu_free, advice)


def check_memory(
    needed: dict,
    host_available: int,
    gpu_free: int | None,
    advice: str = "give a smaller --size or --rows (or fewer --modes)",
) -> None:
    """Refuse (BenchRefused) a run whose peak, from ``memory_needed``, is over the memory free,
    ending with ``advice``: the options that make it smaller."""
    for kind, available, what in (
        ("host", host_available, "MemAvailable"),
        ("gpu", gpu_free, "the GPU's free memory"),
    ):
        parts = needed[kind]
        total = sum(parts.values())
        if available is None or total <= available:
            continue
        held = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items())
        raise BenchRefused(
            f"the run would hold {format_bytes(total)} of {kind} memory ({held}), more than "
            f"{what} ({format_bytes(available)}): {advice}"
        )
