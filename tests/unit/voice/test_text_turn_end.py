"""The LLM's end-of-turn signal beside the sound's: commands and statements end after the short silence,
mid-clause pauses still wait, and without the LLM's signal the endpoint is what the sound and the words make it."""

from __future__ import annotations

import asyncio

import pytest

from app import protocol
from app.voice.turns import Endpointer, combined_probability

ENDPOINT_MS, COMPLETE_MS, UNFINISHED_MS = 400, 200, 1200
FRAME_MS, VAD_WINDOW_MS = 20, 32
COMMAND = "Set a timer for ten minutes."
SOUND_MISJUDGES = 0.05  # what Smart Turn said of commands and statements in the benchmark


def committed(conv):
    return lambda: bool([e for e in conv.of(protocol.Transcript) if e.final])


# ------------------------------------------------------------------ the rule
def test_a_command_the_sound_misjudges_ends_after_the_short_silence_when_the_llm_reads_it_finished():
    endpointer = Endpointer()
    assert endpointer.required_silence_ms(COMMAND, SOUND_MISJUDGES, "en", text_probability=0.4) == COMPLETE_MS
    assert endpointer.required_silence_ms(COMMAND, SOUND_MISJUDGES, "en") == UNFINISHED_MS  # the sound alone


@pytest.mark.parametrize("sound", [0.05, 0.97])  # a cut out of fluent speech can sound finished
def test_words_the_llm_reads_as_unfinished_wait_however_they_sound(sound):
    endpointer = Endpointer()
    assert endpointer.required_silence_ms("I would like to hear", sound, "en", text_probability=1e-9) == UNFINISHED_MS
    # Whisper's question mark on cut-off audio does not overrule the LLM (it did the sound alone): it writes a question
    # cut at its pause as one; when the mark overruled the LLM, bench turn-end's paused questions were judged paused
    # 20 of 44 times instead of 37 (2026-12-05)
    assert endpointer.required_silence_ms("What is the capital of?", sound, "en", 1e-8) == UNFINISHED_MS
    assert endpointer.required_silence_ms("Can you tell me?", sound, "en", 1e-7) == UNFINISHED_MS


@pytest.mark.parametrize(
    ("text", "sound", "expected"),
    [
        (COMMAND, 0.6, COMPLETE_MS),
        (COMMAND, 0.3, ENDPOINT_MS),
        (COMMAND, SOUND_MISJUDGES, UNFINISHED_MS),
        ("Can you recommend a good book?", SOUND_MISJUDGES, ENDPOINT_MS),
        (COMMAND, None, ENDPOINT_MS),
        ("I would like to visit Paris and", 0.99, UNFINISHED_MS),
    ],
)
def test_without_the_llm_s_signal_the_rule_is_the_sound_s_and_the_words(text, sound, expected):
    assert Endpointer().required_silence_ms(text, sound, "en", text_probability=None) == expected


def test_the_words_own_cue_still_waits_whatever_both_signals_say():
    assert Endpointer().required_silence_ms("I need to buy milk and", 0.99, "en", 0.9) == UNFINISHED_MS


def test_the_combination_grows_with_each_signal_and_is_the_sound_s_alone_without_the_llm():
    assert combined_probability(0.3, None) == 0.3 and combined_probability(None, None) is None
    assert combined_probability(0.3, 1e-3) < combined_probability(0.3, 1e-1) < combined_probability(0.3, 0.9)
    assert combined_probability(0.1, 1e-2) < combined_probability(0.9, 1e-2)
    assert combined_probability(None, 0.5) > 0.5 > combined_probability(None, 1e-5)


# ------------------------------------------------------------------ in a conversation
# how the verdict comes: from the speculative reply's own prefill (the engine's way), or asked apart
READ_BY_REPLY = pytest.mark.parametrize("read_by_reply", [True, False], ids=["read by the reply", "asked apart"])


@READ_BY_REPLY
async def test_a_command_ends_after_the_short_silence(conversation, read_by_reply):
    conv = conversation(turn_probability=SOUND_MISJUDGES, text_probability=0.4, system_prompt="Be brief.")
    conv.llm.reads_turn_end = read_by_reply
    await conv.speak(1.0, COMMAND)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert COMPLETE_MS <= waited_ms <= COMPLETE_MS + VAD_WINDOW_MS + FRAME_MS
    # one way or the other, never both; with the conversation its reply is asked with
    read, asked = conv.llm.turn_end_read, conv.llm.turn_end_asked
    [(asked_with, words)] = read if read_by_reply else asked
    assert not (asked if read_by_reply else read)
    assert words == COMMAND and asked_with[0] == {"role": "system", "content": "Be brief."}
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].metrics.turn_text_probability == 0.4


async def test_without_a_speculative_reply_the_verdict_is_asked_apart(conversation):
    conv = conversation(turn_probability=SOUND_MISJUDGES, text_probability=0.4, speculative_reply=False)
    conv.llm.reads_turn_end = True
    await conv.speak(1.0, COMMAND)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert COMPLETE_MS <= waited_ms <= COMPLETE_MS + VAD_WINDOW_MS + FRAME_MS
    assert [words for _, words in conv.llm.turn_end_asked] == [COMMAND] and conv.llm.turn_end_read == []


@pytest.mark.parametrize("how", ["remote LLM", "turned off", "failed"])
async def test_without_the_llm_s_signal_a_command_waits_as_the_sound_says(conversation, how):
    text_probability = RuntimeError("engine down") if how == "failed" else 0.4
    conv = conversation(
        turn_probability=SOUND_MISJUDGES,
        text_probability=text_probability,
        llm_scheduling=how != "remote LLM",
        turn_text_signal=how != "turned off",
    )
    await conv.speak(1.0, COMMAND)
    await conv.silence(0.9)
    assert not conv.finals()
    waited_ms = 900 + await conv.silence_until(committed(conv)) * 1000
    assert UNFINISHED_MS <= waited_ms <= UNFINISHED_MS + VAD_WINDOW_MS + FRAME_MS
    assert bool(conv.llm.turn_end_asked) == (how == "failed")


@READ_BY_REPLY
async def test_a_mid_clause_pause_both_signals_doubt_waits(conversation, read_by_reply):
    conv = conversation(turn_probability=SOUND_MISJUDGES, text_probability=1e-9)
    conv.llm.reads_turn_end = read_by_reply
    await conv.speak(1.0, "I would like to hear")
    await conv.silence(0.9)
    assert not conv.finals()
    waited_ms = 900 + await conv.silence_until(committed(conv)) * 1000
    assert UNFINISHED_MS <= waited_ms <= UNFINISHED_MS + VAD_WINDOW_MS + FRAME_MS


async def test_words_that_end_mid_clause_are_not_asked_about(conversation):
    conv = conversation(turn_probability=0.9, text_probability=0.9)
    await conv.speak(1.0, "Set a timer for")
    await conv.silence_until(committed(conv))
    assert conv.llm.turn_end_asked == []


@READ_BY_REPLY
async def test_a_late_llm_leaves_the_endpoint_to_the_other_cues_after_a_short_wait(conversation, read_by_reply):
    conv = conversation(turn_probability=0.95, text_probability=1e-9, turn_text_wait_ms=400)
    conv.llm.reads_turn_end = read_by_reply
    conv.llm.text_turn_gate = asyncio.Event()  # the engine is busy: no verdict comes
    await conv.speak(1.0, COMMAND)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    # the sound says the turn is over: the endpoint waits for the LLM until 400 ms of silence, no longer
    assert 400 <= waited_ms <= 400 + VAD_WINDOW_MS + 2 * FRAME_MS
    # a verdict asked apart is aborted at the commit; one the reply reads is the reply's, which goes on
    assert conv.llm.turn_end_cancelled == (0 if read_by_reply else 1)
    conv.llm.text_turn_gate.set()  # the engine gets to the reply (and the verdict it reads: too late to count)
    await conv.settle()
    metrics = conv.of(protocol.TurnDone)[-1].metrics
    # the words' own cue decided: the sound is not asked for a late verdict (it made the endpoint ~200 ms later)
    assert metrics.turn_text_probability is None and metrics.turn_probability is None


@READ_BY_REPLY
async def test_a_verdict_within_the_wait_still_holds_a_mid_clause_pause(conversation, read_by_reply):
    conv = conversation(turn_probability=0.95, text_probability=1e-9, turn_text_wait_ms=400)
    conv.llm.reads_turn_end = read_by_reply
    conv.llm.text_turn_gate = gate = asyncio.Event()
    await conv.speak(1.0, "Read me the latest")  # sounds finished; the LLM reads it as not
    await conv.silence(0.3)
    gate.set()
    await conv.silence(0.6)
    assert not conv.finals()
    waited_ms = 900 + await conv.silence_until(committed(conv)) * 1000
    assert UNFINISHED_MS <= waited_ms <= UNFINISHED_MS + VAD_WINDOW_MS + FRAME_MS


# ------------------------------------------------------------------ the sound, asked only where it matters
def test_the_sound_matters_only_where_the_words_leave_the_endpoint_open():
    endpointer = Endpointer()
    assert not endpointer.sound_matters(COMMAND, "en", 0.9)  # finished whatever it sounds like
    assert not endpointer.sound_matters("Play me the latest", "en", 1e-9)  # unfinished whatever it sounds like
    assert not endpointer.sound_matters("I need to buy milk and", "en", None)  # the words' own cue waits
    assert endpointer.sound_matters(COMMAND, "en", 0.02) and endpointer.sound_matters(COMMAND, "en", None)


@pytest.mark.parametrize(("words", "text_probability"), [(COMMAND, 0.9), ("I would like to hear", 1e-9)])
async def test_the_sound_is_not_asked_where_the_llm_s_verdict_decides(conversation, words, text_probability):
    conv = conversation(turn_probability=0.5, text_probability=text_probability)
    await conv.speak(1.0, words)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    expected = COMPLETE_MS if text_probability > 0.5 else UNFINISHED_MS
    assert expected <= waited_ms <= expected + VAD_WINDOW_MS + FRAME_MS
    await conv.settle()
    metrics = conv.of(protocol.TurnDone)[-1].metrics
    assert metrics.turn_probability is None and metrics.turn_detect_ms is None


@pytest.mark.parametrize(("sound", "expected"), [(0.9, COMPLETE_MS), (0.1, ENDPOINT_MS)])
async def test_where_the_llm_leaves_it_open_the_sound_is_asked_after_it_and_decides(conversation, sound, expected):
    conv = conversation(turn_probability=sound, text_probability=0.02)
    await conv.speak(1.0, COMMAND)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert expected <= waited_ms <= expected + VAD_WINDOW_MS + FRAME_MS
    await conv.settle()
    metrics = conv.of(protocol.TurnDone)[-1].metrics
    assert metrics.turn_probability == sound and metrics.turn_text_probability == 0.02


async def test_a_verdict_that_comes_after_the_wait_does_not_ask_the_sound(conversation):
    # a longer endpoint than the LLM's wait, so the turn is still open when the verdict comes
    conv = conversation(turn_probability=0.9, text_probability=0.02, endpoint_silence_ms=600, turn_text_wait_ms=400)
    conv.llm.text_turn_gate = gate = asyncio.Event()
    await conv.speak(1.0, COMMAND)
    await conv.silence(0.46)
    assert not conv.finals()
    gate.set()
    await conv.silence_until(committed(conv))
    await conv.settle()
    metrics = conv.of(protocol.TurnDone)[-1].metrics
    assert metrics.turn_text_probability == 0.02 and metrics.turn_probability is None
