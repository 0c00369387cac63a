"""Finding the C row copy's library, and trusting it: the one the install built, else one compiled
at run time into the cache folder.

``find`` tries, in turn:

1. the library the install built into the package (``_rowcopy*.so`` beside this file: ``setup.py``),
   trusted as the package's own code is, used when its interface checks out (``declare``: the
   caller's declarations of the functions and structs) and it was built from the source beside it
   (``ple_source_digest()``; an editable install edited since is stale);
2. ``PLE_UM_CACHE_DIR/native/rowcopy-<digest>.so``, the digest naming the source, the compiler, the
   flags and the machine: loaded only when the folders are safe and the file is a regular file of
   this user's that no one else can write (``cache_folder``), whose bytes hash to what its build
   recorded beside it (``.sha256``); the bytes checked are the bytes loaded (from a private copy
   of a name of its own), so the file cannot be swapped between the check and the load. A file
   that fails a check is built again, with a warning;
3. a build now (``native_build.command`` without ``-Werror``), into a private temporary folder in
   that folder, renamed into place once its hash is recorded, and loaded like a checked one.

A library that lacks a symbol or reports another interface is not used (never an AttributeError):
the next way is tried, and when none works the caller gets None and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ple_um import cache_folder
from ple_um.lookup import native_build

logger = logging.getLogger(__name__)

MAX_LIBRARY_BYTES = 64 << 20  # the row copy is well under 1 MiB: a bigger file is not one
Declare = Callable[[ctypes.CDLL], "str | None"]


def packaged_library() -> Path | None:
    """The library the install built into the package, or None (an install without a compiler, a
    source tree never built)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / ("_rowcopy" + suffix)
        if path.is_file():
            return path
    return None


def _unload(lib: ctypes.CDLL) -> None:
    import _ctypes

    with contextlib.suppress(OSError, AttributeError):
        _ctypes.dlclose(lib._handle)


def open_library(
    path: str, declare: Declare, *, name: str | None = None, defines: tuple[str, ...] = ()
) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``path`` once ``declare`` found its interface as declared and its source
    digest is that of the source beside this module built with ``defines`` (a test's build: the
    ``-D`` flags it was compiled with; none for every other); else None and why not (it is
    unloaded)."""
    name = name or path
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return None, f"loading {name} failed: {exc}"
    try:
        digest_fn = lib.ple_source_digest
    except AttributeError:
        _unload(lib)
        return None, f"{name} has no ple_source_digest(): not a row copy of this interface"
    digest_fn.argtypes, digest_fn.restype = [], ctypes.c_char_p
    digest = (digest_fn() or b"").decode(errors="replace")
    why = declare(lib)
    try:
        here = native_build.source_digest(defines=defines)
    except OSError:  # an install that ships no C files: the library is the only row copy there is
        here = digest
    if why is None and digest != here:
        why = f"built from other source (digest {digest}, the source here is {here})"
    if why is not None:
        _unload(lib)
        return None, f"{name}: {why}"
    return lib, None


def _open_bytes(data: bytes, target: Path, declare: Declare) -> tuple[ctypes.CDLL | None, str | None]:
    """The library of ``data`` (the bytes of ``target``, checked by the caller), loaded from a
    private copy of its own name in ``target``'s folder, removed once loaded: what is loaded is what
    was checked, and a name the process loaded before (dlopen answers a known name with the library
    loaded under it) is never asked for again. Messages name ``target``."""
    fd, copy = tempfile.mkstemp(dir=target.parent, prefix=".load-", suffix=".so")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return open_library(copy, declare, name=str(target))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(copy)


def _load_checked(target: Path, declare: Declare) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``target`` once checked (module docstring, 2), or None and why it was refused
    (None and None: there is none)."""
    try:
        data = cache_folder.read_private(str(target), MAX_LIBRARY_BYTES)
        recorded = cache_folder.read_private(f"{target}.sha256", 64).decode(errors="replace").strip()
    except FileNotFoundError as exc:
        if exc.filename == str(target):
            return None, None
        return None, f"{target} has no {target.name}.sha256 recorded by its build"
    except cache_folder.UnsafeCacheError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"{target}: {exc}"
    if hashlib.sha256(data).hexdigest() != recorded:
        return None, f"{target}'s bytes are not those its build recorded in {target.name}.sha256"
    return _open_bytes(data, target, declare)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _target(cache_dir: str, cc: str) -> Path:
    digest = hashlib.sha256(native_build.source_digest().encode())
    digest.update(
        " ".join((cc, *native_build.COMPILE_FLAGS, *native_build.LINK_FLAGS, platform.machine())).encode()
    )
    return Path(cache_dir) / "native" / f"rowcopy-{digest.hexdigest()[:16]}.so"


def _build(cache_dir: str, cc: str, declare: Declare) -> tuple[ctypes.CDLL | None, str]:
    target = _target(cache_dir, cc)
    try:
        cache_folder.private_folder(cache_dir)
        cache_folder.private_folder(str(target.parent))
    except cache_folder.UnsafeCacheError as exc:
        return None, f"not compiling the row copy into an unsafe folder: {exc}"
    what = f"C row copy ({target.name}, built with {cc})"
    lib, refused = _load_checked(target, declare)
    if lib is not None:
        return lib, what
    if refused is not None:
        logger.warning("ple-um: not loading the row copy found in the cache: %s; compiling it again", refused)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run(
                native_build.command(cc, str(built), werror=False),
                capture_output=True,
                text=True,
                timeout=300,  # a loaded machine compiles slowly: the fallback is worth the wait
            )
            if done.returncode != 0:
                return None, f"compiling {native_build.NATIVE} with {cc} failed: {done.stderr.strip()[-500:]}"
            data = cache_folder.read_private(str(built), MAX_LIBRARY_BYTES)
            cache_folder.write_private(f"{target}.sha256", hashlib.sha256(data).hexdigest().encode())
            os.replace(built, target)  # atomic: another process may build the same file at once
        lib, why = _open_bytes(data, target, declare)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"compiling {native_build.NATIVE} with {cc} into {target.parent} failed: {exc}"
    return (lib, what) if lib is not None else (None, why)


def find(cache_dir: str, declare: Declare) -> tuple[ctypes.CDLL | None, str]:
    """The row copy's library and what it is, or None and why none could be had."""
    packaged = packaged_library()
    if packaged is not None:
        lib, why = open_library(str(packaged), declare)
        if lib is not None:
            return lib, f"C row copy (installed: {packaged.name})"
        logger.warning("ple-um: not using the installed row copy (%s); compiling it at run time", why)
    cc = _compiler()
    if not cc:
        return None, "no C compiler found ($CC, cc, gcc)" + ("" if packaged else " and no installed row copy")
    try:
        return _build(cache_dir, cc, declare)
    except OSError as exc:  # the C files are not there to compile (an install that ships none)
        return None, f"cannot compile the row copy: {exc}"
