"""The row copy under the sanitizers, as CI runs it: the C files compiled with warnings as errors and
``-fsanitize=address,undefined`` (out-of-bounds reads and writes, use after free, overflow, any
undefined behaviour ends the run), and separately with ``-fsanitize=thread`` (data races, with the
row cache's sequence-lock copy annotated: native/sanitize.h), then driven by ``sanitized_lookups.py``
in a fresh interpreter with the sanitizer's runtime preloaded: the row copy, the pool, the row cache
and its block scales' follower, the reader, the page touch and the dispatcher, their threads at
once, on a real NVFP4 checkpoint, every row and block scale checked. A
sanitizer report, a wrong row or a hang (the timeout) fails the test.

A last test builds the thread-sanitized library without the sequence lock's annotation and sees
ThreadSanitizer report the race it covers: the run above could fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ple_um.lookup import native_build

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CC = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
SANITIZERS = {
    "address,undefined": ("libasan.so", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"),
    "thread": ("libtsan.so", "-fsanitize=thread"),
}
OPTIONS = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
}


def runtime(name: str) -> str | None:
    """The sanitizer runtime the compiler links against, for LD_PRELOAD (a Python process must load it
    first), or None where the compiler has none."""
    if CC is None:
        return None
    found = subprocess.run([CC, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def build(tmp_path, sanitizer: str, *extra: str) -> str:
    out = str(tmp_path / f"rowcopy-{sanitizer.replace(',', '-')}.so")
    flags = (*SANITIZERS[sanitizer][1:], "-O1", "-g", "-fno-omit-frame-pointer", *extra)
    command = native_build.command(CC, out, werror=True, extra=flags)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_lookups(
    library: str, sanitizer: str, directory: str, *defines: str, lookups: int = 8
) -> subprocess.CompletedProcess:
    # libstdc++ too: the runtime intercepts __cxa_throw, which it finds only in a library loaded
    # before it (Python is C; Triton's C++ module throws while it is imported).
    preload = [runtime(SANITIZERS[sanitizer][0]), runtime("libstdc++.so")]
    env = {**os.environ, **OPTIONS, "PYTHONPATH": REPO, "LD_PRELOAD": " ".join(p for p in preload if p)}
    env["SANITIZED_LOOKUPS"] = str(lookups)
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "sanitized_lookups.py"), library, directory, *defines],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from ple_um.synthetic import write_checkpoint

    folder = tmp_path_factory.mktemp("sanitized") / "ckpt"
    layout = write_checkpoint(folder, num_rows=2003, row_dim=48, dtype="nvfp4", shards=5, files=2, seed=7)
    return str(layout.directory)


@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_lookups_under_the_sanitizer_are_clean_and_exact(tmp_path, checkpoint, sanitizer):
    if runtime(SANITIZERS[sanitizer][0]) is None:
        pytest.skip(f"{CC} has no {SANITIZERS[sanitizer][0]}")
    done = run_lookups(build(tmp_path, sanitizer), sanitizer, checkpoint)
    report = done.stderr[-6000:]
    assert done.returncode == 0, f"exit {done.returncode}\n{report}"
    assert "ERROR: AddressSanitizer" not in done.stderr and "runtime error" not in done.stderr
    assert "WARNING: ThreadSanitizer" not in done.stderr
    assert "40 lookups, 0 wrong" in done.stdout


def test_thread_sanitizer_sees_the_sequence_lock_race_unannotated(tmp_path, checkpoint):
    if runtime("libtsan.so") is None:
        pytest.skip(f"{CC} has no libtsan.so")
    library = build(tmp_path, "thread", "-DPLE_NO_RACE_ANNOTATIONS")
    # The race shows only where a copy and a rewrite of one slot overlap in time, which a busy
    # machine makes rarer: up to 8 times the lookups (the sanitizer ends the run at its first report).
    done = run_lookups(library, "thread", checkpoint, "-DPLE_NO_RACE_ANNOTATIONS", lookups=64)
    assert done.returncode == 66 and "WARNING: ThreadSanitizer: data race" in done.stderr
    assert "ple_cache_get" in done.stderr
