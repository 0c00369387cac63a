"""How the C row copy (``native/``) is compiled: its files, its flags, the digest of its source.

One list for both builds: ``setup.py`` compiles the files at install time into one shared library
inside the package (``ple_um/lookup/_rowcopy*.so``, an optional extension: an install without a
compiler still installs), and ``rowcopy.py`` compiles them at run time into the cache folder only
where that library is missing, stale or refused. This module imports nothing outside the standard
library, so that ``setup.py`` can read it before anything is installed.

The flags harden the library as distributions build theirs (stack protector, ``_FORTIFY_SOURCE``,
full RELRO, a stack that cannot execute) and turn on the warnings; at install time and in CI
(``tests/native``) warnings are errors. The run-time fallback compiles without ``-Werror``: a newer
compiler's new warning must not cost a user the row copy. The digest of the source, and of the
``-D`` defines a test's build adds, is compiled into the library (``ple_source_digest()``), so a
library built from other source (an editable install edited since) or as a test's variant
(``-DPLE_TEST_PUBLISH_FIRST``) is known at load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

NATIVE = Path(__file__).with_name("native")
SOURCE_NAMES = ("rowcopy.c", "pool.c", "rowcache.c", "reader.c", "uring.c", "abi.c")
HEADER_NAMES = ("rowcopy.h", "rowcache.h", "reader.h", "sanitize.h")
# The extension's name: setuptools adds the interpreter's suffix (_rowcopy.cpython-311-...so).
EXTENSION = "ple_um.lookup._rowcopy"
WARNINGS = ("-Wall", "-Wextra", "-Wconversion")
HARDENING = ("-fstack-protector-strong", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2", "-fPIC", "-pthread")
COMPILE_FLAGS = ("-O3", *WARNINGS, *HARDENING)
LINK_FLAGS = ("-shared", "-pthread", "-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack")


def sources() -> list[Path]:
    return [NATIVE / name for name in SOURCE_NAMES]


def source_digest(defines: tuple[str, ...] = ()) -> str:
    """The digest of the headers and sources (names and bytes) in ``native/`` and of ``defines`` (the
    ``-D`` flags a build adds): what a library built from them reports as ``ple_source_digest()``."""
    digest = hashlib.sha256()
    for name in (*HEADER_NAMES, *SOURCE_NAMES):
        digest.update(name.encode() + b"\0" + (NATIVE / name).read_bytes())
    for define in defines:
        digest.update(define.encode() + b"\0")
    return digest.hexdigest()[:32]


def digest_define(defines: tuple[str, ...] = ()) -> str:
    return f'-DPLE_SOURCE_DIGEST="{source_digest(defines)}"'


def command(cc: str, output: str, *, werror: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """The command that compiles and links every source into the library ``output``; the ``-D``
    flags of ``extra`` go into its digest, so that only ``open_library`` told them accepts it."""
    digest = digest_define(defines=tuple(flag for flag in extra if flag.startswith("-D")))
    flags = (*COMPILE_FLAGS, *(("-Werror",) if werror else ()), digest, *extra)
    return [cc, *flags, *LINK_FLAGS, "-o", output, *map(str, sources())]
