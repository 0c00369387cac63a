"""`ple-um bench` from the command line: every bad argument refused before anything is written or
timed, a table that would not fit the disk, the file-size limit or the memory refused with the
figures, nothing left behind on any failure, --layer, and one real run end to end (its report's
header, paths, spreads, and where the JSON and the plot went)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.cli import REPO, run, run_cli, run_json, two_layer_checkpoint

from ple_um import cli
from ple_um.access.memory import mem_available
from ple_um.access.probe import ALL_MODES
from ple_um.synthetic_engram import write_engram_checkpoint

BENCH_REFUSALS = [
    (["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["--repeats", "-2"], "argument --repeats: must be at least 1, got -2"),
    (["--repeats", "1.5"], "argument --repeats: expected a whole number, got '1.5'"),
    (["--rows", "16,0"], "argument --rows: must be at least 1, got 0"),
    (["--rows", ","], "argument --rows: no batch sizes given"),
    (["--size", "0"], "argument --size: must be at least 1 byte, got '0'"),
    (["--size", "-5"], "argument --size: expected a byte count >= 0, got '-5'"),
    (["--size", "lots"], "argument --size: expected a byte count with an optional binary suffix"),
    (
        ["--size", "1e30"],
        "argument --size: expected a byte count of at most 8 EiB (2**63 - 1 bytes), got '1e30'",
    ),
    (["--shards", "0"], "argument --shards: must be at least 1, got 0"),
    (["--row-bytes", "0"], "argument --row-bytes: must be at least 1, got 0"),
    (["--processes", "-1"], "argument --processes: must be at least 0, got -1"),
    (["--layer", "1"], "--layer needs DIR: the synthetic table has one layer"),
    (
        ["--modes", "bogus"],
        "argument --modes: 'bogus' is not a ple-um mode: expected a comma-separated list of "
        "ats, registered, cpu, device",
    ),
    (["--modes", "cpu,gpu"], "argument --modes: 'gpu' is not a ple-um mode"),
    (["--modes", "cpu,CPU"], "argument --modes: a mode is named twice in 'cpu,CPU'"),
    (["--modes", ","], "argument --modes: no mode given"),
    (["--ids", "bogus"], "argument --ids: 'bogus' is not an id distribution: expected uniform or zipf:S"),
    (["--ids", "zipf:1"], "argument --ids: 'zipf:1': the Zipf exponent 1 is out of range"),
    (["--ids", ","], "argument --ids: no id distribution given"),
    (["--device", "bogus"], "argument --device: 'bogus' is not a device: expected cpu, cuda or cuda:N"),
    (["--size", "100"], "--size 100 B holds no row of 160 B (--row-bytes): give at least that"),
    (["--size", "1KiB", "--shards", "8"], "--shards 8 is more than the 6 rows of --size 1024 B"),
    (["--json-file", "/nowhere/b.json"], "--json-file /nowhere/b.json: its directory does not exist"),
    (["--json-file", "/tmp"], "--json-file /tmp: is a directory; give a file name"),
    (["--plot", "/nowhere/p.png"], "--plot /nowhere/p.png: its directory does not exist"),
    (["--plot", "PLOT.xyz"], "has its extension .xyz: give a file name ending in one of "),
    (["--plot", "PLOT"], "has no extension: give a file name ending in one of "),
    (["--memory-limit", "0"], "argument --memory-limit: must be at least 1 byte, got '0'"),
    (["--memory-limit", "1GiB,,"], None),
    (["--memory-limit", ","], "argument --memory-limit: no sizes given"),
    (["--memory-limit", "1GiB,1e19"], "argument --memory-limit: expected a byte count of at most 8 EiB"),
    (
        ["--memory-limit", "1GiB", "--modes", "registered,device"],
        "--memory-limit runs only the modes that read the table where it lies (cpu, ats): --modes "
        "registered,device holds it in memory",
    ),
    (
        ["--memory-limit", "lots"],
        "argument --memory-limit: expected a byte count with an optional binary suffix",
    ),
    (["--warmup", "5"], "--warmup times the steady state of --memory-limit or --serving: give one"),
    (
        ["--memory-limit", "1GiB", "--warmup", "-1"],
        "argument --warmup: expected seconds from 0 to 86400, got '-1'",
    ),
    (["--memory-limit", "1GiB", "--warmup", "nan"], "argument --warmup: expected seconds from 0 to 86400"),
    (["--model", "gemma"], "argument --model: invalid choice: 'gemma'"),
    (
        ["--model", "deepseek-v41", "--row-bytes", "160"],
        "--row-bytes is a PLE table's option: an Engram table (--model deepseek-v41) is one unsplit tensor "
        "of 264 B rows (256 FP8 values, 8 E8M0 scale bytes) whose lookups the bench times side by side",
    ),
    (["--model", "deepseek-v41", "--shards", "2"], "--shards is a PLE table's option: an Engram table"),
    (["--model", "deepseek-v41", "--memory-limit", "1GiB"], "--memory-limit is a PLE table's option"),
    (["--model", "deepseek-v41", "--serving"], "--serving is a PLE table's option: an Engram table"),
    (["--model", "deepseek-v41", "--size", "263"], "--size 263 B holds no row of 264 B"),
    (["--model", "deepseek-v41", "--layer", "1"], "--layer needs DIR: the synthetic table has one layer"),
    (["/a/dir", "--size", "1GiB"], "--size shapes the synthetic table: DIR's table is benched as it is"),
    (["/a/dir", "--row-bytes", "160"], "--row-bytes shapes the synthetic table: DIR's table is benched as"),
    (["/a/dir", "--shards", "4"], "--shards shapes the synthetic table: DIR's table is benched as it is"),
    (["--memory-limit", "1GiB", "--warmup", "1e9"], "argument --warmup: expected seconds from 0 to 86400"),
    (["--memory-limit", "1GiB", "--processes", "2"], "--processes is not a --memory-limit option: it opens"),
    (["--memory-limit", "1GiB", "--rounds", "2"], "--rounds is not a --memory-limit option: it splits"),
    (["--serving", "--rounds", "2"], "--rounds is not a --serving option: it splits"),
]


@pytest.mark.parametrize("argv,message", [case for case in BENCH_REFUSALS if case[1] is not None])
def test_bench_refuses_bad_arguments_before_it_runs(capsys, tmp_path, monkeypatch, argv, message):
    """Exit 2 and one line naming the bad value and what is accepted (the JSON error under --json),
    before anything is written: the bench takes minutes, its synthetic table gigabytes."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    argv = [arg.replace("PLOT", str(tmp_path / "p")) for arg in argv]
    code, out, err = run(capsys, "bench", *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("ple-um bench: error: ") and message in line
    code, out, err = run(capsys, "bench", *argv, "--json")
    assert code == 2 and err == ""
    assert message in json.loads(out)["error"]
    assert os.listdir(tmp_path) == []  # no cache folder, no plot, no JSON


def test_list_options_take_empty_items_and_any_case_alike():
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "--memory-limit", "1GiB,,2GiB,"]).memory_limits == (1 << 30, 2 << 30)
    args = parser.parse_args(["bench", "--modes", "CPU,", "--rows", "16,,1024,", "--ids", "uniform,"])
    assert args.modes == ("cpu",) and args.rows == (16, 1024) and [d.name for d in args.ids] == ["uniform"]
    assert parser.parse_args(["bench", "--modes", " Device , cpu"]).modes == ("device", "cpu")
    defaults = parser.parse_args(["bench"])
    assert defaults.size is None and defaults.rows is None and defaults.memory_limits is None


def test_a_table_larger_than_the_disk_is_refused_with_the_figures(tmp_path):
    """The largest `--size` taken (just under 8 EiB: no ftruncate traceback) and a table just over
    the free disk: exit 3 before anything is written, the sizes in the message, no folder in the
    cache."""
    cache = tmp_path / "cache"
    free = shutil.disk_usage(tmp_path).free
    for size in ("8388607T", str(free + (1 << 30))):
        done = run_cli("bench", "--size", size, "--json", env={"PLE_UM_CACHE_DIR": str(cache)}, timeout=120)
        assert done.returncode == cli.EXIT_REFUSED, done.stderr
        data = json.loads(done.stdout)
        assert data["refused"] is True
        assert "does not fit the free disk of" in data["error"] and " free, " in data["error"]
        assert re.search(r"the synthetic table \([\d.]+ [KMGT]iB, --size\)", data["error"]), data["error"]
        assert not cache.exists()


def test_a_table_over_the_file_size_limit_is_refused(tmp_path):
    cache = tmp_path / "cache"
    done = run_cli(
        "bench", "--size", "64MiB", env={"PLE_UM_CACHE_DIR": str(cache)}, shell_prefix="ulimit -f 1024;"
    )
    assert done.returncode == cli.EXIT_REFUSED and done.stdout == ""
    (line,) = done.stderr.splitlines()
    # The shell's blocks are 512 B (dash) or 1 KiB (bash).
    assert re.fullmatch(
        r"ple-um bench: error: the synthetic table's largest file \(16\.06 MiB\) is over this process's "
        r"file-size limit \((512\.00 KiB|1\.00 MiB), ulimit -f\): give a smaller --size, or raise the limit",
        line,
    ), line
    assert not cache.exists()


def test_a_run_larger_than_the_memory_is_refused_with_the_figures(capsys, tmp_path, monkeypatch):
    """A table that fits the disk but whose run (the table in the page cache and the anchor's copy
    of it) would not fit MemAvailable: exit 3 naming what holds the memory, nothing written."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    size = mem_available()
    if size + (1 << 30) > shutil.disk_usage(tmp_path).free:
        pytest.skip("the disk here is smaller than the memory")
    code, data = run_json(capsys, "bench", "--size", str(size), "--device", "cpu")
    assert code == cli.EXIT_REFUSED and data["refused"] is True
    assert "of host memory (the table in the page cache" in data["error"]
    assert "the torch anchor's copy" in data["error"] and "more than MemAvailable" in data["error"]
    assert not (tmp_path / "cache").exists()


def _partials(cache) -> list[str]:
    return [n for n in os.listdir(cache) if n.endswith(".partial")] if os.path.exists(cache) else []


def test_a_write_that_fails_leaves_no_partial_table(tmp_path):
    """The table's writer hits the file-size limit (EFBIG) half way, the check before it bypassed:
    the error comes out and the partial folder is gone."""
    cache = tmp_path / "cache"
    code = (
        "from ple_um.bench.config import Config, default_table\n"
        "try:\n"
        "    default_table(Config(size=8 << 20, shards=8), progress=False)\n"
        "except OSError as exc:\n"
        "    print('failed', exc.errno)\n"
    )
    done = subprocess.run(
        f"ulimit -f 1024; {sys.executable} -c {shlex.quote(code)}",
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PLE_UM_CACHE_DIR": str(cache), "PYTHONPATH": REPO},
        timeout=120,
    )
    assert done.stdout.strip() == "failed 27", done.stderr
    assert os.listdir(cache) == []


def test_an_interrupt_while_the_table_is_written_leaves_nothing(tmp_path):
    """Ctrl-C during the write: exit 130, one line, no partial folder."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ple_um.cli", "bench", "--size", "1GiB", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PLE_UM_CACHE_DIR": str(cache), "PYTHONPATH": REPO},
    )
    deadline = time.monotonic() + 120
    while not _partials(cache) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert _partials(cache), "the table's partial folder never appeared"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert err.splitlines()[-1] == "ple-um bench: error: interrupted"
    assert os.listdir(cache) == []


def test_bench_on_a_directory_without_a_table_says_so_in_one_line(capsys, tmp_path):
    code, out, err = run(capsys, "bench", str(tmp_path), "--device", "cpu")
    assert code == 1 and out == ""
    assert err.strip() == f"ple-um bench: error: no PLE shards were found in {tmp_path}"


def test_bench_without_matplotlib_refuses_plot_before_it_runs(capsys, tmp_path, monkeypatch):
    """Without matplotlib (hidden from the import system here), --plot fails at once, naming the
    extra that brings it, before the bench writes its table or times anything."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == ""
    assert err.strip() == (
        "ple-um bench: error: --plot needs matplotlib, which is not installed: pip install 'ple-um[plot]'"
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "p.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_bench_refuses_a_cuda_device_on_a_machine_without_one(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", "--device", "cuda")
    assert code == 2
    assert err.strip() == (
        "ple-um bench: error: --device: device 'cuda': no CUDA device here "
        "(torch.cuda.is_available() is False)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_bench_refuses_a_mode_forced_where_it_cannot_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PLE_UM_MODE", "registered")
    code, out, err = run(capsys, "bench", "--device", "cpu", "--size", "1MiB")
    assert code == 2 and out == ""
    assert err.strip().startswith("ple-um bench: error: PLE_UM_MODE=registered: access mode 'registered'")
    assert not (tmp_path / "cache").exists()


def test_bench_of_one_layer_of_a_checkpoint_with_two(capsys, tmp_path):
    directory = two_layer_checkpoint(tmp_path)
    argv = ["--layer", "3", "--device", "cpu", "--rows", "16", "--repeats", "2", "--rounds", "1"]
    code, result = run_json(capsys, "bench", directory, *argv)
    assert code == 0
    assert (result["table"]["layer"], result["table"]["num_rows"]) == (3, 30)
    assert result["startup"]["warm"]["mode"] in ALL_MODES
    assert set(result["lookup"]["ple-um cpu"]["uniform"]) == {"16", "host"}


def test_bench_of_an_engram_table_end_to_end(capsys, tmp_path, monkeypatch):
    """`ple-um bench --model deepseek-v41` on the CPU: the synthetic Engram table written once into
    the cache, its contenders (the torch anchor decoding with torch ops, ple-um's cpu mode; no seeds,
    no pinned copy without CUDA) timed side by side, the ratios from its own numbers; then the same
    run on a directory's Engram table of two layers, one picked by --layer, opened in a second
    process too (--processes 1). No times asserted."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    argv = [
        "--model",
        "deepseek-v41",
        "--size",
        "2MiB",
        "--rows",
        "16,256",
        "--repeats",
        "3",
        "--rounds",
        "2",
    ]
    code, result = run_json(capsys, "bench", *argv, "--ids", "uniform,zipf:1.1")
    assert code == 0
    rows = (2 << 20) // 264
    table = result["table"]
    assert (table["dtype"], table["layer"], table["num_rows"], table["row_bytes"]) == ("MXFP8", 1, rows, 256)
    assert (table["shards"], table["bytes"]) == (1, rows * 264)
    assert table["directory"] == str(tmp_path / "cache" / f"bench-engram-{rows}x264-1")
    assert list(result["lookup"]) == ["torch index_select", "ple-um cpu"]
    assert "E8M0 scales" in result["contenders"]["torch index_select"]
    anchor = result["lookup"]["torch index_select"]
    for entry in result["lookup"].values():
        for dist in ("uniform", "zipf:1.1"):
            for n in ("16", "256"):
                row = entry[dist][n]
                assert row["calls"] == 3 and row["p10_us"] <= row["median_us"] <= row["p90_us"]
                assert row["gbps"] == pytest.approx(int(n) * 264 / row["median_us"] / 1e3)
                assert row["vs_torch"] == pytest.approx(row["median_us"] / anchor[dist][n]["median_us"])
    assert set(result["decode_step"]) == set(result["lookup"])
    assert result["decode_step"]["ple-um cpu"]["uniform"]["eager"]["calls"] == 3
    assert result["startup"]["warm"]["mode"] in ALL_MODES
    write_engram_checkpoint(tmp_path / "two", tables={1: 500, 14: 700})
    argv_dir = [str(tmp_path / "two"), "--layer", "14", *argv[:2], *argv[4:], "--processes", "1"]
    code, result = run_json(capsys, "bench", *argv_dir)
    assert code == 0 and (result["table"]["layer"], result["table"]["num_rows"]) == (14, 700)
    assert list(result["processes"]) == ["ple-um"]  # no pinned copy without CUDA
    assert len(result["processes"]["ple-um"]["mem_available_drop_bytes"]) == 1
    code, out, err = run(capsys, "bench", str(tmp_path / "two"), *argv[:2], *argv[4:])
    assert code == cli.EXIT_USAGE and "several Engram tables in" in err and "1, 14; pass --layer" in err


def test_a_table_of_the_other_model_names_the_model_to_give(capsys, tmp_path):
    """DIR holding an Engram table benched as a PLE table (the default --model), or the other way
    round, is not a broken checkpoint: exit 2 naming the --model that reads it, before any work."""
    write_engram_checkpoint(tmp_path / "engram", tables={1: 500})
    code, out, err = run(capsys, "bench", str(tmp_path / "engram"))
    assert code == cli.EXIT_USAGE and not out, err
    assert f"no PLE shards were found in {tmp_path / 'engram'}" in err
    assert "it holds an Engram table (layer 1): give --model deepseek-v41" in err
    from ple_um.synthetic import write_checkpoint

    write_checkpoint(
        str(tmp_path / "ple"), num_rows=64, row_dim=16, dtype="F8_E4M3", shards=2, progress=False
    )
    code, out, err = run(capsys, "bench", str(tmp_path / "ple"), "--model", "deepseek-v41")
    assert code == cli.EXIT_USAGE and not out, err
    assert "it holds a PLE table (layer 1): give --model qwen3.8-flash-next" in err


def _console_script() -> str:
    script = shutil.which("ple-um") or os.path.join(os.path.dirname(sys.executable), "ple-um")
    if not os.path.exists(script):
        pytest.skip("the ple-um console script is not installed")
    return script


def test_bench_smoke_console_script(tmp_path):
    """`ple-um bench` end to end on a small cached synthetic table: the JSON's structure (on stdout
    with --json, the same in the --json-file), the ratios computed from its own numbers, the
    report's header, paths and spreads, where the files went; no times are asserted."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = {**os.environ, "PLE_UM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": REPO}
    argv = ["bench", "--size", "4MiB", "--rows", "16,256", "--repeats", "3", "--rounds", "2", "--shards", "8"]
    argv += ["--ids", "uniform,zipf:1.1", "--processes", "1"]
    done = subprocess.run(
        [_console_script(), *argv, "--json", "--json-file", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # stdout holds the JSON object alone
    assert json.loads(out.read_text()) == result
    assert png.read_bytes().startswith(b"\x89PNG")
    report = done.stderr
    assert "| path |" in report and "lookups, zipf:1.1 ids" in report  # the report
    assert f"ple-um bench, {result['date']}: ple-um {' '.join(argv)} --json" in report
    assert f"ple-um {result['versions']['ple-um']}, python " in report and "torch " in report
    assert report.splitlines()[-2:] == [f"results (JSON): {out}", f"plot: {png}"]
    for name, what in result["contenders"].items():
        assert f"  {name}: {what}" in report
    assert "vllm_ple_mmap" in result["contenders"]["seeds cpu"]
    assert not re.search(r"(?<![\d.])0\.00 ?(GB/s|x)", report)
    assert re.search(r"\| ple-um cpu \| [\d.]+ \[[\d.]+-[\d.]+( noisy)?\] \(", report)
    assert {"device", "table", "probe", "ids", "anchor", "lookup", "decode_step", "startup"} <= set(result)
    assert result["table"]["shards"] == 8
    assert result["table"]["bytes"] == result["table"]["num_rows"] * result["table"]["row_bytes"]
    assert result["table"]["directory"].startswith(str(tmp_path / "cache"))
    assert result["probe"]["mode"] in ALL_MODES
    assert list(result["ids"]) == ["uniform", "zipf:1.1"]
    assert result["ids"]["zipf:1.1"]["kind"] == "zipf" and result["ids"]["zipf:1.1"]["s"] == 1.1
    assert result["anchor"] == {"name": "torch index_select", "memory": "host memory (no CUDA device)"}
    assert list(result["lookup"]) == ["torch index_select", "ple-um cpu", "seeds cpu"]
    host = result["method"]["host_overhead"]
    assert (host["calls"], host["rows"]) == (300, 16)
    anchor = result["lookup"]["torch index_select"]
    for entry in result["lookup"].values():
        assert "skipped" not in entry, entry
        for dist in ("uniform", "zipf:1.1"):
            for n in ("16", "256"):
                row = entry[dist][n]
                assert {"median_us", "p10_us", "p90_us", "gbps"} <= set(row)
                assert row["p10_us"] <= row["median_us"] <= row["p90_us"]
                assert row["calls"] == 3
                assert row["vs_torch"] == pytest.approx(row["median_us"] / anchor[dist][n]["median_us"])
            h = entry[dist]["host"]
            assert (h["calls"], h["rows"], len(h["rounds_us"])) == (300, 16, 2)
            assert h["p10_us"] <= h["median_us"] <= h["p90_us"]
            assert h["vs_torch"] == pytest.approx(h["median_us"] / anchor[dist]["host"]["median_us"])
    assert result["method"]["timed_calls"] == 3 and result["method"]["rounds"] == 2
    steps = result["decode_step"]
    assert set(steps) == set(result["lookup"])
    assert steps["torch index_select"]["capture_safe"] is True
    assert steps["seeds cpu"]["capture_safe"] is False
    for step in steps.values():
        for dist in ("uniform", "zipf:1.1"):
            eager = step[dist]["eager"]
            ref = steps["torch index_select"][dist]["eager"]
            assert eager["vs_torch"] == pytest.approx(eager["median_us"] / ref["median_us"])
            assert "graph" not in step[dist]  # no CUDA here
    assert {"cold", "warm"} <= set(result["startup"])
    assert {"mode", "open_s", "pinned_bytes"} <= set(result["startup"]["warm"])
    assert len(result["processes"]["ple-um"]["mem_available_drop_bytes"]) == 1  # --processes 1 runs one
    assert result["processes"]["ple-um"]["mode"] == result["startup"]["warm"]["mode"]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_bench_under_a_memory_limit_end_to_end(capsys, tmp_path, monkeypatch):
    """`ple-um bench --memory-limit`: the child under each limit (a real cgroup where this machine
    allows one, else said not enforced), the storage's ceiling, the report on stderr under --json,
    the JSON and the plot of time against the limit written."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    out, png = tmp_path / "cold.json", tmp_path / "cold.png"
    argv = ["--size", "4MiB", "--shards", "8", "--memory-limit", "768MiB", "--rows", "16", "--repeats", "2"]
    argv += ["--warmup", "0.5"]
    code, stdout, stderr = run(
        capsys, "bench", *argv, "--device", "cpu", "--json", "--json-file", str(out), "--plot", str(png)
    )
    assert code == 0, stderr
    result = json.loads(stdout)
    assert json.loads(out.read_text()) == result and png.read_bytes().startswith(b"\x89PNG")
    assert result["command"].startswith("ple-um bench --size 4MiB")
    (entry,) = result["limits"].values()
    assert entry["bytes"] == 768 << 20
    row = entry["modes"]["cpu"]["uniform"]["16"]
    assert row["cold"]["calls"] == row["steady"]["calls"] == 2 and row["cold"]["vs_ceiling"] > 0
    warmup = entry["modes"]["cpu"]["warmup"]["uniform"]
    assert result["method"]["warmup_s"] == 0.5 and warmup["calls"] >= 10 and warmup["seconds"] >= 0.5
    assert "then at least 0.5 s of lookups" in result["method"]["steady"]
    assert "storage: random reads from the table's 4 files" in stderr
    assert "| ple-um cpu (eager) | 16 |" in stderr
    assert stderr.splitlines()[-2:] == [f"results (JSON): {out}", f"plot: {png}"]
