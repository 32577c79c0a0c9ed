"""The ``timers`` skill: ``set_timer``, ``list_timers``, ``cancel_timer``; a timer rings in the conversation that
set it (``owner.announce("timer", "Your pasta timer is done.")``), once.

Why in memory: a timer is short (at most ``MAX_SECONDS``) and belongs to a conversation; when the conversation
ends (``close``) its timers go with it.

Why one lock: sync tools run on worker threads while the due loop fires on the event loop; each timer leaves the
table exactly once, under the lock, either cancelled or fired, so a cancel racing the ring does one or the other.
Announcements are made outside the lock, on the loop (``fire_due``).
"""

from __future__ import annotations

import difflib
import itertools
import logging
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from app.skills.base import CANNOT_DO, ServerTool, SkillOwner, WallClock
from app.skills.clock import DueLoop
from app.skills.spoken_time import (
    SpokenTimeError,
    describe_duration,
    duration_seconds,
    parse_duration,
    said_durations,
    words_heard,
)

log = logging.getLogger(__name__)

MAX_TIMERS_PER_CONVERSATION = 20
MAX_TIMERS = 1000  # all conversations together: a flood of conversations cannot grow the table without end
MAX_LABEL_CHARS = 60
MAX_SECONDS = 7 * 86400


@dataclass(frozen=True)
class Timer:
    id: int
    owner: SkillOwner
    label: str  # "" when none was given
    seconds: float
    ends_at: datetime

    @property
    def name(self) -> str:
        """What the user calls it: its label, else its length ("10 minutes")."""
        return self.label or describe_duration(self.seconds)

    def spoken(self) -> str:
        """ "pasta timer", "timer for 10 minutes"."""
        return f"{self.label} timer" if self.label else f"timer for {describe_duration(self.seconds)}"

    def remaining(self, now: datetime) -> str:
        return describe_duration(max(0.0, (self.ends_at - now).total_seconds()))


def _label(arguments: dict[str, Any]) -> str:
    label = arguments.get("label") or ""
    if not isinstance(label, str):
        raise SpokenTimeError("the label must be words")
    label = re.sub(r"^(?:the|my)\s+|\s*\btimers?$", "", " ".join(label.split()), flags=re.IGNORECASE)
    if len(label) > MAX_LABEL_CHARS:
        raise SpokenTimeError(f"the label is too long (at most {MAX_LABEL_CHARS} characters)")
    return label


class TimerSkill:
    """Per-conversation timers over an injected wall clock. ``fire_due(now)`` rings what is due (tests call it
    with a fake time); ``start()`` runs a ``DueLoop`` that calls it at each deadline."""

    name = "timers"

    def __init__(self, clock: WallClock, *, max_per_conversation: int = MAX_TIMERS_PER_CONVERSATION) -> None:
        self._clock = clock
        self._max_per_conversation = max_per_conversation
        self._timers: dict[int, Timer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._loop = DueLoop(clock, self.next_due, self.fire_due)

    # ------------------------------------------------------------ the skill
    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        label = {"type": "string", "description": "What the timer is for, only when the user said it."}
        return (
            ServerTool(
                "set_timer",
                lambda arguments: self.set_timer(owner, arguments),
                "Set a timer for a duration, e.g. 'ten minutes'.",
                {
                    "type": "object",
                    "properties": {
                        "duration": {"type": "string", "description": "How long, as the user said it."},
                        "label": label,
                    },
                    "required": ["duration"],
                },
            ),
            ServerTool("list_timers", lambda arguments: self.list_timers(owner), "List the running timers."),
            ServerTool(
                "cancel_timer",
                lambda arguments: self.cancel_timer(owner, arguments),
                "Cancel a timer.",
                {"type": "object", "properties": {"label": label}},
            ),
        )

    def close(self, owner: SkillOwner) -> None:
        """The conversation ended: its timers go, unrung."""
        with self._lock:
            for timer_id in [t.id for t in self._timers.values() if t.owner.conversation_id == owner.conversation_id]:
                del self._timers[timer_id]
        self._loop.wake()

    async def start(self) -> None:
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    # ------------------------------------------------------------ the tools
    def set_timer(self, owner: SkillOwner, arguments: dict[str, Any]) -> dict[str, str]:
        try:
            seconds = parse_duration(arguments.get("duration", ""), max_seconds=MAX_SECONDS)
            label = _label(arguments)
        except SpokenTimeError as error:
            return {"error": str(error)}
        heard = owner.heard()
        if heard and seconds not in said_durations(heard):
            # (said as is: read back by a small model, an instruction to it was heard as one)
            return {"error": "the user did not say how long", "say": CANNOT_DO}
        if (heard and label and not words_heard(label, heard)) or duration_seconds(label) is not None:
            label = ""  # a label the user did not say ("Kitchen lights are on."), or the duration again, is left out
        now = self._clock.now()
        with self._lock:
            if len(self._owned(owner)) >= self._max_per_conversation:
                return {"error": f"there are already {self._max_per_conversation} timers; cancel one first"}
            if len(self._timers) >= MAX_TIMERS:
                return {"error": "too many timers are running"}
            timer = Timer(next(self._ids), owner, label, seconds, now + timedelta(seconds=seconds))
            self._timers[timer.id] = timer
        self._loop.wake()
        result = {"set": f"a timer for {describe_duration(seconds)}", "ends_at": f"{timer.ends_at:%H:%M}"}
        said = f"Your {label} timer is set" if label else "Timer set"
        result["say"] = f"{said} for {describe_duration(seconds)}."
        return {**result, "label": label} if label else result

    def list_timers(self, owner: SkillOwner) -> dict[str, Any]:
        now = self._clock.now()
        with self._lock:
            timers = sorted(self._owned(owner), key=lambda t: t.ends_at)
        if not timers:
            return {"timers": [], "say": "No timers are running."}
        listed = [{"timer": t.name, "left": t.remaining(now), "ends_at": f"{t.ends_at:%H:%M}"} for t in timers]
        said = "; ".join(f"{t.spoken()}, {t.remaining(now)} left" for t in timers)
        return {"timers": listed, "say": f"{said[0].upper()}{said[1:]}."}

    def cancel_timer(self, owner: SkillOwner, arguments: dict[str, Any]) -> dict[str, Any]:
        """By label (the closest one; "all": every one); with no label, the only timer there is."""
        try:
            label = _label(arguments)
        except SpokenTimeError as error:
            return {"error": str(error)}
        with self._lock:
            timers = sorted(self._owned(owner), key=lambda t: t.ends_at)
            if not timers:
                return {"error": "no timer is running"}
            if label.lower() in ("all", "all timers", "every", "everything"):
                chosen = timers
            elif label:
                match = _closest(label, timers)
                if match is None:
                    return {"error": f"no timer is called '{label}'", "timers": [t.name for t in timers]}
                chosen = [match]
            elif len(timers) == 1:
                chosen = timers
            else:
                return {"error": "which timer? say its name", "timers": [t.name for t in timers]}
            for timer in chosen:
                del self._timers[timer.id]
        self._loop.wake()
        cancelled = ", ".join(t.spoken() for t in chosen)
        return {"cancelled": cancelled, "say": f"I cancelled the {cancelled}."}

    # ------------------------------------------------------------ ringing
    def next_due(self, now: datetime | None = None) -> datetime | None:
        with self._lock:
            return min((t.ends_at for t in self._timers.values()), default=None)

    def fire_due(self, now: datetime) -> int:
        """Ring every timer that ended by ``now``, each once; how many rang. On the event loop (announce is)."""
        with self._lock:
            due = sorted((t for t in self._timers.values() if t.ends_at <= now), key=lambda t: t.ends_at)
            for timer in due:
                del self._timers[timer.id]
        for timer in due:
            try:
                timer.owner.announce("timer", f"Your {timer.spoken()} is done.")
            except Exception:  # one conversation's failure must not silence the others' timers
                log.exception("timer %s: the announcement failed", timer.id)
        return len(due)

    def _owned(self, owner: SkillOwner) -> list[Timer]:
        return [t for t in self._timers.values() if t.owner.conversation_id == owner.conversation_id]


def _closest(label: str, timers: list[Timer]) -> Timer | None:
    """The timer whose name is ``label``, contains it, or is closest to it (soonest to end among equals)."""
    wanted = label.casefold()
    for timer in timers:
        if timer.name.casefold() == wanted:
            return timer
    for timer in timers:
        if wanted in timer.name.casefold() or timer.name.casefold() in wanted:
            return timer
    names = [t.name.casefold() for t in timers]
    close = difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
    return timers[names.index(close[0])] if close else None
