"""Per-connection limits that keep one client from hurting the others."""

from __future__ import annotations

import time
from collections.abc import Callable


class AudioBudget:
    """Admits microphone audio up to ``rate`` times real time, with a burst of ``burst_s`` seconds.

    A token bucket measured in audio seconds: it refills by ``rate`` audio seconds per wall
    second. A client that streams in real time never touches the limit; one that floods
    (a file pushed as fast as the socket allows) is cut to ``rate``x, so the VAD, the
    resampler and ASR spend on it at most that share of the machine.
    """

    def __init__(self, rate: float, burst_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst_s, self._clock = rate, burst_s, clock
        self._tokens = burst_s
        self._last = clock()
        self.dropped_s = 0.0

    def admit(self, seconds: float) -> bool:
        now = self._clock()
        self._tokens = min(self.burst_s, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if seconds <= self._tokens:
            self._tokens -= seconds
            return True
        self.dropped_s += seconds
        return False


class Every:
    """True at most once per ``interval_s`` (so a flood of bad input gets one error a second, not one per frame)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self._clock = interval_s, clock
        self._last: float | None = None

    def __call__(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        return True
