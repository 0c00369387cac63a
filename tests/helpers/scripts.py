"""The repository's scripts/ loaded as modules, for tests that call their functions and main()."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` imported as the module ``NAME``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
