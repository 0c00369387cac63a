"""Whether a device's streams and ple-um's dispatcher thread can signal each other, checked once
per device (``signals_work``) with the rest of what a host path needs of the device
(``prepare_device``: when a host path is built, or at the open of a table whose fit check may
build one later on its own thread): a stream writes a ready word in pinned
memory and waits on a done word this process writes afterwards (``cuda.py`` says how eager lookups
use the words). Where they do not work, eager lookups are host nodes and the table's ``row_reads``
says why. A stream that never sees the host's write would wait for ever, and so would every later
synchronize of the device; so the check releases such a stream by the device's own write on
another stream, and where even that fails it raises ``StreamBlockedError`` rather than leave a hang
behind.
"""

from __future__ import annotations

import logging
import time

import torch

from ple_um import envs
from ple_um.lookup.decode import e2m1_values
from ple_um.lookup.host.cuda import (
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    DONE_AT,
    SIGNAL_BYTES,
    CudaDriver,
    StreamBlockedError,
)
from ple_um.lookup.streams import own_stream

log = logging.getLogger(__name__)

# Seconds the open-time check waits for a stream to see a write.
SIGNAL_TIMEOUT = 5.0
# The check's verdict per device index: "" (works), a reason (use host nodes), or the error.
_verdicts: dict[int, str | BaseException] = {}
# Pinned words a blocked stream may still wait on: never freed (freed memory could be handed out
# and written again, releasing or corrupting the wait).
_stranded: list[torch.Tensor] = []


def prepare_device(lib, device: torch.device) -> tuple[CudaDriver, str | None]:
    """What every host path on CUDA ``device`` needs, made once per device and process, with
    ``device`` current: the driver's binding, the E2M1 values on the device (before any capture
    needs them), the dispatcher thread and the check that the device's streams and it can signal
    each other. The driver, and None where eager lookups go through the dispatcher, else why they
    are host nodes. Only the first call for a device makes CUDA calls (an allocation, a pinned
    buffer, a stream, the signals' round trip): ``build_paths`` makes it on the opening thread
    wherever a fit check may build the table's first host path later, on its own thread, where
    another thread may be capturing a CUDA graph (such calls there would break the capture) and
    another device may be current."""
    driver = CudaDriver.get()
    with torch.cuda.device(device):
        e2m1_values(device)
        if not envs.PLE_UM_DISPATCHER:
            return driver, "PLE_UM_DISPATCHER=0"
        if not lib.ple_dispatch_start():
            return driver, "the dispatcher thread could not be started"
        return driver, signals_work(driver, device)


def signals_work(driver: CudaDriver, device: torch.device) -> str | None:
    """None when stream memory operations work on ``device`` as the dispatcher uses them (checked
    once per device), else why not. Raises StreamBlockedError, at every call, for a device whose
    check left a stream blocked."""
    known = _verdicts.get(device.index)
    if known is None:
        try:
            known = _check(driver, device)
        except StreamBlockedError as exc:
            known = exc
        _verdicts[device.index] = known
    if isinstance(known, BaseException):
        raise known
    return known or None


def _check(driver: CudaDriver, device: torch.device) -> str:
    if not driver.mem_ops:
        return "this driver has no cuStreamWriteValue32_v2 / cuStreamWaitValue32_v2"
    try:
        driver.ensure_context(device.index)
        word = torch.zeros(SIGNAL_BYTES // 4, dtype=torch.int32, pin_memory=True)  # one slot's words
        stream = own_stream(device).cuda_stream
    except Exception as exc:  # noqa: BLE001 - any failure means: use host nodes
        return f"stream memory operations failed: {exc}"
    return round_trip(driver, stream, word, lambda: own_stream(device).cuda_stream)


def round_trip(driver, stream: int, word: torch.Tensor, other_stream, timeout: float | None = None) -> str:
    """The check itself, on ``stream`` with one slot's words in ``word`` (pinned): the stream
    writes the ready word, then waits for the done word, which this thread sets. A stream that
    never sees the write still waits: the word is kept for the life of the process, and the same
    write is made from the device on ``other_stream()`` to release it. Where even that does not
    release it, or the release itself fails (the other stream or its write refused), StreamBlockedError
    (logged first). "" when it works, else why not."""
    timeout = SIGNAL_TIMEOUT if timeout is None else timeout
    done = DONE_AT // 4
    rc, released, release_failed = None, False, ""
    try:
        address = driver.device_pointer(word.data_ptr())
        driver.write_value(stream, address, 7)
        driver.wait_value(stream, address + DONE_AT, 1)
        time.sleep(1e-3)
        word[done] = 1  # as the dispatcher signals a lookup done
        rc = _settle(driver, stream, timeout)
        if rc == CUDA_ERROR_NOT_READY:
            _stranded.append(word)
            driver.write_value(other_stream(), address + DONE_AT, 1)
            released = _settle(driver, stream, timeout) == CUDA_SUCCESS
    except Exception as exc:  # noqa: BLE001 - any failure means: use host nodes
        if rc != CUDA_ERROR_NOT_READY:  # no stream left waiting
            return f"stream memory operations failed: {exc}"
        release_failed = f"{type(exc).__name__}: {exc}"  # the stream still waits: not released
    if rc == CUDA_ERROR_NOT_READY and not released:
        seen = (
            f"did not see this thread's write within {timeout:g} s, and the device's own write to "
            f"release it failed ({release_failed})"
            if release_failed
            else f"saw neither this thread's write nor the device's own within {2 * timeout:g} s"
        )
        why = (
            f"a stream waiting on pinned memory {seen}: it stays blocked, so any synchronize of this "
            "device will hang. Run with PLE_UM_DISPATCHER=0 (eager lookups as host nodes; this "
            "check is then not made)"
        )
        log.error("ple-um: %s", why)
        raise StreamBlockedError(why)
    if rc == CUDA_ERROR_NOT_READY:
        return "a stream waiting on pinned memory never saw this thread's write"
    if rc != CUDA_SUCCESS:
        return f"a stream waiting on pinned memory: {driver.error_name(rc)} after this thread's write"
    if int(word[0]) != 7:
        return f"a stream's write of pinned memory did not arrive (read {int(word[0])})"
    return ""


def _settle(driver, stream: int, timeout: float) -> int:
    """The stream's query code once it is no longer busy, or CUDA_ERROR_NOT_READY after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (rc := driver.query(stream)) == CUDA_ERROR_NOT_READY and time.monotonic() < deadline:
        time.sleep(1e-4)
    return rc
