"""Streams of ple-um's own, and the per-thread capture mode: what code needs that queues CUDA work,
or allocates, while another thread (or its own stream) may be capturing a CUDA graph.

torch hands out its streams from a small pool in turn, so a pool stream can be the very stream
another thread captures on, and a copy queued there (the stats reporter's, say) breaks that
capture. And in CUDA's default (global) capture interaction mode an allocation or a synchronizing
call in any thread while a capture runs is refused and invalidates the capture; the relaxed mode is
per thread and applies to this thread's calls only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from ple_um.errors import PleUmError


class CudaStreamError(PleUmError, RuntimeError):
    """A stream could not be made, or the capture mode not changed (the CUDA error is named)."""


def ids_to_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A table's ids on its ``device`` (``MappedTable.lookup`` and ``lookup_packed``): copied there
    from another one, but not while this thread captures a CUDA graph (where one of the two is a
    CUDA device): the copy between devices cannot be captured. ValueError naming both devices."""
    if ids.device == device:
        return ids
    if "cuda" in (ids.device.type, device.type) and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"ids are on {ids.device} but the table is on {device} (cannot copy during capture)")
    return ids.to(device)


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A non-blocking stream of ple-um's own on ``device``, made through the CUDA runtime (not from
    torch's pool). It lives as long as the process."""
    from cuda.bindings import runtime as rt

    with torch.cuda.device(device):
        torch.cuda.init()
        err, handle = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    if int(err) != 0:
        raise CudaStreamError(f"cudaStreamCreateWithFlags failed: {err}")
    return torch.cuda.ExternalStream(int(handle), device=device)


@contextlib.contextmanager
def relaxed_capture_mode(on_failure: Callable[[BaseException], None] | None = None) -> Iterator[None]:
    """Run the body in CUDA's relaxed capture mode for this thread, then restore the mode it had.
    Where the mode cannot be changed (no cuda-python, a CUDA error), ``on_failure(exc)`` is told
    and the body runs in the current mode; without ``on_failure`` the failure raises."""
    old = None
    try:
        from cuda.bindings import runtime as rt

        err, mode = rt.cudaThreadExchangeStreamCaptureMode(
            rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
        )
        if int(err) != 0:
            raise CudaStreamError(f"cudaThreadExchangeStreamCaptureMode failed: {err}")
        old = mode
    except Exception as exc:
        if on_failure is None:
            raise
        on_failure(exc)
    try:
        yield
    finally:
        if old is not None:
            rt.cudaThreadExchangeStreamCaptureMode(old)


# cudaStreamIsCapturing on the legacy stream while a blocking stream captures: unknown, not an
# error to give up on (the capture is not invalidated by the query).
_CAPTURE_IMPLICIT = 906


def wait_for_streams(device: torch.device, streams: Iterable[int], pause: float = 1e-3) -> None:
    """Wait until the work queued so far on each stream in ``streams`` (raw handles on ``device``)
    has run, without joining or breaking a CUDA graph capture that another thread makes meanwhile.

    Synchronizing the device would be refused while any stream captures, and the refusal
    invalidates that capture; a stream is synchronized only while it is not capturing (a stream
    that captures now is waited for until its capture ends; the legacy stream is while a blocking
    stream captures). Run it in the relaxed capture mode of the calling thread."""
    from cuda.bindings import runtime as rt

    with torch.cuda.device(device):
        for handle in streams:
            while True:
                err, status = rt.cudaStreamIsCapturing(handle)
                if int(err) == 0 and status == rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone:
                    break
                if int(err) not in (0, _CAPTURE_IMPLICIT):
                    raise CudaStreamError(f"cudaStreamIsCapturing failed: {err}")
                time.sleep(pause)
            (err,) = rt.cudaStreamSynchronize(handle)
            if int(err) != 0:
                raise CudaStreamError(f"cudaStreamSynchronize failed: {err}")
