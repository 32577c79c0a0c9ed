"""The ``clock`` skill (``get_time``: the local date and time) and the wait for a wall-clock deadline that timers
and reminders share (``DueLoop``).

Why a tool and a line for the prompt both: the model cannot know the time, and a small one asked "what time is
it" answers from its weights unless the answer is in front of it. ``describe_now`` is one line a system prompt
can carry; ``get_time`` is the exact answer when asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from datetime import datetime

from app.skills.base import ServerTool, SkillOwner, WallClock, unasked
from app.skills.spoken_time import MONTHS, WEEKDAYS

log = logging.getLogger(__name__)


def timezone_name(now: datetime) -> str:
    return now.tzname() or "local time"


def describe_now(now: datetime) -> str:
    """ "It is Sunday, 6 December 2026, 14:32 (UTC)." English names, whatever the machine's locale."""
    return (
        f"It is {WEEKDAYS[now.weekday()]}, {now.day} {MONTHS[now.month - 1]} {now.year}, "
        f"{now:%H:%M} ({timezone_name(now)})."
    )


class ClockSkill:
    """``get_time``, read from the injected wall clock (tests pass a fake one)."""

    name = "clock"

    def __init__(self, clock: WallClock) -> None:
        self._clock = clock

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        def get_time(arguments: dict) -> dict:
            heard = owner.heard()
            if heard and not asks_about_time_en(heard):
                return unasked("the user did not ask about the date or the time")
            return self.get_time()

        return (ServerTool("get_time", get_time, "Get the current local date and time."),)

    def close(self, owner: SkillOwner) -> None:
        """Nothing is kept per conversation."""

    def get_time(self) -> dict[str, str]:
        now = self._clock.now()
        weekday, date = WEEKDAYS[now.weekday()], f"{now.day} {MONTHS[now.month - 1]} {now.year}"
        return {
            "weekday": weekday,
            "date": date,
            "time": f"{now:%H:%M}",
            "timezone": timezone_name(now),
            "say": f"It is {now:%H:%M} on {weekday}, {date}.",
        }


# English words a question about the date or the time holds: a word list, so English only and named so; words that
# are not English (no common English word among them) are never refused by it.
_TIME_WORDS_EN = re.compile(
    r"\b(time|times|date|day|days|today|tonight|tomorrow|yesterday|clock|o'clock|hour|hours|minute|week|weekday|"
    r"month|year|morning|evening|afternoon|now|late|early|when)\b",
    re.IGNORECASE,
)


def asks_about_time_en(words: str) -> bool:
    """Whether English words ask about the date or the time (any words not in English: yes, unchecked)."""
    if not re.search(r"\b(the|is|it|what|a|an|my|me|you|i|to|of|about|and|for|tell|please|can|do)\b", words, re.I):
        return True  # not English (or too short to tell): not checked
    return _TIME_WORDS_EN.search(words) is not None


class DueLoop:
    """Calls ``fire_due(now)`` on the event loop when the next deadline (``next_due(now)``) comes, and again
    whenever ``wake()`` says the deadlines changed.

    Why wall time checked at least every ``max_sleep_s``: the loop sleeps on the monotonic clock while deadlines
    are wall times; a wall clock that jumps (a suspended laptop, NTP) is caught up within that. ``wake`` may be
    called from any thread (sync tools run on worker threads); the wake flag is cleared before the deadlines are
    read, so a change made while ``fire_due`` runs is never missed.
    """

    def __init__(
        self,
        clock: WallClock,
        next_due: Callable[[datetime], datetime | None],
        fire_due: Callable[[datetime], object],
        *,
        max_sleep_s: float = 30.0,
    ) -> None:
        self._clock, self._next_due, self._fire_due = clock, next_due, fire_due
        self._max_sleep_s = max_sleep_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="skills-due-loop")

    async def stop(self) -> None:
        task, self._task, self._loop = self._task, None, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def wake(self) -> None:
        """The deadlines changed: read them again now. Safe from any thread; a no-op before ``start``."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            now = self._clock.now()
            try:
                self._fire_due(now)
                deadline = self._next_due(now)
            except Exception:  # one bad pass (a locked database, a failing announce) must not end the loop
                log.exception("skills: firing what was due failed")
                deadline = None
            delay = self._max_sleep_s
            if deadline is not None:
                delay = min(delay, max(0.0, (deadline - self._clock.now()).total_seconds()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
