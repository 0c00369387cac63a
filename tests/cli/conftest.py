"""Fixtures of the CLI tests: small sound checkpoints on disk (the tests break copies of them)."""

from __future__ import annotations

import pytest

from ple_um.synthetic import write_checkpoint

MiB = 1 << 20


@pytest.fixture
def table_dir(tmp_path):
    """A sound 4 MiB FP8 table: 26214 rows of 160 B in 8 shards over 4 files."""
    path = tmp_path / "ckpt"
    layout = write_checkpoint(path, num_rows=(4 * MiB) // 160, row_dim=160, dtype="fp8", shards=8)
    return str(path), layout


@pytest.fixture
def five_files(tmp_path):
    """A sound FP8 table of 10 shards in 5 files with an index (the scale in the last file)."""
    path = tmp_path / "five"
    layout = write_checkpoint(path, num_rows=1000, row_dim=160, dtype="fp8", shards=10, files=5)
    return str(path), layout
