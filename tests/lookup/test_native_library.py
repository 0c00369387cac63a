"""Which C row copy is loaded (ple_um/lookup/native_library.py): the library the install built when
its interface and source check out, else one compiled at run time into PLE_UM_CACHE_DIR/native/,
and a library found there only once checked. Real libraries throughout, compiled here from the
package's C files; the planted ones carry a constructor that leaves a mark when it runs, so "not
loaded" is seen, not assumed. A library refused or lacking a symbol gives the run-time build (or
None and why), with a warning, never an AttributeError.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess

import pytest
from helpers.rowcopy_jobs import open_library

from ple_um.lookup import native_build, native_library, rowcopy

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
NOBODY = 65534
CC = native_library._compiler()
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def compile_library(out, *, mark=None, only=None, extra=()) -> str:
    """A library from the package's C files (``only``: those files alone), with a constructor that
    creates the file ``mark`` when the library is loaded."""
    sources = []
    if mark is not None:
        planted = out.parent / f"{out.name}.mark.c"
        planted.write_text(
            "#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void ran(void) "
            f'{{ close(open("{mark}", O_CREAT | O_WRONLY, 0600)); }}\n'
        )
        sources.append(str(planted))
    command = native_build.command(CC, str(out), werror=False, extra=extra)
    if only is not None:
        command = [a for a in command if not a.endswith(".c")] + [str(native_build.NATIVE / n) for n in only]
    done = subprocess.run(command + sources, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return str(out)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A working row copy (every symbol, this interface and source) that marks its loading."""
    folder = tmp_path_factory.mktemp("planted")
    return compile_library(folder / "planted.so", mark=folder / "ran")


def ran_mark(planted) -> str:
    return os.path.join(os.path.dirname(planted), "ran")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(native_library, "packaged_library", lambda: None)
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    return path


def load_fresh(cache_dir) -> tuple:
    rowcopy._loaded.pop(str(cache_dir), None)
    return rowcopy.load(str(cache_dir))


def test_the_installed_library_is_used_when_it_checks_out(tmp_path, monkeypatch):
    installed = compile_library(tmp_path / "_rowcopy.so")
    monkeypatch.setattr(native_library, "packaged_library", lambda: native_library.Path(installed))
    lib, why = load_fresh(tmp_path / "cache")
    assert lib is not None and why == "C row copy (installed: _rowcopy.so)"
    assert lib.ple_abi_version() == rowcopy.ABI_VERSION
    assert not (tmp_path / "cache").exists()  # nothing compiled at run time


@pytest.mark.parametrize(
    "kind", ["missing symbol", "other interface", "stale", "a test's build", "not a library"]
)
def test_an_installed_library_that_does_not_check_out_gives_the_run_time_build(
    tmp_path, monkeypatch, caplog, kind
):
    out = tmp_path / "_rowcopy.so"
    if kind == "missing symbol":  # only abi.c: a library of this source and version, nothing else
        compile_library(out, only=["abi.c"])
        expected = "it has no ple_pool_start()"
    elif kind == "other interface":
        compile_library(out, extra=("-DPLE_ABI_VERSION=99",))
        expected = "interface version 99"
    elif kind == "stale":  # an editable install whose C files were edited since it was built
        compile_library(out, extra=("-UPLE_SOURCE_DIGEST", '-DPLE_SOURCE_DIGEST="0123"'))
        expected = "built from other source (digest 0123"
    elif kind == "a test's build":  # a define of a test's variant is in the digest it reports
        compile_library(out, extra=("-DPLE_TEST_PUBLISH_FIRST",))
        expected = f"the source here is {native_build.source_digest()})"
    else:
        out.write_text("not a library")
        expected = "loading"
    monkeypatch.setattr(native_library, "packaged_library", lambda: out)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        lib, why = load_fresh(cache)
    assert "not using the installed row copy" in caplog.text and expected in caplog.text
    assert lib is not None and why.startswith("C row copy (rowcopy-"), why
    assert lib.ple_abi_version() == rowcopy.ABI_VERSION
    assert len(list((cache / "native").glob("rowcopy-*.so"))) == 1


@pytest.mark.parametrize(
    "kind", ["another owner", "group-writable", "other bytes", "no recorded hash", "a link", "a FIFO"]
)
def test_a_library_in_the_cache_that_fails_a_check_is_not_loaded_but_built_again(
    cache, planted, caplog, kind
):
    if kind == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    target = native_library._target(str(cache), CC)
    target.parent.mkdir(mode=0o700)
    mark = ran_mark(planted)
    if os.path.exists(mark):
        os.unlink(mark)
    if kind == "a FIFO":
        os.mkfifo(target)
    elif kind == "a link":
        os.symlink(planted, target)
    else:
        shutil.copy(planted, target)
    with open(planted, "rb") as f:
        recorded = hashlib.sha256(f.read()).hexdigest()
    if kind != "no recorded hash":
        (target.parent / f"{target.name}.sha256").write_text(recorded if kind != "other bytes" else "0" * 64)
    if kind == "another owner":
        os.chown(target, NOBODY, NOBODY)
        os.chown(target.parent / f"{target.name}.sha256", NOBODY, NOBODY)
    elif kind == "group-writable":
        os.chmod(target, 0o775)
    expected = {
        "another owner": f"owned by uid {NOBODY}",
        "group-writable": "can be written by others",
        "other bytes": "are not those its build recorded",
        "no recorded hash": "no rowcopy-",
        "a link": "is a symbolic link",
        "a FIFO": "is not a regular file (a FIFO)",
    }[kind]
    with caplog.at_level(logging.WARNING):
        lib, why = load_fresh(cache)
    assert "not loading the row copy found in the cache" in caplog.text and expected in caplog.text
    assert not os.path.exists(mark)  # its constructor never ran
    assert lib is not None and why.startswith("C row copy (rowcopy-"), why
    assert lib.ple_abi_version() == rowcopy.ABI_VERSION
    st = os.lstat(target)  # replaced by this process's build
    assert os.path.isfile(target) and not os.path.islink(target) and st.st_uid == os.geteuid()
    with open(target, "rb") as f:
        built = hashlib.sha256(f.read()).hexdigest()
    assert (target.parent / f"{target.name}.sha256").read_text() == built != recorded
    # The next process finds the build and its record: loaded without a warning or a build.
    caplog.clear()
    before = os.stat(target).st_mtime_ns
    with caplog.at_level(logging.WARNING):
        lib, _ = load_fresh(cache)
    assert lib is not None and not caplog.text and os.stat(target).st_mtime_ns == before


def test_a_library_in_the_cache_lacking_a_symbol_is_built_again_not_an_attribute_error(cache, caplog):
    target = native_library._target(str(cache), CC)
    target.parent.mkdir(mode=0o700)
    compile_library(target, only=["abi.c"])
    with open(target, "rb") as f:
        (target.parent / f"{target.name}.sha256").write_text(hashlib.sha256(f.read()).hexdigest())
    with caplog.at_level(logging.WARNING):
        lib, why = load_fresh(cache)
    assert "it has no ple_pool_start()" in caplog.text
    assert lib is not None, why
    assert lib.ple_uring_works() in (0, 1)


def test_no_library_is_built_into_an_unsafe_folder(cache):
    (cache / "native").mkdir()
    os.chmod(cache / "native", 0o777)
    lib, why = load_fresh(cache)
    assert lib is None and "unsafe folder" in why and "can be written by others" in why
    assert list((cache / "native").iterdir()) == []


def test_the_sources_build_with_warnings_as_errors(tmp_path):
    """What the install and CI compile: every warning of -Wall -Wextra -Wconversion an error."""
    command = native_build.command(CC, str(tmp_path / "strict.so"), werror=True)
    assert {"-Wall", "-Wextra", "-Wconversion", "-Werror", "-fstack-protector-strong"} <= set(command)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lib, why = open_library(str(tmp_path / "strict.so"))
    assert lib is not None, why
