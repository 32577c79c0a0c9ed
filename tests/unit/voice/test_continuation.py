"""Continued turns: speech right after a commit, before the reply was heard, goes on with that turn.

A short endpoint (200 ms when the end-of-turn model is sure) answers quickly, and commits
at some mid-sentence pauses too ("I want to visit Paris. ... and London next summer").
Driven frame by frame with scripted stages and a manual clock, like test_conversation.
"""

from __future__ import annotations

import asyncio

import pytest

from app import protocol

FIRST, REST = "I want to visit Paris.", "and London next summer."
WHOLE = f"{FIRST} {REST}"
SURE = 0.9  # the end-of-turn model is sure: the endpoint is 200 ms


async def commit_first_half(conv) -> None:
    await conv.speak(1.0, FIRST)
    await conv.silence_until(lambda: bool(conv.finals()))
    assert conv.finals()[0].text == FIRST


async def test_going_on_right_after_the_commit_continues_the_turn(conversation):
    conv = conversation(turn_probability=SURE)
    await commit_first_half(conv)
    await conv.silence(0.3)  # 0.5 s of pause in all: some reply audio was sent, ~0.3 s of it "played"
    await conv.speak(1.0, REST)  # (ASR hears the new words; the turn's first half is their context)
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    await conv.settle()

    assert [event.turn_id for event in conv.of(protocol.TurnContinued)] == [1]
    assert [(final.turn_id, final.text) for final in conv.finals()] == [(1, FIRST), (1, WHOLE)]
    assert not conv.of(protocol.Interrupt), "a continued turn is not a barge-in"
    assert conv.llm.calls[-1][1:] == [{"role": "user", "content": WHOLE}]  # the first half's reply is gone
    assert conv.session.history == [
        {"role": "user", "content": WHOLE},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ]
    continued_at = conv.events.index(conv.of(protocol.TurnContinued)[0])
    later = conv.events[continued_at:]
    assert any(isinstance(e, protocol.TurnDone) and e.turn_id == 1 and not e.interrupted for e in later)
    partials = [e for e in later if isinstance(e, protocol.Transcript) and not e.final]
    assert all(p.turn_id == 1 and p.text.startswith(FIRST) for p in partials)


async def test_the_held_reply_sends_nothing_while_the_user_goes_on(conversation):
    conv = conversation(turn_probability=SURE)
    conv.llm.hold = asyncio.Event()  # the reply is still being produced when the user goes on
    await commit_first_half(conv)
    await conv.speak(0.2, REST)
    sent_before = len(conv.events), conv.audio_s
    conv.llm.hold.set()  # the reply finishes while the user speaks: held, not sent
    await conv.speak(0.6, REST)
    assert not [e for e in conv.events[sent_before[0] :] if isinstance(e, protocol.AssistantText | protocol.TurnDone)]
    assert conv.audio_s == sent_before[1]


async def test_a_cough_after_the_commit_lets_the_reply_go_on(conversation):
    conv = conversation(turn_probability=SURE)
    conv.llm.hold = asyncio.Event()
    await commit_first_half(conv)
    await conv.speak(0.3, "Mm.")  # a filler: dropped, not a continuation
    conv.llm.hold.set()
    await conv.silence_until(lambda: bool(conv.of(protocol.TurnDone)))
    assert not conv.of(protocol.TurnContinued) and not conv.of(protocol.Interrupt)
    # the client is told the cough is no turn; the turn's words, which its partials may have grown, stand
    dropped = conv.of(protocol.SpeechDropped)
    assert [(e.turn_id, e.reason, e.heard) for e in dropped] == [(1, "filler", "Mm.")]
    assert [(final.turn_id, final.text) for final in conv.finals()] == [(1, FIRST), (1, FIRST)]
    assert conv.events.index(dropped[0]) < conv.events.index(conv.finals()[1])
    assert conv.session.history == [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ]
    assert len(conv.llm.calls) == 1


async def test_speech_after_the_reply_was_heard_is_a_new_turn(conversation):
    conv = conversation(turn_probability=SURE, barge_in_confirm=False)
    conv.llm.pieces = ["Paris is lovely in spring and the museums are wonderful. ", "London too."]
    await commit_first_half(conv)
    await conv.silence(0.8)  # more than continuation_heard_ms of the reply played
    await conv.speak(1.0, "What about Rome?")
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert not conv.of(protocol.TurnContinued)
    assert [(f.turn_id, f.text) for f in conv.finals()] == [(1, FIRST), (2, "What about Rome?")]
    assert conv.of(protocol.Interrupt)[0].turn_id == 1


@pytest.mark.parametrize(
    ("heard_s", "said", "finals"),
    [(0.24, REST, [(1, FIRST), (1, WHOLE)]), (0.6, "What about Rome?", [(1, FIRST), (2, "What about Rome?")])],
)
async def test_what_was_heard_is_judged_when_the_user_began_not_when_the_vad_confirmed_it(
    conversation, heard_s, said, finals
):
    # The VAD confirms speech min_speech_ms after it began: here 0.4 s, in which the reply plays
    # on. Beginning with 0.24 s of it heard (< continuation_heard_ms, 500) continues the turn,
    # although 0.64 s had played by the time the VAD said so; beginning at 0.6 s does not.
    conv = conversation(turn_probability=SURE, min_speech_ms=400, barge_in_confirm=False, barge_in_ms=2000)
    conv.llm.pieces = ["Paris is lovely in spring and the museums are wonderful. ", "London too."]
    await commit_first_half(conv)
    await conv.silence_until(lambda: conv.audio_s > 0)
    await conv.silence(heard_s)
    await conv.speak(1.0, said)
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert [event.turn_id for event in conv.of(protocol.TurnContinued)] == ([1] if finals[1][0] == 1 else [])
    assert [(final.turn_id, final.text) for final in conv.finals()] == finals


async def test_without_the_setting_going_on_makes_a_second_turn(conversation):
    conv = conversation(turn_probability=SURE, continuation_ms=0)
    await commit_first_half(conv)
    await conv.silence(0.3)
    await conv.speak(1.0, REST)
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert not conv.of(protocol.TurnContinued)
    assert [f.turn_id for f in conv.finals()] == [1, 2]


async def test_speech_after_a_typed_turn_never_continues_it(conversation):
    conv = conversation(turn_probability=SURE)
    await conv.type("Tell me about Paris.")
    await conv.speak(1.0, REST)
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert not conv.of(protocol.TurnContinued)
    assert [f.text for f in conv.finals()] == ["Tell me about Paris.", REST]


async def test_speech_after_the_window_is_a_new_turn_however_little_was_heard(conversation):
    conv = conversation(turn_probability=SURE, continuation_heard_ms=5000, barge_in_confirm=False)
    conv.llm.pieces = ["Paris is lovely in spring and the museums are wonderful. " * 3]
    await commit_first_half(conv)
    await conv.silence(1.6)  # past continuation_ms (1500) after the commit
    await conv.speak(1.0, "What about Rome?")
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert not conv.of(protocol.TurnContinued)
    assert [f.turn_id for f in conv.finals()] == [1, 2]
