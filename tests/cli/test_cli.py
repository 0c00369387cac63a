"""The `ple-um` command: every verb's exit code, JSON shape and messages, on real checkpoints
written to disk (sound and deliberately broken), and page-cache residency that moves as it should
under prewarm and POSIX_FADV_DONTNEED."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.reference import drop_page_cache

from ple_um import cli, operating
from ple_um.access.probe import ALL_MODES
from ple_um.synthetic import write_checkpoint

MiB = 1 << 20


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's refusals exit through SystemExit."""
    try:
        code = cli.main([*argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (longest mount point prefix)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


@pytest.fixture
def table_dir(tmp_path):
    """A sound 4 MiB FP8 table: 26214 rows of 160 B in 8 shards over 4 files."""
    path = tmp_path / "ckpt"
    layout = write_checkpoint(path, num_rows=(4 * MiB) // 160, row_dim=160, dtype="fp8", shards=8)
    return str(path), layout


# -- probe ---------------------------------------------------------------------------------------
def test_probe_json_names_a_mode_and_a_reason_for_every_other(capsys):
    code, data = run_json(capsys, "probe")
    assert code == 0
    assert set(data) >= {"mode", "reasons", "capabilities", "pin_budget"}
    assert data["mode"] in ALL_MODES
    assert set(data["reasons"]) == set(ALL_MODES) - {data["mode"]}
    assert all(isinstance(why, str) and why for why in data["reasons"].values())
    assert isinstance(data["capabilities"]["cuda"], bool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_probe_of_a_cuda_device_on_a_machine_without_one(capsys):
    """The probe's answer, not a traceback: no CUDA device, so no GPU mode, and why."""
    for argv in (["--device", "cuda"], ["--device", "cuda:1"]):
        code, data = run_json(capsys, "probe", *argv)
        assert code == 0
        assert data["mode"] == "cpu" and data["capabilities"]["cuda"] is False
        assert data["reasons"]["registered"] == "no CUDA device"
        (why,) = data["capabilities"]["errors"]
        assert why.endswith("no CUDA device here (torch.cuda.is_available() is False)")
        code, out, _ = run(capsys, "probe", *argv)
        assert code == 0 and out.startswith("mode: cpu") and "no CUDA device here" in out


def test_probe_of_a_device_that_is_no_device(capsys):
    code, out, err = run(capsys, "probe", "--device", "bogus")
    assert code == 2 and out == ""
    assert err.strip() == (
        "ple-um probe: error: argument --device: 'bogus' is not a device: expected cpu, cuda or cuda:N "
        "(see ple-um probe --help)"
    )
    code, data = run_json(capsys, "probe", "--device", "bogus")
    assert code == 2 and data == {
        "error": "argument --device: 'bogus' is not a device: expected cpu, cuda or cuda:N"
    }


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"PLE_UM_MODE": "gpu"},
            "environment variable PLE_UM_MODE='gpu': expected one of auto, ats, registered, cpu, device, "
            "got 'gpu'",
        ),
        (
            {"PLE_UM_PIN_BUDGET": "lots"},
            "environment variable PLE_UM_PIN_BUDGET='lots': expected a byte count with an optional binary "
            "suffix (4096, 512MiB, 48GiB, 1T), got 'lots'",
        ),
        (
            {"PLE_UM_PIN_FRACTION": "nan"},
            "environment variable PLE_UM_PIN_FRACTION='nan': expected a fraction from 0 to 1, got 'nan'",
        ),
        (
            {"PLE_UM_MODE": "registered"},
            "PLE_UM_MODE=registered: access mode 'registered' is not available: no CUDA device; "
            "this machine can run: ats, cpu, device",
        ),
        (
            {"PLE_UM_MODE": "device", "TRITON_INTERPRET": None},
            "PLE_UM_MODE=device: access mode 'device' is not available: no CUDA device; "
            "this machine can run: cpu",
        ),
    ],
)
def test_probe_with_a_bad_knob(capsys, monkeypatch, env, message):
    """A knob with a value it does not take, or a mode forced where it cannot work: exit 2 and one
    line naming the variable, its value and what is accepted. (The CPU machine: registered needs
    CUDA; with the Triton interpreter the host serves as the device of the ats and device modes.)"""
    for var, value in env.items():
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    code, out, err = run(capsys, "probe", "--device", "cpu")
    assert code == 2 and out == ""
    assert err.strip() == f"ple-um probe: error: {message}"
    code, data = run_json(capsys, "probe", "--device", "cpu")
    assert code == 2 and data == {"error": message}


def test_probe_text(capsys):
    code, out, _ = run(capsys, "probe")
    assert code == 0
    assert out.startswith("mode: ")
    assert "capabilities:" in out
    assert out.count("  not ") == len(ALL_MODES) - 1


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_sound_checkpoint(capsys, table_dir):
    path, layout = table_dir
    code, data = run_json(capsys, "inspect", path)
    assert code == 0
    assert data["valid"] is True and data["problems"] == []
    assert data["layers"] == [1]
    (t,) = data["tables"]
    assert t["layer"] == 1
    assert t["dtype"] == "F8_E4M3"
    assert (t["rows"], t["row_dim"], t["row_bytes"]) == (layout.num_rows, 160, 160)
    assert t["bytes"] == layout.nbytes
    assert t["parts"] == 8 and len(t["shards"]) == 8
    assert t["rows_per_shard"] == layout.rows_per_shard
    assert t["scale"] == pytest.approx(layout.scale)
    assert sum(s["rows"] for s in t["shards"]) == layout.num_rows
    assert [s["offset"] for s in t["shards"]] == [s.offset for s in layout.shards]
    assert sorted(f["file"] for f in t["files"]) == sorted(os.path.basename(f) for f in layout.files)
    assert sum(f["bytes"] for f in t["files"]) == layout.nbytes

    code, out, _ = run(capsys, "inspect", path, "--shards")
    assert code == 0
    assert "verdict: sound" in out
    assert f"layer 1: {layout.num_rows} rows x 160 F8_E4M3" in out
    assert "| 7 |" in out  # the shard listing


def test_inspect_bf16_has_no_scale(capsys, tmp_path):
    write_checkpoint(tmp_path / "bf", num_rows=100, row_dim=8, dtype="bf16", shards=3)
    code, data = run_json(capsys, "inspect", str(tmp_path / "bf"))
    assert code == 0
    assert data["tables"][0]["scale"] is None
    assert data["tables"][0]["row_bytes"] == 16


def test_inspect_several_layers_and_layer_option(capsys, tmp_path):
    """Two layers in one checkpoint (files and index merged): inspect lists both, --layer picks one."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_checkpoint(a, num_rows=50, row_dim=16, dtype="fp8", shards=4, layer=1, files=2)
    write_checkpoint(b, num_rows=30, row_dim=16, dtype="fp8", shards=2, layer=3, files=1, seed=1)
    index_a = json.loads((a / "model.safetensors.index.json").read_text())
    index_b = json.loads((b / "model.safetensors.index.json").read_text())
    for name in sorted(os.listdir(b)):
        if name.endswith(".safetensors"):
            shutil.move(str(b / name), str(a / f"layer3-{name}"))
    for tensor, file_name in index_b["weight_map"].items():
        index_a["weight_map"].setdefault(tensor, f"layer3-{file_name}")
    (a / "model.safetensors.index.json").write_text(json.dumps(index_a))

    code, data = run_json(capsys, "inspect", str(a))
    assert code == 0, data["problems"]
    assert data["layers"] == [1, 3]
    assert [(t["layer"], t["rows"]) for t in data["tables"]] == [(1, 50), (3, 30)]

    code, data = run_json(capsys, "inspect", str(a), "--layer", "3")
    assert code == 0
    assert [t["layer"] for t in data["tables"]] == [3]

    code, data = run_json(capsys, "inspect", str(a), "--layer", "2")
    assert code == 1
    assert data["valid"] is False
    assert any("no PLE shards of layer 2" in p and "1, 3" in p for p in data["problems"])

    # residency and prewarm need one layer: without --layer they say which exist, and name the
    # flag (the library's message names its layer= argument).
    for verb in ("residency", "prewarm"):
        code, out, err = run(capsys, verb, str(a))
        assert code == 2 and out == ""
        assert err.strip().splitlines() == [
            f"ple-um {verb}: error: several PLE layers have shards in {a}: 1, 3; pass --layer to pick one"
        ]
        code, data = run_json(capsys, verb, str(a))
        assert code == 2 and "pass --layer to pick one" in data["error"]
    code, data = run_json(capsys, "residency", str(a), "--layer", "3")
    assert code == 0 and data["layer"] == 3


def test_inspect_truncated_and_corrupt_files_lists_every_problem(capsys, table_dir):
    path, layout = table_dir
    truncated, corrupt = layout.files[1], layout.files[2]
    os.truncate(truncated, os.path.getsize(truncated) - 1000)
    with open(corrupt, "r+b") as f:
        f.seek(12)  # inside the JSON header
        f.write(b"\xff\xfe")

    code, data = run_json(capsys, "inspect", path)
    assert code == 1
    assert data["valid"] is False
    assert data["tables"] == []
    problems = data["problems"]
    assert any(truncated in p and "truncated" in p for p in problems)
    assert any(corrupt in p and "header" in p for p in problems)
    assert any("missing" in p for p in problems)  # the shards of the unreadable header

    code, out, _ = run(capsys, "inspect", path)
    assert code == 1
    assert f"verdict: INVALID, {len(problems)} problems:" in out
    for p in problems:
        assert f"  - {p}" in out


def test_inspect_missing_fp8_scale(capsys, tmp_path):
    """An FP8 table whose scale tensor was renamed (same length, in the header) and dropped from
    the index: the verdict names the missing scale."""
    path = tmp_path / "noscale"
    layout = write_checkpoint(path, num_rows=40, row_dim=16, dtype="fp8", shards=4, files=4)
    with open(layout.files[-1], "r+b") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
        f.seek(header.index(b"weight_scale"))
        f.write(b"weight_scalX")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("weight_scale")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    code, data = run_json(capsys, "inspect", str(path))
    assert code == 1
    assert any("without its global scale" in p for p in data["problems"])


def test_inspect_missing_directory(capsys, tmp_path):
    code, data = run_json(capsys, "inspect", str(tmp_path / "nowhere"))
    assert code == 1
    assert data["layers"] is None
    assert any("does not exist" in p for p in data["problems"])
    # The text says so too, not "cannot tell (headers unreadable)".
    code, out, _ = run(capsys, "inspect", str(tmp_path / "nowhere"))
    assert code == 1
    assert "PLE layers with shards: none: the directory does not exist" in out
    assert "headers unreadable" not in out
    (tmp_path / "file").write_text("x")
    code, out, _ = run(capsys, "inspect", str(tmp_path / "file"))
    assert code == 1 and "PLE layers with shards: none: not a directory" in out


# -- residency and prewarm ---------------------------------------------------------------------
def test_residency_json_shape(capsys, table_dir):
    path, layout = table_dir
    code, data = run_json(capsys, "residency", path)
    assert code == 0
    assert data["layer"] == 1
    assert data["page_size"] == os.sysconf("SC_PAGE_SIZE")
    assert [s["index"] for s in data["shards"]] == list(range(8))
    assert sum(s["bytes"] for s in data["shards"]) == layout.nbytes
    assert data["total"]["bytes"] == layout.nbytes
    for s in data["shards"]:
        assert 0 <= s["resident_bytes"] <= s["bytes"]
        assert s["fraction"] == pytest.approx(s["resident_bytes"] / s["bytes"])
    assert sorted(f["file"] for f in data["files"]) == sorted(os.path.basename(f) for f in layout.files)

    code, out, _ = run(capsys, "residency", path)
    assert code == 0
    assert out.splitlines()[0] == "| shard | file | bytes | resident | % |"
    assert out.splitlines()[-1].startswith("total: ")


def test_residency_follows_prewarm_and_dontneed(capsys, table_dir):
    path, layout = table_dir
    if fs_type(path) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: DONTNEED cannot drop them")

    code, data = run_json(capsys, "prewarm", path)
    assert code == 0
    assert data["read_bytes"] >= layout.nbytes
    assert data["after"]["fraction"] > 0.99
    code, data = run_json(capsys, "residency", path)
    assert data["total"]["fraction"] > 0.99
    assert all(s["fraction"] > 0.99 for s in data["shards"])

    drop_page_cache(layout)
    code, data = run_json(capsys, "residency", path)
    assert code == 0
    assert data["total"]["fraction"] < 0.05
    assert all(s["fraction"] < 0.1 for s in data["shards"])

    # Half of each file: at least the first shard of each file (2 shards per file) comes in; the
    # kernel's readahead may bring in more (here up to the device's read_ahead_kb).
    code, data = run_json(capsys, "prewarm", path, "--fraction", "0.5")
    assert code == 0
    assert data["requested_bytes"] <= layout.nbytes // 2 + 4 * os.sysconf("SC_PAGE_SIZE")
    assert data["after"]["fraction"] >= 0.49
    code, data = run_json(capsys, "residency", path)
    fractions = [s["fraction"] for s in data["shards"]]
    assert all(f > 0.99 for f in fractions[0::2]), fractions

    drop_page_cache(layout)
    code, out, err = run(capsys, "prewarm", path)  # text, with its progress bar
    assert code == 0
    assert "prewarmed 4.00 MiB" in out
    assert "-> 100.0%" in out
    assert "prewarm" in err and "100%" in err  # tqdm


def test_prewarm_refuses_more_than_allowed(capsys, table_dir):
    path, layout = table_dir
    drop_page_cache(layout)
    before = operating.residency(path)["total"]["resident_bytes"]

    code, out, err = run(capsys, "prewarm", path, "--max-bytes", "1MiB")
    assert code == cli.EXIT_REFUSED
    assert out == ""
    assert "ple-um prewarm: error:" in err
    assert "more than the --max-bytes limit (1.00 MiB)" in err
    assert "--fraction" in err and "--force" in err
    assert operating.residency(path)["total"]["resident_bytes"] <= before + 64 * 1024  # nothing read

    code, data = run_json(capsys, "prewarm", path, "--max-bytes", "1MiB")
    assert code == cli.EXIT_REFUSED
    assert data["refused"] is True and "--force" in data["error"]

    code, data = run_json(capsys, "prewarm", path, "--max-bytes", "1MiB", "--force")
    assert code == 0
    assert data["forced"] is True
    if fs_type(path) != "tmpfs":
        assert data["after"]["fraction"] > 0.99


def test_prewarm_refusal_against_mem_available(table_dir):
    """Without --max-bytes the limit is MemAvailable; ``available`` stands in for a small one."""
    path, layout = table_dir
    small = lambda: layout.nbytes // 2
    with pytest.raises(operating.PrewarmRefused, match=r"more than MemAvailable \(2.00 MiB\)"):
        operating.prewarm(path, available=small)
    result = operating.prewarm(path, available=small, fraction=0.25)
    assert result["requested_bytes"] <= layout.nbytes // 2
    assert result["mem_available"] == layout.nbytes // 2 and not result["forced"]
    assert operating.prewarm(path, available=small, force=True)["forced"] is True
    assert operating.prewarm(path)["mem_available"] > 0  # the real MemAvailable: this table fits


@pytest.mark.parametrize("fraction", ["0", "1.5", "-1", "nan", "half"])
def test_prewarm_bad_fraction(capsys, table_dir, fraction):
    """A bad --fraction is a bad argument (exit 2), not an invalid checkpoint (exit 1)."""
    path, layout = table_dir
    code, out, err = run(capsys, "prewarm", path, "--fraction", fraction)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"ple-um prewarm: error: argument --fraction: must be in (0, 1], got {fraction!r} "
        "(see ple-um prewarm --help)"
    ]
    code, data = run_json(capsys, "prewarm", path, "--fraction", fraction)
    assert code == 2
    assert data == {"error": f"argument --fraction: must be in (0, 1], got {fraction!r}"}


def test_residency_and_prewarm_of_a_broken_checkpoint(capsys, table_dir):
    path, layout = table_dir
    os.truncate(layout.files[0], 100)
    for verb in ("residency", "prewarm"):
        code, out, err = run(capsys, verb, path)
        assert code == 1
        assert f"ple-um {verb}: error:" in err and layout.files[0] in err
        code, data = run_json(capsys, verb, path)
        assert code == 1 and layout.files[0] in data["error"]


# -- knobs, arguments ----------------------------------------------------------------------------
def test_knobs(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_MMAP_STATS_SEC", "5")
    code, data = run_json(capsys, "knobs")
    assert code == 0
    knobs = {k["name"]: k for k in data["knobs"]}
    assert {"PLE_UM_PROMETHEUS", "PLE_UM_STATS_SEC", "PLE_UM_METRICS_SEC"} <= set(knobs)
    assert knobs["PLE_UM_STATS_SEC"]["set"] == "VLLM_PLE_MMAP_STATS_SEC=5"
    code, out, _ = run(capsys, "knobs")
    assert "PLE_UM_STATS_SEC (alias VLLM_PLE_MMAP_STATS_SEC)" in out


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect"])
    assert exc.value.code == 2
    capsys.readouterr()


BENCH_REFUSALS = [
    (["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["--repeats", "-2"], "argument --repeats: must be at least 1, got -2"),
    (["--rows", "16,0"], "argument --rows: must be at least 1, got 0"),
    (["--rows", ","], "argument --rows: no batch sizes given"),
    (["--size", "0"], "argument --size: must be at least 1 byte, got '0'"),
    (["--size", "-5"], "argument --size: expected a byte count >= 0, got '-5'"),
    (["--size", "lots"], "argument --size: expected a byte count with an optional binary suffix"),
    (["--shards", "0"], "argument --shards: must be at least 1, got 0"),
    (["--row-bytes", "0"], "argument --row-bytes: must be at least 1, got 0"),
    (["--processes", "-1"], "argument --processes: must be at least 0, got -1"),
    (
        ["--modes", "bogus"],
        "argument --modes: 'bogus' is not a ple-um mode: expected a comma-separated list of "
        "ats, registered, cpu, device",
    ),
    (["--modes", "cpu,gpu"], "argument --modes: 'gpu' is not a ple-um mode"),
    (["--modes", "cpu,cpu"], "argument --modes: a mode is named twice in 'cpu,cpu'"),
    (["--ids", "bogus"], "argument --ids: 'bogus' is not an id distribution: expected uniform or zipf:S"),
    (["--ids", "zipf:1"], "argument --ids: 'zipf:1': the Zipf exponent 1 is out of range"),
    (["--device", "bogus"], "argument --device: 'bogus' is not a device: expected cpu, cuda or cuda:N"),
    (["--size", "100"], "--size 100 B holds no row of 160 B (--row-bytes): give at least that"),
    (["--size", "1KiB", "--shards", "8"], "--shards 8 is more than the 6 rows of --size 1024 B"),
    (
        ["/nowhere/bench.json"],
        "checkpoint directory /nowhere/bench.json does not exist (--json prints the "
        "results, --json-file PATH writes them)",
    ),
    (["--json-file", "/nowhere/b.json"], "--json-file /nowhere/b.json: its directory does not exist"),
    (["--json-file", "/tmp"], "--json-file /tmp: is a directory; give a file name"),
]


@pytest.mark.parametrize("argv,message", BENCH_REFUSALS)
def test_bench_refuses_bad_arguments_before_it_runs(capsys, tmp_path, monkeypatch, argv, message):
    """Exit 2 and one line naming the bad value and what is accepted (the JSON error under --json),
    before anything is written: the bench takes minutes, its synthetic table gigabytes."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("ple-um bench: error: ") and message in line
    code, out, err = run(capsys, "bench", *argv, "--json")
    assert code == 2 and err == ""
    assert message in json.loads(out)["error"]
    assert not (tmp_path / "cache").exists()


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


def test_side_by_side_times_every_path_once_per_fresh_id_set_in_rotated_rounds():
    """The bench's timing harness on the CPU clock: each path gets ``calls`` timed calls, each on
    its own fresh id set (index >= warmup, once), in rounds whose path order rotates; warm-up
    calls use only the warm-up sets."""
    import torch

    from ple_um.bench.runner import _Timer

    log: list[tuple[str, int]] = []
    fns = {name: (lambda k, name=name: log.append((name, k))) for name in ("a", "b", "c")}
    times = _Timer(torch.device("cpu")).side_by_side(fns, calls=10, warmup=2, rounds=4)
    assert {name: len(t) for name, t in times.items()} == {"a": 10, "b": 10, "c": 10}
    assert all(t >= 0 for ts in times.values() for t in ts)
    for name in fns:
        timed = [k for n, k in log if n == name and k >= 2]
        assert timed == list(range(2, 12))  # every fresh set once, in order
        assert {k for n, k in log if n == name and k < 2} <= {0, 1}
    # Rounds of 3, 3, 2, 2 timed calls; round r starts with path r % 3.
    firsts, seen = [], 2
    for block in (3, 3, 2, 2):
        firsts.append(next(n for n, k in log if k == seen))
        seen += block
    assert firsts == ["a", "b", "c", "a"]


# -- real processes ------------------------------------------------------------------------------
def test_inspect_into_a_closed_pipe_ends_quietly(table_dir):
    """`ple-um inspect DIR | head -4`: the reader goes away before the output is written; the
    command ends with the shell's SIGPIPE status and no traceback."""
    path, _ = table_dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "ple_um.cli", "inspect", path, "--shards"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # before the child writes anything
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == cli.EXIT_BROKEN_PIPE
    assert err == ""
    # Through a shell, as typed: head gets its lines, nothing else is printed.
    done = subprocess.run(
        f"{sys.executable} -m ple_um.cli inspect {path} --shards | head -4",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert done.stdout.splitlines()[0] == f"checkpoint: {path}" and len(done.stdout.splitlines()) == 4
    assert done.stderr == ""


def test_inspect_as_a_module_subprocess(table_dir):
    path, layout = table_dir
    done = subprocess.run(
        [sys.executable, "-m", "ple_um.cli", "inspect", path, "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tables"][0]["rows"] == layout.num_rows
    os.truncate(layout.files[0], 100)
    done = subprocess.run(
        [sys.executable, "-m", "ple_um.cli", "inspect", path], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "verdict: INVALID" in done.stdout


def _console_script() -> str:
    script = shutil.which("ple-um") or os.path.join(os.path.dirname(sys.executable), "ple-um")
    if not os.path.exists(script):
        pytest.skip("the ple-um console script is not installed")
    return script


def test_bench_smoke_console_script(tmp_path):
    """`ple-um bench` end to end on a small cached synthetic table: the JSON's structure (on stdout
    with --json, the same in the --json-file), the ratios computed from its own numbers; no times."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PLE_UM_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["bench", "--size", "4MiB", "--rows", "16,256", "--repeats", "3", "--rounds", "2", "--shards", "8"]
    argv += ["--ids", "uniform,zipf:1.1", "--processes", "1"]
    done = subprocess.run(
        [_console_script(), *argv, "--json", "--json-file", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # stdout holds the JSON object alone
    assert json.loads(out.read_text()) == result
    assert "| path |" in done.stderr and "lookups, zipf:1.1 ids" in done.stderr  # the table
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
                assert {"median_us", "gbps"} <= set(row)
                assert row["calls"] == 3
                assert row["vs_torch"] == pytest.approx(row["median_us"] / anchor[dist][n]["median_us"])
            h = entry[dist]["host"]
            assert (h["calls"], h["rows"], len(h["rounds_us"])) == (300, 16, 2)
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


def _scales_in_their_own_file(layout, directory):
    """A copy of an NVFP4 checkpoint whose shards' block scales sit in one file of their own."""
    from safetensors.torch import load_file, save_file

    from ple_um.checkpoint import read_layout

    os.makedirs(directory)
    layout_dir = layout.directory
    with open(os.path.join(layout_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    weight_map, scales = {}, {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(layout_dir, name))
        keep = {k: v for k, v in tensors.items() if not (".shard_" in k and k.endswith(".weight_scale"))}
        scales.update({k: v for k, v in tensors.items() if k not in keep})
        save_file(keep, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keep, name))
    save_file(scales, os.path.join(directory, "model-scales.safetensors"), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(scales, "model-scales.safetensors"))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return read_layout(str(directory))


def test_nvfp4_block_scales_in_a_file_of_their_own(capsys, make_checkpoint, tmp_path):
    """inspect lists the scales' file (its text crashed on a file holding no shard's rows), and
    prewarm reads the block scales too (every lookup reads them)."""
    layout = _scales_in_their_own_file(
        make_checkpoint(dtype="nvfp4", num_rows=20000, row_dim=64, shards=4), tmp_path / "split"
    )
    path = layout.directory
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "  model-scales.safetensors: block scales, 78.12 KiB" in out.splitlines()
    scale_files = layout.scale_layout().files
    drop_page_cache(layout)
    drop_page_cache(layout.scale_layout())
    code, data = run_json(capsys, "prewarm", path)
    assert code == 0 and data["requested_bytes"] >= layout.nbytes
    assert data["after"]["bytes"] == layout.nbytes
    if fs_type(path) != "tmpfs":
        assert data["before"]["fraction"] < 0.5 and data["after"]["fraction"] > 0.99
        code, residency = run_json(capsys, "residency", path)
        assert residency["block_scales"]["total"]["fraction"] > 0.99, scale_files


def test_prewarm_suggests_a_fraction_that_fits(table_dir):
    """The refusal's --fraction, asked for with the same limit, is taken (it was computed as if the
    whole table had been asked for)."""
    import re

    path, layout = table_dir
    limit = layout.nbytes // 4
    with pytest.raises(operating.PrewarmRefused) as info:
        operating.prewarm(path, fraction=0.5, limit=limit)
    suggested = float(re.search(r"--fraction (\d\.\d\d)", str(info.value)).group(1))
    assert operating.prewarm(path, fraction=suggested, limit=limit)["requested_bytes"] <= limit
