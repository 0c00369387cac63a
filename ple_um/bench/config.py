"""What a bench run is asked to do (``Config``: every option, its default in the run it belongs
to, and the options that do not go together), the synthetic table it writes once into the cache
folder (``default_table``: Qwen3.8-Flash-Next's PLE shape, or DeepSeek-V4.1's Engram shape), and
the table's layout and ple-um's open of it for either model (``bench_layout``, ``open_ple_um``).
Whether the run fits this machine: ``bench/sizing.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

import ple_um
from ple_um import cache_folder, envs
from ple_um.access.probe import ALL_MODES
from ple_um.bench.ids import IdDistribution, parse_ids
from ple_um.checkpoint import MXFP8_BLOCK, ShardLayout, read_engram_layout, read_layout
from ple_um.checkpoint.scan import INDEX_FILE
from ple_um.errors import CheckpointError, PleUmError
from ple_um.synthetic import write_checkpoint
from ple_um.synthetic_engram import write_engram_checkpoint
from ple_um.units import format_bytes

DEFAULT_ROWS = (16, 1024, 16384, 131072)
# The batch sizes under --memory-limit, and the seconds of lookups (of the serving loop's steps)
# before a steady state is timed (and at least 10 calls).
COLD_ROWS = (16, 1024, 16384)
WARMUP_S = 5.0
# Timed calls a measurement, and the serving loop's timed steps a figure, when --repeats is not
# given.
REPEATS, SERVING_STEPS = 20, 50
# The rounds the side-by-side run splits its timed calls into, when --rounds is not given.
ROUNDS = 4
# The serving loop's GPU work per step (milliseconds, a figure each), and its prefill chunk's tokens
# a step (a decode step's lookups are ``decode_tokens`` x ``heads`` ids beside them).
STEP_MS = (5.0, 20.0, 50.0)
PREFILL_TOKENS = 2048
# The square matmuls the serving loop's GPU work is made of: bf16, this many rows and columns (about
# 0.2 ms each on an H200; a step of 5 ms is some 25 of them).
MATMUL_SIZE = 4096
# The serving loop's steps timed between two refills of its id pool (and one device sync).
POOL_STEPS = 32
# The models whose table shape the bench knows: Qwen3.8-Flash-Next's PLE table (its row width and
# shards from --row-bytes and --shards) and DeepSeek-V4.1's Engram table (one unsplit tensor of
# E4M3 rows of 256 values, each with 8 E8M0 scale bytes; the released model's first Engram layer).
PLE_MODEL, ENGRAM_MODEL = "qwen3.8-flash-next", "deepseek-v41"
MODELS = (PLE_MODEL, ENGRAM_MODEL)
# The synthetic PLE table's bytes, row width in bytes (a row and its block scales) and shards, when
# --size, --row-bytes and --shards are not given.
SIZE, ROW_BYTES, SHARDS = 2 << 30, 160, 128
ENGRAM_HEAD_DIM = 256
ENGRAM_ROW_BYTES = ENGRAM_HEAD_DIM + ENGRAM_HEAD_DIM // MXFP8_BLOCK  # a row and its scales
ENGRAM_LAYER = 1
# How long a bench waits for another one writing the same synthetic table (a large table at the
# disk's speed) before it writes its own without the lock.
TABLE_LOCK_WAIT_S = 3600.0


class BenchUsageError(PleUmError, ValueError):
    """Options of a bench run that do not go together (``ple-um bench`` exits 2), named as the
    command line spells them."""


@dataclass
class Config:
    """A bench run, as ``ple-um bench``'s options ask for it: each option sets the field of its name
    (DIR ``directory``, --memory-limit ``memory_limits``, --warmup ``warmup_s``); one left None takes
    the default of the run it belongs to (the model's, a run under memory limits', the serving
    loop's). Options that do not go together are refused here, before anything is written or
    timed (BenchUsageError)."""

    directory: str | None = None
    layer: int | None = None
    size: int | None = None  # of the synthetic table: SIZE
    row_bytes: int | None = None  # of a row and its block scales: ROW_BYTES (ENGRAM_ROW_BYTES: Engram)
    shards: int | None = None  # SHARDS (1: Engram)
    model: str = PLE_MODEL
    rows: tuple[int, ...] | None = None  # DEFAULT_ROWS (COLD_ROWS under memory limits)
    modes: tuple[str, ...] | None = None
    ids: tuple[IdDistribution, ...] = parse_ids("uniform")
    repeats: int | None = None  # REPEATS (SERVING_STEPS: the serving loop)
    warmup: int = 3
    rounds: int | None = None  # the side-by-side run's alone: ROUNDS
    decode_tokens: int = 64
    prefill_tokens: int | None = None  # the serving loop's prefill chunk (0: none): PREFILL_TOKENS
    heads: int = 16
    device: str | None = None
    processes: int = 0  # the side-by-side run's alone
    seed: int = 0
    host_calls: int = 300  # the host-overhead figure's back-to-back calls (of timing.HOST_ROWS rows)
    memory_limits: tuple[int, ...] | None = ()  # the run under memory limits (``cold.py``), a child each
    serving: bool = False  # the serving loop (``serving.py``), under each of ``memory_limits`` too
    step_ms: tuple[float, ...] | None = None  # the serving loop's GPU work a step, a figure each: STEP_MS
    warmup_s: float | None = None  # the steady state's warm-up, under limits or serving: WARMUP_S
    command: str | None = None  # the command line that asked for the run, for the report's header

    def __post_init__(self) -> None:
        if self.warmup_s is not None and not (self.memory_limits or self.serving):
            raise BenchUsageError("--warmup times the steady state of --memory-limit or --serving: give one")
        self._check_serving()
        self._check_side_by_side()
        self._check_named_once()
        if self.directory is not None:
            self._check_directory()
        self.size = SIZE if self.size is None else self.size
        self._check_model()
        if self.directory is None:
            self._check_synthetic()
        self.memory_limits = tuple(self.memory_limits or ())
        self.rows = self.rows or (COLD_ROWS if self.memory_limits else DEFAULT_ROWS)
        self.repeats = self.repeats or (SERVING_STEPS if self.serving else REPEATS)
        self.rounds = ROUNDS if self.rounds is None else self.rounds
        self.step_ms = self.step_ms or STEP_MS
        self.prefill_tokens = PREFILL_TOKENS if self.prefill_tokens is None else self.prefill_tokens
        self.warmup_s = WARMUP_S if self.warmup_s is None else self.warmup_s

    def _check_serving(self) -> None:
        """The options that belong to --serving alone, and those it does not take."""
        if not self.serving:
            for flag, given, what in (
                ("--step-ms", self.step_ms, "GPU work"),
                ("--prefill-tokens", self.prefill_tokens, "prefill chunk"),
            ):
                if given is not None:
                    raise BenchUsageError(f"{flag} sets the {what} of --serving's steps: give --serving too")
            return
        for flag, given in (("--rows", self.rows), ("--processes", self.processes)):
            if given:
                raise BenchUsageError(
                    f"{flag} is not a --serving option: the serving loop's lookups are a decode step's and "
                    "a prefill chunk's, in one process (and a child per --memory-limit)"
                )

    def _check_named_once(self) -> None:
        """Each batch size, memory limit and step time is one figure, keyed by its value in the
        results: one named twice would be timed twice (a child each under a limit), the second
        run's figures replacing the first's."""
        for flag, given, key, show in (
            ("--rows", self.rows, str, str),
            ("--memory-limit", self.memory_limits, str, format_bytes),
            ("--step-ms", self.step_ms, lambda ms: f"{ms:g}", lambda ms: f"{ms:g}"),
        ):
            values = list(given or ())
            keys = [key(value) for value in values]
            twice = next((v for i, v in enumerate(values) if keys[i] in keys[:i]), None)
            if twice is not None:
                raise BenchUsageError(f"{flag} names {show(twice)} twice: each is timed once, give it once")

    def _check_side_by_side(self) -> None:
        """The side-by-side run's own options, refused for the other runs, which would drop them
        without a word: a run under --memory-limit times each batch size's calls in a row, in one
        child per limit, and the serving loop its steps."""
        other = "--serving" if self.serving else "--memory-limit" if self.memory_limits else None
        if other is None:
            return
        for flag, given, what in (
            ("--rounds", self.rounds is not None, "splits the side-by-side run's timed calls into rounds"),
            ("--processes", self.processes, "opens the table in N processes after the side-by-side run"),
        ):
            if given:
                raise BenchUsageError(f"{flag} is not a {other} option: it {what}")

    def _check_model(self) -> None:
        """``row_bytes`` and ``shards`` set to the synthetic table's: an Engram table's are the
        model's, and the options of a PLE table's bench are refused for one."""
        if not self.engram:
            self.row_bytes, self.shards = self.row_bytes or ROW_BYTES, self.shards or SHARDS
            return
        pairs = ("--row-bytes", self.row_bytes), ("--shards", self.shards)
        for flag, given in (*pairs, ("--memory-limit", self.memory_limits), ("--serving", self.serving)):
            if given:
                raise BenchUsageError(
                    f"{flag} is a PLE table's option: an Engram table (--model {ENGRAM_MODEL}) is one "
                    f"unsplit tensor of {ENGRAM_ROW_BYTES} B rows (256 FP8 values, 8 E8M0 scale bytes) whose "
                    "lookups the bench times side by side"
                )
        self.row_bytes, self.shards = ENGRAM_ROW_BYTES, 1

    def _check_directory(self) -> None:
        """The synthetic table's options refused with DIR, whose table is benched as it is (they
        would otherwise be dropped without a word)."""
        shape = ("--size", self.size), ("--row-bytes", self.row_bytes), ("--shards", self.shards)
        for flag, given in shape:
            if given is not None:
                raise BenchUsageError(
                    f"{flag} shapes the synthetic table: DIR's table is benched as it is; give one or "
                    "the other"
                )

    def _check_synthetic(self) -> None:
        """The synthetic table's options: one layer, at least a row, no more shards than rows."""
        if self.layer is not None:
            raise BenchUsageError("--layer needs DIR: the synthetic table has one layer")
        if self.num_rows < 1:
            raise BenchUsageError(
                f"--size {self.size} B holds no row of {self.row_bytes} B (--row-bytes): give at least that"
            )
        if self.shards > self.num_rows:
            raise BenchUsageError(
                f"--shards {self.shards} is more than the {self.num_rows} rows of --size {self.size} B"
            )

    @property
    def engram(self) -> bool:
        """Whether the table benched is an Engram table (``--model deepseek-v41``)."""
        return self.model == ENGRAM_MODEL

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
    kind = "engram" if cfg.engram else "fp8"
    return os.path.join(envs.PLE_UM_CACHE_DIR, f"bench-{kind}-{cfg.num_rows}x{cfg.row_bytes}-{cfg.shards}")


def table_written(path: str) -> bool:
    """Whether the synthetic table at ``path`` is there (``default_table`` renames it in whole)."""
    return os.path.exists(os.path.join(path, INDEX_FILE))


@contextlib.contextmanager
def table_lock():
    """Held while this process writes or removes a synthetic table: an ``flock`` on the cache
    folder itself (no file of its own, so none is left behind), waited for at most
    TABLE_LOCK_WAIT_S; past it, or where the folder cannot be locked, the block runs without it.
    Two benches started at once on a cache without their table would each remove the other's
    partial folder. The kernel releases the lock when its holder's descriptor closes."""
    try:
        fd = os.open(cache_folder.private_folder(envs.PLE_UM_CACHE_DIR), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # UnsafeCacheError among them: the write reports it
        yield
        return
    try:
        cache_folder.flock_within(fd, TABLE_LOCK_WAIT_S)
        yield
    finally:
        os.close(fd)


def default_table(cfg: Config, progress: bool = True) -> str:
    """The synthetic table of ``cfg.model``, written once into the cache folder: FP8 shaped like
    Qwen3.8-Flash-Next's, or an Engram table of layer ENGRAM_LAYER shaped like DeepSeek-V4.1's.

    It is written into ``<path>.partial`` and renamed into place when complete; a failure (a full
    disk, an interrupt) removes the partial folder, so no half-written table is ever left or used.
    One process writes it at a time (``table_lock``); another waits for it and uses its table."""
    path = table_path(cfg)
    if table_written(path):
        return path
    with table_lock():
        if not table_written(path):  # another process wrote it while this one waited
            _write_table(cfg, path, progress)
    return path


def _write_table(cfg: Config, path: str, progress: bool) -> None:
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a run killed while writing (nothing else removes it)
    try:
        if cfg.engram:
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


def bench_layout(cfg: Config) -> ShardLayout:
    """The layout of the table ``cfg`` benches: the directory's, or the synthetic one (written first
    where it is not yet, and again where its files were damaged since); an Engram table's for the
    Engram model."""
    read = read_engram_layout if cfg.engram else read_layout
    if cfg.directory is not None:
        return read(cfg.directory, cfg.layer)
    try:
        return read(default_table(cfg), cfg.layer)
    except CheckpointError:  # the bench's own table, a file removed or cut short since it was written
        with table_lock():
            try:  # another process found it damaged too, and wrote it again while this one waited
                return read(table_path(cfg), cfg.layer)
            except CheckpointError:
                shutil.rmtree(table_path(cfg), ignore_errors=True)
        return read(default_table(cfg), cfg.layer)


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
