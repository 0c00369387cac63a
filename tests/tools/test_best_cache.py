"""tools/best_cache.py: the best row and page caches of the bench's zipf ids, against the row
probabilities and cache_sim's bounds computed here, and its JSON and table."""

from __future__ import annotations

import json

import cache_bound
import numpy as np
import pytest
from cache_bound import best_distinct_misses, best_hits, page_probabilities, pages_held_hits
from helpers.tools import load_tool

from ple_um.bench.ids import parse_ids
from ple_um.lookup.host.row_cache import slots_for


@pytest.fixture(scope="module")
def script():
    return load_tool("best_cache")


def test_best_caches_of_each_size(script, tmp_path, capsys):
    """Row caches of the shipped cache's slot count and page caches of whole pages, each figure
    recomputed here, the tail's share named."""
    out = tmp_path / "bc.json"
    args = ["--table-rows", "20000", "--ids", "zipf:1.2:300K", "--cache", "64KiB,1MiB,0", "--batch", "256"]
    args += ["--page-cache", "64KiB,1MiB", "--reads-per-s", "50000", "--exact-ranks", "100000"]
    assert script.main([*args, "--json-file", str(out)]) == 0
    got = json.loads(out.read_text())
    (dist,) = parse_ids("zipf:1.2:300K")
    rows = cache_bound.row_probabilities(dist, 20000, 100_000)
    pages = page_probabilities(rows, 160, 4096)
    held = [slots_for(64 << 10, 160), slots_for(1 << 20, 160), 0]
    assert held[0] > 0 and held[2] == 0
    want = list(zip(["row"] * 3, [64 << 10, 1 << 20, 0], held, best_hits(rows, held), strict=True))
    want += zip(["page"] * 2, [64 << 10, 1 << 20], [16, 256], best_hits(pages, [16, 256]), strict=True)
    reads = best_distinct_misses(rows, held, 256) + best_distinct_misses(pages, [16, 256], 256)
    assert [(c["cache"], c["bytes"], c["held"]) for c in got["caches"]] == [w[:3] for w in want]
    for c, (_, _, _, hit), read in zip(got["caches"], want, reads, strict=True):
        assert c["hit_rate"] == pytest.approx(hit, rel=1e-12)
        assert c["missed_rows_per_lookup"] == pytest.approx(256 * (1 - hit), rel=1e-12)
        assert c["reads_per_lookup"] == pytest.approx(read, rel=1e-12)
        assert c["least_read_ms"] == pytest.approx(1e3 * read / 50000, rel=1e-12)
    assert got["caches"][2]["hit_rate"] == 0.0 and got["caches"][0]["hit_rate"] < got["caches"][1]["hit_rate"]
    # Rows: the best set holds each row wholly. Pages: the rows wholly in the best pages, below the bound.
    for c in got["caches"][:3]:
        assert c["held_hit_rate"] == c["hit_rate"]
    for c, reached in zip(got["caches"][3:], pages_held_hits(rows, [16, 256], 160, 4096), strict=True):
        assert c["held_hit_rate"] == pytest.approx(reached, rel=1e-12) and reached < c["hit_rate"]
    assert got["tail_share"] == pytest.approx(cache_bound.tail_share(dist, 100_000)) and got["tail_share"] > 0
    assert (got["table_rows"], got["batch"], got["exact_ranks"], got["distribution"]["ngram_space"]) == (
        20000,
        256,
        100_000,
        300 << 10,
    )
    printed = capsys.readouterr().out
    first = got["caches"][0]
    assert f"| row | 64.00 KiB | {held[0]:,} rows | {first['hit_rate']:.2%} |" in printed
    last = got["caches"][4]
    rates = f"{last['hit_rate']:.2%} | {last['held_hit_rate']:.2%}"
    assert f"| page | 1.00 MiB | 256 pages | {rates} |" in printed
    assert (
        "least read time at 50,000 reads/s |" in printed and f"{first['least_read_ms']:.2f} ms |" in printed
    )
    assert f"each hit rate is off by at most {100 * got['tail_share']:.2f} points" in printed


def test_without_a_read_rate_or_a_tail(script, tmp_path, capsys):
    out = tmp_path / "bc.json"
    args = ["--table-rows", "5000", "--ids", "zipf:1.5:5000", "--cache", "", "--page-cache", "8KiB"]
    assert script.main([*args, "--json-file", str(out)]) == 0
    got = json.loads(out.read_text())
    (page,) = got["caches"]
    assert page["least_read_ms"] is None and got["tail_share"] == 0.0
    rows = cache_bound.row_probabilities(parse_ids("zipf:1.5:5000")[0], 5000)
    assert page["hit_rate"] == pytest.approx(best_hits(page_probabilities(rows, 160, 4096), [2])[0])
    printed = capsys.readouterr().out
    assert "the hit rates are exact" in printed and "reads/s" not in printed
    assert printed.count("| page |") == 1 and "| row |" not in printed
    assert np.isclose(page["missed_rows_per_lookup"], 1024 * (1 - page["hit_rate"]))


@pytest.mark.parametrize(
    "args,says",
    [
        (["--ids", "uniform"], "one zipf:S[:NGRAMS] distribution"),
        (["--ids", "trace"], "one zipf:S[:NGRAMS] distribution"),
        (["--ids", "zipf:1.1,zipf:1.2"], "one zipf:S[:NGRAMS] distribution"),
        (["--ids", "zipf:0.5"], "expected uniform or zipf:S"),
        (["--cache", "lots"], "--cache 'lots'"),
        (["--cache", "", "--page-cache", ""], "no cache sizes"),
        (["--batch", "0"], "must be at least 1"),
        (["--reads-per-s", "0"], "--reads-per-s must be more than 0"),
    ],
)
def test_refuses_bad_arguments(script, args, says, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(args)
    assert exc.value.code == 2 and says in capsys.readouterr().err
