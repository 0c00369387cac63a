"""The serving loop (``ple-um bench --serving``) on a real GPU: the whole step (GPU work on the
step's stream, the lookups forked onto a side stream and joined) captured in one CUDA graph; every
replay on fresh ids gives exactly the rows of its ids (outputs poisoned before each, shard
boundaries in the ids), after a timed loop too; and the run end to end (configurations, ratios,
a child under a memory limit, the CLI with its JSON and plot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.cli import REPO
from helpers.reference import reference_rows

import ple_um
from ple_um.bench import serving
from ple_um.bench.config import Config
from ple_um.bench.ids import parse_ids

SIZES = {"decode": 64 * 16, "prefill": 256 * 16}


def _check(step, layout, what: str) -> None:
    torch.cuda.synchronize()
    for name, ids in step.inputs.items():
        got = step.outputs[name].view(torch.uint8).cpu().numpy()
        expect = reference_rows(layout, ids.cpu().numpy())
        bad = np.flatnonzero((got != expect).any(axis=1))
        assert bad.size == 0, f"{what}, {name}: {bad.size} rows differ, first at {bad[:5]}"


@pytest.mark.parametrize("mode", ["cpu", "device", "registered"])
@pytest.mark.parametrize("ids", ["uniform", "zipf:1.1", "trace"])
def test_every_replay_of_the_serving_step_is_exact(tables, device, mode, ids):
    layout = tables["fp8"]
    (dist,) = parse_ids(ids)
    rng = np.random.default_rng(int.from_bytes(os.urandom(3), "little"))
    work = serving.GpuWork(512, device)
    pool = serving.IdPool(dist, layout.num_rows, SIZES, 8, device, rng)
    edges = [k * layout.rows_per_shard + d for k in range(1, layout.parts) for d in (-1, 0)]
    pool.batches["decode"][0, : len(edges)] = torch.tensor(edges, dtype=torch.int64)
    with ple_um.open_table(layout.directory, mode=mode, device=device) as table:
        step = serving.ServingStep(table, SIZES, layout.row_dim, layout.dtype, work, 4, device)
        assert step.graph is not None, "the step was not captured"
        for k in range(pool.steps):
            for out in step.outputs.values():
                out.view(torch.uint8).fill_(0xA5)
            pool.load(k, step.inputs)
            step.go()
            _check(step, layout, f"{mode} {ids} replay {k}")
        times = serving.time_steps(step, pool, 3 * pool.steps)  # back to back, the pool refilled
        assert len(times) == 3 * pool.steps and min(times) > 0
        # The static inputs hold the last replay's ids (the pool's refill rewrites only the pool).
        _check(step, layout, f"{mode} {ids} after the timed loop")


def test_a_step_without_a_table_is_the_gpu_work_alone(device):
    work = serving.GpuWork(512, device)
    step = serving.ServingStep(None, SIZES, 160, torch.uint8, work, 6, device)
    assert step.graph is not None and step.inputs == {} and step.outputs == {}
    pool = serving.IdPool(None, 1, {}, 4, device, None)
    one = float(np.median(serving.time_steps(step, pool, 8)))
    longer = serving.ServingStep(None, {}, 160, torch.uint8, work, 24, device)
    assert float(np.median(serving.time_steps(longer, pool, 8))) > one  # four times the matmuls


def test_the_serving_run_end_to_end(tables, device):
    layout = tables["fp8"]
    cfg = Config(
        directory=layout.directory,
        ids=parse_ids("uniform,trace"),
        repeats=10,
        device=str(device),
        memory_limits=(2 << 30,),
        serving=True,
        step_ms=(2.0, 5.0),
        warmup_s=0.5,
    )
    cfg.prefill_tokens = 256
    result = serving.run(cfg, log=print)
    assert "CUDA graph" in result["method"]["timing"]
    assert not [name for name, c in result["configs"].items() if "skipped" in c], result["configs"]
    (limit,) = result["limits"].values()
    assert "failed" not in limit, limit
    for ms in ("2", "5"):
        for dist in ("uniform", "trace"):
            rows = result["steps"][ms][dist]
            assert set(rows) == {"no PLE", "resident", "cpu", "cpu under 2.00 GiB"}
            for name, row in rows.items():
                assert row["calls"] == 10 and "eager" not in row, (name, row)
                if name != "resident":
                    assert row["vs_resident"] == pytest.approx(
                        row["median_us"] / rows["resident"]["median_us"]
                    )
            assert rows["cpu"]["row_cache_hits"] is None or 0 <= rows["cpu"]["row_cache_hits"] <= 1


def test_the_cli_serving_run(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    argv = ["bench", "--serving", "--size", "64MiB", "--shards", "8", "--step-ms", "3", "--repeats", "5"]
    argv += ["--warmup", "0.5", "--ids", "uniform,zipf:1.1", "--json-file", str(out), "--plot", str(png)]
    done = subprocess.run(
        [sys.executable, "-m", "ple_um.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PLE_UM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": REPO},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["steps"]["3"]["zipf:1.1"]) == {"no PLE", "resident", "cpu"}
    assert "| GPU work | ids | no PLE | resident | cpu |" in done.stdout
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a GPU besides the current one")
def test_a_bench_on_a_gpu_that_is_not_the_current_one_captures_that_gpus_work(tables):
    """`--device cuda:N` while another GPU is current: torch records events and captures graphs on
    the current device, so the bench makes its own device current for its timed work. Captured on
    the other GPU, the decode step's graph would hold none of its work, and its replays would not
    equal the eager step."""
    from ple_um.bench import runner

    layout = tables["fp8"]
    other = torch.device("cuda", (torch.cuda.current_device() + 1) % torch.cuda.device_count())
    cfg = Config(
        directory=layout.directory,
        device=str(other),
        rows=(16, 4096),
        repeats=3,
        modes=("device", "cpu"),
        ids=parse_ids("uniform"),
    )
    result = runner.run(cfg, log=print)
    captured = {name: d for name, d in result["decode_step"].items() if d["capture_safe"]}
    assert {"ple-um device", "ple-um cpu"} <= set(captured)
    assert all(d["graph_replay_equals_eager"] for d in captured.values()), captured
    cfg = Config(directory=layout.directory, device=str(other), repeats=5, serving=True, step_ms=(2.0,))
    cfg.prefill_tokens, cfg.warmup_s = 64, 0.2
    served = serving.run(cfg, log=print)
    assert not [name for name, c in served["configs"].items() if "skipped" in c], served["configs"]
