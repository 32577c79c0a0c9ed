"""The skills' tests' stand-ins: a fake wall clock (time moves only when a test moves it) and conversations that record
what they are told unprompted."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from app.skills.base import SkillOwner

# Sunday, 6 December 2026, 14:22 UTC: a set_timer for ten minutes ends at 14:32.
NOW = datetime(2026, 12, 6, 14, 22, tzinfo=UTC)


@dataclass
class FakeClock:
    current: datetime = NOW

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> datetime:
        self.current += timedelta(seconds=seconds)
        return self.current


@dataclass
class Listener:
    """A conversation's ``announce``: what it was told, as (kind, text)."""

    heard: list[tuple[str, str]] = field(default_factory=list)

    def __call__(self, kind: str, text: str) -> None:
        self.heard.append((kind, text))


def conversation(conversation_id: str) -> tuple[SkillOwner, list[tuple[str, str]]]:
    """A conversation's owner, and the list of what it hears (kind, text)."""
    listener = Listener()
    return SkillOwner(conversation_id, listener), listener.heard
