"""ple_um.file_lock: one holder at a time, a bounded wait, and a reason where it is not held."""

from __future__ import annotations

import threading
import time

from ple_um import file_lock


def test_one_holder_at_a_time_and_a_bounded_wait(tmp_path):
    path = str(tmp_path / "deep" / "folder" / "x.lock")  # the folder is made
    with file_lock.held(path, 1.0) as why:
        assert why is None
        found = []

        def second():
            t0 = time.monotonic()
            with file_lock.held(path, 0.3) as other:
                found.append((other, time.monotonic() - t0))

        worker = threading.Thread(target=second)
        worker.start()
        worker.join(10)
        ((other, waited),) = found
        assert other == f"{path} still held by another process after 0 s" and 0.3 <= waited < 5
    with file_lock.held(path, 0.0) as why:  # released with the block
        assert why is None


def test_the_lock_waited_for_is_taken_once_released(tmp_path):
    path = str(tmp_path / "x.lock")
    taken = []

    def waiter():
        with file_lock.held(path, 10.0) as why:
            taken.append((why, time.monotonic()))

    with file_lock.held(path, 1.0):
        worker = threading.Thread(target=waiter)
        worker.start()
        time.sleep(0.3)
        released = time.monotonic()
    worker.join(10)
    ((why, at),) = taken
    assert why is None and at >= released


def test_a_file_that_cannot_be_made_is_said(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with file_lock.held(str(blocker / "x.lock"), 1.0) as why:
        assert why.startswith(f"cannot open {blocker / 'x.lock'}: ")
