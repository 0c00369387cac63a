"""When a cached first-read verdict is trusted (ple_um/access/verdict_cache.py): only a well-formed
record for this very key, in a regular file of this user's that no one else can write, in a folder
of this user's that no one else can write, no longer than a verdict can be. A planted "passed"
verdict that fails any of these is ignored with a warning and the child checks the first read
again (its failure injected: the verdict then says "rejected", which a trusted plant would have
hidden). A verdict that is a FIFO or a link to /dev/zero is read in a child killed at a timeout
and held to a memory limit: a read that blocks or runs without end fails the test, not the suite.
Verdicts are written 0600 in a folder made 0700.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from ple_um.access import verdict_cache
from ple_um.access.capabilities import read_capabilities, triton_interpreter
from ple_um.access.first_read import first_read_verdict
from ple_um.access.verdict_cache import FORMAT, FORMAT_VERSION, read_verdict, verdict_key, verdict_path

pytestmark = [
    pytest.mark.skipif(not triton_interpreter(), reason="the child reads through the interpreted kernel"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534
CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(path))
    return path


def passed_record(key) -> dict:
    """A verdict anyone can write: well formed, for this key, passed."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "key": key,
        "passed": True,
        "reason": None,
        "checked_at": "2026-12-01 10:00:00 UTC",
        "child_seconds": 1.0,
    }


def test_verdicts_are_written_private(layout, cache):
    verdict = first_read_verdict("ats", read_capabilities("cpu"), layout, (0, layout.num_rows), CPU)
    assert verdict.source == "child" and verdict.path is not None
    assert stat.S_IMODE(os.stat(verdict.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(verdict.path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


@pytest.mark.parametrize("kind", ["world-writable", "folder group-writable", "another owner", "oversized"])
def test_a_planted_passed_verdict_that_fails_a_check_is_ignored_and_the_child_runs(
    layout, cache, monkeypatch, caplog, kind
):
    if kind == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    key = verdict_key(read_capabilities("cpu"), "ats", layout.files)
    path = verdict_path(key)
    os.makedirs(os.path.dirname(path), mode=0o700)
    text = json.dumps(passed_record(key))
    if kind == "oversized":  # well formed, but padded past what a verdict can be
        text += " " * (verdict_cache.MAX_BYTES + 1)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    expected = {
        "world-writable": "can be written by others",
        "folder group-writable": "can be written by others",
        "another owner": f"owned by uid {NOBODY}",
        "oversized": f"larger than the {verdict_cache.MAX_BYTES} bytes",
    }[kind]
    if kind == "world-writable":
        os.chmod(path, 0o666)
    elif kind == "folder group-writable":
        os.chmod(os.path.dirname(path), 0o770)
    elif kind == "another owner":
        os.chown(path, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING):
        assert read_verdict(path, key) is None
    assert f"ignoring the first-read verdict file {path}: not trusted" in caplog.text
    assert expected in caplog.text
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "corrupt")  # what the child finds: not what the plant says
    verdict = first_read_verdict("ats", read_capabilities("cpu"), layout, (0, layout.num_rows), CPU)
    assert (verdict.status, verdict.source) == ("rejected", "child")


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link to a good verdict"])
def test_a_verdict_that_is_not_a_regular_file_is_not_read(tmp_path, kind):
    folder = tmp_path / "first-read"
    folder.mkdir(mode=0o700)
    path = folder / "ats-0123456789abcdef.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        good = tmp_path / "good.json"
        good.write_text(json.dumps(passed_record({"device": "x"})))
        os.chmod(good, 0o600)
        os.symlink(good, path)
    code = textwrap.dedent(
        f"""
        import logging, resource
        from ple_um.access.verdict_cache import read_verdict
        logging.basicConfig(level=logging.WARNING)
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
        print("verdict:", read_verdict({str(path)!r}, None))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verdict: None" in done.stdout
    expected = "is not a regular file (a FIFO)" if kind == "fifo" else "is a symbolic link"
    assert "not trusted" in done.stderr and expected in done.stderr
