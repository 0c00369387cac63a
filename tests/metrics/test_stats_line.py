"""ple_um.metrics.stats_line: the line's figures per mode and its page-cache sizes in the package's
byte units."""

from __future__ import annotations

import os

from ple_um.metrics.stats_line import figures, format_line


def window(**figures: float) -> dict[str, float]:
    base = dict.fromkeys(("lookups", "rows", "bytes", "out_of_range", "gather", "stage", "wait"), 0.0)
    base |= dict.fromkeys(("file_reads", "file_read_seconds", "row_cache_hits", "row_cache_misses"), 0.0)
    base |= dict.fromkeys(("row_cache_evictions", "row_cache_rows", "row_cache_bytes"), 0.0)
    return base | figures


def test_line_of_one_window():
    cpu = window(lookups=1200, rows=19200, bytes=3_072_000, gather=0.3105, stage=0.124, wait=0.0183)
    line = format_line({"cpu": cpu}, 30.0, int(12.3 * (1 << 30)), int(47.68 * (1 << 30)))
    assert line == (
        f"ple-um stats (last 30s, pid {os.getpid()}): cpu: 1200 lookups, 19200 rows (640 rows/s, 0.10 MB/s), "
        "0 out-of-range, host 0.362 ms/lookup; phases ms: gather 310.5, stage 124.0, "
        "gpu-wait 18.3; page cache: 12.30 GiB of 47.68 GiB resident (25.8%)"
    )


def test_page_cache_sizes_in_binary_units():
    one = {"ats": window(rows=16, bytes=2560)}
    assert format_line(one, 10.0, 512 << 20, 1 << 30).endswith(
        "page cache: 512.00 MiB of 1.00 GiB resident (50.0%)"
    )
    assert format_line(one, 10.0, 0, 1536).endswith("page cache: 0 B of 1.50 KiB resident (0.0%)")
    assert "page cache" not in format_line(one, 10.0, 0, 0)  # nothing mapped: no page-cache part


def test_modes_in_order_and_idle_modes_left_out():
    line = format_line(
        {"registered": window(rows=5, bytes=50), "cpu": window(lookups=2, rows=3, bytes=30), "ats": window()},
        1.0,
        0,
        0,
    )
    assert line.index("): cpu: 2 lookups, 3 rows") < line.index("; registered: 0 lookups, 5 rows")
    assert "ats:" not in line and "phases" not in line  # no phase seconds: no phase part
    assert format_line({"ats": window()}, 1.0, 0, 0) is None


def test_figures_of_a_stats_dict():
    stats = {
        "lookups": 3,
        "rows": 7,
        "bytes": 70,
        "out_of_range": 1,
        "file_reads": 8,
        "file_read_seconds": 0.25,
        "phase_seconds": {"gather": 0.5},
        "mode": "cpu",
    }
    read = dict(file_reads=8, file_read_seconds=0.25)
    assert figures(stats) == window(lookups=3, rows=7, bytes=70, out_of_range=1, gather=0.5, **read)
    assert figures({}) == window()
    cache = {
        "hits": 90,
        "misses": 10,
        "rows": 40,
        "resident_bytes": 4096,
    }
    assert figures({**stats, "row_cache": cache}) == window(
        lookups=3,
        rows=7,
        bytes=70,
        out_of_range=1,
        gather=0.5,
        **read,
        row_cache_hits=90,
        row_cache_misses=10,
        row_cache_rows=40,
        row_cache_bytes=4096,
    )
    assert figures({**stats, "row_cache": None}) == figures(stats)  # a table without a cache


def test_the_row_cache_in_the_line():
    cpu = window(
        lookups=10,
        rows=16000,
        bytes=2_560_000,
        gather=0.02,
        row_cache_hits=15400,
        row_cache_misses=600,
        file_reads=580,
        file_read_seconds=0.0021,
        row_cache_rows=6_100_000,
        row_cache_bytes=int(1.02 * (1 << 30)),
    )
    line = format_line({"cpu": cpu}, 10.0, 0, 0)
    assert "; row cache: 96.2% hits, 6.10 M rows in 1.02 GiB; 580 file reads (2.1 ms)" in line
    assert "row cache" not in format_line({"cpu": window(lookups=1, rows=2, bytes=20)}, 1.0, 0, 0)


def test_file_reads_in_the_line_without_a_row_cache():
    cpu = window(lookups=4, rows=64, bytes=10240, gather=0.01, file_reads=60, file_read_seconds=0.0045)
    line = format_line({"cpu": cpu}, 1.0, 0, 0)
    assert "row cache" not in line and line.endswith("; 60 file reads (4.5 ms)")
    assert "file reads" not in format_line({"cpu": window(lookups=1, rows=2, bytes=20)}, 1.0, 0, 0)
