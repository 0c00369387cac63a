"""ple_um.checkpoint.files: files that cannot be read (a dangling symlink, no permission, a FIFO,
a directory) are refused with the file named, and a FIFO never blocks the open; a 90 MB string,
under the 100 MB cap, in a header or the index is read in a child process whose address space is
bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers.hand_checkpoints import INDEX, one_file, ple, raises, shard
from helpers.reference import write_safetensors


def test_broken_symlink_shard_file(tmp_path):
    one_file(tmp_path, ple())
    os.symlink(tmp_path / "gone.bin", tmp_path / "dangling.safetensors")
    raises(str(tmp_path), r"cannot open: No such file or directory", path="dangling.safetensors")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path):
    path = tmp_path / "model.safetensors"
    one_file(tmp_path, ple())
    path.chmod(0)
    try:
        raises(str(tmp_path), r"cannot open: Permission denied", path="model.safetensors")
    finally:
        path.chmod(0o644)


def test_fifo_and_directory_named_safetensors(tmp_path):
    one_file(tmp_path, ple())
    os.mkfifo(tmp_path / "pipe.safetensors")  # opening it for reading must not wait for a writer
    raises(str(tmp_path), r"not a regular file", path="pipe.safetensors")
    os.unlink(tmp_path / "pipe.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    raises(str(tmp_path), r"not a regular file", path="dir.safetensors")


# A child that bounds its own address space to what it maps after its imports plus BUDGET, then
# reads the layout.
BUDGET = 1 << 30
_CHILD = textwrap.dedent(
    """
    import resource, sys
    from ple_um.checkpoint import read_layout
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[2]), resource.RLIM_INFINITY))
    print(read_layout(sys.argv[1]).num_rows)
    """
)
LONG = 90_000_000


def _read_bounded(directory) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(directory), str(BUDGET)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_a_90_mb_metadata_string_is_read_in_bounded_memory(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple(), metadata={"note": "x" * LONG})
    assert os.path.getsize(tmp_path / "model.safetensors") > LONG
    assert _read_bounded(tmp_path) == "9"


def test_a_90_mb_string_in_the_index_is_read_in_bounded_memory(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple())
    weight_map = {name: "model.safetensors" for name in ple()}
    assert shard(0) in weight_map
    index = {"metadata": {"total_size": 0, "note": "\n" * (LONG // 2)}, "weight_map": weight_map}
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert os.path.getsize(tmp_path / INDEX) > LONG
    assert _read_bounded(tmp_path) == "9"
