"""The storage's ceiling on real files: every read size and depth measured, O_DIRECT where the
filesystem takes it and said otherwise, and the ceiling of n rows as n over the reads per second."""

from __future__ import annotations

import os

import pytest
from helpers.cli import fs_type

from ple_um.bench import storage


@pytest.fixture
def files(tmp_path):
    paths = []
    for k, size in enumerate((3 << 20, 1 << 20)):
        path = tmp_path / f"f{k}"
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    return paths


def test_every_size_and_depth_is_measured(files):
    found = storage.ceiling(files, depths=(1, 4), reads={1: 200, 4: 400})
    assert found["files"] == 2 and found["bytes"] == 4 << 20
    assert set(found["sizes"]) == {"4096", "512"}
    direct = fs_type(files[0]) != "tmpfs"
    for entry in found["sizes"].values():
        if direct:
            assert entry["direct"] is True and entry["how"] == "O_DIRECT"
        for depth, count in (("1", 200), ("4", 400)):
            assert entry[depth]["reads"] == count
            assert entry[depth]["reads_per_s"] > 0 and entry[depth]["us_per_read"] > 0
    rate = found["sizes"]["4096"]["4"]["reads_per_s"]
    assert storage.ceiling_us(found, 1024, depth=4) == pytest.approx(1024 / rate * 1e6)
    assert storage.ceiling_us(found, 1024, depth=64) is None  # not measured


def test_buffered_reads_drop_the_pages_first_and_say_so(files):
    """Where O_DIRECT is not taken (here: not asked for) the reads go through the page cache, its
    pages of the files dropped first and readahead off."""
    found = storage.ceiling(files, depths=(2,), sizes=(4096,), reads={2: 100}, direct=False)
    entry = found["sizes"]["4096"]
    assert entry["direct"] is False and entry["how"] == "buffered (O_DIRECT not asked for)"
    assert entry["2"]["reads"] == 100 and entry["2"]["reads_per_s"] > 0
