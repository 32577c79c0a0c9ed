"""``DeadlineLock``: the shared synthesizer serves the piece needed soonest, not the one that came first;
``NowAndAheadLocks``: a piece needed now does not wait behind one with audio ahead of it, nor does one whose
audio ran out while it waited."""

from __future__ import annotations

import math
import threading
import time

import pytest

from app.stages.scheduling import DeadlineLock, NowAndAheadLocks


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


def test_a_piece_needed_now_does_not_wait_behind_one_with_audio_ahead_but_pieces_of_a_lane_take_turns():
    now = 100.0
    locks = NowAndAheadLocks(clock=lambda: now)
    holding, release, done = threading.Event(), threading.Event(), []

    def later_piece() -> None:  # 2 s of its listener's audio still playing
        with locks.hold(now + 2.0):
            holding.set()
            release.wait()

    holder = threading.Thread(target=later_piece)
    holder.start()
    assert holding.wait(5)
    for deadline in (None, now, now - 0.5):  # a first piece; one whose listener ran dry just now, or before
        with locks.hold(deadline):
            done.append(deadline)
    assert done == [None, now, now - 0.5] and locks.waiting(locks.AHEAD) == 0

    def another_later_piece() -> None:
        with locks.hold(now + 1.0):
            done.append(now + 1.0)

    another = threading.Thread(target=another_later_piece)
    another.start()
    _wait_until(lambda: locks.waiting(locks.AHEAD) == 1)  # a second piece with audio ahead waits its turn
    assert len(done) == 3
    release.set()
    for thread in (holder, another):
        thread.join(5)
    assert done[3:] == [now + 1.0]


def test_a_piece_whose_listener_runs_dry_while_it_waits_moves_to_the_lane_of_work_needed_now():
    clock = [100.0]
    locks = NowAndAheadLocks(clock=lambda: clock[0])
    holding, release, served = threading.Event(), threading.Event(), threading.Event()

    def long_later_piece() -> None:  # another reply's long piece, 5 s of its audio still playing
        with locks.hold(105.0):
            holding.set()
            release.wait()

    def second_piece() -> None:  # its listener has 0.2 s of audio left: it waits behind the long piece
        with locks.hold(100.2):
            served.set()

    holder, waiter = threading.Thread(target=long_later_piece), threading.Thread(target=second_piece)
    holder.start()
    assert holding.wait(5)
    waiter.start()
    _wait_until(lambda: locks.waiting(locks.AHEAD) == 1)
    assert not served.wait(0.3)  # (its deadline not yet passed: it keeps its turn behind the holder)
    clock[0] = 100.25  # the audio ran out while it waited: it is needed now, and that lane is free
    assert served.wait(5)
    assert locks.waiting(locks.AHEAD) == 0 and locks.waiting(locks.NOW) == 0
    release.set()
    for thread in (holder, waiter):
        thread.join(5)


def test_a_deadline_that_is_no_number_is_refused_and_one_never_due_waits_with_time_ahead():
    locks = NowAndAheadLocks()
    with pytest.raises(ValueError, match="number"), locks.hold(math.nan):
        pass
    with locks.hold(math.inf):
        assert locks.waiting(locks.AHEAD) == 0
    with locks.hold(None):  # nothing left behind
        assert locks.waiting(locks.NOW) == 0
