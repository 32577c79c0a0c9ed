"""Reminders in SQLite over a fake wall clock: kept across a restart, said once, where a conversation is open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from skill_fakes import FakeClock, conversation

from app.skills.reminders import SCHEMA_VERSION, ReminderSkill


def tool(skill: ReminderSkill, owner, name: str):
    return next(t for t in skill.tools(owner) if t.name == name).run


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "skills" / "reminders.sqlite3"  # the folders do not exist yet


def test_set_reminder_says_what_it_understood(path: Path) -> None:
    skill = ReminderSkill(FakeClock(), path)
    owner, _ = conversation("a")
    set_reminder = tool(skill, owner, "set_reminder")
    assert set_reminder({"text": "call mom", "when": "tomorrow at nine"}) == {
        "set": "a reminder",
        "text": "call mom",
        "when": "tomorrow at 09:00",
        "say": "I will remind you to call mom tomorrow at 09:00.",
    }
    assert set_reminder({"text": "remind me to buy milk.", "when": "in 10 minutes"})["text"] == "buy milk"
    # the time said in the text too, as the user said it, while the model wrote it on the clock: said once
    call = set_reminder({"text": "call my mother tomorrow at 9", "when": "tomorrow at 09:00"})
    assert call["say"] == "I will remind you to call my mother tomorrow at 09:00."
    assert set_reminder({"text": "x", "when": "blorp"}) == {
        "error": "I could not understand the time 'blorp' (say it like 'tomorrow at 9 am')"
    }
    assert (
        set_reminder({"text": "x", "when": "today at 9 am"})["error"]
        == "'today at 9 am' is already past (it is 14:22 now)"
    )
    assert "too far ahead" in set_reminder({"text": "x", "when": "in two years"})["error"]
    assert "too long" in set_reminder({"text": "x" * 201, "when": "tomorrow"})["error"]
    assert "error" in set_reminder({"text": "", "when": "tomorrow"})
    assert [r["text"] for r in tool(skill, owner, "list_reminders")({})["reminders"]] == [
        "buy milk",
        "call mom",
        "call my mother",
    ]


def test_a_reminder_survives_a_restart_and_is_said_once(path: Path) -> None:
    clock = FakeClock()
    first = ReminderSkill(clock, path)
    owner, _ = conversation("a")
    tool(first, owner, "set_reminder")({"text": "take the bread out", "when": "in 20 minutes"})

    restarted = ReminderSkill(clock, path)  # a new server over the same file
    listed = tool(restarted, owner, "list_reminders")({})
    assert listed["reminders"] == [{"text": "take the bread out", "when": "today at 14:42"}]
    assert listed["say"] == "You have reminders to take the bread out today at 14:42."
    later, heard = conversation("after-restart")  # the old conversation id never comes back
    restarted.opened(later)
    assert restarted.fire_due(clock.advance(19 * 60)) == 0
    assert restarted.fire_due(clock.advance(60)) == 1
    assert heard == [("reminder", "Reminder: take the bread out.")]
    assert restarted.fire_due(clock.advance(60)) == 0
    first.opened(later)  # the other object over the file: marked said in the database, not said again
    assert first.fire_due(clock.now()) == 0
    assert heard == [("reminder", "Reminder: take the bread out.")]
    assert tool(restarted, later, "list_reminders")({}) == {"reminders": [], "say": "You have no reminders."}
    assert ReminderSkill(clock, path).fire_due(clock.advance(3600)) == 0


def test_said_in_its_conversation_else_in_another_open_one(path: Path) -> None:
    clock = FakeClock()
    skill = ReminderSkill(clock, path)
    owner, owner_heard = conversation("a")
    other, other_heard = conversation("b")
    skill.opened(other)
    skill.opened(owner)
    tool(skill, owner, "set_reminder")({"text": "stretch", "when": "in 1 minute"})
    skill.fire_due(clock.advance(60))
    assert owner_heard == [("reminder", "Reminder: stretch.")] and other_heard == []

    tool(skill, owner, "set_reminder")({"text": "drink water", "when": "in 1 minute"})
    skill.close(owner)  # its conversation is gone: said in the one still open
    skill.fire_due(clock.advance(60))
    assert other_heard == [("reminder", "Reminder: drink water.")]
    assert len(owner_heard) == 1


def test_missed_reminders_are_said_when_a_conversation_opens(path: Path) -> None:
    clock = FakeClock()
    skill = ReminderSkill(clock, path)
    owner, _ = conversation("a")
    tool(skill, owner, "set_reminder")({"text": "water the plants", "when": "in 1 hour"})
    assert skill.tools(owner)  # making tools opens nothing
    assert skill.fire_due(clock.advance(2 * 3600)) == 0  # no conversation open: kept, missed
    assert skill.next_due(clock.now()) is None  # and the due loop does not spin on it
    later, heard = conversation("b")
    skill.opened(later)
    assert heard == [("reminder", "You missed a reminder, today at 15:22: water the plants.")]
    skill.opened(conversation("c")[0])
    assert len(heard) == 1


def test_cancel_matches_the_closest_text(path: Path) -> None:
    clock = FakeClock()
    skill = ReminderSkill(clock, path)
    owner, heard = conversation("a")
    skill.opened(owner)
    set_reminder, cancel = tool(skill, owner, "set_reminder"), tool(skill, owner, "cancel_reminder")
    set_reminder({"text": "call the dentist", "when": "tomorrow at 10"})
    set_reminder({"text": "buy milk", "when": "in 1 hour"})
    assert cancel({"text": "the milk"}) == {
        "cancelled": "buy milk",
        "was_due": "today at 15:22",
        "say": "I cancelled the reminder to buy milk.",
    }
    assert cancel({"text": "call dentist"})["was_due"] == "tomorrow at 10:00"
    assert cancel({"text": "anything"}) == {"error": "there are no reminders"}
    set_reminder({"text": "feed the cat", "when": "in 1 hour"})
    assert cancel({"text": "quantum physics"})["error"] == "no reminder matches 'quantum physics'"
    skill.fire_due(clock.advance(7200))
    assert heard == [("reminder", "You missed a reminder, today at 15:22: feed the cat.")]


def test_the_store_is_bounded(path: Path) -> None:
    skill = ReminderSkill(FakeClock(), path, max_reminders=3)
    owner, _ = conversation("a")
    set_reminder = tool(skill, owner, "set_reminder")
    for n in range(3):
        assert "set" in set_reminder({"text": f"thing {n}", "when": "tomorrow"})
    assert set_reminder({"text": "one more", "when": "tomorrow"}) == {
        "error": "there are already 3 reminders; cancel some first"
    }


def test_the_schema_is_versioned(path: Path) -> None:
    ReminderSkill(FakeClock(), path)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer"):
        ReminderSkill(FakeClock(), path)
