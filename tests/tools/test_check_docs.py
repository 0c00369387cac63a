"""tools/check_docs.py: the docs as they are pass it, and a page naming a path, a test, a knob or
a metric that does not exist gets one problem line for each, naming the page and the line; DESIGN's
map names every module and no file that is gone. And the README's Python examples: the one for a
machine without a GPU runs as written and prints what its comments say; the CUDA one beside it
compiles and calls only what the package has. And DESIGN's list of the keys ``table.stats()``
returns is the keys it returns."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import torch
from helpers.tools import TOOLS, load_tool

import ple_um

SCRIPT = TOOLS / "check_docs.py"
README = TOOLS.parent / "README.md"


def _readme_examples() -> tuple[str, str]:
    """The README's two Python blocks: the one for any machine, then the CUDA one."""
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 2, f"README.md has {len(blocks)} Python examples, not the CPU one and the CUDA one"
    return blocks[0], blocks[1]


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
        "`tools/no_such_script.py` is gone; `ple_um/lookup/_rowcopy*.so` is built by the install\n"
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


def test_a_module_the_map_lacks_and_a_file_it_names_that_is_gone_are_reported(tmp_path, monkeypatch):
    """docs/DESIGN.md's map: a module of the package it does not name, and a file name it names
    that no file has, are each one problem."""
    check = load_tool("check_docs")
    design = (TOOLS.parent / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    assert check.check_map() == []
    assert design.count("`stats_line.py` (the stats line), ") == 1
    edited = design.replace("`stats_line.py` (the stats line), ", "`stats_lines.py` (the stats line), ")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "DESIGN.md").write_text(edited, encoding="utf-8")
    for folder in ("ple_um", "tools", "tests"):
        (tmp_path / folder).symlink_to(TOOLS.parent / folder)
    monkeypatch.setattr(check, "ROOT", str(tmp_path))
    assert check.check_map() == [
        "docs/DESIGN.md: the map does not name ple_um/metrics/stats_line.py",
        "docs/DESIGN.md: the map names stats_lines.py, which no file has",
    ]


def test_the_readme_example_for_a_machine_without_a_gpu_runs_as_written(tmp_path):
    """Run as a user would on a CPU-only machine (no Triton interpreter, which the suite sets and
    which would make the host look like a device): its checkpoint goes to tmp_path instead of
    /tmp/ple-demo, else the code is the README's."""
    code, _ = _readme_examples()
    assert code.count('"/tmp/ple-demo"') == 2, code
    code = code.replace('"/tmp/ple-demo"', repr(str(tmp_path / "ple-demo")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(TOOLS.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    # table.mode, the rows' shape (64 tokens x 16 heads x 160 values), and stats()["rows"]
    assert run.stdout.splitlines()[-1] == "cpu (64, 16, 160) 1024", run.stdout


def test_the_readme_cuda_example_names_only_what_the_package_has(make_checkpoint):
    """The CUDA example cannot run here: it compiles, and every ``ple_um.NAME`` it calls, every
    ``table.NAME`` (of a table opened here) and every keyword it passes exists."""
    _, code = _readme_examples()
    compile(code, "README.md", "exec")
    for name in re.findall(r"\bple_um\.(\w+)", code):
        assert hasattr(ple_um, name), name
    layout = make_checkpoint()
    with ple_um.open_table(layout.directory) as table:
        for name in re.findall(r"\btable\.(\w+)", code):
            assert hasattr(table, name), name
    calls = re.findall(r"\b(open_table|lookup)\(([^()]*)\)", code)
    assert {function for function, _ in calls} == {"open_table", "lookup"}, calls
    for function, call in calls:
        accepted = inspect.signature(getattr(ple_um if function == "open_table" else table, function))
        for keyword in re.findall(r"(\w+)=", call):
            assert keyword in accepted.parameters, f"{function}({keyword}=)"


def _listed(text: str) -> set[str]:
    """The names of a comma-separated list in a doc, each without its parenthesised gloss."""
    items = (re.sub(r"`", "", item).strip() for item in re.sub(r"\([^()]*\)", "", text).split(","))
    return {item for item in items if item}


def test_design_lists_the_keys_stats_returns(make_checkpoint, monkeypatch):
    """docs/DESIGN.md's API: the keys of ``table.stats()``, of its ``row_cache`` and of its
    ``serving``, as a table opened here returns them (one with a row cache)."""
    design = (TOOLS.parent / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    block = re.search(r"table\.stats\(sync=True\)\s*# dict: (.*?)\n(?!\s*#)", design, re.S).group(1)
    keys = _listed(re.sub(r"\n\s*#", ",", block))
    cache = re.search(r'`stats\(\)\["row_cache"\]` is None .*?else a dict: (.*?)\.\n', design, re.S).group(1)
    serving = re.search(r'`stats\(\)\["serving"\]` says .*?: (.*?)\.\n', design, re.S).group(1)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "64KiB")
    layout = make_checkpoint(num_rows=4096, row_dim=32, shards=3)
    with ple_um.open_table(layout.directory, mode="cpu") as table:  # the host path, where a row cache is
        table.lookup(torch.arange(64))
        stats = table.stats()
    assert keys == set(stats), (keys, set(stats))
    assert _listed(" ".join(cache.split())) == set(stats["row_cache"]), stats["row_cache"]
    assert _listed(" ".join(serving.split())) == set(stats["serving"]), stats["serving"]
