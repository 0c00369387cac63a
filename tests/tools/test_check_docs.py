"""tools/check_docs.py: the docs as they are pass it, and a page naming a path, a test, a knob or
a metric that does not exist gets one problem line for each, naming the page and the line."""

from __future__ import annotations

import subprocess
import sys

from helpers.tools import TOOLS, load_tool

SCRIPT = TOOLS / "check_docs.py"


def test_the_docs_name_only_what_exists():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "docs: ok"


def test_each_kind_of_bad_name_is_reported(tmp_path):
    check = load_tool("check_docs")
    page = tmp_path / "PAGE.md"
    page.write_text(
        "fine: `ple_um/envs.py`, PLE_UM_ROW_CACHE, vllm:ple_um_row_cache_hits_total\n"
        "`tools/no_such_script.py` is gone\n"
        "`tests/tools/test_check_docs.py::test_no_such_case`\n"
        "set PLE_UM_NO_SUCH_KNOB=1\n"
        "watch vllm:ple_um_no_such_metric\n",
        encoding="utf-8",
    )
    problems = check.check_manual(str(page), check._all_tests())
    where = check.os.path.relpath(str(page), check.ROOT)
    assert problems == [
        f"{where}:2: tools/no_such_script.py does not exist",
        f"{where}:3: no test test_no_such_case in tests/",
        f"{where}:4: PLE_UM_NO_SUCH_KNOB is no knob of ple_um/envs.py",
        f"{where}:5: vllm:ple_um_no_such_metric is no metric of ple_um/metrics/counters.py",
    ], problems
