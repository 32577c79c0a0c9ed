"""Time, injected: the conversation reads the clock only through ``Clock``, so tests drive it.

Turn-taking decisions are made in audio time (samples received), which tests control by
feeding audio; wall time matters for what the user experiences (latency figures, where
the client's playback of a reply stands) and comes from a ``Clock``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

T = TypeVar("T")

RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]
"""Runs blocking model work (ASR, TTS) off the event loop; tests pass an inline runner."""


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


# Model work mostly waits: each model runs one call at a time behind its own lock (Whisper, Piper)
# and orders its waiters itself. asyncio's default pool has cpu_count + 4 threads, 6 on 2 cores:
# four conversations' pieces parked on the Piper lock and their ASR and end-of-turn jobs could use
# them all, and a tail's transcription (the critical path) would wait for a thread, not for
# Whisper. Threads are made only as jobs need them; this is a bound, not a cost.
MODEL_WORK_THREADS = 64
_model_work = ThreadPoolExecutor(max_workers=MODEL_WORK_THREADS, thread_name_prefix="parley-model")


async def run_in_thread(work: Callable[[], T]) -> T:
    """The default ``RunBlocking``: a thread of a pool that has one for every job that may wait on a model."""
    return await asyncio.get_running_loop().run_in_executor(_model_work, work)


class ArrivalClock:
    """Maps a stream sample index to the wall time its frame arrived (for latency figures)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._marks: deque[tuple[int, float]] = deque(maxlen=4096)

    def mark(self, end_sample: int, when: float) -> None:
        self._marks.append((end_sample, when))

    def time_of(self, sample: int) -> float:
        for end_sample, when in self._marks:
            if end_sample >= sample:
                return when
        return self._marks[-1][1] if self._marks else self._clock.now()
