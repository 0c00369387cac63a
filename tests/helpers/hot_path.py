"""The files one lookup crosses, measured: the package's Python files whose functions run during a
call on this thread (``sys.setprofile``), and the C files that define the row copy's functions the
host path runs (read from the source: C frames cannot be profiled). ``tests/structure/test_hot_path.py``
and ``tests/gpu/test_gpu_hot_path.py`` hold the host path to docs/DESIGN.md's count with them."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import ple_um

PACKAGE = Path(ple_um.__file__).resolve().parent
ROOT = PACKAGE.parent
NATIVE = PACKAGE / "lookup" / "native"
# The C functions a lookup's row copy runs, rows in memory and at most INLINE_ROWS ids: the entry a
# host node and the direct call run, the dispatcher thread and its post, the job's run, its rows.
ROW_COPY_FUNCTIONS = (
    "ple_lookup_run",
    "ple_dispatch_post",
    "dispatcher",
    "ple_run_lookup",
    "ple_run_rows",
    "copy_table",
    "copy_mapped",
)
# What the host path's cold read crosses with no Python of it running: the job struct's ctypes mirror.
MIRROR = "ple_um/lookup/rowcopy.py"
_COMPREHENSIONS = frozenset(("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"))


def python_functions_crossed(call: Callable[[], object]) -> set[tuple[str, str]]:
    """The package's Python functions that ran during ``call()`` on this thread, from its entry to
    its return: (file relative to the repository, qualified name). Comprehensions are no functions
    of their own (Python 3.12 runs them inline)."""
    seen: set[tuple[str, str]] = set()
    prefix = str(PACKAGE) + os.sep

    def profile(frame, event, arg) -> None:
        if event == "call":
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(prefix) and frame.f_code.co_name not in _COMPREHENSIONS:
                seen.add((str(Path(path).relative_to(ROOT)), frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def python_files_crossed(call: Callable[[], object]) -> set[str]:
    """The package files with a Python function that ran during ``call()`` on this thread."""
    return {path for path, _ in python_functions_crossed(call)}


def c_files_defining(names=ROW_COPY_FUNCTIONS) -> set[str]:
    """The C files (relative to the repository) that define the functions ``names``; each must be
    defined exactly once."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for path in sorted(NATIVE.glob("*.c")):
        text = path.read_text()
        for name in names:
            if re.search(rf"^\w[^\n;=(]*\b{name}\([^\n;]*\)\s*\{{\s*$", text, re.M):
                found[name].append(str(path.relative_to(ROOT)))
    missing = {name: where for name, where in found.items() if len(where) != 1}
    assert not missing, f"not defined exactly once: {missing}"
    return {where[0] for where in found.values()}
