"""What a bench run is asked to do (``Config``), the synthetic table it writes once into the cache
folder (``default_table``: Qwen3.8-Flash-Next's PLE shape, or DeepSeek-V4.1's Engram shape), the
table's layout and ple-um's open of it for either model (``bench_layout``, ``open_ple_um``), and
whether that table and the run fit this machine before anything is written or timed
(``check_fits``)."""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass

import ple_um
from ple_um import envs
from ple_um.access.probe import ALL_MODES
from ple_um.bench.ids import IdDistribution, parse_ids
from ple_um.checkpoint import MXFP8_BLOCK, ShardLayout, read_engram_layout, read_layout
from ple_um.errors import PleUmError
from ple_um.synthetic import MAX_FILES, write_checkpoint
from ple_um.synthetic_engram import write_engram_checkpoint
from ple_um.units import format_bytes

DEFAULT_ROWS = (16, 1024, 16384, 131072)
# The batch sizes under --memory-limit, and the seconds of lookups (of the serving loop's steps)
# before a steady state is timed (and at least 10 calls).
COLD_ROWS = (16, 1024, 16384)
WARMUP_S = 5.0
# The serving loop's GPU work per step (milliseconds, a figure each) and its timed steps a figure
# when --repeats is not given.
STEP_MS = (5.0, 20.0, 50.0)
SERVING_STEPS = 50
# The square matmuls the serving loop's GPU work is made of: bf16, this many rows and columns (about
# 0.2 ms each on an H200; a step of 5 ms is some 25 of them).
MATMUL_SIZE = 4096
# The serving loop's steps timed between two refills of its id pool (and one device sync).
POOL_STEPS = 32
# Host memory a run holds besides the table and its copies: the interpreter, torch, the id sets
# drawn ahead and the outputs of the largest batch.
RUN_OVERHEAD_BYTES = 1 << 30
# Free disk kept beside a written table, so that the bench never fills the filesystem.
DISK_MARGIN_BYTES = 256 << 20
# The models whose table shape the bench knows: Qwen3.8-Flash-Next's PLE table (its row width and
# shards from --row-bytes and --shards) and DeepSeek-V4.1's Engram table (one unsplit tensor of
# E4M3 rows of 256 values, each with 8 E8M0 scale bytes; the released model's first Engram layer).
PLE_MODEL, ENGRAM_MODEL = "qwen3.8-flash-next", "deepseek-v41"
MODELS = (PLE_MODEL, ENGRAM_MODEL)
ENGRAM_HEAD_DIM = 256
ENGRAM_ROW_BYTES = ENGRAM_HEAD_DIM + ENGRAM_HEAD_DIM // MXFP8_BLOCK  # a row and its scales
ENGRAM_LAYER = 1


class BenchRefused(PleUmError, RuntimeError):
    """The bench would not fit this machine (disk, file-size limit, memory); nothing was written."""


@dataclass
class Config:
    directory: str | None = None
    layer: int | None = None
    size: int = 2 << 30
    row_bytes: int = 160  # of a row and its block scales (ENGRAM_ROW_BYTES for the Engram model)
    shards: int = 128
    model: str = PLE_MODEL
    rows: tuple[int, ...] = DEFAULT_ROWS
    modes: tuple[str, ...] | None = None
    ids: tuple[IdDistribution, ...] = parse_ids("uniform")
    repeats: int = 20
    warmup: int = 3
    rounds: int = 4
    decode_tokens: int = 64
    prefill_tokens: int = 2048  # the serving loop's prefill chunk (0: none)
    heads: int = 16
    device: str | None = None
    processes: int = 0
    seed: int = 0
    host_calls: int = 300  # the host-overhead figure's back-to-back calls (of timing.HOST_ROWS rows)
    memory_limits: tuple[int, ...] = ()  # the run under memory limits (``cold.py``), one child a limit
    serving: bool = False  # the serving loop (``serving.py``), under each of ``memory_limits`` too
    step_ms: tuple[float, ...] = STEP_MS  # the serving loop's GPU work per step, a figure each
    warmup_s: float = WARMUP_S  # the steady state's warm-up, under a limit or in the serving loop
    command: str | None = None  # the command line that asked for the run, for the report's header

    @property
    def kind(self) -> str:
        """Which of the three runs ``cfg`` asks for (``report.format_report`` and ``plot.draw`` read
        it from the result): ``serving``, ``memory-limit`` or ``side-by-side``."""
        return "serving" if self.serving else "memory-limit" if self.memory_limits else "side-by-side"

    @property
    def serving_lookups(self) -> dict[str, int]:
        """The serving loop's lookups, ids a step: a decode step's and a prefill chunk's (none when
        it has 0 tokens)."""
        sizes = {"decode": self.decode_tokens * self.heads, "prefill": self.prefill_tokens * self.heads}
        return {name: n for name, n in sizes.items() if n > 0}

    @property
    def num_rows(self) -> int:
        """The synthetic table's rows: the whole rows of ``row_bytes`` in ``size``."""
        return self.size // self.row_bytes

    def run_modes(self, cuda: bool) -> tuple[str, ...]:
        """The ple-um modes the side-by-side run times: those asked for, else every mode on a GPU and
        cpu without one."""
        return self.modes or (ALL_MODES if cuda else ("cpu",))

    def table_bytes(self, layout: ShardLayout | None) -> int:
        """The bytes of the table benched: DIR's (``layout``), else the synthetic table's."""
        return layout.nbytes if layout is not None else self.num_rows * self.row_bytes


def table_path(cfg: Config) -> str:
    """Where the synthetic table of ``cfg`` lives in the cache folder."""
    kind = "engram" if cfg.model == ENGRAM_MODEL else "fp8"
    return os.path.join(envs.PLE_UM_CACHE_DIR, f"bench-{kind}-{cfg.num_rows}x{cfg.row_bytes}-{cfg.shards}")


def _table_written(path: str) -> bool:
    return os.path.exists(os.path.join(path, "model.safetensors.index.json"))


def default_table(cfg: Config, progress: bool = True) -> str:
    """The synthetic table of ``cfg.model``, written once into the cache folder: FP8 shaped like
    Qwen3.8-Flash-Next's, or an Engram table of layer ENGRAM_LAYER shaped like DeepSeek-V4.1's.

    It is written into ``<path>.partial`` and renamed into place when complete; a failure (a full
    disk, an interrupt) removes the partial folder, so no half-written table is ever left or used."""
    path = table_path(cfg)
    if _table_written(path):
        return path
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a run killed while writing (nothing else removes it)
    try:
        if cfg.model == ENGRAM_MODEL:
            rows = cfg.num_rows
            write_engram_checkpoint(
                tmp, tables={ENGRAM_LAYER: rows}, head_dim=ENGRAM_HEAD_DIM, seed=cfg.seed, write_back=True
            )
        else:
            write_checkpoint(
                tmp,
                num_rows=cfg.num_rows,
                row_dim=cfg.row_bytes,
                dtype="F8_E4M3",
                shards=cfg.shards,
                progress=progress,
                # Written back to disk now, not while the first timings run (writeback takes CPU and
                # memory bandwidth from the lookups measured): the table's files, not the whole machine's.
                write_back=True,
            )
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def bench_layout(cfg: Config) -> ShardLayout:
    """The layout of the table ``cfg`` benches: the directory's, or the synthetic one (written first
    where it is not yet); an Engram table's for the Engram model."""
    directory = cfg.directory or default_table(cfg)
    read = read_engram_layout if cfg.model == ENGRAM_MODEL else read_layout
    return read(directory, cfg.layer)


def open_ple_um(layout: ShardLayout, device, mode: str = "auto") -> ple_um.MappedTable:
    """ple-um's table of ``layout`` in ``mode``: an Engram table's (MXFP8) or a PLE table's."""
    opener = ple_um.open_engram_table if layout.is_mxfp8 else ple_um.open_table
    return opener(layout.directory, layer=layout.layer, mode=mode, device=device)


def child_request(cfg: Config, layout: ShardLayout, device, modes) -> dict:
    """What every child under a memory limit is asked (``memlimit.run_limited``): the table, the
    device, the modes, the ids (their names, which the child parses again), the timed calls, the
    warm-up's seconds and the seed."""
    return {
        "directory": layout.directory,
        "layer": layout.layer,
        "device": str(device),
        "modes": list(modes),
        "ids": ",".join(dist.name for dist in cfg.ids),
        "repeats": cfg.repeats,
        "warmup_s": cfg.warmup_s,
        "seed": cfg.seed,
    }


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
    if _table_written(path):
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
            what = (
                "vllm pinned-host's copy"
                if copies == 1
                else f"vllm pinned-host's copies in {copies} processes"
            )
            host[what] = copies * table_bytes
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


def child_memory(rows: tuple[int, ...], row_bytes: int, repeats: int, cuda: bool) -> dict:
    """Bytes the bench under a memory limit holds besides the table, by kind of memory: the parent
    (RUN_OVERHEAD_BYTES) and its child, whose lookups of every batch size are open at once (ids and
    an output each, on the device), one batch size's ids drawn ahead (``repeats`` sets, on the host)
    and a call's rows gathered on the host."""
    n = max(rows)
    host = {
        "the run itself": RUN_OVERHEAD_BYTES,
        "the child process itself": CHILD_BASE_BYTES[cuda],
        f"--rows {n}: the ids drawn ahead ({repeats} calls)": repeats * n * 8,
        f"--rows {n}: a call's rows gathered on the host": n * (row_bytes + 8) + 4 * n * 8,
    }
    device = {f"--rows {','.join(map(str, rows))}: the ids and outputs": sum(rows) * (8 + row_bytes)}
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
    limits: tuple[int, ...], rows: tuple[int, ...], row_bytes: int, repeats: int, cuda: bool
) -> None:
    """Refuse (BenchRefused) a memory limit that cannot hold the child process itself before it
    holds a row of the table: its run would be killed, or measure nothing of the table."""
    needed = child_memory(rows, row_bytes, repeats, cuda)["host"]
    needed.pop("the run itself")
    floor = sum(needed.values())
    small = [x for x in limits if x < floor]
    if small:
        held = ", ".join(f"{name} {format_bytes(n)}" for name, n in needed.items())
        raise BenchRefused(
            f"--memory-limit {','.join(format_bytes(x) for x in small)}: less than the child process "
            f"holds before it holds a row of the table ({format_bytes(floor)}: {held}): give at least "
            f"{format_bytes(floor)} (and room for the table's rows), or smaller --rows"
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
    if cfg.serving:
        sizes = tuple(cfg.serving_lookups.values())
        if limits:
            check_limits(limits, sizes, row_bytes, POOL_STEPS, cuda)
        needed = serving_memory(table_bytes, sizes, row_bytes, bool(limits))
    elif limits:  # the bench under a limit holds no copy of the table: its child's batches
        check_limits(limits, cfg.rows, row_bytes, cfg.repeats, cuda)
        needed = child_memory(cfg.rows, row_bytes, cfg.repeats, cuda)
    else:
        nvfp4, engram = layout is not None and layout.is_nvfp4, cfg.model == ENGRAM_MODEL
        modes = cfg.run_modes(cuda)
        needed = memory_needed(table_bytes, cuda, modes, nvfp4=nvfp4, processes=cfg.processes)
        paths = path_count(modes, cuda, nvfp4, seeds=not engram)
        if engram:  # every contender decodes to bf16
            row_bytes = 2 * (layout.row_dim if layout is not None else ENGRAM_HEAD_DIM)
        add_batches(needed, cfg.rows, row_bytes, cfg.repeats + cfg.warmup, paths, cuda)
    check_memory(needed, mem_available(), gpu_free)


def check_memory(needed: dict, host_available: int, gpu_free: int | None) -> None:
    """Refuse (BenchRefused) a run whose peak, from ``memory_needed``, is over the memory free."""
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
            f"{what} ({format_bytes(available)}): give a smaller --size or --rows (or fewer --modes)"
        )
