"""The serving loop's plumbing on the CPU (its figures mean something only on a GPU, where
tests/gpu/test_gpu_serving.py runs it): the calibration's arithmetic, the id pools (fresh ids every
step, copied into the step's static inputs), the step's rows exact on every step, the run's
configurations and ratios, a child under a memory limit merged in, the report, the JSON and the
grouped-bar plot; and the CLI refusing --serving where it cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.cli import fs_type, run
from helpers.reference import reference_rows

import ple_um
from ple_um.bench import plot, report, serving
from ple_um.bench.cold import drop_table_pages, table_files
from ple_um.bench.config import Config
from ple_um.bench.ids import parse_ids
from ple_um.bench.plot import draw
from ple_um.mapping import MappedShards
from ple_um.operating import resident_rows
from ple_um.synthetic import write_checkpoint


def test_matmuls_for_a_step_and_the_correction():
    assert serving.matmuls_for(0.020, 0.0002) == 100
    assert serving.matmuls_for(0.005, 0.0015) == 3  # 3.33 rounds down
    assert serving.matmuls_for(0.0001, 0.002) == 1  # never none
    with pytest.raises(ValueError):
        serving.matmuls_for(0.005, 0.0)
    assert serving.refine(100, 0.020, 0.025) == 80  # 100 took 25 ms: 80 take 20
    assert serving.refine(100, 0.020, 0.016) == 125
    assert serving.refine(3, 0.005, 0.0) == 3  # no measurement: unchanged
    assert serving.refine(1, 0.001, 0.5) == 1


@pytest.mark.parametrize("ids", ["uniform", "zipf:1.1", "trace"])
def test_an_id_pool_gives_fresh_ids_every_step(ids):
    (dist,) = parse_ids(ids)
    sizes = {"decode": 64 * 16, "prefill": 96 * 16}
    pool = serving.IdPool(dist, 5000, sizes, 4, "cpu", np.random.default_rng(0))
    first = {name: t.clone() for name, t in pool.batches.items()}
    for name, n in sizes.items():
        assert first[name].shape == (4, n) and first[name].dtype == torch.int64
        assert int(first[name].min()) >= 0 and int(first[name].max()) < 5000
        assert not torch.equal(first[name][0], first[name][1])  # each step its own ids
    inputs = {name: torch.full((n,), -1, dtype=torch.int64) for name, n in sizes.items()}
    pool.load(2, inputs)
    for name in sizes:
        assert torch.equal(inputs[name], first[name][2])
    pool.refill()
    assert not torch.equal(pool.batches["decode"], first["decode"])


@pytest.fixture
def small_table(tmp_path):
    path = tmp_path / "t"
    layout = write_checkpoint(path, num_rows=3001, row_dim=160, dtype="fp8", shards=5, files=2)
    return str(path), layout


def test_every_step_looks_up_its_own_ids_exactly(small_table):
    """The step on the CPU (eager, one stream): after each step the outputs hold, bit for bit, the
    rows of the ids that step was given, shard boundaries included; the outputs poisoned first."""
    path, layout = small_table
    sizes = {"decode": 8 * 4, "prefill": 16 * 4}
    work = serving.GpuWork(16, "cpu")
    (dist,) = parse_ids("uniform")
    pool = serving.IdPool(dist, layout.num_rows, sizes, 3, "cpu", np.random.default_rng(1))
    boundaries = torch.tensor([0, 599, 600, 601, 1199, 1200, 2999, 3000] * 4, dtype=torch.int64)
    pool.batches["decode"][0].copy_(boundaries)
    with ple_um.open_table(path, mode="cpu", device="cpu") as table:
        step = serving.ServingStep(table, sizes, layout.row_dim, layout.dtype, work, 2, "cpu")
        assert step.graph is None and set(step.inputs) == {"decode", "prefill"}
        for k in range(3):
            for out in step.outputs.values():
                out.view(torch.uint8).fill_(0xA5)
            pool.load(k, step.inputs)
            step.go()
            for name, ids in step.inputs.items():
                got = step.outputs[name].view(torch.uint8).numpy()
                np.testing.assert_array_equal(got, reference_rows(layout, ids.numpy()), err_msg=f"{name} {k}")


def test_a_run_times_every_configuration_and_writes_its_report_json_and_plot(
    small_table, tmp_path, monkeypatch
):
    """serving.run on the CPU: every configuration at every step time and id distribution, the
    ratios computed from the run's own medians, the report's table, the JSON and a PNG."""
    path, layout = small_table
    ids = parse_ids("uniform,zipf:1.1")
    cfg = Config(
        directory=path, ids=ids, repeats=3, device="cpu", serving=True, step_ms=(1.0, 2.0), warmup_s=0.0
    )
    cfg.decode_tokens, cfg.prefill_tokens, cfg.heads = 4, 8, 4
    lines: list[str] = []
    result = serving.run(cfg, log=lines.append)
    assert result["kind"] == "serving" and set(result["calibration"]["matmuls"]) == {"1", "2"}
    assert result["method"]["lookups"] == {
        "decode": {"ids": 16, "tokens": 4, "rows_per_token": 4},
        "prefill": {"ids": 32, "tokens": 8, "rows_per_token": 4},
    }
    assert list(result["configs"]) == ["no PLE", "resident", "cpu", "lookups alone, cpu"]
    assert result["configs"]["cpu"]["mode"] == "cpu"
    for ms in ("1", "2"):
        for dist in ("uniform", "zipf:1.1"):
            rows = result["steps"][ms][dist]
            assert set(rows) >= {"no PLE", "cpu"}
            for name, row in rows.items():
                assert row["calls"] == 3 and row["p10_us"] <= row["median_us"] <= row["p90_us"]
                assert len(row["times_us"]) == 3 and sorted(row["times_us"])[1] == row["median_us"]
                assert row["warmup"]["steps"] >= serving.MIN_WARMUP_STEPS
                if name != "no PLE":
                    assert row["vs_no_ple"] == pytest.approx(row["median_us"] / rows["no PLE"]["median_us"])
                if "resident" in rows and name != "resident":
                    assert row["vs_resident"] == pytest.approx(
                        row["median_us"] / rows["resident"]["median_us"]
                    )
            assert 0 <= rows["cpu"]["page_cache_hits"] <= 1
    assert set(result["lookups_alone"]["uniform"]) == {"lookups alone, cpu"}
    text = report.format_report(result)
    assert "| GPU work | ids | no PLE |" in text and "| 2 ms | zipf:1.1 |" in text
    assert "  cpu: ple-um's cpu mode, the table where it lies" in text
    assert "step: the median over its (below 1x: faster than it, above 1x: slower)" in text
    assert json.loads(json.dumps(result)) == result  # every value JSON's own: none turned into a string
    png = tmp_path / "serving.png"
    titles = []
    real_save = plot._save
    monkeypatch.setattr(
        plot, "_save", lambda fig, path: titles.append(fig.axes[0].get_title()) or real_save(fig, path)
    )
    draw(result, str(png))
    assert png.read_bytes().startswith(b"\x89PNG")
    assert titles[0].endswith("(labels: step time over the resident step's: above 1x is slower)")


def test_a_limited_childs_figures_are_merged_beside_the_parents(small_table):
    """A child under a memory limit (here without a cgroup: the row cache's knob holds it) runs the
    served modes only, with the parent's matmul counts; its figures land beside the parent's."""
    path, layout = small_table
    cfg = Config(
        directory=path, ids=parse_ids("uniform"), repeats=2, device="cpu", serving=True, step_ms=(1.0,)
    )
    cfg.decode_tokens, cfg.prefill_tokens, cfg.heads = 2, 4, 4
    cfg.memory_limits, cfg.warmup_s = (768 << 20,), 0.0
    result = serving.run(cfg, log=lambda line: None, hierarchy=(None, "none in this test"))
    (limit,) = result["limits"].values()
    assert limit["enforced"] is False and "failed" not in limit, limit
    rows = result["steps"]["1"]["uniform"]
    assert set(rows) >= {"no PLE", "cpu", "cpu under 768.00 MiB"}
    assert rows["cpu under 768.00 MiB"]["vs_no_ple"] == pytest.approx(
        rows["cpu under 768.00 MiB"]["median_us"] / rows["no PLE"]["median_us"]
    )
    assert result["configs"]["cpu under 768.00 MiB"]["mode"] == "cpu"


def test_merge_keeps_the_limits_own_fields():
    result = {
        "configs": {"cpu": {}},
        "steps": {"5": {"uniform": {"cpu": {"median_us": 1}}}},
        "lookups_alone": {},
    }
    child = {
        "bytes": 1,
        "how": "h",
        "calibration": {},
        "configs": {"cpu under 1 B": {"mode": "cpu"}},
        "steps": {"5": {"uniform": {"cpu under 1 B": {"median_us": 2}}}},
    }
    serving.merge(result, child)
    assert child == {"bytes": 1, "how": "h"}
    assert set(result["steps"]["5"]["uniform"]) == {"cpu", "cpu under 1 B"}
    assert list(result["configs"]) == ["cpu", "cpu under 1 B"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_the_cli_refuses_serving_without_cuda(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", "--serving", "--size", "1MiB", "--shards", "4")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "ple-um bench: error: --serving times a decode loop captured in CUDA graphs: cpu is not a CUDA "
        "device (torch.cuda.is_available() is False)"
    ]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--step-ms", "5"], "--step-ms sets the GPU work of --serving's steps: give --serving too"),
        (
            ["--serving", "--step-ms", "0"],
            "argument --step-ms: expected milliseconds above 0 and at most 10000",
        ),
        (["--serving", "--step-ms", ","], "argument --step-ms: no durations given"),
        (["--prefill-tokens", "0"], "--prefill-tokens sets the prefill chunk of --serving's steps"),
        (["--serving", "--prefill-tokens", "-1"], "argument --prefill-tokens: must be at least 0, got -1"),
        (["--serving", "--rows", "16"], "--rows is not a --serving option"),
        (["--serving", "--processes", "2"], "--processes is not a --serving option"),
    ],
)
def test_the_serving_options_are_checked_before_anything_runs(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", *argv)
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("ple-um bench: error: ") and message in line
    assert not (tmp_path / "cache").exists()


def test_step_ms_parses_a_list():
    from ple_um import cli

    assert cli.build_parser().parse_args(["bench", "--serving", "--step-ms", "5,20.5,"]).step_ms == (
        5.0,
        20.5,
    )


def test_the_page_cache_share_is_of_rows_a_step_has_not_read_yet(tmp_path, monkeypatch):
    """A figure's share of rows in the page cache is what a step finds there before it reads
    them: taken of rows the step has read, it would be 100% whatever the page cache held. Here the
    table's pages are dropped and a few hundred of its 262 144 rows are read: few are found."""
    if fs_type(str(tmp_path)) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: nothing to drop")
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "0")  # the page cache alone holds the rows read
    path = tmp_path / "t"
    layout = write_checkpoint(path, num_rows=1 << 18, row_dim=160, dtype="fp8", shards=4, write_back=True)
    (dist,) = parse_ids("uniform")
    sizes = {"decode": 16}
    pool = serving.IdPool(dist, layout.num_rows, sizes, 4, "cpu", np.random.default_rng(2))
    drop_table_pages(table_files(layout))
    with ple_um.open_table(str(path), mode="cpu", device="cpu") as table, MappedShards(layout) as probe:
        step = serving.ServingStep(
            table, sizes, layout.row_dim, layout.dtype, serving.GpuWork(16, "cpu"), 1, "cpu"
        )
        row = serving.measure(step, pool, 4, 0.0, lambda ids: resident_rows(probe, ids))
        assert row["page_cache_hits"] < 0.5, row


def test_a_configuration_whose_timing_fails_is_marked_failed_and_the_run_goes_on(small_table, tmp_path):
    """An error while a configuration is timed (after its table opened: here its trace file gone
    between two of its figures, put back once it is reported) marks that configuration failed with
    its reason, keeps the figures it took, and the run goes on with the others; the report says so
    and the CLI's list of what was not measured names it (which makes it exit 4)."""
    import shutil

    from ple_um.bench.trace import sample_path
    from ple_um.cli.bench import unmeasured

    path, layout = small_table
    trace = tmp_path / "trace.npz"
    shutil.copy(sample_path(), trace)
    ids = parse_ids(f"trace:{trace}")
    cfg = Config(
        directory=path, ids=ids, repeats=2, device="cpu", serving=True, step_ms=(1.0, 2.0), warmup_s=0.0
    )
    cfg.decode_tokens, cfg.prefill_tokens, cfg.heads = 2, 4, 4
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("resident, 1 ms, "):
            trace.rename(tmp_path / "away.npz")
        elif line.startswith("resident: failed"):
            (tmp_path / "away.npz").rename(trace)

    result = serving.run(cfg, log=log)
    (dist,) = (d.name for d in ids)
    failed = result["configs"]["resident"]["failed"]
    assert failed.startswith("ValueError: ") and "no trace file" in failed, failed
    assert f"resident: failed ({failed})" in lines
    assert "resident" in result["steps"]["1"][dist] and "resident" not in result["steps"]["2"][dist]
    for ms in ("1", "2"):
        assert {"no PLE", "cpu"} <= set(result["steps"][ms][dist])
    assert set(result["lookups_alone"][dist]) == {"lookups alone, cpu"}
    assert all("failed" not in result["configs"][n] for n in ("no PLE", "cpu", "lookups alone, cpu"))
    text = report.format_report(result)
    assert f"  resident: {report.WHAT['resident']}; failed: {failed}" in text
    assert unmeasured(result, None) == [f"resident: {failed}"]
