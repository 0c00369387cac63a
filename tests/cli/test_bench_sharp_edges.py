"""`ple-um bench`'s sharp edges: a run whose batches would not fit the memory refused up front, a
memory limit too small for its child refused, a mode this machine cannot run refused, a run that
could not measure what was asked exits 4 with its figures, Ctrl-C under --memory-limit leaves
nothing behind (cgroup, child processes, partial files) and exits 130; and the CLI's own: the verb
named in every argument error, --version, a --layer the checkpoint lacks exits 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.cgroup import alive, started
from helpers.cli import REPO, run, run_json, two_layer_checkpoint

import ple_um
from ple_um import cli
from ple_um.bench import report, sizing
from ple_um.bench.memlimit import find_hierarchy
from ple_um.cli.bench import unmeasured
from ple_um.synthetic_engram import write_engram_checkpoint
from ple_um.version import __version__

SMALL = ["--size", "1MiB", "--shards", "4", "--device", "cpu"]


def test_a_batch_larger_than_the_memory_is_refused_naming_rows(capsys, tmp_path, monkeypatch):
    """`--rows 100000000` on a small table: the ids drawn ahead and the outputs of that batch would
    take tens of GiB; refused (exit 3) before anything is written, naming --rows and the bytes."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, data = run_json(capsys, "bench", *SMALL, "--rows", "100000000")
    assert code == cli.EXIT_REFUSED and data["refused"] is True
    assert "--rows 100000000: the ids drawn ahead (3 paths x 23 calls)" in data["error"]
    assert "more than MemAvailable" in data["error"] and "give a smaller --size or --rows" in data["error"]
    assert not (tmp_path / "cache").exists()


def test_the_batches_counted_are_the_largest_batchs():
    needed = sizing.add_batches(sizing.memory_needed(1 << 20, False, ("cpu",)), (16, 1000), 160, 23, 3, False)
    host = needed["host"]
    assert host["--rows 1000: the ids drawn ahead (3 paths x 23 calls)"] == 3 * 23 * 1000 * 8
    assert host["--rows 1000: the outputs (3 paths)"] == 3 * 1000 * 160
    assert host["--rows 1000: a call's rows gathered on the host"] == 1000 * 168 + 32 * 1000
    on_gpu = sizing.add_batches(sizing.memory_needed(1 << 20, True, ("cpu",)), (1000,), 160, 23, 4, True)
    assert on_gpu["gpu"]["--rows 1000: the outputs (4 paths)"] == 4 * 1000 * 160
    assert sizing.path_count(("cpu",), False, False) == 3  # the anchor, ple-um cpu, the seeds
    assert sizing.path_count(("ats", "registered", "cpu", "device"), True, False) == 9
    assert sizing.path_count(("cpu",), True, True) == 1  # NVFP4: ple-um alone


def test_a_memory_limit_smaller_than_its_child_is_refused(capsys, tmp_path, monkeypatch):
    """`--memory-limit 1`: no child process fits one byte; refused (exit 3) naming the limit and
    what the child holds, instead of a run that measures nothing and exits 0."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "bench", *SMALL, "--memory-limit", "1,1GiB")
    assert code == cli.EXIT_REFUSED and out == ""
    (line,) = err.splitlines()
    assert line.startswith("ple-um bench: error: --memory-limit 1 B: less than the child process holds")
    assert "the child process itself 320.00 MiB" in line
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
@pytest.mark.parametrize("extra", [[], ["--memory-limit", "1GiB"]])
def test_a_mode_this_machine_cannot_run_is_refused(capsys, tmp_path, monkeypatch, extra):
    """A CPU-only host (without the Triton interpreter, which makes the host a device): a mode it
    cannot run is refused (exit 2) instead of skipped in a run that exits 0."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    modes = "cpu,ats" if extra else "device"
    code, out, err = run(capsys, "bench", *SMALL, "--modes", modes, *extra)
    assert code == cli.EXIT_USAGE and out == ""
    missing = "ats" if extra else "device"
    assert err.splitlines() == [
        f"ple-um bench: error: --modes: this machine cannot run {missing} (no CUDA device); it can run: cpu"
    ]
    assert not (tmp_path / "cache").exists()


def test_a_mode_that_fails_to_open_exits_4_with_the_figures(capsys, tmp_path, monkeypatch):
    """A mode asked for by --modes that cannot open (a failure injected at its open): the run goes
    on, writes what it measured, and exits 4 naming what is missing; under --json the error's
    object carries the results (stdout holds one JSON object)."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    real = ple_um.open_table

    def failing(*args, **kwargs):
        if kwargs.get("mode") == "cpu":
            raise RuntimeError("injected open failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(ple_um, "open_table", failing)
    out = tmp_path / "b.json"
    argv = [
        *SMALL,
        "--modes",
        "cpu",
        "--rows",
        "16",
        "--repeats",
        "2",
        "--rounds",
        "1",
        "--json-file",
        str(out),
    ]
    code, data = run_json(capsys, "bench", *argv)
    assert code == cli.EXIT_INCOMPLETE
    assert data["error"] == (
        "the run could not measure what was asked: ple-um cpu: RuntimeError: injected open failure"
    )
    assert data["results"]["lookup"]["ple-um cpu"] == {"skipped": "RuntimeError: injected open failure"}
    assert json.loads(out.read_text()) == data["results"]
    assert "16" in data["results"]["lookup"]["torch index_select"]["uniform"]


def test_unmeasured_names_every_failure_of_a_limited_run():
    result = {
        "limits": {
            "1": {"how": "cgroup v2 /g1", "failed": "the child was killed (SIGKILL)"},
            "2": {"how": "cgroup v2 /g2", "modes": {"cpu": {"uniform": {}}, "ats": {"skipped": "E: no"}}},
        }
    }
    assert unmeasured(result, None) == [
        "under cgroup v2 /g1: the child was killed (SIGKILL)",
        "ple-um ats under cgroup v2 /g2: E: no",
    ]
    skipped = {"lookup": {"ple-um device": {"skipped": "E: x"}, "seeds cpu": {"skipped": "E: y"}}}
    assert unmeasured(skipped, ("device",)) == ["ple-um device: E: x"]
    assert unmeasured(skipped, None) == []  # not asked for: a path this machine lacks, reported


def test_a_json_folder_that_vanishes_during_the_run_is_named_and_the_plot_still_written(
    capsys, tmp_path, monkeypatch
):
    """--json-file's folder removed while the run measures: the error names the flag and the path
    given, the plot (its own folder still there) is written all the same, and under --json the
    error's object carries the results."""
    pytest.importorskip("matplotlib")
    from ple_um.bench import runner

    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "cache"))
    gone = tmp_path / "gone"
    gone.mkdir()
    real = runner.run

    def run_then_vanish(cfg, log=print):
        result = real(cfg, log=log)
        gone.rmdir()
        return result

    monkeypatch.setattr(runner, "run", run_then_vanish)
    out, png = gone / "b.json", tmp_path / "b.png"
    argv = [*SMALL, "--rows", "16", "--repeats", "2", "--rounds", "1"]
    argv += ["--json-file", str(out), "--plot", str(png)]
    code, data = run_json(capsys, "bench", *argv)
    assert code == cli.EXIT_INVALID
    assert data["error"] == f"the results could not be written: --json-file {out}: No such file or directory"
    assert "16" in data["results"]["lookup"]["torch index_select"]["uniform"]
    assert png.read_bytes().startswith(b"\x89PNG")


def test_a_table_that_vanishes_after_its_lookups_keeps_their_figures(capsys, tmp_path, monkeypatch):
    """DIR removed once the lookups are timed: the open figures that come after (start-up, and
    --processes) say why they are missing, and the lookups' figures are written and printed; the
    run exits 4, naming what is missing."""
    from ple_um.bench import runner
    from ple_um.synthetic import write_checkpoint

    table = tmp_path / "table"
    write_checkpoint(table, num_rows=600, row_dim=160, dtype="fp8", shards=4)
    real = runner._time_decode

    def decode_then_vanish(*args, **kwargs):
        real(*args, **kwargs)
        shutil.rmtree(table)

    monkeypatch.setattr(runner, "_time_decode", decode_then_vanish)
    out = tmp_path / "b.json"
    argv = [str(table), "--device", "cpu", "--rows", "16", "--repeats", "2", "--rounds", "1"]
    argv += ["--processes", "1"]
    code, data = run_json(capsys, "bench", *argv, "--json-file", str(out))
    assert code == cli.EXIT_INCOMPLETE, data
    results = data["results"]
    assert "16" in results["lookup"]["ple-um cpu"]["uniform"]
    assert results["startup"]["skipped"].startswith(("FileNotFoundError: ", "CheckpointError: "))
    assert results["processes"]["ple-um"]["skipped"].startswith(("FileNotFoundError: ", "CheckpointError: "))
    assert data["error"].startswith("the run could not measure what was asked: start-up: ")
    assert json.loads(out.read_text()) == results
    text = report.format_report(results)
    assert f"| open | skipped: {results['startup']['skipped']} |" in text


# -- Ctrl-C under --memory-limit -------------------------------------------------------------------
def _children(pid: int) -> list[tuple[int, int]]:
    """The bench's limited children (``python -m ple_um...``), each a pid and when it started: not
    a helper process an import starts and reaps on its own (one a loaded machine may catch)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    found = []
    for child in pids:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        when = started(child)
        if b"-m" in argv and any(a.startswith(b"ple_um.") for a in argv) and when is not None:
            found.append((child, when))
    return found


def _interrupt_under_a_limit(tmp_path, prelude: str, group_dirs, sig=signal.SIGINT, again=()):
    """Start `ple-um bench --memory-limit` (after ``prelude``), wait for its child to run (and the
    ``group_dirs(pid)`` to exist), send the bench ``sig``, then each signal of ``again`` a
    millisecond apart while it runs: (the finished bench, the child processes it had, its pid)."""
    cache = tmp_path / "cache"
    code = prelude + "import sys; from ple_um import cli; sys.exit(cli.main(sys.argv[1:]))"
    argv = ["bench", *SMALL, "--memory-limit", "768MiB", "--rows", "16", "--repeats", "2", "--warmup", "60"]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PLE_UM_CACHE_DIR": str(cache), "PYTHONPATH": REPO},
    )
    deadline = time.monotonic() + 300
    children: list[tuple[int, int]] = []
    while time.monotonic() < deadline and proc.poll() is None:
        children = _children(proc.pid)
        if children and all(os.path.exists(d) for d in group_dirs(proc.pid)):
            break
        time.sleep(0.1)
    assert children, "the bench's child never started"
    time.sleep(3)  # the child is importing or looking up
    proc.send_signal(sig)
    for more in again:  # during its cleanup: the child's kill and wait, the group's removal
        time.sleep(0.001)
        if proc.poll() is not None:
            break
        proc.send_signal(more)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), children, proc.pid


def _check_nothing_left(done, children, tmp_path, sig=signal.SIGINT) -> None:
    """Exit 130 and "interrupted" for Ctrl-C; for SIGTERM and SIGHUP a shell's status for a process
    they killed (128 + the signal's number), naming the signal."""
    said = "interrupted" if sig == signal.SIGINT else f"terminated by {sig.name}"
    code = cli.EXIT_INTERRUPTED if sig == signal.SIGINT else 128 + sig
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == f"ple-um bench: error: {said}"
    assert "Traceback" not in done.stderr
    assert not [pid for pid, since in children if alive(pid, since)]
    cache = tmp_path / "cache"
    assert not [n for n in os.listdir(cache) if n.endswith(".partial") or n.startswith(".")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupt_under_a_memory_limit_removes_its_cgroup_and_child(tmp_path, sig):
    """Ctrl-C, and the signals that end a process (``kill``, a closed terminal), which would leave
    the child (a session of its own) running in its group were they not caught."""
    found, why = find_hierarchy()
    if found is None:
        pytest.skip(f"no memory cgroup here: {why}")

    def groups(pid: int) -> list[str]:
        return [os.path.join(found.group, f"ple-um-bench-{pid}-0")]

    probe = os.path.join(found.group, f"ple-um-test-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        pytest.skip(f"no cgroup can be made in {found.group}: {exc.strerror}")
    done, children, pid = _interrupt_under_a_limit(tmp_path, "", groups, sig)
    _check_nothing_left(done, children, tmp_path, sig)
    assert not [g for g in groups(pid) if os.path.exists(g)]


@pytest.mark.parametrize("grouped", [True, False], ids=["cgroup", "no cgroup"])
def test_signals_during_the_cleanup_wait_for_its_end(tmp_path, grouped):
    """Ctrl-C, then more Ctrl-C and SIGTERM while the bench kills its child and removes its group:
    they wait for the cleanup's end (the child killed and reaped, the group removed), then the bench
    ends as the first asked, without a traceback."""
    prelude = ""
    if grouped:
        found, why = find_hierarchy()
        if found is None:
            pytest.skip(f"no memory cgroup here: {why}")

        def groups(pid: int) -> list[str]:
            return [os.path.join(found.group, f"ple-um-bench-{pid}-0")]
    else:
        prelude = (
            "from ple_um.bench import memlimit\n"
            "memlimit.find_hierarchy = lambda *a: (None, 'no memory cgroup in this test')\n"
        )

        def groups(pid: int) -> list[str]:
            return []

    again = [signal.SIGINT, signal.SIGTERM] * 150
    done, children, pid = _interrupt_under_a_limit(tmp_path, prelude, groups, signal.SIGINT, again)
    # The run ends as the interrupt asked (a SIGTERM that comes before the cleanup starts, while
    # the interrupt unwinds, is the one asked); signals still coming once the cleanup is done end
    # the bench as they would any process.
    said = {"ple-um bench: error: interrupted", "ple-um bench: error: terminated by SIGTERM"}
    assert said & set(done.stderr.splitlines()), done.stderr[-3000:]
    codes = (cli.EXIT_INTERRUPTED, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)
    assert done.returncode in codes, done.stderr[-3000:]
    assert not [p for p, since in children if alive(p, since)]
    assert not [g for g in groups(pid) if os.path.exists(g)]


def test_an_interrupt_where_no_cgroup_can_be_made_leaves_nothing(tmp_path):
    """The fallback (no memory cgroup: the limit held only by the row cache's knob) cleans up too."""
    prelude = (
        "from ple_um.bench import memlimit\n"
        "memlimit.find_hierarchy = lambda *a: (None, 'no memory cgroup in this test')\n"
    )
    done, children, _ = _interrupt_under_a_limit(tmp_path, prelude, lambda pid: [])
    _check_nothing_left(done, children, tmp_path)


# -- the CLI's own ---------------------------------------------------------------------------------
def test_an_unknown_argument_after_a_verb_names_the_verb(capsys):
    for json_flag in ([], ["--json"]):
        code, out, err = run(capsys, "bench", "--bogus", *json_flag)
        assert code == cli.EXIT_USAGE
        if json_flag:
            assert json.loads(out) == {"error": "unrecognized arguments: --bogus"}
        else:
            assert err.splitlines() == [
                "ple-um bench: error: unrecognized arguments: --bogus (see ple-um bench --help)"
            ]
    code, _, err = run(capsys, "knobs", "extra")
    assert code == 2 and err.startswith("ple-um knobs: error: unrecognized arguments: extra")


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert code == 0 and out == f"ple-um {__version__}\n" and err == ""


def test_an_engram_layer_missing_or_not_picked_exits_2_naming_the_flag(capsys, tmp_path):
    """`bench --model deepseek-v41 DIR` as for a PLE table: an Engram checkpoint of several layers
    needs --layer, and a --layer it lacks is refused naming the flag and the layers it has."""
    write_engram_checkpoint(tmp_path, tables={1: 8, 3: 8}, head_dim=256)
    engram = ["bench", str(tmp_path), "--model", "deepseek-v41", "--device", "cpu"]
    code, out, err = run(capsys, *engram)
    assert code == cli.EXIT_USAGE and out == ""
    assert err.splitlines() == [
        f"ple-um bench: error: several Engram tables in {tmp_path}: layers 1, 3; pass --layer to pick one"
    ]
    code, out, err = run(capsys, *engram, "--layer", "7")
    assert code == cli.EXIT_USAGE and out == ""
    assert err.splitlines() == [
        f"ple-um bench: error: --layer 7: no Engram table of layer 7 in {tmp_path}; layers with one: 1, 3"
    ]


@pytest.mark.parametrize("verb", ["bench", "probe", "inspect", "residency", "prewarm"])
def test_a_layer_the_checkpoint_lacks_exits_2(capsys, tmp_path, verb):
    directory = two_layer_checkpoint(tmp_path)
    code, out, err = run(capsys, verb, directory, "--layer", "7")
    assert code == cli.EXIT_USAGE and out == ""
    assert err.splitlines() == [
        f"ple-um {verb}: error: --layer 7: no PLE shards of layer 7 in {directory}; layers with shards: 1, 3"
    ]
