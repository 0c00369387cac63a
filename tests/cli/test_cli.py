"""The `ple-um` command as a whole: one way to say every error (one line, or a JSON object under
--json), the documented exit codes, knobs checked before any work, help with a description and
the defaults, -v after the verb, stdout that cannot be written. Real processes where the exit code
or the streams are what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.cli import REPO, run, run_cli, run_json, two_layer_checkpoint

from ple_um import cli, envs
from ple_um.cli.checkpoint import ROW_CACHE_KNOBS

VERBS = ("bench", "probe", "inspect", "residency", "prewarm", "knobs")
DIR_VERBS = ("bench", "probe", "inspect", "residency", "prewarm")


# -- help -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_a_description_and_shows_its_defaults(capsys, verb):
    verb_parser = cli.build_parser()._subparsers._group_actions[0].choices[verb]
    assert verb_parser.description and len(verb_parser.description) > 60
    with pytest.raises(SystemExit) as exc:
        cli.main([verb, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # help is wrapped to the terminal's width
    assert " ".join(verb_parser.description.split())[:50] in out
    assert "-v, --verbose" in out and "--json" in out
    defaults = {
        "bench": [
            "(default: 2GiB)",
            "(default: 16,1024,16384,131072; with --memory-limit 16,1024,16384)",
            "(default: 160)",
            "(default: uniform)",
        ],
        "prewarm": ["(default: 1.0)", "(default: 8)", "(default: MemAvailable)"],
    }
    for text in defaults.get(verb, []):
        assert text in out, text
    assert "(default: None)" not in out and "(default: False)" not in out


def test_verbose_before_or_after_the_verb():
    parser = cli.build_parser()
    for argv in (["-v", "probe"], ["probe", "-v"], ["probe", "--verbose"], ["-v", "knobs", "-v"]):
        assert parser.parse_args(argv).verbose is True, argv
    assert parser.parse_args(["probe"]).verbose is False
    done = run_cli("knobs", "-v")
    assert done.returncode == 0, done.stderr


def test_bad_arguments_exit_2(capsys):
    for argv in ([], ["inspect"], ["bogus"], ["inspect", "d", "--layer", "x"], ["probe", "--layer", "-1"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "", argv
        (line,) = err.strip().splitlines()[-1:]
        assert "error: " in line, argv
    code, out, err = run(capsys, "inspect", "d", "--layer", "x")
    assert err.strip().splitlines()[-1] == (
        "ple-um inspect: error: argument --layer: expected a whole number, got 'x' "
        "(see ple-um inspect --help)"
    )


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["knobs", "--jso"], "--jso"),
        (["inspect", "d", "--js"], "--js"),
        (["prewarm", "d", "--max", "1"], "--max 1"),
    ],
)
def test_an_option_is_taken_only_as_spelled(capsys, argv, refused):
    """An abbreviated option is refused (exit 2, naming it), never taken for the option it begins:
    ``--jso`` taken as --json printed answers as JSON but errors as text lines on stderr, since
    the CLI knows --json by its full name."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (argv, out)
    assert err.splitlines()[-1].startswith(f"ple-um {argv[0]}: error: unrecognized arguments: {refused} ")


# -- the checkpoint directory, the same in every verb ---------------------------------------------
@pytest.mark.parametrize("verb", DIR_VERBS)
def test_a_missing_directory_is_one_line_and_exit_1_in_every_verb(capsys, tmp_path, verb):
    missing = str(tmp_path / "nowhere")
    code, out, err = run(capsys, verb, missing)
    assert code == 1 and out == ""
    assert err.splitlines() == [f"ple-um {verb}: error: checkpoint directory {missing} does not exist"]
    code, data = run_json(capsys, verb, missing)
    assert code == 1 and data == {"error": f"checkpoint directory {missing} does not exist"}
    assert not os.path.exists(missing)


def test_a_missing_directory_as_typed(tmp_path):
    missing = str(tmp_path / "nowhere.json")
    done = run_cli("bench", missing)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"ple-um bench: error: checkpoint directory {missing} does not exist (--json prints the results, "
        "--json-file PATH writes them)"
    ]


def test_a_symbolic_link_that_leads_nowhere_is_named_so(capsys, tmp_path):
    loop = tmp_path / "loop"
    os.symlink("loop", loop)
    code, out, err = run(capsys, "inspect", str(loop))
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"ple-um inspect: error: checkpoint directory {loop} is a symbolic link that leads nowhere "
        "(its target is missing, or a loop)"
    ]


@pytest.mark.parametrize("verb", DIR_VERBS)
def test_a_file_given_as_the_directory(capsys, tmp_path, verb):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, out, err = run(capsys, verb, str(a_file))
    assert code == 1 and out == ""
    assert err.splitlines() == [f"ple-um {verb}: error: checkpoint directory {a_file} is not a directory"]
    code, data = run_json(capsys, verb, str(a_file))
    assert code == 1 and data == {"error": f"checkpoint directory {a_file} is not a directory"}


@pytest.mark.parametrize("verb", ["bench", "probe", "residency", "prewarm"])
def test_several_layers_need_layer_in_every_verb_that_serves_one(capsys, tmp_path, verb):
    directory = two_layer_checkpoint(tmp_path)
    code, out, err = run(capsys, verb, directory)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"ple-um {verb}: error: several PLE layers have shards in {directory}: 1, 3; pass --layer to pick one"
    ]
    code, data = run_json(capsys, verb, directory)
    assert code == 2 and "pass --layer to pick one" in data["error"]


# -- knobs, checked before the work ---------------------------------------------------------------
BAD_KNOBS = [
    ("PLE_UM_CPU_THREADS", "0", "a whole number from 1 to 1024"),
    ("VLLM_PLE_MMAP_WORKERS", "0", "a whole number from 1 to 1024"),
    ("PLE_UM_BULK_ROWS", "abc", "auto or a whole number of rows from 0 (never) to 2147483648"),
    ("PLE_UM_STATS_SEC", "soon", "a number of seconds from 0 (off) to 86400"),
    ("PLE_UM_MADVISE", "sometimes", "one of auto, random, normal, none"),
    ("PLE_UM_FIRST_READ_CHECK", "bogus", "off or a comma-separated list of ats, registered"),
    ("PLE_UM_FIRST_READ_TIMEOUT", "0", "a number of seconds above 0, at most 86400"),
    ("PLE_UM_FIRST_READ_TIMEOUT", "abc", "a number of seconds above 0, at most 86400"),
    ("PLE_UM_PREWARM", "maybe", "a boolean (1/0, true/false, yes/no, on/off)"),
    ("PLE_UM_CACHE_DIR", "", "a directory, got an empty value"),
    ("PLE_UM_MODE", "bogus", "one of auto, ats, registered, cpu, device"),
]


@pytest.mark.parametrize("var,value,accepted", BAD_KNOBS)
def test_probe_refuses_a_bad_knob_before_it_works(capsys, monkeypatch, table_dir, var, value, accepted):
    """Every knob a verb reads is checked before it works: the probe of a table (which starts a
    first-read child) exits 2 naming the variable, its value and what it takes."""
    path, _ = table_dir
    monkeypatch.setenv(var, value)
    code, out, err = run(capsys, "probe", path, "--device", "cpu")
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"ple-um probe: error: environment variable {var}={value!r}")
    assert f"expected {accepted}" in line
    assert "invalid literal" not in line and "could not convert" not in line
    code, data = run_json(capsys, "probe", path, "--device", "cpu")
    assert code == 2 and data["error"] == line.removeprefix("ple-um probe: error: ")


def test_bench_refuses_a_bad_knob_before_it_writes_or_times_anything(tmp_path):
    """As typed: the bench exits 2 at once, before its synthetic table is written."""
    cache = tmp_path / "cache"
    for var, value, accepted in (BAD_KNOBS[0], BAD_KNOBS[2], BAD_KNOBS[6]):
        done = run_cli(
            "bench", "--size", "1MiB", env={"PLE_UM_CACHE_DIR": str(cache), var: value}, timeout=120
        )
        assert done.returncode == 2 and done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert (
            line.startswith(f"ple-um bench: error: environment variable {var}={value!r}") and accepted in line
        )
        assert not cache.exists()


def test_the_verbs_on_files_alone_read_only_their_knobs(capsys, monkeypatch, table_dir):
    """inspect and prewarm read no knob, residency only the row cache's, the reader's and the fit's:
    every other knob set to a value it does not take changes nothing for them (residency's row cache
    included); one of residency's own set so is refused before any work, naming it."""
    path, _ = table_dir
    code, unset = run_json(capsys, "residency", path)
    assert code == 0, unset
    for knob in envs.KNOBS.values():
        if knob.name not in ROW_CACHE_KNOBS:
            monkeypatch.setenv(knob.name, "not a value any knob takes")
    takes_any_text = {name for name, knob in envs.KNOBS.items() if knob.parse is str}
    invalid = sum(row["invalid"] is not None for row in envs.describe())
    assert invalid == len(envs.KNOBS) - len(ROW_CACHE_KNOBS) - len(takes_any_text - set(ROW_CACHE_KNOBS))
    for verb in ("inspect", "residency", "prewarm"):
        code, _, err = run(capsys, verb, path)
        assert code == 0, err
    code, invalid_set = run_json(capsys, "residency", path)
    assert code == 0 and invalid_set["row_cache"] == unset["row_cache"], invalid_set["row_cache"]
    for name in ROW_CACHE_KNOBS:
        if name == "PLE_UM_CACHE_DIR":  # any text names a folder: it would be made
            continue
        monkeypatch.setenv(name, "not a value any knob takes")
        for verb in ("inspect", "prewarm"):
            code, _, err = run(capsys, verb, path)
            assert code == 0, err
        code, out, err = run(capsys, "residency", path)
        assert code == 2 and out == "" and f"environment variable {name}=" in err, err
        monkeypatch.delenv(name)


# -- stdout that cannot be written ----------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_stdout_is_one_line_and_exit_1(table_dir):
    path, _ = table_dir
    for argv in (["knobs"], ["residency", path], ["inspect", path, "--shards"], ["knobs", "--json"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [sys.executable, "-m", "ple_um.cli", *argv],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": REPO},
                timeout=120,
            )
        assert done.returncode == 1, (argv, done.stderr)
        assert done.stderr.splitlines() == [
            f"ple-um {argv[0]}: error: cannot write to stdout: No space left on device"
        ], argv


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
    done = run_cli("inspect", path, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tables"][0]["rows"] == layout.num_rows
    os.truncate(layout.files[0], 100)
    done = run_cli("inspect", path)
    assert done.returncode == 1
    assert "verdict: INVALID" in done.stdout
