"""``DeadlineLock``: the shared synthesizer serves the piece needed soonest, not the one that came first."""

from __future__ import annotations

import threading
import time

import pytest

from app.stages.scheduling import DeadlineLock


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    ends = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < ends, "timed out"
        time.sleep(0.001)


def _serve(deadlines: list[float | None]) -> list[float | None]:
    """Queue a waiter per deadline (in that order) behind a holder; the order in which they got the lock."""
    lock, served, holding, release = DeadlineLock(), [], threading.Event(), threading.Event()

    def holder() -> None:
        with lock.hold(0.0):
            holding.set()
            release.wait()

    def waiter(deadline: float | None) -> None:
        with lock.hold(deadline):
            served.append(deadline)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(5)
    for queued, deadline in enumerate(deadlines, start=1):
        thread = threading.Thread(target=waiter, args=(deadline,))
        thread.start()
        threads.append(thread)
        _wait_until(lambda n=queued: lock.waiting == n)  # queued in this order
    release.set()
    for thread in threads:
        thread.join(5)
    return served


def test_waiters_get_the_lock_earliest_deadline_first():
    # a later piece with 3 s of audio still playing waits for a first piece (needed now)
    assert _serve([13.0, 11.0, 12.0, 10.5]) == [10.5, 11.0, 12.0, 13.0]


def test_no_deadline_means_now_and_equal_deadlines_keep_their_turn():
    assert _serve([5.0, None, 5.0, None]) == [None, None, 5.0, 5.0]


def test_a_lone_caller_takes_a_free_lock_at_once_and_the_lock_is_free_after_an_error():
    lock = DeadlineLock()
    with pytest.raises(RuntimeError), lock.hold(1.0):
        raise RuntimeError("synthesis failed")
    with lock.hold(None):
        assert lock.waiting == 0
    assert _serve([2.0, 1.0]) == [1.0, 2.0]
