"""The first-read verdicts' cache: one JSON file per key in ``PLE_UM_CACHE_DIR/first-read/``.

The key names what decides whether a mode's first read works here: the device (UUID), the driver
version, the kernel release, the mode and its kind of direct read, the filesystems that hold the
table, and the ple-um version (with a digest of the kernels' source). A changed key is another
file. A verdict is trusted only when everything about it says this user wrote it for this key:
its folder is safe and it is a regular file of this user's that no one else can write, at most
``MAX_BYTES`` long (``cache_folder``: a FIFO, a link or another user's file is not even read), and
it parses as a record of this format and version, for this very key (machine, driver, kernel,
filesystem, ple-um version), with a verdict, a reason for a rejection and a time. Anything else is
ignored with a warning, never trusted: the mode's first read is checked again by its child. Writes
go to a private temporary file (0600) renamed over the old one (atomic), under the verdict's lock
(``cache_folder.locked``, ``PATH.lock``), which also makes ranks starting at once run one child
between them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import socket

from ple_um import cache_folder, envs
from ple_um.access import memory
from ple_um.access.capabilities import DeviceCapabilities
from ple_um.access.probe import direct_read
from ple_um.version import __version__

logger = logging.getLogger(__name__)

FORMAT = "ple-um first-read verdict"
FORMAT_VERSION = 1
MAX_BYTES = 64 << 10  # a verdict is a few hundred bytes: a longer file is not one


@functools.lru_cache(maxsize=1)
def ple_um_version() -> str:
    """The package version and a digest of the kernels' source: a kernel edited without a version
    change must not inherit the verdict of the kernel before it."""
    spec = importlib.util.find_spec("ple_um.kernels")  # where they are, without importing them here
    digest = hashlib.sha256()
    folder = os.path.dirname(spec.origin)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return f"{__version__}+kernels.{digest.hexdigest()[:12]}"


def _mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this process's mounts, longest mount point first; of a
    point mounted over, the mount on top (listed after the one it hides) first."""
    mounts = []
    try:
        with open(mountinfo, "rb") as f:
            for line in f:
                fields = line.split()
                if b"-" not in fields[6:]:
                    continue
                sep = fields.index(b"-", 6)
                point = memory.mount_path(fields[4])  # unescaped
                mounts.append((point, fields[sep + 1].decode(errors="replace")))
    except (OSError, IndexError):
        return []
    return sorted(reversed(mounts), key=lambda m: len(m[0]), reverse=True)  # a stable sort


def filesystems(paths) -> str:
    """The filesystem types that hold ``paths`` ("ext4", "ext4+nfs4"), "unknown" when unreadable:
    how the OS serves a fault on a file's page depends on them (page cache, tmpfs, DAX, FUSE)."""
    mounts = _mount_points()
    found = set()
    for path in paths:
        real = os.path.realpath(path)
        fs = next(
            (t for point, t in mounts if real == point or real.startswith(point.rstrip("/") + "/")),
            "unknown",
        )
        found.add(fs)
    return "+".join(sorted(found)) or "unknown"


# The fields of a verdict's key, in the order ``verdict_key`` gives them.
KEY_FIELDS = ("device", "driver", "kernel", "mode", "direct_read", "filesystem", "ple_um")


def verdict_key(caps: DeviceCapabilities, mode: str, files) -> dict:
    """What decides whether ``mode``'s first read of the table in ``files`` works here: the cache key."""
    driver = caps.driver_version
    if not driver and caps.host_is_device:
        import triton

        driver = f"Triton {triton.__version__} interpreter"
    values = (
        caps.uuid or f"{caps.name} ({caps.device}) on {socket.gethostname()}",
        driver,
        platform.release(),
        mode,
        direct_read(caps) if mode == "ats" else None,
        filesystems(files),
        ple_um_version(),
    )
    return dict(zip(KEY_FIELDS, values, strict=True))


def verdict_dir() -> str:
    return os.path.join(envs.PLE_UM_CACHE_DIR, "first-read")


def verdict_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(verdict_dir(), f"{key['mode']}-{digest}.json")


def _why_untrusted(record: object, key: dict | None) -> str | None:
    """None when ``record`` is a verdict of this format (and for ``key``, when given), else why not."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if record.get("format") != FORMAT:
        return f"not a {FORMAT} (format {record.get('format')!r})"
    if record.get("version") != FORMAT_VERSION:
        return f"format version {record.get('version')!r}; this ple-um reads version {FORMAT_VERSION}"
    found = record.get("key")
    if not isinstance(found, dict) or (key is not None and found != key):
        return "written for another key (machine, driver, kernel, filesystem or ple-um version)"
    # Without a key to match (a probe listing every verdict), its fields are checked.
    if sorted(found) != sorted(KEY_FIELDS) or not isinstance(found["mode"], str):
        return "its key is not the fields of a verdict's key"
    if not isinstance(record.get("passed"), bool):
        return "no passed/rejected verdict"
    if not record["passed"] and not isinstance(record.get("reason"), str):
        return "a rejection without a reason"
    if not isinstance(record.get("checked_at"), str):
        return "no checked_at time"
    return None


def read_verdict(path: str, key: dict | None) -> dict | None:
    """The verdict stored at ``path`` for ``key`` (None: any key), or None when there is none or it
    cannot be trusted (then with a warning)."""
    try:
        cache_folder.check_folder(os.path.dirname(path))
        record = json.loads(cache_folder.read_private(path, MAX_BYTES).decode("utf-8"))
        why = _why_untrusted(record, key)
    except FileNotFoundError:
        return None
    except cache_folder.UnsafeCacheError as exc:
        why = f"not trusted: {exc}"
    except (OSError, ValueError) as exc:
        why = f"unreadable: {exc}"
    if why is None:
        return record
    logger.warning("ple-um: ignoring the first-read verdict file %s: %s", path, why)
    return None


def write_verdict(path: str, record: dict) -> bool:
    """Store ``record`` at ``path`` atomically (``cache_folder.write_private``): a reader sees the
    old file or the new one, never a part. False (and a warning) when the folder cannot be written
    or is not safe (``cache_folder``): the verdict then holds for this process only."""
    try:
        cache_folder.write_private(path, json.dumps(record, indent=1, sort_keys=True).encode())
        return True
    except OSError as exc:
        logger.warning("ple-um: cannot cache the first-read verdict in %s: %s", path, exc)
        return False


def machine_key(key: dict) -> dict:
    """A key without the table's filesystem: what names this machine, driver, kernel and ple-um."""
    return {k: v for k, v in key.items() if k != "filesystem"}
