"""The stats line: one window's figures per access mode, as an operator reads them in the log.

``ple-um stats (last 30s, pid 4242): cpu: 1200 lookups, 19200 rows (640 rows/s, 0.10 MB/s),
0 out-of-range, host 0.412 ms/lookup; phases ms: dedup 60.2, gather 310.5, stage 124.0, gpu-wait
18.3; page cache: 12.30 GiB of 47.68 GiB resident (25.8%)``
"""

from __future__ import annotations

import os

from ple_um.metrics.counters import PHASES
from ple_um.units import format_bytes

FIGURES = ("lookups", "rows", "bytes", "out_of_range")


def figures(stats: dict) -> dict[str, float]:
    """The cumulative figures of a ``stats()`` dict that the stats line shows."""
    out = {key: float(stats.get(key, 0)) for key in FIGURES}
    phases = stats.get("phase_seconds") or {}
    for key in PHASES:
        out[key] = float(phases.get(key, 0.0))
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
                f"{per}; phases ms: dedup {f['dedup'] * 1e3:.1f}, gather {f['gather'] * 1e3:.1f}, "
                f"stage {f['stage'] * 1e3:.1f}, gpu-wait {f['wait'] * 1e3:.1f}"
            )
        parts.append(text)
    if not parts:
        return None
    line = f"ple-um stats (last {elapsed:.0f}s, pid {os.getpid()}): " + "; ".join(parts)
    if mapped:
        share = 100.0 * resident / mapped
        line += f"; page cache: {format_bytes(resident)} of {format_bytes(mapped)} resident ({share:.1f}%)"
    return line
