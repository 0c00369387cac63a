"""The first read of a mapping by the GPU, made in a child process; its verdict cached per machine.

Why: in the ``ats`` mode the kernel dereferences the mapping's host addresses, and the OS (ATS) or
the driver (HMM) serves the GPU's faults on the file's pages. Should that fault on a platform never
seen (a driver, kernel or IOMMU setting), the CUDA context of the process that read is poisoned
before the probe can fall back, and a server dies at start-up instead of serving from
``registered`` or ``cpu``. So before a guarded mode (``PLE_UM_FIRST_READ_CHECK``, default ``ats``)
is used for the first time on a machine, a child process started afresh (a new interpreter, never
a fork of a CUDA process) opens a few rows of the real table in that mode, gathers them through the
kernel and compares them with the files. A crash (signal), an error, a non-zero exit, wrong rows or
no answer within ``PLE_UM_FIRST_READ_TIMEOUT`` rejects the mode with that reason; ``open_table``
then goes on to the next mode, as it does for a failed self-test. (vLLM guards CUDA peer access the
same way: tested once in a child, the verdict cached.)

The verdict is cached in ``PLE_UM_CACHE_DIR/first-read/``, one JSON file per key: the device
(UUID), the driver version, the kernel release, the mode and its kind of direct read, the
filesystems that hold the table, and the ple-um version (with a digest of the kernels' source).
Later opens read it and start no child; a changed key is another file, so it runs the child again;
``ple-um probe DIR --recheck`` ignores the cache. A file that does not parse, is of another format
or version, or was written for another key is ignored with a warning, never trusted. Writes go to a
temporary file renamed over the old one (atomic), under an exclusive lock that also makes ranks
starting at once run one child, not one each. A timeout is not cached: a loaded machine or a cold
disk can cause one, so the next open tries again.

The child (``_child_main``) opens the sample through ``ple_um.table.open_table``, the public API, as
any user of the table would: that import is the one this layer makes upwards, and only in the
child.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ple_um import envs
from ple_um.access.capabilities import DeviceCapabilities, read_capabilities, resolve_device
from ple_um.access.probe import ProbeReport, decide, direct_read, pin_budget, requested_mode
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.errors import ModeUnavailableError, PleUmError

logger = logging.getLogger(__name__)

FORMAT = "ple-um first-read verdict"
FORMAT_VERSION = 1
SAMPLE_WIDTH = 8  # rows per sample window
_MARK = "ple-um-first-read"  # prefix of the child's stage and result lines on stdout
# The child's program: a fresh interpreter (not ``-m``, which would run this module a second time
# beside the copy that importing ple_um loads).
_CHILD = "import sys; from ple_um.access.first_read import main; sys.exit(main(sys.argv[1:]))"
_STAGES = {
    "import": "importing ple-um",
    "open": "opening the sample",
    "gather": "gathering rows through the kernel",
    "compare": "comparing the rows with the file",
}


class FirstReadRejected(PleUmError, RuntimeError):
    """The first read of a mode in a child process failed (now, or as the cached verdict says)."""

    def __init__(self, verdict: FirstReadVerdict) -> None:
        super().__init__(verdict.rejection())
        self.verdict = verdict


@dataclass
class FirstReadVerdict:
    """Whether ``mode``'s first read passed in a child, and where that answer came from.

    ``status``: "passed", "rejected", "not needed" (the mode is not guarded here) or "not checked"
    (a probe without a table, when the cache holds nothing for this machine). ``source``: "child"
    (a fresh run), "cache" (the file at ``path``), or None."""

    mode: str
    status: str
    source: str | None = None
    reason: str | None = None
    direct_read: str | None = None
    path: str | None = None
    checked_at: str | None = None
    child_seconds: float | None = None
    key: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status != "rejected"

    def _what(self) -> str:
        return f"{self.mode} ({self.direct_read})" if self.direct_read else self.mode

    def _origin(self) -> str:
        if self.source == "child":
            kept = f"; cached in {self.path}" if self.path else "; not cached"
            return f"a fresh child run, {self.child_seconds:.2f} s{kept}"
        return f"cache file {self.path}, checked {self.checked_at}"

    def rejection(self) -> str:
        again = "" if self.source == "child" else "; `ple-um probe DIR --recheck` runs it again"
        return f"first read in a child process failed: {self.reason} ({self._origin()}{again})"

    def describe(self) -> str:
        if self.status == "not needed":
            return f"first read: not needed ({self.reason})"
        if self.status == "not checked":
            return f"first read: {self._what()} not checked on this machine yet ({self.reason})"
        if self.status == "rejected":
            return f"first read: {self._what()} REJECTED: {self.reason} ({self._origin()})"
        fs = self.key.get("filesystem")
        where = f" on {fs}" if fs and self.source == "cache" and self.key else ""
        return f"first read: {self._what()} passed in a child process{where} ({self._origin()})"

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "status": self.status,
            "source": self.source,
            "reason": self.reason,
            "direct_read": self.direct_read,
            "path": self.path,
            "checked_at": self.checked_at,
            "child_seconds": self.child_seconds,
            "key": dict(self.key),
        }


# -- the key and the cache file ----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def ple_um_version() -> str:
    """The package version and a digest of the kernels' source: a kernel edited without a version
    change must not inherit the verdict of the kernel before it."""
    from ple_um import __version__, kernels

    digest = hashlib.sha256()
    folder = os.path.dirname(kernels.__file__)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return f"{__version__}+kernels.{digest.hexdigest()[:12]}"


def _mount_points() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this process's mounts, longest mount point first."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields[6:]:
                    continue
                sep = fields.index("-", 6)
                # mountinfo escapes blanks and backslashes in paths as octal (\040).
                point = fields[4].encode().decode("unicode_escape")
                mounts.append((point, fields[sep + 1]))
    except (OSError, IndexError, UnicodeDecodeError):
        return []
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


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


def verdict_key(caps: DeviceCapabilities, mode: str, files) -> dict:
    """What decides whether ``mode``'s first read of the table in ``files`` works here: the cache key."""
    driver = caps.driver_version
    if not driver and caps.host_is_device:
        import triton

        driver = f"Triton {triton.__version__} interpreter"
    return {
        "device": caps.uuid or f"{caps.name} ({caps.device}) on {socket.gethostname()}",
        "driver": driver,
        "kernel": platform.release(),
        "mode": mode,
        "direct_read": direct_read(caps) if mode == "ats" else None,
        "filesystem": filesystems(files),
        "ple_um": ple_um_version(),
    }


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
    if not isinstance(record.get("key"), dict) or (key is not None and record["key"] != key):
        return "written for another key (machine, driver, kernel, filesystem or ple-um version)"
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
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ple-um: ignoring the first-read verdict file %s: unreadable: %s", path, exc)
        return None
    why = _why_untrusted(record, key)
    if why is not None:
        logger.warning("ple-um: ignoring the first-read verdict file %s: %s", path, why)
        return None
    return record


def write_verdict(path: str, record: dict) -> bool:
    """Store ``record`` at ``path`` atomically (a temporary file in the same folder, renamed over the
    old one): a reader sees the old file or the new one, never a part. False (and a warning) when
    the folder cannot be written: the verdict then holds for this process only."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the verdict from the machine's other users
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.warning("ple-um: cannot cache the first-read verdict in %s: %s", path, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


@contextlib.contextmanager
def _exclusive(path: str, wait: float) -> Iterator[bool]:
    """Hold the lock of ``path``'s verdict (flock on ``path.lock``) for at most ``wait`` seconds of
    waiting: ranks that start at once run one child. Yields whether the lock is held; on a folder
    that cannot be written, or after the wait, the caller goes on without it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    held = False
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("ple-um: %s.lock still held after %.0f s; going on without it", path, wait)
                    break
                time.sleep(0.05)
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# -- the sample and the child ----------------------------------------------------------------------
def sample_windows(layout: ShardLayout, rows: tuple[int, int], width: int = SAMPLE_WIDTH) -> list:
    """A few windows of ``width`` rows inside ``rows``: its first rows, a shard boundary near the
    middle (one between two files where there is one), its last rows; overlaps merged."""
    start, end = rows
    if end <= start:
        return []
    S = layout.rows_per_shard
    windows = [(start, min(end, start + width)), (max(start, end - width), end)]
    boundaries = [k * S for k in range(1, layout.parts) if start < k * S < end]
    if boundaries:
        between_files = [
            b for b in boundaries if layout.shards[b // S - 1].path != layout.shards[b // S].path
        ]
        pick = between_files or boundaries
        b = pick[len(pick) // 2]
        windows.append((max(start, b - width // 2), min(end, b + width // 2)))
    merged: list[list[int]] = []
    for lo, hi in sorted(windows):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [tuple(w) for w in merged]


@dataclass
class ChildOutcome:
    passed: bool
    reason: str | None
    seconds: float
    cacheable: bool  # False for a timeout: not a property of the machine
    rows: int = 0  # ids whose rows the child compared with the file


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def run_child(
    layout: ShardLayout, windows: list, mode: str, device: torch.device, timeout: float
) -> ChildOutcome:
    """Start a fresh Python process on the sample (``_CHILD``) and read its verdict."""
    spec = {
        "directory": layout.directory,
        "layer": layout.layer,
        "mode": mode,
        "device": str(device),
        "windows": [list(w) for w in windows],
    }
    env = dict(os.environ)
    env.update(
        {
            # The child is the check: it does not check itself, and does nothing a server does at
            # open beyond the mode's own set-up (no bulk calibration, self-test, prewarm, metrics).
            "PLE_UM_FIRST_READ_CHECK": "off",
            "PLE_UM_SELF_TEST_ROWS": "0",
            "PLE_UM_BULK_ROWS": "0",
            "PLE_UM_PREWARM": "0",
            "PLE_UM_PROMETHEUS": "0",
            "PLE_UM_STATS_SEC": "0",
            "PLE_UM_METRICS_SEC": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("PLE_UM_MODE", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills it and what it started
        )
    except OSError as exc:
        return ChildOutcome(False, f"cannot start the child: {exc}", 0.0, cacheable=False)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    stage, result = "import", None
    for line in out.splitlines():
        if line.startswith(_MARK + " stage "):
            stage = line.split()[-1]
        elif line.startswith(_MARK + " result "):
            with contextlib.suppress(ValueError):
                result = json.loads(line[len(_MARK + " result ") :])
    doing = _STAGES.get(stage, stage)
    stderr = _tail(err)
    said = f"; stderr: {stderr}" if stderr else ""
    if timed_out:
        why = f"no answer within {timeout:g} s (PLE_UM_FIRST_READ_TIMEOUT) while {doing}; killed{said}"
        return ChildOutcome(False, why, seconds, cacheable=False)
    rc = proc.returncode
    if isinstance(result, dict) and isinstance(result.get("passed"), bool) and rc in (0, 1):
        if result["passed"] and rc == 0:
            return ChildOutcome(True, None, seconds, cacheable=True, rows=int(result.get("rows", 0)))
        return ChildOutcome(False, str(result.get("reason")), seconds, cacheable=True)
    if rc < 0:
        why = f"the child was killed by {_signal_name(-rc)} while {doing}{said}"
    else:
        why = f"the child exited with status {rc} while {doing}{said}"
    return ChildOutcome(False, why, seconds, cacheable=True)


# -- the check an open makes -----------------------------------------------------------------------
def _not_needed(mode: str, rows: tuple[int, int] | None) -> str | None:
    """Why ``mode`` needs no child here, or None when its first read is to be checked."""
    if mode not in envs.FIRST_READ_MODES:
        return f"the {mode} mode has the GPU dereference no address of the mapping"
    if mode not in envs.PLE_UM_FIRST_READ_CHECK:
        return f"{mode} is not in PLE_UM_FIRST_READ_CHECK"
    if rows is not None and rows[1] <= rows[0]:
        return "this process owns no rows of the table"
    return None


def _from_record(mode: str, record: dict, path: str, source: str) -> FirstReadVerdict:
    return FirstReadVerdict(
        mode=mode,
        status="passed" if record["passed"] else "rejected",
        source=source,
        reason=record.get("reason"),
        direct_read=record["key"].get("direct_read"),
        path=path,
        checked_at=record["checked_at"],
        child_seconds=record.get("child_seconds"),
        key=record["key"],
    )


def first_read_verdict(
    mode: str,
    caps: DeviceCapabilities,
    layout: ShardLayout,
    rows: tuple[int, int],
    device: torch.device,
    *,
    recheck: bool = False,
) -> FirstReadVerdict:
    """The verdict on ``mode``'s first read of ``layout`` here: not needed, from the cache, or from a
    child run now (then cached)."""
    skip = _not_needed(mode, rows)
    if skip is not None:
        return FirstReadVerdict(mode=mode, status="not needed", reason=skip)
    key = verdict_key(caps, mode, layout.files)
    path = verdict_path(key)
    if not recheck:
        record = read_verdict(path, key)
        if record is not None:
            return _from_record(mode, record, path, "cache")
    timeout = envs.PLE_UM_FIRST_READ_TIMEOUT
    with _exclusive(path, timeout + 30) as held:
        if held and not recheck:
            # Another process may have run the child while this one waited for the lock.
            record = read_verdict(path, key)
            if record is not None:
                return _from_record(mode, record, path, "cache")
        windows = sample_windows(layout, rows)
        logger.info("ple-um: checking the %s mode's first read in a child process (rows %s)", mode, windows)
        outcome = run_child(layout, windows, mode, device, timeout)
        record = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "key": key,
            "passed": outcome.passed,
            "reason": outcome.reason,
            "checked_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "child_seconds": round(outcome.seconds, 3),
            "sample": {
                "directory": layout.directory,
                "layer": layout.layer,
                "windows": windows,
                "rows_compared": outcome.rows,
            },
        }
        stored = outcome.cacheable and write_verdict(path, record)
    verdict = _from_record(mode, record, path if stored else None, "child")
    (logger.info if outcome.passed else logger.warning)("ple-um: %s", verdict.describe())
    return verdict


def check(
    report: ProbeReport,
    caps: DeviceCapabilities,
    layout: ShardLayout,
    rows: tuple[int, int],
    device: torch.device,
    *,
    recheck: bool = False,
) -> FirstReadVerdict:
    """The hook ``open_table`` calls before it builds ``report.mode``: sets ``report.first_read`` and
    raises FirstReadRejected when the mode's first read failed in a child (now or before)."""
    verdict = first_read_verdict(report.mode, caps, layout, rows, device, recheck=recheck)
    report.first_read = [verdict]
    if not verdict.passed:
        raise FirstReadRejected(verdict)
    return verdict


def probe_table(
    path,
    *,
    layer: int | None = None,
    device=None,
    mode: str = "auto",
    recheck: bool = False,
) -> ProbeReport:
    """The probe for the table at ``path``: the mode ``open_table`` would try to build there, after
    the first-read checks it makes (from the cache, or in a child; ``recheck`` ignores the cache).
    The in-process self-test is not made: that needs the mode built."""
    forced = requested_mode(mode)
    layout = read_layout(os.fspath(path), layer)
    dev = resolve_device(device)
    caps = read_capabilities(dev)
    budget = pin_budget()
    rejected: dict[str, str] = {}
    while True:
        report = decide(caps, mode=forced, table_bytes=layout.nbytes, budget=budget, exclude=rejected)
        try:
            check(report, caps, layout, (0, layout.num_rows), dev, recheck=recheck)
        except FirstReadRejected as exc:
            why = f"{type(exc).__name__}: {exc}"
            if forced != "auto":
                raise ModeUnavailableError(report.mode, why) from None
            rejected[report.mode] = why
            continue
        return report


def cached_verdicts(report: ProbeReport, caps: DeviceCapabilities) -> list[FirstReadVerdict]:
    """For a probe without a table: the verdicts cached on this machine for ``report.mode`` (one per
    filesystem that held a table), or why none is needed, or that none was made yet."""
    skip = _not_needed(report.mode, None)
    if skip is not None:
        return [FirstReadVerdict(mode=report.mode, status="not needed", reason=skip)]
    found = []
    here = _machine_key(verdict_key(caps, report.mode, ()))
    folder = verdict_dir()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            if not (name.startswith(report.mode + "-") and name.endswith(".json")):
                continue
            path = os.path.join(folder, name)
            record = read_verdict(path, None)
            if record is None:
                continue
            key = record["key"]
            # The filesystem is the table's: any one counts here; the rest must be this machine's.
            if path != verdict_path(key):
                logger.warning(
                    "ple-um: ignoring the first-read verdict file %s: its name is not its key's", path
                )
                continue
            if _machine_key(key) == here:
                found.append(_from_record(report.mode, record, path, "cache"))
    if found:
        return found
    why = "the first open of a table runs the child, or `ple-um probe DIR` does"
    return [
        FirstReadVerdict(mode=report.mode, status="not checked", reason=why, direct_read=report.direct_read)
    ]


def _machine_key(key: dict) -> dict:
    """A key without the table's filesystem: what names this machine, driver, kernel and ple-um."""
    return {k: v for k, v in key.items() if k != "filesystem"}


# -- the child -------------------------------------------------------------------------------------
_now = {"stage": "import"}  # the child's stage, for the reason of an error it reports


def _say(kind: str, text: str) -> None:
    if kind == "stage":
        _now["stage"] = text
    print(f"{_MARK} {kind} {text}", flush=True)


def _file_rows(layout: ShardLayout, ids, window: tuple[int, int]):
    """The rows of ``ids`` read with pread from the files (zeros outside ``window``): the reference."""
    import numpy as np

    out = np.zeros((len(ids), layout.row_bytes), dtype=np.uint8)
    S = layout.rows_per_shard
    fds: dict[str, int] = {}
    try:
        for k, i in enumerate(ids):
            if not window[0] <= i < window[1]:
                continue
            spec = layout.shards[i // S]
            if spec.path not in fds:
                fds[spec.path] = os.open(spec.path, os.O_RDONLY)
            data = os.pread(
                fds[spec.path], layout.row_bytes, spec.offset + (i - i // S * S) * layout.row_bytes
            )
            out[k] = np.frombuffer(data, dtype=np.uint8)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _evict(layout: ShardLayout, window: tuple[int, int]) -> None:
    """Ask the kernel to drop the window's pages from the page cache (POSIX_FADV_DONTNEED: pages
    another process maps stay), so that the GPU's first touch reads them from the file, as a
    serving process's does. A hint: nothing depends on it."""
    S, rb = layout.rows_per_shard, layout.row_bytes
    for spec in layout.shards:
        lo = max(window[0], spec.index * S)
        hi = min(window[1], spec.index * S + spec.rows)
        if hi <= lo:
            continue
        with contextlib.suppress(OSError):
            fd = os.open(spec.path, os.O_RDONLY)
            try:
                os.posix_fadvise(
                    fd, spec.offset + (lo - spec.index * S) * rb, (hi - lo) * rb, os.POSIX_FADV_DONTNEED
                )
            finally:
                os.close(fd)


def _inject(fault: str | None) -> None:
    """The test hook (PLE_UM_FIRST_READ_FAULT), while the child reads through the kernel."""
    if fault == "segv":
        import ctypes

        ctypes.string_at(0)  # a read of address 0: SIGSEGV
    elif fault == "abort":
        os.abort()
    elif fault == "hang":
        while True:
            time.sleep(60)
    elif fault == "exit":
        os._exit(3)
    elif fault == "error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def _child_main(spec: dict) -> int:
    _say("stage", "import")
    import numpy as np

    from ple_um.table import open_table  # the public API, as any user opens a table

    fault = envs.PLE_UM_FIRST_READ_FAULT
    layout = read_layout(spec["directory"], spec["layer"])
    parts = [layout, layout.scale_layout()] if layout.is_nvfp4 else [layout]
    rows = 0
    for lo, hi in spec["windows"]:
        for part in parts:
            _evict(part, (lo, hi))
        _say("stage", "open")
        with open_table(
            layout.directory, layer=layout.layer, rows=(lo, hi), mode=spec["mode"], device=spec["device"]
        ) as table:
            # The window's rows and two on each side, which the table does not own: zeros.
            ids_np = np.arange(max(0, lo - 2), min(layout.num_rows, hi + 2), dtype=np.int64)
            ids = torch.from_numpy(ids_np).to(table.device)
            _say("stage", "gather")
            _inject(fault)
            if layout.is_nvfp4:
                packed, scales = table.lookup_packed(ids)
                got = torch.cat([packed.view(torch.uint8), scales.view(torch.uint8)], dim=1)
            else:
                got = table.lookup(ids).view(torch.uint8).reshape(ids_np.size, -1)
            if table.device.type == "cuda":
                torch.cuda.synchronize(table.device)  # a fault in the kernel surfaces here
            got = got.cpu().numpy().copy()
        _say("stage", "compare")
        if fault == "corrupt":
            got[got.shape[0] // 2, 0] ^= 0x5A
        expect = np.concatenate([_file_rows(part, ids_np.tolist(), (lo, hi)) for part in parts], axis=1)
        if not np.array_equal(got, expect):
            bad = np.flatnonzero((got != expect).any(axis=1))
            reason = (
                f"{bad.size} of {ids_np.size} sample rows read through the kernel differ from the file "
                f"(first: row {int(ids_np[bad[0]])})"
            )
            _say("result", json.dumps({"passed": False, "reason": reason}))
            return 0
        rows += ids_np.size
    _say("result", json.dumps({"passed": True, "rows": rows}))
    return 0


def main(argv: list[str]) -> int:
    """The child's entry (``_CHILD SPEC``): one first read; the verdict on stdout. Exit 0 with a
    verdict, 1 with an error reported as a rejection."""
    spec = json.loads(argv[0])
    try:
        return _child_main(spec)
    except Exception as exc:  # noqa: BLE001 - any error in the mode is its verdict
        doing = _STAGES.get(_now["stage"], _now["stage"])
        _say("result", json.dumps({"passed": False, "reason": f"while {doing}: {type(exc).__name__}: {exc}"}))
        return 1
