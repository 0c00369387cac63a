"""The host path's ring of job structs (``host.cuda.StreamState.slot``): a slot is handed out once its
host node has run; while the caller waits, a stream in error or a node that never ran ends the wait
with HostNodeError instead of a hang. The CUDA driver's answers are injected (a CPU machine has no
driver); the job's flag is cleared by the real C row copy, as a host node clears it. Also the
dispatcher's signals check at open (``host.signal_check``), the context calls a thread new to
CUDA makes first, a stream's eager buffers whose growth fails, and a host path whose build fails
releasing what it had made."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch
from helpers.rowcopy_jobs import make_job, reader_threads

from ple_um.lookup import rowcopy
from ple_um.lookup.host import cuda, misses, signal_check
from ple_um.lookup.host.cuda import RING, HostNodeError, StreamState, check_pending
from ple_um.lookup.host.file_reads import FileReader
from ple_um.lookup.host.gather import HostGather
from ple_um.mapping import MappedShards


class _InjectedDriver:
    """Answers cuStreamQuery with the codes given (0 done, 600 not ready, else an error)."""

    def __init__(self, codes):
        self.codes = codes

    def query(self, stream: int) -> int:
        return self.codes[stream]

    def error_name(self, rc: int) -> str:
        return f"error {rc}"


def test_a_free_slot_comes_at_once_and_the_ring_turns():
    state = StreamState(0)
    seen = [state.slot(_InjectedDriver({0: 0})) for _ in range(RING + 1)]
    assert seen[:RING] == list(range(RING)) and seen[RING] == 0


@pytest.mark.parametrize("call", ["slot", "close"])
@pytest.mark.parametrize(
    "codes,match",
    [({0: 600, 7: 719}, "error 719"), ({0: 0}, "never ran")],
    ids=["stream failed", "never ran"],
)
def test_a_node_that_cannot_run_ends_the_wait(monkeypatch, codes, match, call):
    """A wait for a ring job's row copy, for the next slot (``slot``) or at the release of the
    stream's state (``close``), ends with HostNodeError where the job cannot run any more (its
    stream failed, or it is idle with the job still pending) instead of a hang: the release then
    keeps the mappings, and the events with them."""
    state = StreamState(0)
    if 7 in codes:
        state.side = type("side", (), {"cuda_stream": 7})()
    job = state.ring[0 if call == "slot" else RING - 1]
    job.busy = 1
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            getattr(state, call)(_InjectedDriver(codes))
        except BaseException as exc:  # noqa: BLE001 - judged below
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(30)
    hung = waiter.is_alive()
    job.busy = 0  # a hung waiter, had there been one, now returns
    assert not hung, "the wait did not end: a hang"
    assert len(raised) == 1 and isinstance(raised[0], HostNodeError) and match in str(raised[0])


def test_a_dispatched_job_whose_done_word_is_set_is_not_a_node_that_never_ran(monkeypatch):
    """The dispatcher sets a job's done word, then clears its busy flag: a stream idle in between
    is not an error; with the word not yet set (or no word: a host node) it is."""
    import numpy as np

    words = np.zeros(16, dtype=np.uint32)
    job = rowcopy.LookupStruct()
    job.busy, job.seq, job.done = 1, 5, words.ctypes.data
    idle = _InjectedDriver({0: 0})
    words[0] = 5
    check_pending(idle, [0], job)  # signalled: no error
    words[0] = 4
    with pytest.raises(HostNodeError, match="never ran"):
        check_pending(idle, [0], job)
    job.done = None
    with pytest.raises(HostNodeError, match="never ran"):
        check_pending(idle, [0], job)


def test_the_wait_ends_when_the_node_runs(make_checkpoint, tmp_path):
    lib, why = rowcopy.load(str(tmp_path))
    assert lib is not None, why
    layout = make_checkpoint(num_rows=100, row_dim=16, dtype="fp8", shards=2)
    with MappedShards(layout) as mapping:
        rows, counts = rowcopy.Rows(mapping), rowcopy.Counts()
        state = StreamState(0)
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


class _EventsDriver:
    """Events as the driver makes them: each one made is live until destroyed (destroying one
    twice, or one never made, fails the test); ``fail_record``: cuEventRecord refuses."""

    def __init__(self, *, fail_record: bool = False) -> None:
        self.live: set[int] = set()
        self.made, self.fail_record = 0, fail_record

    def event(self) -> int:
        self.made += 1
        self.live.add(self.made)
        return self.made

    def record(self, event: int, stream: int) -> None:
        assert event in self.live
        if self.fail_record:
            raise HostNodeError("cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE (400) (injected)")

    def done(self, event: int) -> bool:
        return False  # the stream is still reading the outgrown buffers

    def destroy(self, event: int) -> None:
        self.live.remove(event)


def _eager_buffers(capacity: int) -> cuda.PinnedBuffers:
    """A stream's eager buffers of ``capacity`` ids as they stand after earlier lookups (what they
    hold does not matter here; pinned memory needs a GPU)."""
    bufs = cuda.PinnedBuffers.__new__(cuda.PinnedBuffers)
    bufs.capacity = capacity
    return bufs


def test_buffers_a_failed_allocation_outgrew_stay_the_streams_alone():
    """A lookup that outgrows its stream's eager buffers, whose pinned allocation fails (no GPU
    here; a GPU cannot pin 128 TiB either): the old buffers stay the stream's, and are not retired
    as well, however often it fails; no event is made for them, and those made are destroyed once."""
    state, driver = StreamState(0), _EventsDriver()
    old = state.buffers = _eager_buffers(1024)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            state.buffers_for(1 << 44, False, (16,), driver)
        assert state.buffers is old
        assert all(b is not old for _, b in state.retired), "the stream's buffers are retired as well"
    assert state.buffers_for(1000, False, (16,), driver) is old  # what fits takes them, as before
    state.close(driver)
    assert driver.live == set() and state.retired == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_an_event_whose_record_fails_is_destroyed_and_the_buffers_stay():
    """Where the event that guards the outgrown buffers cannot be recorded, it is destroyed, and
    the old buffers stay the stream's (the new ones, never handed out, are let go)."""
    state, driver = StreamState(0), _EventsDriver(fail_record=True)
    old = state.buffers = _eager_buffers(4)
    with pytest.raises(HostNodeError, match="injected"):
        state.buffers_for(8, False, (16,), driver)
    assert state.buffers is old and state.retired == [] and driver.live == set() and driver.made == 1


class _SignalsDriver:
    """The open-time check's driver calls, answered as a device would: a write of a value to an
    address lands in the (here: unpinned) word; a waiting stream is done once its word reaches the
    value, where the device sees the host's writes (``sees_host``) or the device itself wrote it
    (``sees_device``)."""

    def __init__(self, word: torch.Tensor, *, sees_host: bool, sees_device: bool = True) -> None:
        self.word, self.sees_host, self.sees_device = word, sees_host, sees_device
        self.waits: dict[int, tuple[int, int]] = {}
        self.device_wrote: set[int] = set()

    def device_pointer(self, host: int) -> int:
        return host

    def write_value(self, stream: int, address: int, value: int) -> None:
        ctypes.c_uint32.from_address(address).value = value
        self.device_wrote.add(address)

    def wait_value(self, stream: int, address: int, value: int) -> None:
        self.waits[stream] = (address, value)

    def query(self, stream: int) -> int:
        if stream not in self.waits:
            return 0
        address, value = self.waits[stream]
        seen = self.sees_host or (self.sees_device and address in self.device_wrote)
        return 0 if seen and ctypes.c_uint32.from_address(address).value >= value else 600

    def error_name(self, rc: int) -> str:
        return f"error {rc}"


@pytest.mark.parametrize(
    "sees_host,sees_device,reason",
    [
        (True, True, ""),
        (False, True, "never saw this thread's write"),
        (False, False, "stays blocked"),
    ],
    ids=["works", "released by the device's write", "blocked for good"],
)
def test_the_signals_check_never_leaves_a_stream_waiting_unsaid(monkeypatch, sees_host, sees_device, reason):
    """The open-time check of the dispatcher's signals: where the device does not see the host's
    write, the stream is released by the device's own write on another stream and the dispatcher is
    not used (the word kept: the stream may still read it); where nothing releases it, HostNodeError
    says so and how to run instead, rather than a hang at the next synchronize."""
    monkeypatch.setattr(signal_check, "_stranded", [])
    word = torch.zeros(cuda.SIGNAL_BYTES // 4, dtype=torch.int32)
    driver = _SignalsDriver(word, sees_host=sees_host, sees_device=sees_device)
    if reason == "stays blocked":
        with pytest.raises(cuda.StreamBlockedError, match="stays blocked.*PLE_UM_DISPATCHER=0"):
            signal_check.round_trip(driver, 1, word, lambda: 2, timeout=0.2)
    else:
        said = signal_check.round_trip(driver, 1, word, lambda: 2, timeout=0.2)
        assert reason in said and (said == "") == (reason == "")
    assert int(word[0]) == 7 and int(word[cuda.DONE_AT // 4]) == 1
    assert (signal_check._stranded == [word]) == (not sees_host)


class _RefusingDriver(_SignalsDriver):
    """A device that sees neither write, and whose release write on the other stream is refused."""

    def write_value(self, stream: int, address: int, value: int) -> None:
        if stream == 2:
            raise HostNodeError("cuStreamWriteValue32 failed: CUDA_ERROR_ILLEGAL_STATE (401) (injected)")
        super().write_value(stream, address, value)


@pytest.mark.parametrize("refused", ["write", "stream"])
def test_a_stream_whose_release_fails_is_blocked_not_a_reason_for_host_nodes(monkeypatch, refused):
    """Where the stream did not see the host's write and the device's own write that would release
    it cannot be made (the other stream or the write refused), the stream still waits: the check
    raises StreamBlockedError, naming the failure, rather than answer 'use host nodes' and leave the
    next synchronize of the device to hang."""
    monkeypatch.setattr(signal_check, "_stranded", [])
    word = torch.zeros(cuda.SIGNAL_BYTES // 4, dtype=torch.int32)
    driver = _RefusingDriver(word, sees_host=False, sees_device=False)

    def other_stream() -> int:
        if refused == "stream":
            raise RuntimeError("CUDA error: out of memory (injected)")
        return 2

    said = r"release it failed \(.*injected\)\): it stays blocked"
    with pytest.raises(cuda.StreamBlockedError, match=said):
        signal_check.round_trip(driver, 1, word, other_stream, timeout=0.2)
    assert driver.query(1) == 600  # still waiting
    assert signal_check._stranded == [word]  # the word it waits on is kept


def test_a_device_left_blocked_is_said_again_at_every_open_and_not_checked_twice(monkeypatch):
    calls = []

    def check(driver, device):
        calls.append(device)
        raise cuda.StreamBlockedError("a stream ... stays blocked")

    monkeypatch.setattr(signal_check, "_verdicts", {})
    monkeypatch.setattr(signal_check, "_check", check)
    device = torch.device("cuda", 3)
    for _ in range(2):
        with pytest.raises(HostNodeError, match="stays blocked"):
            signal_check.signals_work(object(), device)
    assert calls == [device]


class _ContextLib:
    """libcuda's context calls for a thread with no context current: each records itself and
    returns its code from ``codes`` (0 success); the device and context it makes are handed out as
    the driver does, through the pointer given."""

    def __init__(self, codes):
        self.codes, self.calls = codes, []

    def _answer(self, name, *args):
        self.calls.append((name, *args))
        return self.codes.get(name, 0)

    def cuCtxGetCurrent(self, current):
        return 0  # no context current: ``current`` stays NULL

    def cuDeviceGet(self, device, index):
        device._obj.value = 40 + index
        return self._answer("cuDeviceGet", index)

    def cuDevicePrimaryCtxRetain(self, context, device):
        context._obj.value = 0x1000 + device.value
        return self._answer("cuDevicePrimaryCtxRetain", device.value)

    def cuCtxSetCurrent(self, context):
        return self._answer("cuCtxSetCurrent", context.value)

    def cuGetErrorName(self, rc, name):
        return 0


@pytest.mark.parametrize("failing", [None, "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"])
def test_a_context_is_made_current_one_checked_call_at_a_time(failing):
    driver = cuda.CudaDriver.__new__(cuda.CudaDriver)  # no libcuda here: its calls injected
    driver.lib, driver._thread = _ContextLib({failing: 999}), threading.local()
    made = [("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 42), ("cuCtxSetCurrent", 0x1000 + 42)]
    if failing is None:
        driver.ensure_context(2)
        driver.ensure_context(2)  # once per thread
        assert driver.lib.calls == made
        return
    with pytest.raises(HostNodeError, match="device 2's context current failed.*999"):
        driver.ensure_context(2)
    stop = [name for name, *_ in made].index(failing) + 1
    assert driver.lib.calls == made[:stop]  # no call after the one that failed
    with pytest.raises(HostNodeError):  # not taken as done: the next lookup tries again
        driver.ensure_context(2)


def test_a_host_path_whose_build_fails_releases_its_files_and_reader_threads(
    make_checkpoint, tmp_path, monkeypatch
):
    """A host path for a CUDA device whose driver fails once its row cache and reader of misses are
    planned (injected here, the same on any machine; on a GPU the signals check's StreamBlockedError
    comes at that point too) raises, and leaves neither a descriptor of the files open nor a hold
    on the reader threads: a reader made after it, once closed, stops them."""
    lib, why = rowcopy.load(str(tmp_path))
    assert lib is not None, why
    layout = make_checkpoint(num_rows=300, row_dim=32, dtype="fp8", shards=3, files=2)
    monkeypatch.setenv("PLE_UM_ROW_CACHE", "64KiB")
    monkeypatch.setenv("PLE_UM_FILE_READS", "threads")

    def no_driver() -> cuda.CudaDriver:
        raise HostNodeError("cuInit failed: CUDA_ERROR_NO_DEVICE (100) (injected)")

    monkeypatch.setattr(cuda.CudaDriver, "get", staticmethod(no_driver))
    with MappedShards(layout) as mapping:
        plan = misses.plan(lib, mapping, None, spills=True)
        assert plan.slots > 0 and plan.reads, plan
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(HostNodeError, match="injected"):
                HostGather(
                    lib,
                    mapping,
                    torch.device("cuda", 0),
                    storage=layout.dtype,
                    scale=None,
                    threads=2,
                    misses=plan,
                )
        assert len(os.listdir("/proc/self/fd")) == fds
        # The reader threads run while a reader holds them (its misses read by them here) and stop
        # once the last holder lets go: a hold a failed build kept would keep them running.
        reader = FileReader(mapping, strategy="threads", direct=False, depth=4, lib=lib)
        try:
            ids, counts = torch.arange(layout.num_rows), rowcopy.Counts()
            out = torch.empty((ids.numel(), layout.row_bytes), dtype=torch.uint8)
            job = make_job([rowcopy.Rows(mapping, reader=reader)], ids, [out], counts)
            lib.ple_lookup_run(ctypes.addressof(job))
            assert counts.read()["file_reads"] == layout.num_rows and reader_threads() > 0
        finally:
            reader.close()
        assert reader_threads() == 0


@pytest.mark.parametrize("direct", [False, True], ids=["plain", "O_DIRECT asked"])
def test_a_file_the_reader_cannot_reopen_is_named_and_no_descriptor_is_left(make_checkpoint, direct):
    """A reader of misses whose reopen of a mapped file fails (out of descriptors: RLIMIT_NOFILE
    lowered to let one more open through) raises OSError naming that file and a tensor it holds,
    not the /proc/self/fd path it reopens through, and closes the descriptor it had opened."""
    import errno
    import resource

    layout = make_checkpoint(num_rows=300, row_dim=32, dtype="fp8", shards=3, files=3)
    with MappedShards(layout) as mapping:
        regions = list(dict.fromkeys(owned.region for owned in mapping.owned.values()))
        assert len(regions) >= 2
        second = mapping.regions[regions[1]]
        held = [layout.shards[i].tensor for i, o in mapping.owned.items() if o.region == regions[1]]
        fds = sorted(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.open("/dev/null", os.O_RDONLY)
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + 1, hard))  # one descriptor more
        try:
            with pytest.raises(OSError) as raised:
                FileReader(mapping, strategy="threads", direct=direct, depth=4)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        exc = raised.value
        assert exc.errno == errno.EMFILE and exc.filename == second.path, exc
        assert f"reopening the mapped file of {held[0]} for the reads of misses failed" in str(exc)
        assert "/proc/self/fd" not in str(exc)
        assert sorted(os.listdir("/proc/self/fd")) == fds
