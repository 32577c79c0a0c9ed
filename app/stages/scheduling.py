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
        self._condition = threading.Condition()
        self._held = False
        self._waiting: list[tuple[float, int]] = []  # heap of (deadline, arrival)
        self._arrivals = itertools.count()

    @contextmanager
    def hold(self, deadline: float | None = None) -> Iterator[None]:
        ticket = (-math.inf if deadline is None else deadline, next(self._arrivals))
        with self._condition:
            heapq.heappush(self._waiting, ticket)
            try:
                while self._held or self._waiting[0] != ticket:
                    self._condition.wait()
            except BaseException:  # (a waiter interrupted: let the next one in)
                self._waiting.remove(ticket)
                heapq.heapify(self._waiting)
                self._condition.notify_all()
                raise
            heapq.heappop(self._waiting)
            self._held = True
        try:
            yield
        finally:
            with self._condition:
                self._held = False
                self._condition.notify_all()

    @property
    def waiting(self) -> int:
        with self._condition:
            return len(self._waiting)


class NowAndAheadLocks:
    """Two ``DeadlineLock`` lanes: work a listener waits on now (a ``deadline`` past or None) and work with time
    ahead of it (audio still playing), each in deadline order, the two beside each other.

    With one lock a reply's first piece waited for the piece being synthesized, a later piece of another reply
    with seconds of audio still ahead of it: with four users, first audio p90 ~300-440 ms against a p50 ~150
    (a 20-word piece holds Piper ~1 s on one thread). In its own lane it waits only for other pieces needed now.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.now = DeadlineLock()
        self.ahead = DeadlineLock()

    @contextmanager
    def hold(self, deadline: float | None = None) -> Iterator[None]:
        lane = self.now if deadline is None or deadline <= self._clock() else self.ahead
        with lane.hold(deadline):
            yield
