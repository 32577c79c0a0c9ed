"""The built-in skills by name (``builtin_skills``) and the set a server holds (``SkillSet``): every skill's tools
for a conversation, and the calls the session and the server make on all of them.

Lifecycle, as the server and a session drive it:
* server start: ``skills = SkillSet(builtin_skills(settings.skills, clock=..., data_dir=...))``, then
  ``await skills.start()`` (on the event loop: the timers' and reminders' due loops);
* a conversation starts: ``tools = skills.tools(owner)`` (makes its tools, registers nothing), then
  ``skills.opened(owner)`` (on the loop: it may now hear announcements, and missed reminders are said);
* it ends: ``skills.close(owner)`` (its timers go; reminders stay);
* server stop: ``await skills.stop()`` (ends the due loops and closes the reminders' file).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from app.skills.base import Instructs, ServerTool, Skill, SkillOwner, WallClock
from app.skills.calculator import CalculatorSkill
from app.skills.clock import ClockSkill
from app.skills.reminders import ReminderSkill
from app.skills.timers import TimerSkill

log = logging.getLogger(__name__)

BUILTIN_SKILLS = ("clock", "timers", "reminders", "calculator")
REMINDERS_FILE = "reminders.sqlite3"


def builtin_skills(enabled: Iterable[str], *, clock: WallClock, data_dir: Path) -> list[Skill]:
    """The built-in skills named in ``enabled``, in ``BUILTIN_SKILLS``' order; ValueError names unknown ones.
    The reminders are kept in ``data_dir / REMINDERS_FILE`` (the folder is made when missing)."""
    names = set(enabled)
    unknown = sorted(names - set(BUILTIN_SKILLS))
    if unknown:
        raise ValueError(f"unknown skills {unknown}: the built-in ones are {list(BUILTIN_SKILLS)}")
    makers: dict[str, Callable[[], Skill]] = {
        "clock": lambda: ClockSkill(clock),
        "timers": lambda: TimerSkill(clock),
        "reminders": lambda: ReminderSkill(clock, Path(data_dir) / REMINDERS_FILE),
        "calculator": CalculatorSkill,
    }
    return [makers[name]() for name in BUILTIN_SKILLS if name in names]


@runtime_checkable
class OpensConversations(Protocol):
    """A skill that wants to know when a conversation starts (to speak in it unprompted)."""

    def opened(self, owner: SkillOwner) -> None: ...


@runtime_checkable
class RunsInBackground(Protocol):
    """A skill with work of its own on the event loop (a due loop)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class SkillSet:
    """The skills a server runs, used as one."""

    def __init__(self, skills: Iterable[Skill]) -> None:
        self.skills = tuple(skills)
        names = [skill.name for skill in self.skills]
        if len(set(names)) != len(names):
            raise ValueError(f"two skills of one name: {names}")

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        """Every skill's tools for ``owner``'s conversation; ValueError when two have one name (the LLM calls
        tools by name). Registers nothing: ``opened`` does."""
        tools = tuple(tool for skill in self.skills for tool in skill.tools(owner))
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"two skills' tools share a name: {names}")
        return tools

    def instructions(self) -> str:
        """What the skills add to a system prompt (``Instructs``; "" for none)."""
        return "\n\n".join(
            text for skill in self.skills if isinstance(skill, Instructs) and (text := skill.instructions())
        )

    def opened(self, owner: SkillOwner) -> None:
        """``owner``'s conversation started and may be spoken to. On the event loop."""
        for skill in self.skills:
            if isinstance(skill, OpensConversations):
                self._guarded(skill, "opened", lambda s=skill: s.opened(owner))

    def close(self, owner: SkillOwner) -> None:
        """``owner``'s conversation ended."""
        for skill in self.skills:
            self._guarded(skill, "close", lambda s=skill: s.close(owner))

    async def start(self) -> None:
        for skill in self.skills:
            if isinstance(skill, RunsInBackground):
                await skill.start()

    async def stop(self) -> None:
        """Stop every skill's background work, each even when another's stop fails."""
        for skill in self.skills:
            if isinstance(skill, RunsInBackground):
                try:
                    await skill.stop()
                except Exception:
                    log.exception("skill %s: stop failed", skill.name)

    @staticmethod
    def _guarded(skill: Skill, what: str, call: Callable[[], object]) -> None:
        """One skill's failure must not keep the others from hearing of a conversation."""
        try:
            call()
        except Exception:
            log.exception("skill %s: %s failed", skill.name, what)
