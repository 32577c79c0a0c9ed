"""Timers over a fake wall clock: set, listed, cancelled, rung once, dropped with their conversation, bounded."""

from __future__ import annotations

import threading

from skill_fakes import FakeClock, conversation

from app.skills.timers import TimerSkill


def tool(skill: TimerSkill, owner, name: str):
    return next(t for t in skill.tools(owner) if t.name == name).run


def test_set_timer_says_what_it_understood() -> None:
    skill = TimerSkill(FakeClock())
    owner, _ = conversation("a")
    result = tool(skill, owner, "set_timer")({"duration": "ten minutes", "label": "pasta"})
    assert result == {
        "set": "a timer for 10 minutes",
        "ends_at": "14:32",
        "label": "pasta",
        "say": "Your pasta timer is set for 10 minutes.",
    }
    assert tool(skill, owner, "set_timer")({"duration": "an hour and a half"})["set"] == "a timer for 1 hour 30 minutes"


def test_an_unreadable_duration_is_an_error_to_read_back_and_sets_nothing() -> None:
    skill = TimerSkill(FakeClock())
    owner, _ = conversation("a")
    assert tool(skill, owner, "set_timer")({"duration": "blorp"}) == {
        "error": "I could not understand the duration 'blorp' (say it like 'ten minutes')"
    }
    assert "error" in tool(skill, owner, "set_timer")({"duration": "8 days"})
    assert "error" in tool(skill, owner, "set_timer")({"duration": "5 minutes", "label": "x" * 500})
    assert "error" in tool(skill, owner, "set_timer")({})
    assert skill.next_due() is None


def test_a_timer_rings_once_in_its_conversation() -> None:
    clock = FakeClock()
    skill = TimerSkill(clock)
    owner, heard = conversation("a")
    other, other_heard = conversation("b")
    tool(skill, owner, "set_timer")({"duration": "10 minutes", "label": "pasta"})
    tool(skill, owner, "set_timer")({"duration": "90 seconds"})
    assert skill.fire_due(clock.advance(60)) == 0
    assert skill.fire_due(clock.advance(31)) == 1
    assert heard == [("timer", "Your timer for 1 minute 30 seconds is done.")]
    assert skill.fire_due(clock.advance(600)) == 1
    assert skill.fire_due(clock.advance(600)) == 0  # past it twice: rung once
    assert heard[1:] == [("timer", "Your pasta timer is done.")]
    assert other_heard == []


def test_cancel_before_the_end_means_no_ring() -> None:
    clock = FakeClock()
    skill = TimerSkill(clock)
    owner, heard = conversation("a")
    tool(skill, owner, "set_timer")({"duration": "10 minutes", "label": "pasta"})
    assert tool(skill, owner, "cancel_timer")({}) == {
        "cancelled": "pasta timer",
        "say": "I cancelled the pasta timer.",
    }  # the only one: no label needed
    skill.fire_due(clock.advance(3600))
    assert heard == []
    assert tool(skill, owner, "cancel_timer")({}) == {"error": "no timer is running"}


def test_cancel_picks_by_label_and_asks_when_unsure() -> None:
    skill = TimerSkill(FakeClock())
    owner, _ = conversation("a")
    for label in ("pasta", "eggs", "laundry"):
        tool(skill, owner, "set_timer")({"duration": "10 minutes", "label": label})
    cancel = tool(skill, owner, "cancel_timer")
    assert cancel({})["error"] == "which timer? say its name"
    assert cancel({"label": "the egg timer"})["cancelled"] == "eggs timer"
    assert cancel({"label": "Pasta"})["cancelled"] == "pasta timer"
    assert cancel({"label": "bread"}) == {"error": "no timer is called 'bread'", "timers": ["laundry"]}
    assert cancel({"label": "all"}) == {"cancelled": "laundry timer", "say": "I cancelled the laundry timer."}


def test_list_shows_the_time_left() -> None:
    clock = FakeClock()
    skill = TimerSkill(clock)
    owner, _ = conversation("a")
    assert tool(skill, owner, "list_timers")({}) == {"timers": [], "say": "No timers are running."}
    tool(skill, owner, "set_timer")({"duration": "10 minutes", "label": "pasta"})
    tool(skill, owner, "set_timer")({"duration": "5 minutes"})
    clock.advance(110)
    assert tool(skill, owner, "list_timers")({}) == {
        "timers": [
            {"timer": "5 minutes", "left": "3 minutes 10 seconds", "ends_at": "14:27"},
            {"timer": "pasta", "left": "8 minutes 10 seconds", "ends_at": "14:32"},
        ],
        "say": "Timer for 5 minutes, 3 minutes 10 seconds left; pasta timer, 8 minutes 10 seconds left.",
    }
    other, _ = conversation("b")
    assert tool(skill, other, "list_timers")({})["timers"] == []  # each conversation sees its own


def test_close_drops_the_conversations_timers() -> None:
    clock = FakeClock()
    skill = TimerSkill(clock)
    owner, heard = conversation("a")
    other, other_heard = conversation("b")
    tool(skill, owner, "set_timer")({"duration": "1 minute"})
    tool(skill, other, "set_timer")({"duration": "1 minute"})
    skill.close(owner)
    skill.fire_due(clock.advance(120))
    assert heard == [] and len(other_heard) == 1


def test_timers_per_conversation_are_bounded() -> None:
    skill = TimerSkill(FakeClock(), max_per_conversation=3)
    owner, _ = conversation("a")
    set_timer = tool(skill, owner, "set_timer")
    for _ in range(3):
        assert "set" in set_timer({"duration": "1 minute"})
    assert set_timer({"duration": "1 minute"}) == {"error": "there are already 3 timers; cancel one first"}
    other, _ = conversation("b")
    assert "set" in tool(skill, other, "set_timer")({"duration": "1 minute"})


def test_cancel_racing_the_ring_does_one_or_the_other() -> None:
    """Cancels on worker threads against rings on this one: each timer is either cancelled or rung, never both."""
    clock = FakeClock()
    skill = TimerSkill(clock, max_per_conversation=200)
    owners = [conversation(str(i)) for i in range(100)]
    for owner, _ in owners:
        tool(skill, owner, "set_timer")({"duration": "1 minute"})
    clock.advance(60)
    results: dict[str, dict] = {}

    def cancel(owner) -> None:
        results[owner.conversation_id] = tool(skill, owner, "cancel_timer")({})

    threads = [threading.Thread(target=cancel, args=(owner,)) for owner, _ in owners]
    for thread in threads:
        thread.start()
    rung = skill.fire_due(clock.now())
    for thread in threads:
        thread.join()
    for owner, heard in owners:
        assert len(heard) + ("cancelled" in results[owner.conversation_id]) == 1
    assert rung == sum(len(heard) for _, heard in owners)
