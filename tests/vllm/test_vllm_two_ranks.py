"""Two ranks (two processes, gloo): each backend maps only its own vocab range, and the reduced
result equals the stock device backend's, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import vllm_harness as h

pytestmark = [pytest.mark.vllm, h.needs_vllm, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_rank_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_ranks")
    checkpoints = tmp / "ckpt"
    for dtype in ("fp8", "bf16"):
        fp8 = dtype == "fp8"
        # Without the world there is no vLLM config to size the table from; table_rows needs none.
        h.write_table(checkpoints / dtype, h.text_config(fp8=fp8), fp8=fp8, seed=3)
    env = {k: v for k, v in os.environ.items() if k not in ("PLE_UM_DIR", "VLLM_PLE_MMAP_DIR")}
    # The stock masked lookup is a torch.compile(inductor) function: compiling it on the CPU costs
    # more than the rest of the test, and eager integer masking is the same computation.
    env["TORCHDYNAMO_DISABLE"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), "2", str(tmp), str(checkpoints), str(tmp)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        logs.append(out)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_each_rank_maps_its_range(reports, dtype):
    runs = [r["runs"][dtype] for r in reports]
    assert [run["tp_size"] for run in runs] == [2, 2]
    (a0, a1), (b0, b1) = (run["owned_rows"] for run in runs)
    assert (
        a0 == 0 and a1 == b0 and b1 == runs[0]["table_bytes"] // (h.HEAD_DIM * (1 if dtype == "fp8" else 2))
    )
    for run in runs:
        assert tuple(run["table_rows"]) == tuple(run["owned_rows"]) == tuple(run["stock_rows"])
        assert run["mapped_bytes"] < run["table_bytes"]


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_reduced_result_equals_stock(reports, dtype):
    runs = [r["runs"][dtype] for r in reports]
    for run in runs:
        for output in run["outputs"]:
            assert output["raw_equal"] and output["dequantized_equal"]
    for seed in range(2):
        first, second = (run["outputs"][seed]["raw"] for run in runs)
        assert torch.equal(first, second)  # both ranks hold the sum over the group
        assert first.any()
