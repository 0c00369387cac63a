"""The bench's pieces on the CPU: the torch anchor's rows, the Zipf-hashed ids, the ratios to the
anchor, the decode step, what each contender is said to be. No times are asserted: the numbers
here are made up or only checked for their bookkeeping."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from helpers.cgroup import alive
from helpers.reference import reference_rows

import ple_um
from ple_um.bench import footprint, runner
from ple_um.bench.contenders import TorchResident, describe
from ple_um.bench.ids import (
    HASH_MULTIPLIER,
    NGRAM_SPACE,
    hash_onto_rows,
    parse_ids,
    zipf_ngrams,
)
from ple_um.bench.timing import DecodeStep, KernelOnly
from ple_um.bench.trace import DECODE_MAX_TOKENS


# -- the anchor ----------------------------------------------------------------------------------
def test_torch_anchor_gathers_the_rows_of_the_files(make_checkpoint):
    """Every row of a table of uneven shards, shard boundaries and duplicates included, into a
    poisoned preallocated out."""
    layout = make_checkpoint(num_rows=103, row_dim=40, shards=7, files=3)
    anchor = TorchResident(layout, torch.device("cpu"))
    S = layout.rows_per_shard
    edges = [0, S - 1, S, 2 * S - 1, 2 * S, layout.num_rows - 1, 5, 5]
    rng = np.random.default_rng(7)
    ids = torch.tensor(edges + rng.integers(0, layout.num_rows, 200).tolist())
    out = torch.full((ids.numel(), layout.row_bytes), 0xAB, dtype=torch.uint8)
    assert anchor.lookup(ids, out) is out
    np.testing.assert_array_equal(out.numpy(), reference_rows(layout, ids))
    assert anchor.capture_safe is True  # one stock kernel
    anchor.close()
    assert anchor.rows is None


def test_kernel_only_lends_the_table_without_its_bulk_path(make_checkpoint):
    """The kernel-only contender switches the lookup paths' bulk crossover off for its call and puts
    it back after, the rows exact in a poisoned output; closing it leaves the table open."""
    layout = make_checkpoint(num_rows=103, row_dim=40, shards=7, files=3)
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        table.paths.bulk_rows = 64
        kernel_only = KernelOnly(table)
        ids = torch.from_numpy(np.random.default_rng(3).integers(0, layout.num_rows, (2, 90)))
        for k in range(2):
            out = torch.full((90, layout.row_bytes), 0xAB, dtype=torch.uint8)
            assert kernel_only.lookup(ids[k], out=out.view(layout.dtype)) is not None
            np.testing.assert_array_equal(out.numpy(), reference_rows(layout, ids[k]))
            assert table.paths.bulk_rows == 64
        kernel_only.close()
        assert table.lookup(ids[0]).shape == (90, layout.row_dim)


# -- ids -------------------------------------------------------------------------------------------
def test_parse_ids_accepts_uniform_and_zipf_lists():
    (u,) = parse_ids("uniform")
    assert (u.name, u.s) == ("uniform", None)
    u, z = parse_ids("uniform, zipf:1.10")
    assert (z.name, z.s) == ("zipf:1.1", 1.1)
    assert z.describe() == {
        "kind": "zipf",
        "s": 1.1,
        "ngram_space": NGRAM_SPACE,
        "hash": z.describe()["hash"],
    }
    assert f"{HASH_MULTIPLIER:#x}" in z.describe()["hash"]
    assert [d.name for d in parse_ids("zipf:2,zipf:1.01")] == ["zipf:2", "zipf:1.01"]


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "bogus",
            "'bogus' is not an id distribution: expected uniform or zipf:S[:NGRAMS] with 1.01 <= S <= 10 "
            "and 2 <= NGRAMS <= 2^40",
        ),
        ("zipf", "'zipf' is not an id distribution"),
        ("zipf:x", "'zipf:x' is not an id distribution"),
        ("zipf:1", "'zipf:1': the Zipf exponent 1 is out of range"),
        ("zipf:0.9", "out of range"),
        ("zipf:11", "out of range"),
        ("uniform,", "'' is not an id distribution"),
        ("zipf:1.1,zipf:1.10", "'zipf:1.10' is named twice"),
        ("zipf:1.1:", "'zipf:1.1:' is not an id distribution"),
        ("zipf:1.1:x", "'zipf:1.1:x' is not an id distribution"),
        ("zipf:1.1:64M:3", "'zipf:1.1:64M:3' is not an id distribution"),
        ("zipf:1.1:1", "'zipf:1.1:1': the n-gram space 1 is out of range"),
        ("zipf:1.1:2T", "'zipf:1.1:2T': the n-gram space 2T is out of range"),
        ("zipf:0.5:64M", "'zipf:0.5:64M': the Zipf exponent 0.5 is out of range"),
    ],
)
def test_parse_ids_refuses_bad_values(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_ids(text)


def test_parse_ids_accepts_an_ngram_space():
    """``zipf:S:NGRAMS``: a count with an optional binary suffix, from 2 to the default space."""
    (z,) = parse_ids("zipf:1.1:64M")
    assert (z.name, z.s, z.space) == ("zipf:1.1:64M", 1.1, 1 << 26)
    assert z.describe()["ngram_space"] == 1 << 26
    a, b, c = parse_ids("zipf:1.5:1000,zipf:1.5:2,zipf:1.5:1T")
    assert [d.space for d in (a, b, c)] == [1000, 2, NGRAM_SPACE]
    assert [d.name for d in (a, b, c)] == ["zipf:1.5:1000", "zipf:1.5:2", "zipf:1.5:1T"]
    (default,) = parse_ids("zipf:1.1")
    assert default.space == NGRAM_SPACE


def test_zipf_draws_come_only_from_the_ngram_space():
    """Every draw of ``zipf:1.1:1000`` is one of the 1000 n-grams' rows, and each of them is hit."""
    num_rows = 1_000_000
    (z,) = parse_ids("zipf:1.1:1000")
    ids = z.draw(np.random.default_rng(4), num_rows, 200_000)
    space_rows = set(hash_onto_rows(np.arange(1, 1001), num_rows).tolist())
    assert set(ids.tolist()) <= space_rows
    # Rank 1000 has probability 1000^-1.1 / sum_{r<=1000} r^-1.1 = 9e-5: 18 draws of 200 000 expected.
    assert set(ids.tolist()) == space_rows
    ranks = zipf_ngrams(np.random.default_rng(5), 1.01, 50_000, space=7)
    assert ranks.min() == 1 and ranks.max() == 7


def test_hash_is_the_documented_formula():
    """The hash the JSON describes, recomputed with Python's integers."""
    num_rows = 1_000_003
    ngrams = [1, 2, 3, 12345, NGRAM_SPACE]
    expect = []
    for g in ngrams:
        h = (g * HASH_MULTIPLIER) % (1 << 64)
        expect.append((h ^ (h >> 32)) % num_rows)
    assert hash_onto_rows(np.array(ngrams), num_rows).tolist() == expect


def test_zipf_ids_are_skewed_fresh_and_spread_over_the_table():
    num_rows = 1_000_003  # not a power of two
    (zipf,) = parse_ids("zipf:1.1")
    rng = np.random.default_rng(0)
    a, b = zipf.draw(rng, num_rows, 200_000), zipf.draw(rng, num_rows, 200_000)
    for ids in (a, b):
        assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < num_rows
    assert not np.array_equal(a, b)  # fresh draws every call
    rows, counts = np.unique(a, return_counts=True)
    # The hottest row is the rank-1 n-gram's: Zipf(1.1) gives rank 1 1/zeta(1.1) = 9.45% of the
    # draws, ~10.0% once draws past the n-gram space (5.6%) are drawn again. Uniform: 1e-6.
    top = rows[np.argmax(counts)]
    assert top == hash_onto_rows(np.array([1]), num_rows)[0]
    assert 0.09 < counts.max() / a.size < 0.11
    # The same rows stay hot from call to call.
    hot_a = set(rows[np.argsort(counts)[-20:]].tolist())
    rows_b, counts_b = np.unique(b, return_counts=True)
    hot_b = set(rows_b[np.argsort(counts_b)[-20:]].tolist())
    assert len(hot_a & hot_b) >= 15
    # ... and they are spread over the whole table, not packed at its start: each tenth of the
    # table holds some of the 200 hottest rows.
    hottest = rows[np.argsort(counts)[-200:]]
    assert len(np.unique(hottest * 10 // num_rows)) == 10
    # Ranks themselves stay inside the n-gram space.
    ranks = zipf_ngrams(rng, 1.01, 50_000)
    assert ranks.min() >= 1 and ranks.max() <= NGRAM_SPACE


def test_uniform_ids_cover_the_table_evenly():
    (uniform,) = parse_ids("uniform")
    ids = uniform.draw(np.random.default_rng(1), 1000, 200_000)
    assert ids.min() == 0 and ids.max() == 999
    counts = np.bincount(ids, minlength=1000)
    assert counts.max() < 2 * counts.mean()


def _timing(median: float) -> dict:
    return {"median_us": median, "p10_us": median, "p90_us": median, "gbps": 1.0, "calls": 3}


def test_ratios_divide_every_figure_by_the_anchors():
    ids = ("uniform", "zipf:1.1")
    result = {
        "ids": {name: {} for name in ids},
        "lookup": {
            runner.ANCHOR: {
                "uniform": {"16": _timing(10.0), "1024": _timing(20.0), "host": {"median_us": 5.0}},
                "zipf:1.1": {"16": _timing(8.0), "host": {"median_us": 4.0}},
            },
            "ple-um registered": {
                "mode": "registered",
                "uniform": {"16": _timing(30.0), "1024": _timing(50.0), "host": {"median_us": 25.0}},
                "zipf:1.1": {"16": _timing(12.0), "1024": _timing(99.0), "host": {"median_us": 6.0}},
            },
            "ple-um ats": {"skipped": "ModeUnavailableError: no ATS"},
        },
        "decode_step": {
            runner.ANCHOR: {
                "capture_safe": True,
                "uniform": {"eager": _timing(100.0), "graph": _timing(20.0)},
            },
            "ple-um registered": {
                "capture_safe": True,
                "uniform": {"eager": _timing(150.0), "graph": _timing(50.0)},
            },
            "seeds cpu": {"capture_safe": False, "uniform": {"eager": _timing(1000.0)}},
        },
    }
    runner.ratios(result)
    reg = result["lookup"]["ple-um registered"]
    assert reg["uniform"]["16"]["vs_torch"] == pytest.approx(3.0)
    assert reg["uniform"]["1024"]["vs_torch"] == pytest.approx(2.5)
    assert reg["uniform"]["host"]["vs_torch"] == pytest.approx(5.0)
    assert reg["zipf:1.1"]["16"]["vs_torch"] == pytest.approx(1.5)
    assert reg["zipf:1.1"]["host"]["vs_torch"] == pytest.approx(1.5)
    assert "vs_torch" not in reg["zipf:1.1"]["1024"]  # the anchor has no such figure
    assert result["lookup"][runner.ANCHOR]["uniform"]["16"]["vs_torch"] == 1.0
    assert result["lookup"]["ple-um ats"] == {"skipped": "ModeUnavailableError: no ATS"}
    step = result["decode_step"]
    assert step["ple-um registered"]["uniform"]["eager"]["vs_torch"] == pytest.approx(1.5)
    assert step["ple-um registered"]["uniform"]["graph"]["vs_torch"] == pytest.approx(2.5)
    assert step["seeds cpu"]["uniform"]["eager"]["vs_torch"] == pytest.approx(10.0)


def test_decode_step_reads_capture_safe_from_the_table(make_checkpoint):
    """The graph column follows what the table reports, not a list of modes (on the CPU there is
    no graph to capture, whatever it reports)."""
    layout = make_checkpoint(num_rows=300, row_dim=16, shards=3)
    cfg = runner.Config(decode_tokens=4, heads=2)
    check = [torch.randint(0, layout.num_rows, (8,)) for _ in range(3)]
    with ple_um.open_table(layout.directory, mode="cpu", device="cpu") as table:
        step = DecodeStep(table, layout, torch.device("cpu"), cfg.decode_tokens, cfg.heads, check)
        assert step.capture_safe is table.capture_safe
        assert step.graph is None
        y = step.eager(check[1])
        assert y.shape == (4, 64)


def test_every_contender_is_said_what_it_is():
    assert "vllm_ple_mmap" in describe("seeds cpu", "host memory") and "before ple-um" in describe(
        "seeds cpu", ""
    )
    assert "torch.index_select" in describe(runner.ANCHOR, "GPU memory") and "GPU memory" in describe(
        runner.ANCHOR, "GPU memory"
    )
    assert "pinned host memory" in describe("vllm pinned-host", "")
    for mode in ("ats", "registered", "cpu", "device"):
        line = describe(f"ple-um {mode}", "")
        assert line.startswith(f"ple-um's {mode} mode: ") and len(line) > 40
    assert "the host path switched off" in describe("ple-um registered kernel-only", "")


# -- the processes' figure and the host burst's ids ----------------------------------------------
def test_a_process_that_is_never_ready_is_killed_and_its_figure_fails(make_checkpoint, tmp_path, monkeypatch):
    """A real child that hangs before it says it is ready (here: sleeps) is killed after the wait's
    timeout, and the figure says why it is missing instead of the bench hanging."""
    layout = make_checkpoint(num_rows=40, row_dim=16, shards=2)
    pidfile = tmp_path / "pid"
    hang = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    monkeypatch.setattr(footprint, "CHILD", hang)
    t0 = time.monotonic()
    result = footprint.processes(layout, "ple-um", 2, torch.device("cpu"), ready_s=5.0)
    assert time.monotonic() - t0 < 60
    assert result == {"skipped": "a ple-um process was not ready after 5 s: killed"}
    assert not alive(int(pidfile.read_text()))
    assert footprint.READY_TIMEOUT_S >= 60  # long enough for a slow open of a big table


def test_every_host_burst_call_is_a_lookup_of_its_own(make_checkpoint):
    """The back-to-back burst's 16-row calls are drawn as 16-row lookups are, one after the other:
    under a trace, each the next decode step of one request (a 16-row lookup is one token), not
    slices of one prefill chunk of as many tokens as there are calls."""
    layout = make_checkpoint(num_rows=5000, row_dim=16, shards=2)
    (trace,) = parse_ids("trace")
    (reference,) = parse_ids("trace")
    assert trace.trace.rows_per_token == 16 and 1210 > DECODE_MAX_TOKENS
    block = runner._Ids(layout, torch.device("cpu"), seed=3).block(trace, 16, 1210)
    rng = np.random.default_rng(3)
    expected = np.stack([reference.draw(rng, layout.num_rows, 16) for _ in range(1210)])
    np.testing.assert_array_equal(block.numpy(), expected)
    assert {kind for kind, _ in trace._replays} == {"decode"}
