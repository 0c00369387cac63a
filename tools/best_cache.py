"""The most any cache of a given size can serve of the bench's ``zipf:S`` ids, however long the
traffic runs: the probability of the most probable rows it can hold (``cache_bound.best_hits``; no
cache that does not know the future serves more), for row caches of ``--cache`` bytes and page
caches of ``--page-cache``.

    python tools/best_cache.py --table-rows 80530636 --ids zipf:1.1 --cache 1.30GiB,2GiB \\
        --page-cache 2.5GiB --reads-per-s 76319 --batch 1024 --json-file best_cache.json

A row cache of B bytes holds the shipped row cache's slots for B (``row_cache.slots_for``, its
per-slot overhead included); a page cache ``B // --page-bytes`` pages, rows laid out in order from
a page boundary. For a page cache the best hit rate counts a row across two pages in its first, an
upper bound; ``held`` counts only the rows wholly in those pages (``cache_bound.pages_held_hits``), a
rate those pages do reach: the best page cache lies between (the shards' header offsets move the
real page boundaries, so both are statistical). Each lookup draws ``--batch`` rows; the misses a
lookup leaves, the distinct rows (pages) among them, which are the fewest reads that serve them,
and at ``--reads-per-s`` the least time those reads take. ``first_lookups.py`` bounds a row cache
after a given amount of traffic; this is the bound no amount of traffic passes.

The row probabilities hash the first ``--exact-ranks`` n-gram ranks one by one and spread the rest
evenly over the rows (``cache_bound.row_probabilities``); the share of the draws spread so is
printed: it is the most any hit rate here can be off by. The defaults take about 45 s and 5 GiB
(numpy: float64 and int64 arrays of the table's rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cache_bound import (  # noqa: E402
    best_distinct_misses,
    best_hits,
    page_probabilities,
    pages_held_hits,
    row_probabilities,
    tail_share,
)
from cache_sim import PAGE_BYTES  # noqa: E402

from ple_um.bench.config import ROW_BYTES  # noqa: E402
from ple_um.bench.ids import IdDistribution, parse_ids  # noqa: E402
from ple_um.lookup.host.row_cache import slots_for  # noqa: E402
from ple_um.units import format_bytes, parse_size  # noqa: E402

# The table of `ple-um bench --memory-limit 3GiB --size 12GiB`: 12 GiB of the bench's rows.
DEFAULT_TABLE_ROWS = (12 << 30) // ROW_BYTES
# About the row cache `auto` sizes for that bench's 3 GiB limit on the H200 host; the page caches:
# the same bytes, and 2.5 GiB.
DEFAULT_CACHE = "1.30GiB"
DEFAULT_PAGE_CACHE = "1.30GiB,2.5GiB"


def measure(
    table_rows: int,
    dist: IdDistribution,
    caches: list[int],
    page_caches: list[int],
    *,
    batch: int,
    row_bytes: int = ROW_BYTES,
    page_bytes: int = PAGE_BYTES,
    reads_per_s: float | None = None,
    exact_ranks: int = 1 << 30,
) -> dict:
    """The best row cache of each size of ``caches`` and the best page cache of each of
    ``page_caches`` (bytes), under ``dist``'s ids over a table of ``table_rows`` rows."""
    start = time.monotonic()
    rows = row_probabilities(dist, table_rows, exact_ranks)
    found = _best("row", rows, caches, [slots_for(c, row_bytes) for c in caches], batch, reads_per_s)
    if page_caches:
        pages = page_probabilities(rows, row_bytes, page_bytes)
        held = [c // page_bytes for c in page_caches]
        found += _best("page", pages, page_caches, held, batch, reads_per_s)
        for entry, reached in zip(
            found[-len(held) :], pages_held_hits(rows, held, row_bytes, page_bytes), strict=True
        ):
            entry["held_hit_rate"] = reached
    return {
        "table_rows": table_rows,
        "row_bytes": row_bytes,
        "page_bytes": page_bytes,
        "ids": dist.name,
        "distribution": dist.describe(),
        "batch": batch,
        "reads_per_s": reads_per_s,
        "exact_ranks": min(exact_ranks, dist.space),
        "tail_share": tail_share(dist, exact_ranks),
        "caches": found,
        "seconds": time.monotonic() - start,
    }


def _best(kind, probabilities, sizes, held, batch, reads_per_s) -> list[dict]:
    hits = best_hits(probabilities, held)
    reads = best_distinct_misses(probabilities, held, batch)
    return [
        {
            "cache": kind,
            "bytes": size,
            "held": n,
            "hit_rate": hit,
            "held_hit_rate": hit,
            "missed_rows_per_lookup": batch * (1.0 - hit),
            "reads_per_lookup": read,
            "least_read_ms": None if reads_per_s is None else 1e3 * read / reads_per_s,
        }
        for size, n, hit, read in zip(sizes, held, hits, reads, strict=True)
    ]


def _sizes(text: str) -> list[int]:
    return [parse_size(item) for item in text.split(",") if item.strip()]


def report(result: dict) -> str:
    """The markdown table of ``measure``'s result, under a line naming what it is of."""
    share = result["tail_share"]
    lines = [
        f"{result['ids']} over {result['table_rows']:,} rows of {result['row_bytes']} B, "
        f"{result['batch']:,} rows a lookup: the best cache after unbounded traffic (A0).",
        f"Ranks past {result['exact_ranks']:,} ({share:.2%} of the draws) spread evenly over the rows: "
        f"each hit rate is off by at most {100 * share:.2f} points."
        if share
        else f"All {result['exact_ranks']:,} n-gram ranks hashed: the hit rates are exact.",
        "",
    ]
    rate = result["reads_per_s"]
    head = (
        "| cache | size | holds | best hit rate | held: rows wholly in it | missed rows per lookup "
        "| distinct reads per lookup |"
    )
    lines += [
        head + (f" least read time at {rate:,.0f} reads/s |" if rate else ""),
        "| --- " * (8 if rate else 7) + "|",
    ]
    for c in result["caches"]:
        unit = "rows" if c["cache"] == "row" else "pages"
        line = (
            f"| {c['cache']} | {format_bytes(c['bytes'])} | {c['held']:,} {unit} | {c['hit_rate']:.2%} | "
            f"{c['held_hit_rate']:.2%} | {c['missed_rows_per_lookup']:.1f} | {c['reads_per_lookup']:.1f} |"
        )
        lines.append(line + (f" {c['least_read_ms']:.2f} ms |" if rate else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-rows", type=int, default=DEFAULT_TABLE_ROWS, help="rows of the table")
    parser.add_argument(
        "--ids", default="zipf:1.1", help="one zipf:S[:NGRAMS] distribution, as ple-um bench --ids"
    )
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="row-cache sizes, comma-separated (none: '')")
    parser.add_argument("--page-cache", default=DEFAULT_PAGE_CACHE, help="page-cache sizes, comma-separated")
    parser.add_argument(
        "--reads-per-s", type=float, help="the storage's random reads a second, for the time column"
    )
    parser.add_argument("--batch", type=int, default=1024, help="rows per lookup")
    parser.add_argument("--row-bytes", type=int, default=ROW_BYTES, help="bytes of a table row")
    parser.add_argument("--page-bytes", type=int, default=PAGE_BYTES, help="bytes of a page")
    parser.add_argument("--exact-ranks", type=int, default=1 << 30, help="n-gram ranks hashed one by one")
    parser.add_argument("--json-file", help="write the results here")
    args = parser.parse_args(argv)
    values = {}
    for flag, text, parse in (
        ("--ids", args.ids, parse_ids),
        ("--cache", args.cache, _sizes),
        ("--page-cache", args.page_cache, _sizes),
    ):
        try:
            values[flag] = parse(text)
        except ValueError as exc:
            parser.error(f"{flag} {text!r}: {exc}")
    dists, caches, page_caches = values["--ids"], values["--cache"], values["--page-cache"]
    if len(dists) != 1 or not isinstance(dists[0], IdDistribution) or dists[0].s is None:
        parser.error(f"--ids {args.ids!r}: one zipf:S[:NGRAMS] distribution (row probabilities need ranks)")
    if not caches and not page_caches:
        parser.error("no cache sizes: give --cache or --page-cache")
    if min(args.table_rows, args.batch, args.row_bytes, args.page_bytes, args.exact_ranks) < 1:
        parser.error("--table-rows, --batch, --row-bytes, --page-bytes and --exact-ranks must be at least 1")
    if args.reads_per_s is not None and not args.reads_per_s > 0:
        parser.error(f"--reads-per-s must be more than 0, got {args.reads_per_s}")
    result = measure(
        args.table_rows,
        dists[0],
        caches,
        page_caches,
        batch=args.batch,
        row_bytes=args.row_bytes,
        page_bytes=args.page_bytes,
        reads_per_s=args.reads_per_s,
        exact_ranks=args.exact_ranks,
    )
    print(report(result))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
