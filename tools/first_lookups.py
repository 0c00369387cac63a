"""The most any row cache can serve of the bench's id stream after a given amount of traffic: the
hit rate of an unbounded cache that starts empty (``cache_sim.seen_before``: it misses only a row's
first lookup), at points of a stream of ``--batch``-row lookups drawn as ``ple-um bench`` draws them.

    python tools/first_lookups.py --table-rows 80530636 --ids zipf:1.1 \\
        --at 14521344,60000000,120000000 --json-file first_lookups.json

A row cache measured after N rows of warm-up (``ple-um bench --memory-limit --warmup``) is read
against the line for N: where they meet, every miss left is a row never looked up before, which no
cache policy or size avoids; only more traffic does. One bit per table row, numpy only: the default
stream takes about 15 s and 100 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cache_sim import seen_before  # noqa: E402

from ple_um.bench.config import ROW_BYTES  # noqa: E402
from ple_um.bench.ids import IdDistribution, parse_ids  # noqa: E402
from ple_um.lookup.host.row_cache import SLOT_OVERHEAD  # noqa: E402
from ple_um.units import format_bytes  # noqa: E402

# The table of `ple-um bench --memory-limit 3GiB --size 12GiB`: 12 GiB of the bench's rows.
DEFAULT_TABLE_ROWS = (12 << 30) // ROW_BYTES


def measure(table_rows: int, dist: IdDistribution, batch: int, at: list[int], window: int, seed: int) -> dict:
    """The unbounded cache's hit rate over the ``window`` rows after each point of ``at`` (rows
    looked up before), and the distinct rows looked up by then."""
    rng = np.random.default_rng(seed)
    points = sorted(at)
    calls = -(-(points[-1] + window) // batch)
    lookups = (dist.draw(rng, table_rows, batch) for _ in range(calls))
    looked = distinct = served = counted = start = start_distinct = 0
    found = []
    for hits in seen_before(lookups, table_rows):
        if len(found) < len(points) and looked >= points[len(found)]:
            if counted == 0:
                start, start_distinct = looked, distinct
            served, counted = served + hits, counted + batch
            if counted >= window:
                found.append(
                    {"after_rows": start, "hit_rate": served / counted, "distinct_rows": start_distinct}
                )
                served = counted = 0
        distinct += batch - hits
        looked += batch
    return {
        "table_rows": table_rows,
        "ids": dist.name,
        "batch": batch,
        "window": window,
        "seed": seed,
        "at": found,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-rows", type=int, default=DEFAULT_TABLE_ROWS, help="rows of the table")
    parser.add_argument("--ids", default="zipf:1.1", help="one id distribution, as ple-um bench --ids")
    parser.add_argument("--batch", type=int, default=1024, help="rows per lookup")
    parser.add_argument("--at", default="1000000,14521344,60000000,120000000", help="rows looked up before")
    parser.add_argument("--window", type=int, default=20480, help="rows each hit rate is counted over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-file", help="write the results here")
    args = parser.parse_args(argv)
    try:
        at = [int(x) for x in args.at.split(",")]
        dists = parse_ids(args.ids)
    except ValueError as exc:
        parser.error(f"--at {args.at!r} / --ids {args.ids!r}: {exc}")
    if len(dists) != 1:
        parser.error(f"--ids {args.ids!r}: one distribution at a time")
    if args.table_rows < 1 or args.batch < 1 or args.window < 1 or min(at) < 0:
        parser.error("--table-rows, --batch and --window must be at least 1, --at at least 0")
    result = measure(args.table_rows, dists[0], args.batch, at, args.window, args.seed)
    slot = ROW_BYTES + SLOT_OVERHEAD
    print(f"{args.ids} over {args.table_rows} rows, {args.batch} a lookup; a cache of no bound:")
    print(
        "| rows looked up before | hits over the next rows | distinct rows by then | their row-cache bytes |"
    )
    print("| --- | --- | --- | --- |")
    for row in result["at"]:
        held = format_bytes(row["distinct_rows"] * slot)
        print(f"| {row['after_rows']:,} | {row['hit_rate']:.1%} | {row['distinct_rows']:,} | {held} |")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
