"""The package's shape, checked: folders follow the data flow and a module imports only from its own
layer or the layers below it (no import circle), and no file, class or function outgrows the size a
newcomer can read (docs/DESIGN.md, "Map").

Imports are read from the source (``ast``), module-level and inside functions alike: a lazy import
upwards is still a dependency upwards. Imports under ``if TYPE_CHECKING:`` (annotations only) are not.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Layers, lowest first: checkpoint -> mapping -> access mode -> kernels -> lookup path -> op and
# table -> open path -> what users run (the package's front, the CLI, the bench, the engines).
LAYERS = (
    (
        "ple_um.errors",
        "ple_um.units",
        "ple_um.version",
        "ple_um.cache_folder",
        "ple_um.knob_values",
        "ple_um.ticker",
    ),
    ("ple_um.envs", "ple_um._testing"),
    ("ple_um.checkpoint",),
    ("ple_um.synthetic", "ple_um.synthetic_engram", "ple_um.mapping", "ple_um.residency"),
    ("ple_um.access",),
    ("ple_um.kernels",),
    ("ple_um.lookup",),
    ("ple_um.ops", "ple_um.metrics", "ple_um.verify", "ple_um.dropped"),
    ("ple_um.table",),
    ("ple_um.opening",),
    (
        "ple_um",
        "ple_um.first_read_child",
        "ple_um.operating",
        "ple_um.bench",
        "ple_um.cli",
        "ple_um.vllm",
        "ple_um.sglang",
    ),
)
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 300, 80
# Where a limit does not hold, and why.
EXCEPTIONS: dict[str, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    base = ROOT / "ple_um"
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(["ple_um", *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The ple_um modules ``name`` imports (``from ple_um import envs`` is ple_um.envs; a name that
    is not a module is the package it comes from)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    typing_only = {  # imports under ``if TYPE_CHECKING:`` are for annotations, never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{name} is in no layer of LAYERS: add it where it belongs"
    return best[0]


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in GRAPH.items()
        for target in sorted(targets)
        if _layer(target) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    state: dict[str, int] = {}
    circles = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                circles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [])
    assert not circles, "\n".join(circles)


def _sources():
    for path in sorted([*MODULES.values(), *(ROOT / "ple_um").rglob("*.c")]):
        yield str(path.relative_to(ROOT)), path


@pytest.mark.parametrize("where,path", list(_sources()), ids=lambda v: v if isinstance(v, str) else "")
def test_sizes(where, path):
    if where in EXCEPTIONS:
        return
    text = path.read_text()
    too_big = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        too_big.append(f"{where}: {len(text.splitlines())} lines (at most {MAX_FILE_LINES})")
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_big.append(f"{where}: class {node.name} {lines} lines (at most {MAX_CLASS_LINES})")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                too_big.append(f"{where}: {node.name}() {lines} lines (at most {MAX_FUNCTION_LINES})")
    assert not too_big, "\n".join(too_big)


def test_the_checker_sees_an_upward_import_and_a_circle():
    """The checks above can fail: a module of a low layer importing the table is upward, and two
    modules importing each other are a circle."""
    assert _layer("ple_um.mapping") < _layer("ple_um.table")
    saved = dict(GRAPH)
    try:
        GRAPH["ple_um.mapping"] = GRAPH["ple_um.mapping"] | {"ple_um.table"}
        with pytest.raises(AssertionError, match="ple_um.mapping .* imports ple_um.table"):
            test_no_module_imports_from_a_layer_above_it()
        with pytest.raises(AssertionError, match="ple_um.mapping -> .*ple_um.mapping"):
            test_no_import_circle()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
