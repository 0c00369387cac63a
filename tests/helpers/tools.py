"""The repository's tools/ loaded as modules, for tests that call their functions and main()."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

TOOLS = pathlib.Path(__file__).parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/NAME.py`` imported as the module ``NAME``."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
