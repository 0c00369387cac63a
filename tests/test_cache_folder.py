"""ple_um.cache_folder and its users: the cache folder is made 0700 and trusted only when it is this
user's and no one else can write it; its files are opened without following a link and without
blocking, and used only when they are regular files of this user's. A lock that is a FIFO does not
hang an open (checked in a child, killed at a timeout), a lock that is a dangling link does not make
its target, and PLE_UM_CACHE_DIR naming a file or an unsafe folder is refused with the other knobs.
A lock has one holder at a time, a bounded wait, and a reason where it is not held.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ple_um import cache_folder, envs
from ple_um.errors import KnobError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
NOBODY = 65534


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_and_lock_files_are_made_private(tmp_path):
    old = os.umask(0o002)  # a lax umask: the modes must not depend on it
    try:
        path = tmp_path / "cache" / "deep" / "x.lock"
        with cache_folder.locked(str(path), 1.0) as why:
            assert why is None
        assert mode_of(tmp_path / "cache") == 0o700 and mode_of(tmp_path / "cache" / "deep") == 0o700
        assert mode_of(path) == 0o600
    finally:
        os.umask(old)


@pytest.mark.parametrize("kind", ["fifo", "dangling link", "link to a file", "folder", "group-writable"])
def test_a_lock_that_is_not_a_private_regular_file_is_not_used(tmp_path, kind):
    path, target = tmp_path / "x.lock", tmp_path / "elsewhere"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling link":
        os.symlink(target, path)
    elif kind == "link to a file":
        target.write_text("")
        os.symlink(target, path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text("")
        path.chmod(0o664)
    with cache_folder.locked(str(path), 0.2) as why:
        assert why is not None and why.startswith(f"cannot open {path}: ")
    assert os.path.exists(target) == (kind == "link to a file")  # a dangling link's target is not made
    if kind != "link to a file":
        assert not target.exists()


@AS_ROOT
def test_a_lock_of_another_user_is_not_used(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("")
    os.chown(path, NOBODY, NOBODY)
    with cache_folder.locked(str(path), 0.2) as why:
        assert f"owned by uid {NOBODY}" in why


def test_an_open_with_a_fifo_for_the_row_cache_lock_does_not_hang(tmp_path, make_checkpoint):
    """The sizing lock (PLE_UM_CACHE_DIR/row-cache.lock) as a FIFO: the open goes on without the
    lock and says why. In a child killed at a timeout: an open that blocks must fail the test, not
    hang the suite."""
    layout = make_checkpoint(num_rows=300, row_dim=16, dtype="fp8", shards=2)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.mkfifo(cache / "row-cache.lock")
    code = textwrap.dedent(
        f"""
        import logging, torch, ple_um
        logging.basicConfig(level=logging.WARNING)
        with ple_um.open_table({layout.directory!r}, mode="cpu", device="cpu") as table:
            assert table.lookup(torch.arange(5)).shape[0] == 5
        print("opened")
        """
    )
    env = {**os.environ, "PLE_UM_CACHE_DIR": str(cache), "PLE_UM_ROW_CACHE": "1MiB", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "opened" in done.stdout
    assert "row cache sized without its lock" in done.stderr and "FIFO" in done.stderr


@pytest.mark.parametrize(
    "kind", ["file", "group-writable", "world-writable", "link", "link/", "link/.", "below a file"]
)
def test_a_cache_dir_that_is_not_a_private_folder_is_refused_with_the_knobs(tmp_path, monkeypatch, kind):
    """A link too where the value ends in a separator or ``.``, which lstat would have followed."""
    path = tmp_path / "cache"
    if kind == "file":
        path.write_text("")
    elif kind in ("group-writable", "world-writable"):
        path.mkdir()
        path.chmod(0o770 if kind == "group-writable" else 0o1777)
    elif kind.startswith("link"):
        (tmp_path / "real").mkdir(mode=0o700)
        os.symlink(tmp_path / "real", path)
    else:
        (tmp_path / "a-file").write_text("")
        path = tmp_path / "a-file" / "cache"
    given = str(path) + (kind.removeprefix("link") if kind.startswith("link") else "")
    monkeypatch.setenv("PLE_UM_CACHE_DIR", given)
    with pytest.raises(KnobError, match="PLE_UM_CACHE_DIR=") as raised:
        envs.check()
    assert str(path) in str(raised.value)
    if kind.startswith("link"):
        assert f"{path} is a symbolic link" in str(raised.value)
        with pytest.raises(cache_folder.UnsafeCacheError, match="is a symbolic link"):
            cache_folder.private_folder(given)
    rows = {row["name"]: row for row in envs.describe()}
    assert "PLE_UM_CACHE_DIR" in rows["PLE_UM_CACHE_DIR"]["invalid"]


@AS_ROOT
def test_a_cache_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(path))
    with pytest.raises(KnobError, match=f"owned by uid {NOBODY}"):
        envs.check()


def test_an_unset_cache_dir_is_checked_at_its_default(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "ple-um").write_text("")  # the default names a file
    monkeypatch.delenv("PLE_UM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(KnobError, match="PLE_UM_CACHE_DIR is unset and its default"):
        envs.check()


def test_a_private_folder_that_is_there_or_not_is_taken(tmp_path, monkeypatch):
    made = tmp_path / "new" / "cache"
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(made))  # not there yet: it will be made
    envs.check()
    assert cache_folder.private_folder(str(made)) == str(made) and mode_of(made) == 0o700
    (tmp_path / "old").mkdir(mode=0o755)  # made by an earlier ple-um: others may read, not write
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "old"))
    envs.check()


def test_a_cache_dir_under_home_written_with_a_tilde_is_there(tmp_path, monkeypatch):
    """``~`` is the home folder, as the default spells it, where no shell expanded it (a systemd
    unit, a container's environment): not a folder named ``~`` in the working directory."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_UM_CACHE_DIR", "~/cache")
    assert envs.PLE_UM_CACHE_DIR == str(tmp_path / "home" / "cache")
    monkeypatch.setenv("PLE_UM_CACHE_DIR", "~")
    assert envs.PLE_UM_CACHE_DIR == str(tmp_path / "home")


def test_a_bounded_read_stops_past_its_bound(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * 5000)
    assert cache_folder.read_private(str(path), 5000) == b"x" * 5000
    with pytest.raises(cache_folder.UnsafeCacheError, match="larger than the 4999 bytes"):
        cache_folder.read_private(str(path), 4999)
    os.symlink("/dev/zero", tmp_path / "zero")
    with pytest.raises(cache_folder.UnsafeCacheError, match="symbolic link"):
        cache_folder.read_private(str(tmp_path / "zero"), 100)


def test_a_private_write_replaces_the_file_whole_and_only_in_a_safe_folder(tmp_path):
    path = tmp_path / "cache" / "f.json"
    cache_folder.write_private(str(path), b"old")
    cache_folder.write_private(str(path), b"new")
    assert path.read_bytes() == b"new" and mode_of(path) == 0o600 and mode_of(path.parent) == 0o700
    assert sorted(os.listdir(path.parent)) == ["f.json"]  # no temporary file left
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(cache_folder.UnsafeCacheError, match="can be written by others"):
        cache_folder.write_private(str(open_folder / "f.json"), b"x")
    assert os.listdir(open_folder) == []
    os.symlink("/nonexistent-target", open_folder / "link")
    open_folder.chmod(0o700)
    cache_folder.write_private(str(open_folder / "link"), b"y")  # the link is replaced, not followed
    assert not os.path.islink(open_folder / "link") and (open_folder / "link").read_bytes() == b"y"


def test_bench_refuses_a_cache_dir_that_is_a_file_before_any_work(tmp_path, capsys, monkeypatch):
    """`ple-um bench` keeps its table in the cache folder: one that names a file is refused with the
    other knobs (exit 2, the variable named), never a bare "Not a directory" mid-run."""
    from helpers.cli import run

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(blocker))
    code, out, err = run(capsys, "bench", "--size", "1MiB")
    assert code == 2 and out == ""
    assert f"environment variable PLE_UM_CACHE_DIR={str(blocker)!r}" in err and "is not a folder" in err


# -- the lock: one holder at a time, a bounded wait, and a reason where it is not held -----------
def test_one_holder_at_a_time_and_a_bounded_wait(tmp_path):
    path = str(tmp_path / "deep" / "folder" / "x.lock")  # the folder is made
    with cache_folder.locked(path, 1.0) as why:
        assert why is None
        found = []

        def second():
            t0 = time.monotonic()
            with cache_folder.locked(path, 0.3) as other:
                found.append((other, time.monotonic() - t0))

        worker = threading.Thread(target=second)
        worker.start()
        worker.join(10)
        ((other, waited),) = found
        assert other == f"{path} still held by another process after 0 s" and 0.3 <= waited < 5
    with cache_folder.locked(path, 0.0) as why:  # released with the block
        assert why is None


def test_the_lock_waited_for_is_taken_once_released(tmp_path):
    path = str(tmp_path / "x.lock")
    taken = []

    def waiter():
        with cache_folder.locked(path, 10.0) as why:
            taken.append((why, time.monotonic()))

    with cache_folder.locked(path, 1.0):
        worker = threading.Thread(target=waiter)
        worker.start()
        time.sleep(0.3)
        released = time.monotonic()
    worker.join(10)
    ((why, at),) = taken
    assert why is None and at >= released


def test_a_file_that_cannot_be_made_is_said(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with cache_folder.locked(str(blocker / "x.lock"), 1.0) as why:
        assert why.startswith(f"cannot open {blocker / 'x.lock'}: ")
