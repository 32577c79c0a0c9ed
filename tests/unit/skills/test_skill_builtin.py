"""The clock skill, the built-in set (names, tools, lifecycle), and the due loop on a real event loop."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fakes import Conversation, ToolScriptedLLM
from skill_fakes import NOW, FakeClock, conversation

from app import protocol
from app.skills.base import ServerTool, SkillOwner, SystemWallClock
from app.skills.builtin import BUILTIN_SKILLS, SkillSet, builtin_skills
from app.skills.clock import ClockSkill, DueLoop, describe_now
from app.skills.reminders import ReminderSkill
from app.skills.timers import TimerSkill


def test_get_time_reads_the_injected_clock() -> None:
    owner, _ = conversation("a")
    (get_time,) = ClockSkill(FakeClock()).tools(owner)
    assert get_time.name == "get_time"
    assert get_time.run({}) == {
        "weekday": "Sunday",
        "date": "6 December 2026",
        "time": "14:22",
        "timezone": "UTC",
        "say": "It is 14:22 on Sunday, 6 December 2026.",
    }


def test_describe_now_is_one_line_for_a_prompt() -> None:
    assert describe_now(NOW.replace(minute=32)) == "It is Sunday, 6 December 2026, 14:32 (UTC)."
    paris = datetime(2026, 7, 1, 9, 5, tzinfo=timezone(timedelta(hours=2), "CEST"))
    assert describe_now(paris) == "It is Wednesday, 1 July 2026, 09:05 (CEST)."


def test_builtin_skills_by_name(tmp_path: Path) -> None:
    skills = builtin_skills(["calculator", "clock"], clock=FakeClock(), data_dir=tmp_path)
    assert [s.name for s in skills] == ["clock", "calculator"]
    everything = builtin_skills(BUILTIN_SKILLS, clock=FakeClock(), data_dir=tmp_path / "data")
    assert [s.name for s in everything] == list(BUILTIN_SKILLS)
    assert (tmp_path / "data" / "reminders.sqlite3").exists()
    with pytest.raises(ValueError, match=r"unknown skills \['weather'\].*'clock', 'timers'"):
        builtin_skills(["clock", "weather"], clock=FakeClock(), data_dir=tmp_path)


def test_the_set_gives_every_tool_once(tmp_path: Path) -> None:
    skills = SkillSet(builtin_skills(BUILTIN_SKILLS, clock=FakeClock(), data_dir=tmp_path))
    owner, _ = conversation("a")
    assert [t.name for t in skills.tools(owner)] == [
        "get_time",
        "set_timer",
        "list_timers",
        "cancel_timer",
        "set_reminder",
        "list_reminders",
        "cancel_reminder",
        "calculate",
        "convert_units",
    ]
    with pytest.raises(ValueError, match="share a name"):
        SkillSet([ClockSkill(FakeClock()), _Renamed(ClockSkill(FakeClock()))]).tools(owner)


class _Renamed:
    def __init__(self, skill: ClockSkill) -> None:
        self.name, self._skill = "another clock", skill

    def tools(self, owner):
        return self._skill.tools(owner)

    def close(self, owner) -> None:
        pass


def test_the_set_opens_and_closes_conversations(tmp_path: Path) -> None:
    clock = FakeClock()
    skills = SkillSet(builtin_skills(BUILTIN_SKILLS, clock=clock, data_dir=tmp_path))
    timers, reminders = skills.skills[1], skills.skills[2]
    assert isinstance(timers, TimerSkill) and isinstance(reminders, ReminderSkill)
    owner, heard = conversation("a")
    tools = {t.name: t for t in skills.tools(owner)}
    tools["set_timer"].run({"duration": "1 minute"})
    tools["set_reminder"].run({"text": "stretch", "when": "in 1 minute"})
    clock.advance(600)
    skills.opened(owner)  # the missed reminder is said as the conversation opens
    assert heard == [("reminder", "You missed a reminder, today at 14:23: stretch.")]
    skills.close(owner)
    assert timers.fire_due(clock.now()) == 0  # its timer went with it


class _JumpingClock:
    """The real wall clock, plus an offset a test may jump (as a suspended laptop's clock does)."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def now(self) -> datetime:
        return SystemWallClock().now() + self.offset


async def test_the_due_loop_rings_a_timer_on_a_real_event_loop(tmp_path: Path) -> None:
    clock = _JumpingClock()
    skills = SkillSet(builtin_skills(["timers", "reminders"], clock=clock, data_dir=tmp_path))
    timers = skills.skills[0]
    assert isinstance(timers, TimerSkill)
    heard: list[tuple[str, str]] = []
    rang = asyncio.Event()

    def announce(kind: str, text: str) -> None:
        heard.append((kind, text))
        rang.set()

    owner = SkillOwner("a", announce)
    await skills.start()
    try:
        # set from worker threads, as sync tools run; the shortest timer is 1 s, so the clock jumps 0.95 s and
        # the next change (a second timer) wakes the loop, which finds the first due in 0.05 s
        await asyncio.to_thread(timers.set_timer, owner, {"duration": "1 second", "label": "tea"})
        clock.offset = timedelta(seconds=0.95)
        started = time.perf_counter()
        await asyncio.to_thread(timers.set_timer, owner, {"duration": "10 minutes", "label": "bread"})
        await asyncio.wait_for(rang.wait(), timeout=10)
        assert time.perf_counter() - started < 5  # at its deadline, not at the 10-minute one (any machine, any load)
        assert heard == [("timer", "Your tea timer is done.")]
    finally:
        await skills.stop()


async def test_the_due_loop_wakes_when_deadlines_change() -> None:
    deadlines: list[datetime] = []
    fired: list[datetime] = []
    clock = SystemWallClock()

    def fire_due(now: datetime) -> None:
        while deadlines and deadlines[0] <= now:
            fired.append(deadlines.pop(0))

    loop = DueLoop(clock, lambda now: deadlines[0] if deadlines else None, fire_due, max_sleep_s=5)
    await loop.start()
    try:
        await asyncio.sleep(0.01)  # asleep, with nothing due
        deadlines.append(clock.now() + timedelta(seconds=0.05))
        loop.wake()
        for _ in range(50):
            if fired:
                break
            await asyncio.sleep(0.01)
        assert len(fired) == 1
    finally:
        await loop.stop()


class _Home:
    """A skill with words for the system prompt, as an MCP server's prompt gives them (``Instructs``)."""

    name = "home"

    def tools(self, owner):
        return (ServerTool("HassTurnOn", lambda arguments: "done", "Turns on a device"),)

    def instructions(self) -> str:
        return "The devices of this home: Kitchen light (light, in the Kitchen)."

    def close(self, owner) -> None:
        pass


async def test_the_skills_words_join_the_system_prompt_while_their_tools_are_the_ones_offered(tmp_path: Path) -> None:
    skills = SkillSet([ClockSkill(FakeClock()), _Home()])
    assert skills.instructions() == _Home().instructions()
    conv = Conversation(llm=ToolScriptedLLM([["It is on."]]), skills=skills)
    await conv.type("Turn on the kitchen light.")
    system = conv.llm.calls[-1][0]
    assert system["role"] == "system" and system["content"].endswith("\n\n" + _Home().instructions())
    # a client that declares its own tools gets its own prompt: the home's words are not in it
    await conv.session.handle(protocol.SessionConfig(tools=[protocol.FunctionTool(name="get_weather")]))
    await conv.settle()
    await conv.type("Is it raining?")
    assert _Home().instructions() not in conv.llm.calls[-1][0]["content"]


async def test_the_skills_words_said_back_are_cut_and_counted(tmp_path: Path) -> None:
    said_back = ["Hm. The devices of this home: Kitchen light ", "(light, in the Kitchen). ", "Anything else?"]
    conv = Conversation(llm=ToolScriptedLLM([said_back]), skills=SkillSet([_Home()]))
    await conv.type("on the kitchen lights")
    [done] = conv.of(protocol.TurnDone)
    # what was said before the run was whole stays said (and is the reply's text); nothing after its tenth word
    assert done.text.startswith("Hm.") and "Kitchen light" not in done.text and done.metrics.guard_runaway == 1
    assert "Kitchen light" not in " ".join(text for _, text in conv.session.models.tts.spoken)
