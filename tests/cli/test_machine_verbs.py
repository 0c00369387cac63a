"""`ple-um probe` and `ple-um knobs`: the mode chosen and why not the others, a device that is
not one, a bad knob or a forced mode (one line, exit 2); every knob listed, an invalid value marked
with its reason."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run, run_cli, run_json

from ple_um.access.probe import ALL_MODES


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


def test_probe_of_a_table_on_a_device_this_machine_lacks_exits_2(capsys, table_dir):
    """With DIR the first read runs on --device: one this machine does not have (no CUDA here, or
    an index past its last GPU) is refused naming the flag, not a traceback."""
    directory, _ = table_dir
    code, out, err = run(capsys, "probe", directory, "--device", "cuda:99")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("ple-um probe: error: --device: device 'cuda:99': ")
    code, data = run_json(capsys, "probe", directory, "--device", "cuda:99")
    assert code == 2 and data["error"].startswith("--device: device 'cuda:99': ")


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


def test_knobs(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_MMAP_STATS_SEC", "5")
    code, data = run_json(capsys, "knobs")
    assert code == 0
    knobs = {k["name"]: k for k in data["knobs"]}
    assert {"PLE_UM_PROMETHEUS", "PLE_UM_STATS_SEC", "PLE_UM_METRICS_SEC"} <= set(knobs)
    assert knobs["PLE_UM_STATS_SEC"]["set"] == "VLLM_PLE_MMAP_STATS_SEC=5"
    code, out, _ = run(capsys, "knobs")
    assert "PLE_UM_STATS_SEC (alias VLLM_PLE_MMAP_STATS_SEC)" in out


def test_probe_layer_needs_a_directory(capsys):
    code, out, err = run(capsys, "probe", "--layer", "1")
    assert code == 2 and out == ""
    assert err.strip() == "ple-um probe: error: --layer needs DIR: it picks a layer of that checkpoint"


def test_knobs_marks_an_invalid_value_with_its_reason(capsys, monkeypatch):
    monkeypatch.setenv("PLE_UM_MODE", "bogus")
    monkeypatch.setenv("VLLM_PLE_MMAP_WORKERS", "0")
    reason = (
        "environment variable PLE_UM_MODE='bogus': expected one of auto, ats, registered, cpu, device, "
        "got 'bogus'"
    )
    alias = (
        "environment variable VLLM_PLE_MMAP_WORKERS='0' (an alias of PLE_UM_CPU_THREADS): expected a whole "
        "number from 1 to 1024, got '0'"
    )
    code, data = run_json(capsys, "knobs")
    assert code == 2
    knobs = {k["name"]: k for k in data["knobs"]}
    assert knobs["PLE_UM_MODE"]["invalid"] == reason
    assert knobs["PLE_UM_CPU_THREADS"]["invalid"] == alias
    assert knobs["PLE_UM_STATS_SEC"]["invalid"] is None
    assert data["error"] == "2 knobs are set to a value it does not take: PLE_UM_MODE, PLE_UM_CPU_THREADS"
    code, out, err = run(capsys, "knobs")
    assert code == 2
    assert f"PLE_UM_MODE = 'auto'; set: PLE_UM_MODE=bogus\n    INVALID: {reason}\n" in out
    assert err.splitlines() == [
        "ple-um knobs: error: 2 knobs are set to a value it does not take: PLE_UM_MODE, PLE_UM_CPU_THREADS "
        "(marked INVALID above)"
    ]


def test_knobs_as_typed_exit_2_on_an_invalid_value():
    done = run_cli("knobs", env={"PLE_UM_FIRST_READ_TIMEOUT": "abc"})
    assert done.returncode == 2
    assert (
        "INVALID: environment variable PLE_UM_FIRST_READ_TIMEOUT='abc': expected a number of seconds"
        in done.stdout
    )
    assert "could not convert" not in done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "ple-um knobs: error: 1 knob is set to a value it does not take: PLE_UM_FIRST_READ_TIMEOUT "
        "(marked INVALID above)"
    ]
    assert run_cli("knobs").returncode == 0


def test_probe_of_a_table_says_which_path_serves_its_decode_lookups(capsys, make_checkpoint, monkeypatch):
    """With DIR, the path a table opened now would serve its decode-sized lookups with, and why:
    on a Grace machine (ATS), the kernel while the rows fit, the host path once they do not; and
    that the fit counted the table alone (a serving process counts its other open tables, never
    another process's)."""
    from helpers.machines import GH200, injected_machine

    from ple_um.access import memory

    layout = make_checkpoint(num_rows=4000, row_dim=160, dtype="fp8", shards=2)
    with injected_machine(GH200):
        code, data = run_json(capsys, "probe", layout.directory)
        assert code == 0 and data["mode"] == "ats"
        assert data["serving"]["path"] == "kernel" and " fit:" in data["serving"]["why"], data["serving"]
        assert (
            data["serving"]["counted"].startswith("this table alone: ")
            and "never another process" in (data["serving"]["counted"])
        )
        monkeypatch.setattr(memory, "mem_available", lambda: 64 << 10)  # 64 KiB left: 625 KiB do not fit
        monkeypatch.setattr(memory, "cgroup_headroom", lambda *a, **k: None)
        code, out, _ = run(capsys, "probe", layout.directory)
        assert code == 0 and "decode lookups: host (the owned rows (" in out and "do not fit" in out, out
        lines = out.splitlines()
        at = next(k for k, line in enumerate(lines) if line.startswith("decode lookups: "))
        assert lines[at + 1] == f"  counted: {data['serving']['counted']}", lines[at : at + 2]
