"""Two ranks (two processes, gloo): each backend maps only its own vocab range, and the reduced
result equals the stock device backend's, bit for bit, for FP8, BF16 and NVFP4 tables."""

from __future__ import annotations

import os

import pytest
import torch
import vllm_harness as h
from two_rank_worker import DTYPES

pytestmark = [pytest.mark.vllm, h.needs_vllm, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_rank_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_ranks")
    checkpoints = tmp / "ckpt"
    for dtype in DTYPES:
        # Without the world there is no vLLM config to size the table from; table_rows needs none.
        h.write_table(checkpoints / dtype, h.text_config(dtype=dtype), seed=3)
    return h.run_two_ranks(WORKER, tmp, str(checkpoints), str(tmp))


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_rank_maps_its_range(reports, dtype):
    runs = [r["runs"][dtype] for r in reports]
    assert [run["tp_size"] for run in runs] == [2, 2]
    (a0, a1), (b0, b1) = (run["owned_rows"] for run in runs)
    assert a0 == 0 < a1 == b0 < b1 == runs[0]["num_rows"] == h.table_rows(h.text_config(dtype=dtype))
    for run in runs:
        assert tuple(run["table_rows"]) == tuple(run["owned_rows"]) == tuple(run["stock_rows"])
        start, end = run["owned_rows"]
        row_bytes = run["table_bytes"] // run["num_rows"]  # NVFP4: packed row and its block scales
        assert run["owned_bytes"] == (end - start) * row_bytes < run["table_bytes"]
        # NVFP4 maps rows and block scales apart: two page-rounded mappings exceed a 23 KB table.
        if dtype != "nvfp4":
            assert run["mapped_bytes"] < run["table_bytes"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduced_result_equals_stock(reports, dtype):
    runs = [r["runs"][dtype] for r in reports]
    for run in runs:
        assert run["lookup_dtype"] == (torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
        for output in run["outputs"]:
            assert output["raw_equal"] and output["dequantized_equal"]
    for seed in range(2):
        first, second = (run["outputs"][seed]["raw"] for run in runs)
        assert torch.equal(first, second)  # both ranks hold the sum over the group
        assert first.any()
