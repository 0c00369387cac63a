"""The counts every lookup path reports, in one shape, so that a table adds them up without asking
which path it holds."""

from __future__ import annotations

PHASES = ("gather", "stage", "wait")


def path_counts(
    rows: int = 0,
    out_of_range: int = 0,
    broken: int = 0,
    lookups: int = 0,
    *,
    file_reads: int = 0,
    file_read_seconds: float = 0.0,
    **phase_seconds: float,
) -> dict:
    """Rows looked up (graph replays too), ids outside the table, broken rows (owned ids whose row
    lay outside its shard's mapping: zero rows), host-path lookups, the rows the host path read
    from the files and the seconds it waited for them (with or without a row cache), and the host
    path's seconds by phase (``PHASES``; the ones not given are 0)."""
    unknown = set(phase_seconds) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; expected {PHASES}")
    return {
        "rows": rows,
        "out_of_range": out_of_range,
        "broken": broken,
        "lookups": lookups,
        "file_reads": file_reads,
        "file_read_seconds": float(file_read_seconds),
        "phase_seconds": {p: float(phase_seconds.get(p, 0.0)) for p in PHASES},
    }
