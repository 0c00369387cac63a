"""ple_um.checkpoint.files: files that cannot be read (a dangling symlink, no permission, a FIFO,
a directory) are refused with the file named, and a FIFO never blocks the open."""

from __future__ import annotations

import os

import pytest
from helpers.hand_checkpoints import one_file, ple, raises


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
