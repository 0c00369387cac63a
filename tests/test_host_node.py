"""The host path's ring of job structs (``host_node._Stream.slot``): a slot is handed out once its
host node has run; while the caller waits, a stream in error or a node that never ran ends the wait
with HostNodeError instead of a hang. The CUDA driver's answers are injected (a CPU machine has no
driver); the job's flag is cleared by the real C row copy, as a host node clears it."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from ple_um.lookup import rowcopy
from ple_um.lookup.host_node import RING, HostNodeError, _Driver, _Stream
from ple_um.mapping import MappedShards


class _InjectedDriver:
    """Answers cuStreamQuery with the codes given (0 done, 600 not ready, else an error)."""

    def __init__(self, codes):
        self.lib = type("lib", (), {"cuStreamQuery": lambda _self, stream: codes[stream]})()

    error_name = _Driver.error_name
    check_pending = _Driver.check_pending


def _error_names(monkeypatch):
    monkeypatch.setattr(_InjectedDriver, "error_name", lambda self, rc: f"error {rc}", raising=False)


def test_a_free_slot_comes_at_once_and_the_ring_turns():
    state = _Stream(0)
    seen = [state.slot(_InjectedDriver({0: 0})) for _ in range(RING + 1)]
    assert seen[:RING] == list(range(RING)) and seen[RING] == 0


@pytest.mark.parametrize(
    "codes,match",
    [({0: 600, 7: 719}, "error 719"), ({0: 0}, "never ran")],
    ids=["stream failed", "never ran"],
)
def test_a_node_that_cannot_run_ends_the_wait(monkeypatch, codes, match):
    _error_names(monkeypatch)
    state = _Stream(0)
    if 7 in codes:
        state.side = type("side", (), {"cuda_stream": 7})()
    state.ring[0].busy = 1
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            state.slot(_InjectedDriver(codes))
        except BaseException as exc:  # noqa: BLE001 - judged below
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "the wait did not end: a hang"
    state.ring[0].busy = 0  # (a hung waiter, had there been one, would now return)
    assert len(raised) == 1 and isinstance(raised[0], HostNodeError) and match in str(raised[0])


def test_a_dispatched_job_whose_done_word_is_set_is_not_a_node_that_never_ran(monkeypatch):
    """The dispatcher sets a job's done word, then clears its busy flag: a stream idle in between
    is not an error; with the word not yet set (or no word: a host node) it is."""
    import numpy as np

    _error_names(monkeypatch)
    words = np.zeros(16, dtype=np.uint32)
    job = rowcopy.LookupStruct()
    job.busy, job.seq, job.done = 1, 5, words.ctypes.data
    idle = _InjectedDriver({0: 0})
    words[0] = 5
    idle.check_pending([0], job)  # signalled: no error
    words[0] = 4
    with pytest.raises(HostNodeError, match="never ran"):
        idle.check_pending([0], job)
    job.done = None
    with pytest.raises(HostNodeError, match="never ran"):
        idle.check_pending([0], job)


def test_the_wait_ends_when_the_node_runs(make_checkpoint, tmp_path):
    lib, why = rowcopy.load(str(tmp_path))
    assert lib is not None, why
    layout = make_checkpoint(num_rows=100, row_dim=16, dtype="fp8", shards=2)
    with MappedShards(layout) as mapping:
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        state = _Stream(0)
        job = state.ring[0]
        ids = torch.arange(10)
        out = torch.empty((10, layout.row_bytes), dtype=torch.uint8)
        job.tables[0], job.dst[0], job.ids, job.n = rows.address, out.data_ptr(), ids.data_ptr(), 10
        job.counts, job.threads, job.inline_rows, job.busy = counts.address, 1, 2048, 1
        # The node runs a little later, on another thread, as the driver's thread would run it.
        runner = threading.Timer(0.2, lib.ple_lookup_run, args=(ctypes.addressof(job),))
        runner.start()
        assert state.slot(_InjectedDriver({0: 600})) == 0
        runner.join()
        assert counts.read()["rows"] == 10 and job.busy == 0
