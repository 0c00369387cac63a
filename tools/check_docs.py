"""Check that the docs name only what exists: every path of the repository they cite (or that a
build makes, as .gitignore names it), every test they cite (in the file cited before it on the same
line, where one is), every knob (or test hook of ``ple_um._testing``) and every metric; and that
docs/OPERATING.md lists every knob of ``ple_um.envs`` with its aliases, no test hook, and every
metric of ``ple_um.metrics``; and that docs/DESIGN.md's map names every module of the package
and no file that is gone. The lab notebook (docs/lab/) may name scripts and files that are gone,
when its README lists them with the commit that holds them.

    python tools/check_docs.py        # exit 1 and one line per problem, else "docs: ok"
"""

from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ple_um._testing import HOOKS  # noqa: E402
from ple_um.envs import KNOBS  # noqa: E402
from ple_um.metrics.counters import METRICS  # noqa: E402

PATH = re.compile(r"(?<![\w./-])((?:tools|tests|ple_um|kernels|docs)/[\w./*-]*[\w*/])")
TEST = re.compile(r"(?<![\w/.])(?:::)?(test_\w+)\b")
KNOB = re.compile(r"\bPLE_UM\w*")
METRIC = re.compile(r"vllm:ple_(?:um|mmap)_\w+\*?")
ALIASES = {alias for knob in KNOBS.values() for alias in knob.aliases}
NAMED = {*KNOBS, *ALIASES, *HOOKS}  # what a doc may name: the knobs, their aliases, the test hooks


def _docs() -> tuple[list[str], list[str]]:
    manual = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    lab = sorted(glob.glob(os.path.join(ROOT, "docs", "lab", "*.md")))
    return manual, lab


def _exists(path: str) -> bool:
    """On disk, or a build's product that .gitignore names exactly (the C row copy's library, which a
    clone has only once installed)."""
    return bool(glob.glob(os.path.join(ROOT, path.rstrip("/")))) or "/" + path in _built()


def _built() -> set[str]:
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        return {line.strip() for line in f if line.startswith("/")}


def _tests_in(path: str) -> set[str]:
    found: set[str] = set()
    for file in glob.glob(os.path.join(ROOT, path)):
        if os.path.isfile(file) and file.endswith(".py"):
            with open(file, encoding="utf-8") as f:
                found |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", f.read(), re.M))
    return found


def _module_names() -> set[str]:
    return {
        os.path.splitext(os.path.basename(p))[0]
        for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
    }


def _all_tests() -> set[str]:
    found = set()
    for file in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True):
        found |= _tests_in(os.path.relpath(file, ROOT))
    return found | _module_names()


def check_manual(path: str, every_test: set[str]) -> list[str]:
    problems = []
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        where = f"{rel}:{number}"
        cited_file = None
        tokens = sorted(
            [(m.start(), "path", m.group(1)) for m in PATH.finditer(line)]
            + [(m.start(), "test", m.group(1)) for m in TEST.finditer(line)]
        )
        for token in tokens:
            if token[1] == "path":
                name = token[2]
                if not _exists(name):
                    problems.append(f"{where}: {name} does not exist")
                cited_file = name if name.startswith("tests/") and name.endswith(".py") else cited_file
                continue
            name = token[2]
            if name not in every_test:
                problems.append(f"{where}: no test {name} in tests/")
            elif cited_file is not None and name not in _module_names() and name not in _tests_in(cited_file):
                problems.append(f"{where}: {name} is not in {cited_file}")
        for knob in set(KNOB.findall(line)):
            if knob not in NAMED:
                why = "is no knob of ple_um/envs.py nor test hook of ple_um/_testing.py"
                problems.append(f"{where}: {knob} {why}")
        for metric in set(METRIC.findall(line)):
            names = _metric_names()
            if metric.endswith("*") and any(n.startswith(metric[:-1]) for n in names):
                continue
            if metric not in names:
                problems.append(f"{where}: {metric} is no metric of ple_um/metrics/counters.py")
    return problems


def _metric_names() -> set[str]:
    return {name for spec in METRICS for name in (spec.name, spec.alias) if name}


def check_operating() -> list[str]:
    path = os.path.join(ROOT, "docs", "OPERATING.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    problems = []
    for name, knob in KNOBS.items():
        row = re.search(rf"^\| `{name}` \|([^|]*)\|", text, re.M)
        if row is None:
            problems.append(f"docs/OPERATING.md: no row for the knob {name}")
            continue
        listed = set(re.findall(r"`(\w+)`", row.group(1)))
        if listed != set(knob.aliases):
            problems.append(
                f"docs/OPERATING.md: {name}'s aliases are {sorted(knob.aliases)}, row: {sorted(listed)}"
            )
    for name in HOOKS:
        if re.search(rf"^\| `{name}` \|", text, re.M):
            why = "is a test hook (ple_um/_testing.py), not a knob to list"
            problems.append(f"docs/OPERATING.md: {name} {why}")
    for spec in METRICS:
        if f"`{spec.name}`" not in text:
            problems.append(f"docs/OPERATING.md: the metric {spec.name} is not listed")
        if spec.alias and f"`{spec.alias}`" not in text:
            problems.append(f"docs/OPERATING.md: the seed alias {spec.alias} is not listed")
    return problems


def check_map() -> list[str]:
    """docs/DESIGN.md's map (its "## Map" section) names every module of the package (a .py, .c or .h
    file but ``__init__.py`` and ``__main__.py``) by its path or its file name, and no file name
    that no file of the package, ``tools/`` or ``tests/`` (or ``setup.py``) has."""
    with open(os.path.join(ROOT, "docs", "DESIGN.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.find("\n## Map")
    section = text[start : text.find("\n## ", start + 1)] if start >= 0 else ""
    modules = [
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "ple_um", "**", "*.*"), recursive=True)
        if path.endswith((".py", ".c", ".h")) and os.path.basename(path) not in ("__init__.py", "__main__.py")
    ]
    named = set(re.findall(r"[\w.]+\.(?:py|c|h|sh)\b", section))
    problems = [
        f"docs/DESIGN.md: the map does not name {module}"
        for module in sorted(modules)
        if os.path.basename(module) not in named and module not in section
    ]
    have = {
        os.path.basename(path)
        for folder in ("ple_um", "tools", "tests")
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*"), recursive=True)
    } | {"setup.py"}
    problems += [f"docs/DESIGN.md: the map names {name}, which no file has" for name in sorted(named - have)]
    return problems


def check_lab(paths: list[str]) -> list[str]:
    readme = os.path.join(ROOT, "docs", "lab", "README.md")
    with open(readme, encoding="utf-8") as f:
        listed = set(PATH.findall(f.read()))
    problems = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in set(PATH.findall(text)):
            if not _exists(name) and not name.startswith("docs/") and name not in listed:
                rel = os.path.relpath(path, ROOT)
                problems.append(f"{rel}: {name} is gone and not listed in docs/lab/README.md")
    return problems


def main() -> int:
    manual, lab = _docs()
    every_test = _all_tests()
    problems = [p for doc in manual for p in check_manual(doc, every_test)]
    problems += check_operating() + check_map() + check_lab(lab)
    for problem in problems:
        print(problem)
    if not problems:
        print("docs: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
