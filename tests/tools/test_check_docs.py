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
        "a test hook: PLE_UM_FIRST_READ_FAULT\n"
        "`tools/no_such_script.py` is gone\n"
        "`tests/tools/test_check_docs.py::test_no_such_case`\n"
        "set PLE_UM_NO_SUCH_KNOB=1\n"
        "watch vllm:ple_um_no_such_metric\n",
        encoding="utf-8",
    )
    problems = check.check_manual(str(page), check._all_tests())
    where = check.os.path.relpath(str(page), check.ROOT)
    assert problems == [
        f"{where}:3: tools/no_such_script.py does not exist",
        f"{where}:4: no test test_no_such_case in tests/",
        f"{where}:5: PLE_UM_NO_SUCH_KNOB is no knob of ple_um/envs.py nor test hook of ple_um/_testing.py",
        f"{where}:6: vllm:ple_um_no_such_metric is no metric of ple_um/metrics/counters.py",
    ], problems


def test_a_test_hook_in_the_knob_table_is_reported(tmp_path, monkeypatch):
    """The knob table of docs/OPERATING.md is for users: a test hook listed there is a problem."""
    check = load_tool("check_docs")
    with open(check.os.path.join(check.ROOT, "docs", "OPERATING.md"), encoding="utf-8") as f:
        text = f.read()
    (tmp_path / "docs").mkdir()
    row = "| `PLE_UM_FIRST_READ_FAULT` | | unset | the first-read child crashes |\n"
    (tmp_path / "docs" / "OPERATING.md").write_text(text + row, encoding="utf-8")
    monkeypatch.setattr(check, "ROOT", str(tmp_path))
    assert check.check_operating() == [
        "docs/OPERATING.md: PLE_UM_FIRST_READ_FAULT is a test hook (ple_um/_testing.py), not a knob to list"
    ]
