"""Durations and moments as a user says them, against a fixed now (Sunday 6 December 2026, 14:22 UTC)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from skill_fakes import NOW

from app.skills.spoken_time import SpokenTimeError, describe_duration, describe_moment, parse_duration, parse_when


def at(day: int, hour: int, minute: int = 0, month: int = 12, year: int = 2026) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=NOW.tzinfo)


@pytest.mark.parametrize(
    ("said", "seconds"),
    [
        ("ten minutes", 600),
        ("10 minutes", 600),
        ("half an hour", 1800),
        ("an hour and a half", 5400),
        ("one and a half hours", 5400),
        ("1.5 hours", 5400),
        ("90 seconds", 90),
        ("ninety seconds", 90),
        ("one second", 1),
        ("a minute", 60),
        ("twenty five minutes", 1500),
        ("1 hour and 30 minutes", 5400),
        ("2 hours, 15 minutes", 8100),
        ("a quarter of an hour", 900),
        ("three quarters of an hour", 2700),
        ("half a minute", 30),
        ("a couple of minutes", 120),
        ("for 5 minutes", 300),
        ("ten-minute", 600),
        ("1h30m", 5400),
        ("2 days", 2 * 86400),
    ],
)
def test_spoken_durations(said: str, seconds: float) -> None:
    assert parse_duration(said) == seconds


@pytest.mark.parametrize(
    ("said", "why"),
    [
        ("blorp", "could not understand the duration 'blorp'"),
        ("10", "could not understand"),  # no unit: not guessed to be minutes
        ("a few minutes", "could not understand"),  # not a number: not guessed
        ("10 minutes and blorp", "could not understand"),
        ("0 minutes", "between 1 second and 7 days"),
        ("8 days", "between 1 second and 7 days"),
        ("", "I need the duration"),
        ("9" * 300 + " minutes", "too long"),
    ],
)
def test_unreadable_or_unbounded_durations_say_why(said: str, why: str) -> None:
    with pytest.raises(SpokenTimeError, match=why):
        parse_duration(said)


@pytest.mark.parametrize(
    ("said", "moment"),
    [
        ("in two hours", at(6, 16, 22)),
        ("in an hour", at(6, 15, 22)),
        ("10 minutes", at(6, 14, 32)),
        ("10 minutes from now", at(6, 14, 32)),
        ("in 3 weeks", at(27, 14, 22)),
        ("tomorrow at nine", at(7, 9)),  # a named day: 7..11 is the morning
        ("tomorrow at 9:30 pm", at(7, 21, 30)),
        ("tomorrow at nine thirty", at(7, 9, 30)),
        ("friday at 3", at(11, 15)),  # a named day: 1..6 is the afternoon
        ("at 5 pm", at(6, 17)),  # still ahead today
        ("at 1 pm", at(7, 13)),  # past today, no day named: tomorrow
        ("at 9", at(6, 21)),  # no day, no am/pm: the next 9 o'clock
        ("at 17:30", at(6, 17, 30)),
        ("5 p.m.", at(6, 17)),
        ("half past nine", at(6, 21, 30)),
        ("quarter to six pm", at(6, 17, 45)),
        ("seven o'clock", at(6, 19)),
        ("noon", at(7, 12)),
        ("midnight", at(7, 0)),
        ("next Monday at 10am", at(7, 10)),  # today is Sunday
        ("tonight at 8", at(6, 20)),
        ("tonight", at(6, 20)),
        ("this evening", at(6, 18)),
        ("tomorrow morning", at(7, 9)),
        ("monday at 7 in the morning", at(7, 7)),
        ("at 6 in the evening", at(6, 18)),
        ("tomorrow", at(7, 9)),  # a day alone: 09:00
        ("on friday", at(11, 9)),
        ("the day after tomorrow at 8 am", at(8, 8)),
        ("in 2 days at 10am", at(8, 10)),
        ("december 25 at 8am", at(25, 8)),
        ("the 25th", at(25, 9)),
        ("the 3rd at noon", at(3, 12, month=1, year=2027)),
        ("2026-12-25 10:00", at(25, 10)),
    ],
)
def test_spoken_moments(said: str, moment: datetime) -> None:
    assert parse_when(said, NOW) == moment


@pytest.mark.parametrize(
    ("said", "why"),
    [
        ("blorp", "could not understand the time 'blorp'"),
        ("today at 9 am", "already past"),  # a day named and the time past: not rolled over
        ("today", "could not understand"),  # no time said
        ("tomorrow 9", "could not understand"),  # dateparser would drop the 9: not guessed
        ("at 25", "not a time of day"),
        ("at 9:75", "not a time of day"),
        ("in two years", "too far ahead"),
        ("a", "could not understand"),
        ("", "I need the time"),
    ],
)
def test_unreadable_or_past_moments_say_why(said: str, why: str) -> None:
    with pytest.raises(SpokenTimeError, match=why):
        parse_when(said, NOW)


def test_the_moment_keeps_nows_timezone() -> None:
    now = NOW.astimezone(timezone(timedelta(hours=-5)))  # 09:22 there
    assert parse_when("at 10 am", now) == datetime(2026, 12, 6, 10, 0, tzinfo=now.tzinfo)


def test_a_moment_across_a_daylight_saving_change_keeps_the_zones_rules(monkeypatch) -> None:
    """Berlin leaves summer time in the night of 24-25 October 2026: tomorrow at nine is 09:00 on that day's clock
    (+01:00, where today's offset said +02:00), and "in 12 hours" is twelve hours of real time. The system clock
    gives a time in the zone with its rules, not today's offset."""
    from zoneinfo import ZoneInfo

    import tzlocal

    from app.skills.base import SystemWallClock

    berlin = ZoneInfo("Europe/Berlin")
    evening = datetime(2026, 10, 24, 20, 0, tzinfo=berlin)
    nine = parse_when("tomorrow at nine am", evening)
    assert (nine.hour, nine.utcoffset()) == (9, timedelta(hours=1))
    later = parse_when("in 12 hours", evening)
    assert later - evening.astimezone(UTC) == timedelta(hours=12) and later.hour == 7
    monkeypatch.setenv("TZ", "Europe/Berlin")
    tzlocal.reload_localzone()
    try:
        now = SystemWallClock().now()
        assert now.tzinfo.key == "Europe/Berlin"
        assert now.utcoffset() == berlin.utcoffset(now.replace(tzinfo=None))
    finally:
        monkeypatch.delenv("TZ")
        tzlocal.reload_localzone()


def test_descriptions_are_spoken_words() -> None:
    assert describe_duration(5400) == "1 hour 30 minutes"
    assert describe_duration(1) == "1 second"
    assert describe_moment(at(6, 14, 32), NOW) == "today at 14:32"
    assert describe_moment(at(7, 9), NOW) == "tomorrow at 09:00"
    assert describe_moment(at(5, 9), NOW) == "yesterday at 09:00"
    assert describe_moment(at(11, 15), NOW) == "Friday at 15:00"
    assert describe_moment(at(25, 8), NOW) == "Friday 25 December at 08:00"
    assert describe_moment(at(3, 12, month=1, year=2027), NOW) == "Sunday 3 January 2027 at 12:00"
