"""Every knob ple-um reads, declared once: name, type, default, aliases and a one-line doc.

Read a knob as an attribute (``envs.PLE_UM_MODE``); the environment is read at each access, so a
test or a launcher can change it before the table opens. The seeds' ``VLLM_PLE_MMAP*`` names are
aliases: when the ple-um name is unset and an alias is set, the alias is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ple_um.errors import KnobError


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _size(text: str) -> int:
    """Bytes, with an optional binary suffix: 512MiB, 16GiB, 1T (= TiB); never negative."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(low[-1:], 1)
    try:
        value = int(float(low[:-1] if scale > 1 else low) * scale)
    except (ValueError, OverflowError):
        raise ValueError(
            f"expected a byte count with an optional binary suffix (4096, 512MiB, 48GiB, 1T), got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"expected a byte count >= 0, got {text!r}")
    return value


def _bulk_rows(text: str) -> str | int:
    value = text.strip().lower()
    if value == "auto":
        return value
    rows = int(value)
    if rows < 0:
        raise ValueError("expected auto or a row count >= 0")
    return rows


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    aliases: tuple[str, ...] = ()

    def raw(self) -> tuple[str, str] | None:
        """(variable name, text) of the first of name and aliases that is set, or None."""
        for var in (self.name, *self.aliases):
            text = os.environ.get(var)
            if text is not None:
                return var, text
        return None

    def value(self) -> Any:
        found = self.raw()
        if found is None:
            return self.default() if callable(self.default) else self.default
        var, text = found
        try:
            return self.parse(text)
        except ValueError as exc:
            raise KnobError(f"environment variable {var}={text!r}: {exc}") from None


def _default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


MODES = ("auto", "ats", "registered", "cpu", "device")

KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("PLE_UM", _bool, False, "enable the vLLM plugin's ple-um backend", ("VLLM_PLE_MMAP",)),
        Knob(
            "PLE_UM_MODE",
            _choice(*MODES),
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
            int,
            _default_threads,
            "threads of the cpu-mode gather",
            ("VLLM_PLE_MMAP_WORKERS",),
        ),
        Knob("PLE_UM_CPU_CHUNK", int, 2048, "rows per gather task in the cpu mode", ("VLLM_PLE_MMAP_CHUNK",)),
        Knob(
            "PLE_UM_MADVISE",
            _choice("auto", "random", "normal", "none"),
            "auto",
            "madvise on the shard mappings; auto = random for cpu/ats, normal otherwise",
            ("VLLM_PLE_MMAP_MADVISE",),
        ),
        Knob(
            "PLE_UM_PREWARM",
            _bool,
            False,
            "read the whole table once at open to fill the page cache",
            ("VLLM_PLE_MMAP_PREWARM",),
        ),
        Knob(
            "PLE_UM_PROMETHEUS",
            _bool,
            True,
            "export Prometheus counters when prometheus_client is installed",
            ("VLLM_PLE_MMAP_PROMETHEUS",),
        ),
        Knob(
            "PLE_UM_STATS_SEC",
            float,
            0.0,
            "seconds between stats log lines (0 = off)",
            ("VLLM_PLE_MMAP_STATS_SEC",),
        ),
        Knob(
            "PLE_UM_PIN_BUDGET",
            _size,
            None,
            "most bytes the registered mode may pin (default: PLE_UM_PIN_FRACTION of MemAvailable)",
        ),
        Knob("PLE_UM_PIN_FRACTION", float, 0.5, "fraction of MemAvailable the registered mode may pin"),
        Knob(
            "PLE_UM_ATS_PREFETCH",
            _bool,
            True,
            "ats mode: CPU threads touch a lookup's pages ahead of the GPU",
        ),
        Knob(
            "PLE_UM_ATS_POPULATE",
            _bool,
            False,
            "ats mode: populate the mapping through cudaHostRegister at open",
        ),
        Knob("PLE_UM_SELF_TEST_ROWS", int, 64, "rows the self-test compares with the file at open (0 = off)"),
        Knob("PLE_UM_STAGING_SLOTS", int, 3, "cpu mode: pinned staging buffers used in turn"),
        Knob(
            "PLE_UM_BULK_ROWS",
            _bulk_rows,
            "auto",
            "GPU modes, eager lookups of at least this many ids take the CPU bulk gather + one copy; "
            "auto = the crossover measured at open, 0 = never",
        ),
        Knob(
            "PLE_UM_ROWCOPY",
            _bool,
            True,
            "big host gathers read rows with the C row copy (compiled once into PLE_UM_CACHE_DIR), "
            "else torch.index_select",
        ),
        Knob("PLE_UM_STRICT", _bool, False, "raise IndexError for ids outside the table (synchronizes)"),
        Knob(
            "PLE_UM_CACHE_DIR",
            str,
            lambda: os.path.join(os.path.expanduser("~"), ".cache", "ple-um"),
            "where `ple-um bench` keeps its synthetic table, and the compiled C row copy",
        ),
        Knob(
            "PLE_UM_METRICS_SEC",
            float,
            15.0,
            "seconds between reads of the GPU modes' device counters and the page-cache residency for "
            "Prometheus when the stats line is off (0 = never; with PLE_UM_STATS_SEC > 0 that period)",
        ),
    )
}


def __getattr__(name: str) -> Any:
    knob = KNOBS.get(name)
    if knob is None:
        raise AttributeError(f"module {__name__!r} has no knob {name!r}")
    return knob.value()


def describe() -> list[dict[str, Any]]:
    """Every knob as a dict (name, aliases, default, doc, current value text), for docs and the CLI."""
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
            }
        )
    return rows
