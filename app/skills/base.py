"""What a skill is: a maker of tools for one conversation, and what those tools act for.

Why per conversation: a timer belongs to the session that set it (it rings there), and a tool's ``run`` takes
only its arguments, so the owner is bound when the session's tools are made (``Skill.tools(owner)``).

Why arguments as the user says them ("ten minutes", "tomorrow at nine"): a small model copies words well and
computes badly (asked to convert "10 minutes" to seconds it wrote 60), so the server parses durations, times
and quantities with a well-kept library, and the tool's result says what it understood ("a timer for 10
minutes, ends at 14:32"), which the model reads back to the user.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ServerTool:
    """A tool an operator registers: ``run(arguments)`` (a dict) returns its result (text, or anything JSON can
    write); it may be a coroutine function, else it runs on a worker thread."""

    name: str
    run: Callable[[dict[str, Any]], Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


CANNOT_DO = "Sorry, I can't do that."
"""What the user hears where a request cannot be done (no tool for it, or its calls failed and the model said
nothing): one honest sentence, never a claimed action."""


def unasked(why: str) -> dict[str, Any]:
    """A call's result when the user's words do not ask for it (``SkillOwner.heard``): the reply is then written
    without tools, as if the call had not been made (``app.voice.tools.unasked_round``). A 0.5B model called
    get_time for "My name is Maya." and calculate("3 times 1000") for "How many pounds is 3 kilograms?"."""
    return {"error": f"not asked: {why}", "unasked": True}


class WallClock(Protocol):
    """Local wall time, injected (tests pass a fake): timers and reminders compare against it."""

    def now(self) -> datetime:
        """The local time, timezone-aware."""
        ...


class SystemWallClock:
    """The machine's clock in its own time zone (``TZ``, else the system's), with its rules, not today's offset:
    "tomorrow at nine" across a daylight-saving change is nine on tomorrow's clock (a fixed offset put it an hour
    off), and an hour later is an hour of real time."""

    def now(self) -> datetime:
        try:
            import tzlocal

            return datetime.now(tzlocal.get_localzone())
        except Exception:  # an unknown zone name: the offset in force now
            return datetime.now().astimezone()


Announce = Callable[[str, str], None]
"""``announce(kind, text)``: say ``text`` to the user of a conversation, unprompted (a timer ended, a reminder is
due); ``kind`` is the skill's name ("timer", "reminder"). Called on the event loop; it does not block."""


@dataclass(frozen=True)
class SkillOwner:
    """The conversation a skill's tools act for: its id, how to speak to its user unprompted, and ``heard()``: the
    user's last words ("" when not known), which an action's arguments must come from (a small model asked to turn
    on the lights, with no tool for that, set a ten-minute timer)."""

    conversation_id: str
    announce: Announce
    heard: Callable[[], str] = lambda: ""
    language: Callable[[], str | None] = lambda: None  # of the user's last words, when known ("en")


class Skill(Protocol):
    """One ability. ``name``: the setting that turns it off. ``tools(owner)``: the tools one conversation may call.
    ``close(owner)``: the conversation ended (its timers go; reminders stay: they are on disk)."""

    name: str

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]: ...

    def close(self, owner: SkillOwner) -> None: ...


@runtime_checkable
class Instructs(Protocol):
    """A skill with words for the system prompt (an MCP server's prompt: Home Assistant's names the home's devices)."""

    def instructions(self) -> str: ...


class SessionSkills(Protocol):
    """What a session uses of the server's skills (``app.skills.builtin.SkillSet``): the tools its replies may call
    and the words their system prompt adds (``instructions``), and that its conversation opened (it may now be
    spoken to) and ended."""

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]: ...

    def instructions(self) -> str: ...

    def opened(self, owner: SkillOwner) -> None: ...

    def close(self, owner: SkillOwner) -> None: ...
