"""The `ple-um` command driven from tests: in this process through ``cli.main`` (``run``,
``run_json``), or as a real process (``run_cli``) where the exit code, stdout or stderr of the
command itself matters; and the checkpoints the CLI tests share."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from ple_um import cli
from ple_um.synthetic import write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def run_cli(*argv: str, env: dict | None = None, timeout: float = 600, shell_prefix: str | None = None):
    """``python -m ple_um.cli ARGV`` as a process (this worktree's package first on its path):
    subprocess.CompletedProcess with text stdout and stderr. ``env`` is added to this process's
    environment (a value None removes the variable); ``shell_prefix`` runs it through the shell
    after that text (``ulimit -f 100;``)."""
    full = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    command = [sys.executable, "-m", "ple_um.cli", *argv]
    if shell_prefix is not None:
        import shlex

        return subprocess.run(
            f"{shell_prefix} {shlex.join(command)}",
            shell=True,
            capture_output=True,
            text=True,
            env=full,
            timeout=timeout,
        )
    return subprocess.run(command, capture_output=True, text=True, env=full, timeout=timeout)


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


def two_layer_checkpoint(tmp_path) -> str:
    """A checkpoint with PLE layers 1 (50 rows) and 3 (30 rows): two checkpoints' files and
    indexes merged into one directory."""
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
    return str(a)
