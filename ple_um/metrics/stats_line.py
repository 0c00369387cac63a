"""The stats line: one window's figures per access mode, as an operator reads them in the log.

``ple-um stats (last 30s, pid 4242): cpu: 1200 lookups, 19200 rows (640 rows/s, 0.10 MB/s),
0 out-of-range, host 0.362 ms/lookup; phases ms: gather 310.5, stage 124.0, gpu-wait
18.3; row cache: 96.2% hits, 6.10 M rows in 1.02 GiB; 730 file reads (2.1 ms); page cache:
12.30 GiB of 47.68 GiB resident (25.8%)``

A table with a row cache adds its window's hit rate and file reads, and what the cache holds.
"""

from __future__ import annotations

import os

from ple_um.lookup.counts import PHASES
from ple_um.units import format_bytes

FIGURES = ("lookups", "rows", "bytes", "out_of_range", "file_reads", "file_read_seconds")
# From stats()["row_cache"], under the keys of the metrics they feed: counted (the window shows what
# they rose by) and held (what the cache holds now).
CACHE_COUNTED = {"row_cache_hits": "hits", "row_cache_misses": "misses", "row_cache_evictions": "evictions"}
CACHE_HELD = {"row_cache_rows": "rows", "row_cache_bytes": "resident_bytes"}


def figures(stats: dict) -> dict[str, float]:
    """The cumulative figures of a ``stats()`` dict that the stats line shows and the counters
    absorb, each under its metric's key (and, under ``CACHE_HELD``'s keys, what its row cache holds
    now)."""
    out = {key: float(stats.get(key, 0)) for key in FIGURES}
    phases = stats.get("phase_seconds") or {}
    for key in PHASES:
        out[key] = float(phases.get(key, 0.0))
    cache = stats.get("row_cache") or {}
    for key, field in (*CACHE_COUNTED.items(), *CACHE_HELD.items()):
        out[key] = float(cache.get(field, 0))
    return out


def format_line(
    window: dict[str, dict[str, float]], elapsed: float, resident: int, mapped: int
) -> str | None:
    """The stats line for one window (figures per mode), or None when nothing was looked up."""
    parts = []
    for mode, f in sorted(window.items()):
        if not f.get("lookups") and not f.get("rows"):
            continue
        n = f["lookups"]
        host_ms = sum(f[k] for k in PHASES if k != "wait") * 1e3
        text = (
            f"{mode}: {n:.0f} lookups, {f['rows']:.0f} rows ({f['rows'] / elapsed:.0f} rows/s, "
            f"{f['bytes'] / elapsed / 1e6:.2f} MB/s), {f['out_of_range']:.0f} out-of-range"
        )
        if any(f[k] for k in PHASES):
            per = f", host {host_ms / n:.3f} ms/lookup" if n else ""
            text += (
                f"{per}; phases ms: gather {f['gather'] * 1e3:.1f}, "
                f"stage {f['stage'] * 1e3:.1f}, gpu-wait {f['wait'] * 1e3:.1f}"
            )
        asked = f.get("row_cache_hits", 0) + f.get("row_cache_misses", 0)
        if asked or f.get("row_cache_rows"):
            rate = f"{100.0 * f['row_cache_hits'] / asked:.1f}% hits" if asked else "no lookups"
            text += (
                f"; row cache: {rate}, {f['row_cache_rows'] / 1e6:.2f} M rows in "
                f"{format_bytes(f.get('row_cache_bytes', 0))}"
            )
        if f.get("file_reads"):
            text += f"; {f['file_reads']:.0f} file reads ({f.get('file_read_seconds', 0) * 1e3:.1f} ms)"
        parts.append(text)
    if not parts:
        return None
    line = f"ple-um stats (last {elapsed:.0f}s, pid {os.getpid()}): " + "; ".join(parts)
    if mapped:
        share = 100.0 * resident / mapped
        line += f"; page cache: {format_bytes(resident)} of {format_bytes(mapped)} resident ({share:.1f}%)"
    return line
