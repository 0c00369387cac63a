"""tools/gpu_run.sh's bench part, with the commands it runs recorded (a python3 and an nvidia-smi
of the test's own on the PATH, which write down their arguments): the bench is run on the shared
table ($TABLE where set, else the synthetic table of $SIZE) and its results written as JSON under
$OUT, as the other parts' are."""

from __future__ import annotations

import os
import subprocess

from helpers.tools import TOOLS

SCRIPT = TOOLS / "gpu_run.sh"

# Records each call; where the script asks for the synthetic table's path, answers one.
PYTHON3 = """#!/bin/sh
printf '%s\\n' "$*" >> "$CALLS"
case "$*" in *default_table*) echo /cache/bench-fp8-synthetic ;; esac
exit 0
"""


def _bench_calls(tmp_path, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", PYTHON3), ("nvidia-smi", "#!/bin/sh\necho 'GPU, 1, 80 GiB'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    run_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "OUT": str(tmp_path / "out"),
    }
    run_env.pop("TABLE", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), "bench"], env={**run_env, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in calls.read_text().splitlines() if line.startswith("-m ple_um.cli bench")]


def test_the_bench_part_runs_on_the_shared_table_and_writes_its_json(tmp_path):
    json_file = tmp_path / "out" / "bench.json"
    assert _bench_calls(tmp_path) == [
        f"-m ple_um.cli bench /cache/bench-fp8-synthetic --json-file {json_file}"
    ]


def test_the_bench_part_runs_on_table_where_it_is_set(tmp_path):
    (call,) = _bench_calls(tmp_path, TABLE="/data/real-checkpoint", BENCH_ARGS="--rows 16")
    json_file = tmp_path / "out" / "bench.json"
    assert call == f"-m ple_um.cli bench /data/real-checkpoint --json-file {json_file} --rows 16"
