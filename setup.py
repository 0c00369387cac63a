"""The C row copy built at install time (pyproject.toml holds everything else).

``ple_um/lookup/native/*.c`` become one shared library inside the package,
``ple_um/lookup/_rowcopy*.so``, which ``ple_um/lookup/rowcopy.py`` loads with ctypes (it is not a
Python module: no Python header is used). Files, flags and the source digest come from
``ple_um/lookup/native_build.py``, which the run-time fallback uses too. The extension is optional:
where no compiler works the install goes on, and the row copy is compiled at the first open instead
(or the cpu mode reads synchronously). Warnings are errors here, as in CI.
"""

import importlib.util
import pathlib

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("native_build", HERE / "ple_um" / "lookup" / "native_build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)

rowcopy = Extension(
    native_build.EXTENSION,
    sources=[str(path.relative_to(HERE)) for path in native_build.sources()],
    depends=[str((native_build.NATIVE / name).relative_to(HERE)) for name in native_build.HEADER_NAMES],
    extra_compile_args=[*native_build.COMPILE_FLAGS, "-Werror", native_build.digest_define()],
    extra_link_args=list(native_build.LINK_FLAGS),
    optional=True,
)

setup(ext_modules=[rowcopy])
