"""Who uses a shared model next, when several conversations wait for it.

A model that runs one call at a time (Piper's session: two at once only fight over the cores)
is a queue. First come, first served is the wrong order for speech: a reply's first piece has
a listener waiting on it now, while a later piece of another reply may have seconds of audio
still playing ahead of it. ``DeadlineLock`` serves the waiter whose audio is needed soonest
(earliest deadline first), which is what keeps both the first audio early and the replies
already playing from running dry.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class DeadlineLock:
    """A lock whose waiters get it in deadline order (earliest first; ties and no deadline: in turn).

    ``deadline`` is on any monotonic scale the callers share; None means "needed now" and goes
    before every deadline. A holder is never pre-empted: the order applies when it releases.
    """

    def __init__(self) -> None:
        self._lanes = _Lanes(1)

    @contextmanager
    def hold(self, deadline: float | None = None) -> Iterator[None]:
        with self._lanes.hold(deadline, lambda: 0):
            yield

    @property
    def waiting(self) -> int:
        return self._lanes.waiting(0)


class NowAndAheadLocks:
    """Two deadline-ordered lanes: work a listener waits on now (a ``deadline`` past or None) and work with time
    ahead of it (audio still playing), the two beside each other.

    With one lock a reply's first piece waited for the piece being synthesized, a later piece of another reply
    with seconds of audio still ahead of it: with four users, first audio p90 ~300-440 ms against a p50 ~150
    (a 20-word piece holds Piper ~1 s on one thread). In its own lane it waits only for other pieces needed now.

    A waiter's lane is its deadline's at each moment: one queued with time ahead whose deadline passes while the
    lane is busy (behind another reply's long piece) moves to the lane of work needed now, as it is by then. So
    deadlines are in seconds on ``clock``'s scale: a waiter looks again when its deadline is due by real time.
    """

    NOW, AHEAD = 0, 1

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lanes = _Lanes(2)

    @contextmanager
    def hold(self, deadline: float | None = None) -> Iterator[None]:
        def lane() -> int:
            return self.NOW if deadline is None or deadline <= self._clock() else self.AHEAD

        def changes_in() -> float | None:  # (a waiter in the lane of work needed now stays there)
            if lane() == self.NOW or not math.isfinite(deadline):
                return None
            return min(deadline - self._clock(), threading.TIMEOUT_MAX)

        with self._lanes.hold(deadline, lane, changes_in):
            yield

    def waiting(self, lane: int) -> int:
        """How many wait for ``lane`` (``NOW`` or ``AHEAD``)."""
        return self._lanes.waiting(lane)


class _Lanes:
    """Locks side by side, one holder each, whose waiters are served in deadline order; a waiter's lane may change
    while it waits (``hold``'s ``lane``, asked again when ``changes_in`` says it may have)."""

    def __init__(self, count: int) -> None:
        self._condition = threading.Condition()
        self._held = [False] * count
        self._waiting: list[list[tuple[float, int]]] = [[] for _ in range(count)]  # heaps of (deadline, arrival)
        self._arrivals = itertools.count()

    @contextmanager
    def hold(
        self,
        deadline: float | None,
        lane: Callable[[], int],
        changes_in: Callable[[], float | None] = lambda: None,
    ) -> Iterator[None]:
        if deadline is not None and math.isnan(deadline):
            raise ValueError("a deadline must be a number (None: needed now)")
        ticket = (-math.inf if deadline is None else deadline, next(self._arrivals))
        with self._condition:
            current = lane()
            heapq.heappush(self._waiting[current], ticket)
            try:
                while self._held[current] or self._waiting[current][0] != ticket:
                    self._condition.wait(changes_in())
                    if (moved := lane()) != current:
                        self._leave(ticket)
                        heapq.heappush(self._waiting[moved], ticket)
                        current = moved
            except BaseException:  # (a waiter interrupted: let the next one in)
                self._leave(ticket)
                raise
            heapq.heappop(self._waiting[current])
            self._held[current] = True
        try:
            yield
        finally:
            with self._condition:
                self._held[current] = False
                self._condition.notify_all()

    def _leave(self, ticket: tuple[float, int]) -> None:
        """``ticket`` no longer waits in any lane (the one after it may be first now)."""
        for waiting in self._waiting:
            if ticket in waiting:
                waiting.remove(ticket)
                heapq.heapify(waiting)
        self._condition.notify_all()

    def waiting(self, lane: int) -> int:
        with self._condition:
            return len(self._waiting[lane])
