"""Every knob ple-um reads, declared once: name, type, default, aliases and a one-line doc.

Read a knob as an attribute (``envs.PLE_UM_MODE``), typed by its annotation below; the environment
is read at each access, so a test or a launcher can change it before the table opens. The
``VLLM_PLE_MMAP*`` names of the earlier CPU-gather patches (docs/OPERATING.md) are aliases: when the
ple-um name is unset and an alias is set, the alias is used.
"""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

from ple_um import knob_values as v
from ple_um.knob_values import Knob
from ple_um.units import parse_size

# Rows at most a lookup's id count can reach (int32 indexing of a batch).
_MAX_BULK_ROWS = 1 << 31
_bulk_rows = v.auto_or(
    v.count(0, _MAX_BULK_ROWS), f"a whole number of rows from 0 (never) to {_MAX_BULK_ROWS}"
)


def _default_threads() -> int:
    """The cores less one, at most 16 (all of them on two cores or fewer): the thread that queues
    the lookups keeps a core, or a big lookup's readers crowd it out and one of them loses its core
    for a scheduler tick, which holds the whole lookup up (docs/lab/PERF_NOTES.md)."""
    cores = os.cpu_count() or 1
    return max(1, min(16, cores - 1 if cores > 2 else cores))


Mode = Literal["auto", "ats", "registered", "cpu", "device"]
# The modes in which the GPU reads host memory, whose first read a child process can make.
FirstReadMode = Literal["ats", "registered"]
AutoOnOff = Literal["auto", "on", "off"]
Madvise = Literal["auto", "random", "normal", "none"]
Fit = Literal["auto", "fits", "spills"]
RowCachePolicy = Literal["tinylfu", "lru", "clock"]
FileReads = Literal["auto", "uring", "threads", "mmap"]
MODES: tuple[Mode, ...] = get_args(Mode)
FIRST_READ_MODES: tuple[FirstReadMode, ...] = get_args(FirstReadMode)

# Each knob's type, for a type checker: the names are declared, not assigned, so that reading one
# goes through ``__getattr__`` (the environment now). tests/test_envs.py checks that every knob has
# one and that its default and the values it takes are of it.
PLE_UM: bool
PLE_UM_MODE: Mode
PLE_UM_DIR: str | None
PLE_UM_CPU_THREADS: int
PLE_UM_CPU_CHUNK: int
PLE_UM_MADVISE: Madvise
PLE_UM_PREWARM: bool
PLE_UM_PROMETHEUS: bool
PLE_UM_STATS_SEC: float
PLE_UM_PIN_BUDGET: int | None
PLE_UM_PIN_FRACTION: float
PLE_UM_ATS_PREFETCH: AutoOnOff
PLE_UM_FIT: Fit
PLE_UM_FIT_CHECK_SEC: float
PLE_UM_MAP_RESIDENT: bool
PLE_UM_DIRECT_LAUNCH: bool
PLE_UM_OVERLAP: bool
PLE_UM_EARLY_LOOKUPS: AutoOnOff
PLE_UM_ATS_POPULATE: bool
PLE_UM_SELF_TEST_ROWS: int
PLE_UM_BULK_ROWS: int | Literal["auto"]
PLE_UM_ROWCOPY: bool
PLE_UM_DISPATCHER: bool
PLE_UM_STRICT: bool
PLE_UM_CACHE_DIR: str
PLE_UM_FIRST_READ_CHECK: tuple[FirstReadMode, ...]
PLE_UM_FIRST_READ_TIMEOUT: float
PLE_UM_ROW_CACHE: int | Literal["auto"]
PLE_UM_ROW_CACHE_FRACTION: float
PLE_UM_ROW_CACHE_POLICY: RowCachePolicy
PLE_UM_FILE_READS: FileReads
PLE_UM_DIRECT_READS: AutoOnOff
PLE_UM_READ_DEPTH: int
PLE_UM_METRICS_SEC: float

KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "PLE_UM", v.boolean, False, "enable the vLLM and SGLang plugins' ple-um path", ("VLLM_PLE_MMAP",)
        ),
        Knob(
            "PLE_UM_MODE",
            v.choice(*MODES),
            "auto",
            "force an access mode (a forced mode that cannot work is an error)",
        ),
        Knob(
            "PLE_UM_DIR",
            str,
            None,
            "checkpoint directory holding the PLE shards (else the model's)",
            ("VLLM_PLE_MMAP_DIR",),
        ),
        Knob(
            "PLE_UM_CPU_THREADS",
            v.count(1, 1024),
            _default_threads,
            "threads that read a big host-path lookup's rows with the C row copy (the calling one "
            "included; default the cores less one, at most 16)",
            ("VLLM_PLE_MMAP_WORKERS",),
        ),
        Knob(
            "PLE_UM_CPU_CHUNK",
            v.count(1, 1 << 30),
            2048,
            "rows per chunk of the cpu mode's synchronous gather (no C row copy): a lookup is read, "
            "copied to the device and decoded a chunk at a time",
            ("VLLM_PLE_MMAP_CHUNK",),
        ),
        Knob(
            "PLE_UM_MADVISE",
            v.choice(*get_args(Madvise)),
            "auto",
            "madvise on the shard mappings; auto = random for cpu/ats, normal otherwise",
            ("VLLM_PLE_MMAP_MADVISE",),
        ),
        Knob(
            "PLE_UM_PREWARM",
            v.boolean,
            False,
            "read the whole table once at open to fill the page cache",
            ("VLLM_PLE_MMAP_PREWARM",),
        ),
        Knob(
            "PLE_UM_PROMETHEUS",
            v.boolean,
            True,
            "export Prometheus counters when prometheus_client is installed",
            ("VLLM_PLE_MMAP_PROMETHEUS",),
        ),
        Knob(
            "PLE_UM_STATS_SEC",
            v.seconds_or_off,
            0.0,
            "seconds between stats log lines (0 = off)",
            ("VLLM_PLE_MMAP_STATS_SEC",),
        ),
        Knob(
            "PLE_UM_PIN_BUDGET",
            parse_size,
            None,
            "most bytes the registered mode may pin (default: PLE_UM_PIN_FRACTION of MemAvailable)",
        ),
        Knob("PLE_UM_PIN_FRACTION", v.fraction, 0.5, "fraction of MemAvailable the registered mode may pin"),
        Knob(
            "PLE_UM_ATS_PREFETCH",
            v.choice(*get_args(AutoOnOff)),
            "auto",
            "ats mode: a host node queued before the kernel touches the pages of the lookup's rows "
            "(auto = while the table fits but is not fully resident, decided at open and at each fit "
            "check; a lookup captured on the kernel always holds the touch, and each replay runs it "
            "only while so decided then; on = always, in the ats and registered modes)",
        ),
        Knob(
            "PLE_UM_FIT",
            v.choice(*get_args(Fit)),
            "auto",
            "whether a table's owned rows fit the memory this process may use (MemAvailable, its memory "
            "cgroups' room, its own pages in memory): a table that does not gets a row cache, and in the "
            "ats and registered modes its decode-sized lookups take the host path; auto = measured at "
            "open and at each check (PLE_UM_FIT_CHECK_SEC); fits, spills = that decision, never switched",
        ),
        Knob(
            "PLE_UM_FIT_CHECK_SEC",
            v.seconds_or_off,
            1.0,
            "seconds between the checks (a sample of the table's pages by mincore, the memory left) "
            "that switch a table's decode-sized lookups between the kernel and the host path as its "
            "fit changes (0 = decided at open only)",
        ),
        Knob(
            "PLE_UM_MAP_RESIDENT",
            v.boolean,
            True,
            "ats and cpu modes: at open, map the table pages already in the page cache into this process "
            "(MADV_POPULATE_READ over resident ranges only), so that lookups take no minor faults",
        ),
        Knob(
            "PLE_UM_DIRECT_LAUNCH",
            v.boolean,
            True,
            "GPU modes: launch the gather kernel through its compiled handle after the first call "
            "(skips Triton's per-call argument binding)",
        ),
        Knob(
            "PLE_UM_OVERLAP",
            v.boolean,
            True,
            "vLLM and SGLang plugins: queue each PLE lookup on a side stream one decoder layer ahead "
            "(the engine's start_prefetch hook), so the host gather overlaps the GPU's work",
        ),
        Knob(
            "PLE_UM_EARLY_LOOKUPS",
            v.choice(*get_args(AutoOnOff)),
            "auto",
            "vLLM and SGLang plugins with PLE_UM_OVERLAP: the first PLE layer's start_prefetch of a step "
            "starts every PLE layer's lookup of that step (auto = where the lookups go on a side stream; "
            "on = also where they cannot, as stream-ordered work at the first layer; off = each layer one "
            "decoder layer ahead). No memory beyond the layers' own prefetch buffers (their total is "
            "logged at load)",
        ),
        Knob(
            "PLE_UM_ATS_POPULATE",
            v.boolean,
            False,
            "ats mode: populate the mapping through cudaHostRegister at open",
        ),
        Knob(
            "PLE_UM_SELF_TEST_ROWS",
            v.count(0, 1 << 20),
            64,
            "rows the self-test compares with the file at open (0 = off)",
        ),
        Knob(
            "PLE_UM_BULK_ROWS",
            _bulk_rows,
            "auto",
            "ats and registered modes: lookups of at least this many ids (eager or captured) take the "
            "host path; auto = the crossover measured at open, 0 = never",
        ),
        Knob(
            "PLE_UM_ROWCOPY",
            v.boolean,
            True,
            "host paths read rows with the C row copy (built at install time; where that library is "
            "missing or stale, compiled at the first open into PLE_UM_CACHE_DIR/native/); off, or where "
            "it does not build, the cpu mode's synchronous gather (not capture-safe)",
        ),
        Knob(
            "PLE_UM_DISPATCHER",
            v.boolean,
            True,
            "host paths, eager lookups: the C row copy run by ple-um's dispatcher thread, the stream "
            "signalled through CUDA stream memory operations (off: a CUDA host node per lookup and "
            "per chunk, as captured lookups always are)",
        ),
        Knob("PLE_UM_STRICT", v.boolean, False, "raise IndexError for ids outside the table (synchronizes)"),
        Knob(
            "PLE_UM_CACHE_DIR",
            v.cache_directory,
            lambda: os.path.join(os.path.expanduser("~"), ".cache", "ple-um"),
            "where `ple-um bench` keeps its synthetic table, the C row copy compiled at run time where "
            "the installed one is missing (native/), the first-read verdicts (first-read/) and the "
            "locks; made 0700, used only when it is this user's folder and no one else can write it "
            "(one folder per user)",
            check_default=True,
        ),
        Knob(
            "PLE_UM_FIRST_READ_CHECK",
            v.modes_list(*FIRST_READ_MODES),
            ("ats",),
            "access modes whose first read of the mapping runs in a child process before this "
            "process uses them, verdict cached per machine (ats, registered; off = none)",
        ),
        Knob(
            "PLE_UM_FIRST_READ_TIMEOUT",
            v.positive_seconds,
            120.0,
            "seconds the first-read child may take before it is killed and its mode rejected",
        ),
        Knob(
            "PLE_UM_ROW_CACHE",
            v.auto_or(parse_size, "a byte count (0, 512MiB, 4GiB)"),
            "auto",
            "host path: bytes of hot rows kept at row granularity in memory the table owns; auto = "
            "PLE_UM_ROW_CACHE_FRACTION of the memory left, when the table's owned rows do not fit in "
            "memory (PLE_UM_FIT; else none, in the page cache or not); a size is capped at what the "
            "owned rows need and refused past the memory left (a fit check's later build cuts it to "
            "PLE_UM_ROW_CACHE_FRACTION of that, and builds it again toward the size once memory comes "
            "back, as auto's regrows); 0 = none",
        ),
        Knob(
            "PLE_UM_ROW_CACHE_FRACTION",
            v.fraction,
            0.5,
            "the fraction of the memory this process can still take (MemAvailable, its memory cgroup's "
            "room) that PLE_UM_ROW_CACHE=auto gives the row cache",
        ),
        Knob(
            "PLE_UM_ROW_CACHE_POLICY",
            v.choice(*get_args(RowCachePolicy)),
            "tinylfu",
            "what the row cache keeps: tinylfu admits a row only when it is wanted more often than the "
            "one it would evict; lru and clock admit every row",
        ),
        Knob(
            "PLE_UM_FILE_READS",
            v.choice(*get_args(FileReads)),
            "auto",
            "host path: how the rows a lookup misses are read, many at a time; auto = io_uring where a "
            "ring can be made, else reader threads; mmap = one page fault at a time",
        ),
        Knob(
            "PLE_UM_DIRECT_READS",
            v.choice(*get_args(AutoOnOff)),
            "auto",
            "host path: read misses with O_DIRECT (past the page cache); auto = when there is a row cache",
        ),
        Knob(
            "PLE_UM_READ_DEPTH",
            v.count(1, 256),
            64,
            "host path: reads of missing rows in flight per reading thread",
        ),
        Knob(
            "PLE_UM_METRICS_SEC",
            v.seconds_or_off,
            15.0,
            "seconds between reads of the device counters, the C row copy's counters, the row cache and "
            "the page-cache residency for Prometheus when the stats line is off (0 = never; with "
            "PLE_UM_STATS_SEC > 0 that period)",
        ),
    )
}


def __getattr__(name: str) -> Any:
    knob = KNOBS.get(name)
    if knob is None:
        raise AttributeError(f"module {__name__!r} has no knob {name!r}")
    return knob.value()


def check(skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> None:
    """Read every knob (or those in ``only``) but ``skip``: the first set to a value it does not
    take raises KnobError, naming it."""
    for name, knob in KNOBS.items():
        if name not in skip and (only is None or name in only):
            knob.value()


def describe() -> list[dict[str, Any]]:
    """Every knob as a dict (name, aliases, default, doc, current value text, and ``invalid``: why
    that value is not taken, or None), for docs and the CLI."""
    rows = []
    for knob in KNOBS.values():
        default = knob.default() if callable(knob.default) else knob.default
        found = knob.raw()
        rows.append(
            {
                "name": knob.name,
                "aliases": list(knob.aliases),
                "default": default,
                "doc": knob.doc,
                "set": None if found is None else f"{found[0]}={found[1]}",
                "invalid": knob.problem() if found is not None or knob.check_default else None,
            }
        )
    return rows
