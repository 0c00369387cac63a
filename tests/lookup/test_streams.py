"""The wait a table's release makes for its lookups' streams (``streams.wait_for_streams``), with the
CUDA runtime's answers injected (the machine has no GPU; tests/gpu/test_gpu_dropped.py runs it
against a real capture): a stream is synchronized only once it is not capturing, the legacy
stream's "unknown while a blocking stream captures" answer is waited out, and any other error is a
``CudaStreamError`` naming the call."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
from cuda.bindings import runtime as rt

from ple_um.lookup import streams
from ple_um.lookup.streams import CudaStreamError, wait_for_streams

NONE = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
ACTIVE = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive


class FakeRuntime:
    """``cudaStreamIsCapturing`` answers from a script per stream; every call is logged."""

    cudaStreamCaptureStatus = rt.cudaStreamCaptureStatus

    def __init__(self, answers: dict[int, list[tuple[int, object]]], sync_error: int = 0) -> None:
        self.answers = {handle: list(script) for handle, script in answers.items()}
        self.sync_error = sync_error
        self.calls: list[tuple[str, int]] = []

    def cudaStreamIsCapturing(self, handle):
        self.calls.append(("is_capturing", handle))
        script = self.answers[handle]
        return script.pop(0) if len(script) > 1 else script[0]

    def cudaStreamSynchronize(self, handle):
        self.calls.append(("synchronize", handle))
        return (self.sync_error,)


@pytest.fixture
def runtime(monkeypatch):
    """Install a FakeRuntime as ``cuda.bindings.runtime`` for the function's import, and no device."""

    def install(fake: FakeRuntime) -> FakeRuntime:
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = fake
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", fake)
        monkeypatch.setattr(streams.torch.cuda, "device", lambda device: contextlib.nullcontext())
        return fake

    return install


def test_each_stream_is_synchronized_only_once_its_capture_ended(runtime):
    fake = runtime(FakeRuntime({7: [(0, ACTIVE), (0, ACTIVE), (0, NONE)], 9: [(0, NONE)]}))
    wait_for_streams("cuda:0", [7, 9], pause=0)
    assert fake.calls == [
        ("is_capturing", 7),
        ("is_capturing", 7),
        ("is_capturing", 7),
        ("synchronize", 7),
        ("is_capturing", 9),
        ("synchronize", 9),
    ]


def test_the_legacy_streams_unknown_answer_is_waited_out(runtime):
    implicit = streams._CAPTURE_IMPLICIT  # a blocking stream captures: the legacy stream's status is unknown
    fake = runtime(FakeRuntime({0: [(implicit, None), (implicit, None), (0, NONE)]}))
    wait_for_streams("cuda:0", [0], pause=0)
    assert fake.calls[-1] == ("synchronize", 0) and fake.calls.count(("is_capturing", 0)) == 3


@pytest.mark.parametrize(
    "fake, call",
    [
        (FakeRuntime({3: [(400, None)]}), "cudaStreamIsCapturing"),  # an invalid handle
        (FakeRuntime({3: [(0, NONE)]}, sync_error=700), "cudaStreamSynchronize"),  # a device fault
    ],
)
def test_a_failing_call_is_a_typed_error_naming_it(runtime, fake, call):
    runtime(fake)
    with pytest.raises(CudaStreamError, match=call):
        wait_for_streams("cuda:0", [3], pause=0)
    assert ("synchronize", 3) not in fake.calls or call == "cudaStreamSynchronize"
