"""The Python checks ``.ci/run`` makes between its steps (``python -c "..."``) run here against the
package as it is: a check that names a moved or renamed function fails here, not only in CI."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from ple_um.lookup import native_library

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _package_checks() -> list[str]:
    """The code of every ``python -c`` line of ``.ci/run`` that imports ple_um."""
    found = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        if re.match(r"\s*python -c ", line):
            code = shlex.split(line)[2]
            if "ple_um" in code:
                found.append(code)
    return found


def test_the_ci_script_has_package_checks():
    assert _package_checks(), ".ci/run no longer checks the installed row copy"


@pytest.mark.parametrize("code", _package_checks())
def test_a_ci_package_check_runs(code):
    if native_library.packaged_library() is None:
        pytest.skip("no row copy built into the package here (setup.py build_ext --inplace builds one)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
