"""tools/profile_registered.py on the CPU machine: the ids each kind draws (in the table, in their
window, consecutive where asked, fresh from call to call), the report's table and ratio, and a clear
refusal without a CUDA device. Its GPU figures come from the H200 (docs/BENCHMARKS.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tools import load_tool

NUM_ROWS, ROW_BYTES, N = 13_421_772, 160, 1024


@pytest.fixture(scope="module")
def script():
    return load_tool("profile_registered")


@pytest.mark.parametrize("kind", ["sequential", "64KiB", "2MiB", "64MiB", "512MiB", "uniform", "zipf:1.1"])
def test_draw_stays_in_the_table_and_is_fresh(script, kind):
    rng = np.random.default_rng(7)
    first = script.draw(kind, rng, NUM_ROWS, ROW_BYTES, N)
    second = script.draw(kind, rng, NUM_ROWS, ROW_BYTES, N)
    for ids in (first, second):
        assert ids.shape == (N,)
        assert ids.min() >= 0 and ids.max() < NUM_ROWS
    assert not np.array_equal(first, second)
    if kind == "sequential":
        assert np.array_equal(first, np.arange(first[0], first[0] + N))
    if kind in script.WINDOWS:
        span = script.WINDOWS[kind] // ROW_BYTES
        assert first.max() - first.min() < span


def test_draw_window_wider_than_the_table(script):
    ids = script.draw("512MiB", np.random.default_rng(1), 1000, ROW_BYTES, N)
    assert ids.min() >= 0 and ids.max() < 1000


def q(median, exact=True):
    return {"median_us": median, "p10_us": median - 1, "p90_us": median + 1, "samples": 3, "exact": exact}


def test_report_gives_the_ratio_and_flags_a_wrong_output(script):
    result = {
        "rows": 1024,
        "replays": 3,
        "spread": {"uniform": {"ple-um registered": q(22.0), "torch index_select (device copy)": q(2.5)}},
        "shapes": {"16x4": {"uniform": q(21.0), "zipf:1.1": q(15.0, exact=False)}},
    }
    text = "\n".join(script.report(result))
    assert "| uniform | 22.0 [21.0-23.0] | 2.5 [1.5-3.5] | 8.80x |" in text
    assert "| 16x4 | 21.0 [20.0-22.0] | 15.0 [14.0-16.0] WRONG |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(script, tmp_path, capsys):
    assert script.main(["--dir", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_rejects_an_unknown_part(script, tmp_path):
    with pytest.raises(SystemExit):
        script.main(["--dir", str(tmp_path), "--parts", "spread,bogus"])
