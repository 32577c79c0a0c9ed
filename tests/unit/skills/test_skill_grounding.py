"""An action's arguments must come from what the user said: the checks that stopped a 0.5B model's made-up actions
(asked to turn on the lights, with no tool for that, it set a ten-minute timer; asked to water the plants, it set a
reminder to "call mom", the example in the tool's description)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from skill_fakes import FakeClock, conversation

from app.skills.reminders import ReminderSkill
from app.skills.spoken_time import said_durations, words_heard
from app.skills.timers import TimerSkill


def heard_by(owner, words: str):
    return replace(owner, heard=lambda: words)


def run(skill, owner, name: str, arguments: dict):
    return next(t for t in skill.tools(owner) if t.name == name).run(arguments)


def test_durations_said_anywhere_in_a_sentence():
    assert said_durations("Set a timer for ten minutes please.") == {600.0}
    assert said_durations("an hour and a half for the roast") == {5400.0}
    assert said_durations("one minute for the eggs and 2 minutes for toast") == {60.0, 120.0, 180.0}
    assert said_durations("Turn on the kitchen lights.") == set()


def test_a_timer_the_user_did_not_ask_for_is_not_set_and_a_made_up_label_is_left_out():
    skill = TimerSkill(FakeClock())
    owner, _ = conversation("a")
    lights = run(skill, heard_by(owner, "Turn on the kitchen lights."), "set_timer", {"duration": "ten minutes"})
    assert "error" in lights and "did not say how long" in lights["error"]
    asked = heard_by(owner, "Set a timer for 10 minutes.")
    assert run(skill, asked, "set_timer", {"duration": "ten minutes", "label": "Kitchen lights are on."}) == {
        "set": "a timer for 10 minutes",
        "ends_at": "14:32",
        "say": "Timer set for 10 minutes.",
    }
    pasta = run(skill, heard_by(owner, "Set a pasta timer for twelve minutes."), "set_timer", {"duration": "12 min"})
    assert pasta["set"] == "a timer for 12 minutes"
    assert run(skill, owner, "set_timer", {"duration": "ten minutes"})["set"]  # words not known: not checked
    assert len(run(skill, owner, "list_timers", {})["timers"]) == 3


def test_a_reminder_holds_what_the_user_said_not_a_description_s_example(tmp_path):
    skill = ReminderSkill(FakeClock(), tmp_path / "r.sqlite3")
    owner, _ = conversation("a")
    plants = heard_by(owner, "Remind me to water the plants at 6 pm.")
    assert "error" in run(skill, plants, "set_reminder", {"text": "call mom", "when": "tomorrow at six pm"})
    assert "error" in run(skill, plants, "set_reminder", {"text": "water the plants", "when": "tomorrow at 6 pm"})
    done = run(skill, plants, "set_reminder", {"text": "Water the plants", "when": "6 pm"})
    assert done["set"] == "a reminder" and done["when"] == "today at 18:00"
    mother = heard_by(owner, "Remind me to call my mother tomorrow at nine.")
    assert (
        run(skill, mother, "set_reminder", {"text": "call mother", "when": "tomorrow at 9"})["when"]
        == "tomorrow at 09:00"
    )


def test_words_heard_reads_numbers_as_digits_and_lets_small_words_go():
    assert words_heard("at 6 pm", "remind me at six")
    assert words_heard("tomorrow at nine", "call mum tomorrow at 9")
    assert not words_heard("tomorrow", "at six")
    # a time on the hour as the model writes it is the hour the user said (the 0.5B wrote "09:00" for "nine")
    assert words_heard("tomorrow at 09:00", "remind me tomorrow at 9.") and words_heard("at 9:00", "at nine")
    assert not words_heard("tomorrow at 9:30", "remind me tomorrow at 9.")
    assert not words_heard("tomorrow at 10:00", "remind me tomorrow at 9.")
    assert words_heard("call my mother", "call mum", share=0.5) and not words_heard("call mom", "water plants", 0.5)


def test_arithmetic_and_the_clock_are_done_only_when_the_words_ask_for_them():
    from app.skills.calculator import CalculatorSkill, numbers_heard
    from app.skills.clock import ClockSkill, asks_about_time_en

    assert numbers_heard("15% of 80", "What is 15 percent of 80?") and numbers_heard("0.15 * 80", "15 percent of 80")
    assert numbers_heard("12 * 7", "What is twelve times seven?")
    assert not numbers_heard("3 * 1000", "How many pounds is 3 kilograms?") and not numbers_heard("x", "1 and 2")
    owner, _ = conversation("a")
    cost = run(CalculatorSkill(), heard_by(owner, "Three apples cost how much?"), "calculate", {"expression": "3*1000"})
    assert cost["unasked"] is True and "result" not in cost
    # numbers not the user's, but the words ask a conversion: that is done instead (the 0.5B passed its own factor)
    pounds = run(
        CalculatorSkill(), heard_by(owner, "How many pounds is 3 kilograms?"), "calculate", {"expression": "3*2.2"}
    )
    assert pounds["say"] == "3 kilograms is about 6.614 pounds"
    assert (
        run(CalculatorSkill(), heard_by(owner, "What is 12 times 7?"), "calculate", {"expression": "12*7"})["result"]
        == 84
    )
    assert asks_about_time_en("What time is it?") and asks_about_time_en("What's the date today?")
    assert not asks_about_time_en("My name is Maya.") and not asks_about_time_en("I work as a nurse.")
    assert not asks_about_time_en("Tell me something interesting about whales.")
    assert asks_about_time_en("Quelle heure est-il ?")  # not English: not refused by an English word list
    clock = ClockSkill(FakeClock())
    assert run(clock, heard_by(owner, "My name is Maya."), "get_time", {})["unasked"] is True
    assert run(clock, heard_by(owner, "What time is it?"), "get_time", {})["time"] == "14:22"


def test_the_clock_s_english_check_on_its_written_sets():
    """The rule was written on the tune set (all of it right) and scored once on the held-out set, written after it
    and never tuned on (67/76 time questions kept, 78/79 others refused): a change that loses ground on either
    shows here."""
    from app.skills.clock import asks_about_time_en

    data = Path(__file__).parent / "data"
    tune = json.loads((data / "time_questions_tune.json").read_text())
    held_out = json.loads((data / "time_questions_held_out.json").read_text())
    assert [x["text"] for x in tune if asks_about_time_en(x["text"], "en") != x["asks_now"]] == []
    kept = sum(asks_about_time_en(x["text"], "en") for x in held_out if x["asks_now"])
    refused = sum(not asks_about_time_en(x["text"], "en") for x in held_out if not x["asks_now"])
    assert (kept, refused) >= (67, 78), (kept, refused)
    for misfire in ("How many days are in a week?", "Good morning! What a lovely day it is.", "How cold is it?"):
        assert not asks_about_time_en(misfire, "en")
    assert asks_about_time_en("good morning")  # not known to be English: not checked
    assert asks_about_time_en("Quelle heure est-il ?", "fr") and asks_about_time_en("Wie spät ist es?", "de")
