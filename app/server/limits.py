"""Per-connection limits that keep one client from hurting the others."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """Up to ``rate`` units a second, with a burst of ``burst`` units.

    It refills by ``rate`` units per wall second. Microphone audio is measured in audio
    seconds (``AudioRateLimit``: a client that streams in real time never touches the
    limit; one that floods is cut to ``rate``x, so the VAD, the resampler and ASR spend on it
    at most that share of the machine); client frames are counted one by one (the
    connection's read pace).
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens = burst
        self._last = clock()
        self.dropped = 0.0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def admit(self, amount: float) -> bool:
        """Take ``amount`` if the bucket holds it; else count it as dropped."""
        self._refill()
        if amount <= self._tokens:
            self._tokens -= amount
            return True
        self.dropped += amount
        return False

    def take(self, amount: float) -> float:
        """Take ``amount`` even into debt; the seconds to wait before the bucket is out of debt (0: none)."""
        self._refill()
        self._tokens -= amount
        return max(0.0, -self._tokens / self.rate)


class ReadPace:
    """How fast a connection's frames (or events) are read: at most ``rate`` a second past a burst of ``burst``
    (beyond that reading waits, so a flood waits in TCP buffers instead of spending the event loop), and a peer
    that keeps over half that pace for about ``flood_close_s`` is flooding on purpose (``took`` says so)."""

    def __init__(
        self, rate: float, burst: float, flood_close_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.flood_rate = rate / 2
        self._pace = TokenBucket(rate, burst, clock)
        self._flood = TokenBucket(self.flood_rate, burst + flood_close_s * self.flood_rate, clock)

    def took(self) -> float | None:
        """One frame was read: the seconds to wait before the next (0: none), or None: the peer is flooding."""
        if not self._flood.admit(1.0):
            return None
        return self._pace.take(1.0)


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
