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

The verdict is cached per machine (``verdict_cache``): later opens read it and start no child; a
changed key (device, driver, kernel, mode, filesystem, ple-um version) runs the child again;
``ple-um probe DIR --recheck`` ignores the cache. A timeout is not cached: a loaded machine or a
cold disk can cause one, so the next open tries again.

The child is the program ``ple_um.first_read_child``, started as a fresh interpreter (this module
never imports it); it prints its stage and its verdict on stdout behind ``MARK``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ple_um import cache_folder, envs
from ple_um.access import verdict_cache
from ple_um.access.capabilities import DeviceCapabilities
from ple_um.access.probe import ProbeReport
from ple_um.checkpoint import ShardLayout
from ple_um.errors import PleUmError

logger = logging.getLogger(__name__)

SAMPLE_WIDTH = 8  # rows per sample window
# Seconds a killed child's output is waited for (``_last_words``).
REAP_SECONDS = 5.0
MARK = "ple-um-first-read"  # prefix of the child's stage and result lines on stdout
# The child's program: a fresh interpreter (not ``-m``, which would run this module a second time
# beside the copy that importing ple_um loads).
_CHILD = "import sys; from ple_um.first_read_child import main; sys.exit(main(sys.argv[1:]))"
STAGES = {
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
        return asdict(self)


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


def _last_words(proc: subprocess.Popen) -> tuple[str, str]:
    """The output of a child just killed, waited for at most ``REAP_SECONDS``: a child stuck in the
    driver (uninterruptible, the kill pending) or a process it started elsewhere keeps its pipes
    open, and the open must not wait on it: its pipes are then closed, with what it said so far."""
    try:
        return proc.communicate(timeout=REAP_SECONDS)
    except subprocess.TimeoutExpired as exc:
        for pipe in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
        said = (exc.stdout, exc.stderr)  # bytes so far, even from a text-mode Popen
        return tuple(s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in said)


def _kill(proc: subprocess.Popen) -> tuple[str, str]:
    """Kill the child and what it started (its process group: a session of its own, out of the
    terminal's reach), and take its last words (``_last_words``)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return _last_words(proc)


def run_child(
    layout: ShardLayout, windows: list, mode: str, device: torch.device, timeout: float
) -> ChildOutcome:
    """Start a fresh Python process on the sample (``_CHILD``) and read its verdict."""
    spec = {
        "directory": layout.directory,
        "layer": layout.layer,
        "engram": layout.is_mxfp8,
        "mode": mode,
        "device": str(device),
        "windows": [list(w) for w in windows],
    }
    env = {
        **os.environ,
        # The child is the check: it does not check itself, and does nothing a server does at open
        # beyond the mode's own set-up (no bulk calibration, self-test, prewarm, metrics).
        "PLE_UM_FIRST_READ_CHECK": "off",
        "PLE_UM_SELF_TEST_ROWS": "0",
        "PLE_UM_BULK_ROWS": "0",
        "PLE_UM_PREWARM": "0",
        "PLE_UM_PROMETHEUS": "0",
        "PLE_UM_STATS_SEC": "0",
        "PLE_UM_METRICS_SEC": "0",
        "PYTHONUNBUFFERED": "1",
    }
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
        out, err = _kill(proc)
    except BaseException:  # an interrupt (Ctrl-C reaches the open, not the child): the child goes too
        _kill(proc)
        raise
    seconds = time.perf_counter() - t0
    stage, result = "import", None
    for line in out.splitlines():
        if line.startswith(MARK + " stage "):
            stage = line.split()[-1]
        elif line.startswith(MARK + " result "):
            with contextlib.suppress(ValueError):
                result = json.loads(line[len(MARK + " result ") :])
    doing = STAGES.get(stage, stage)
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
    key = verdict_cache.verdict_key(caps, mode, layout.files)
    path = verdict_cache.verdict_path(key)

    def cached() -> FirstReadVerdict | None:
        record = None if recheck else verdict_cache.read_verdict(path, key)
        return None if record is None else _from_record(mode, record, path, "cache")

    if (found := cached()) is not None:
        return found
    timeout = envs.PLE_UM_FIRST_READ_TIMEOUT
    # Ranks that start at once run one child: the others wait for its verdict (or go on without the lock).
    with cache_folder.locked(path + ".lock", timeout + 30) as why:
        if why is not None:
            logger.warning("ple-um: the first-read verdict's lock is not held (%s); going on without it", why)
        elif (found := cached()) is not None:  # another process ran the child while this one waited
            return found
        windows = sample_windows(layout, rows)
        logger.info("ple-um: checking the %s mode's first read in a child process (rows %s)", mode, windows)
        outcome = run_child(layout, windows, mode, device, timeout)
        record = {
            "format": verdict_cache.FORMAT,
            "version": verdict_cache.FORMAT_VERSION,
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
        stored = outcome.cacheable and verdict_cache.write_verdict(path, record)
    verdict = _from_record(mode, record, path if stored else None, "child")
    (logger.info if outcome.passed else logger.warning)("ple-um: %s", verdict.describe())
    return verdict


def cached_verdicts(report: ProbeReport, caps: DeviceCapabilities) -> list[FirstReadVerdict]:
    """For a probe without a table: the verdicts cached on this machine for ``report.mode`` (one per
    filesystem that held a table), or why none is needed, or that none was made yet."""
    skip = _not_needed(report.mode, None)
    if skip is not None:
        return [FirstReadVerdict(mode=report.mode, status="not needed", reason=skip)]
    found = []
    here = verdict_cache.machine_key(verdict_cache.verdict_key(caps, report.mode, ()))
    folder = verdict_cache.verdict_dir()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            if not (name.startswith(report.mode + "-") and name.endswith(".json")):
                continue
            path = os.path.join(folder, name)
            record = verdict_cache.read_verdict(path, None)
            if record is None:
                continue
            key = record["key"]
            # The filesystem is the table's: any one counts here; the rest must be this machine's.
            if path != verdict_cache.verdict_path(key):
                logger.warning(
                    "ple-um: ignoring the first-read verdict file %s: its name is not its key's", path
                )
                continue
            if verdict_cache.machine_key(key) == here:
                found.append(_from_record(report.mode, record, path, "cache"))
    if found:
        return found
    why = "the first open of a table runs the child, or `ple-um probe DIR` does"
    return [
        FirstReadVerdict(mode=report.mode, status="not checked", reason=why, direct_read=report.direct_read)
    ]
