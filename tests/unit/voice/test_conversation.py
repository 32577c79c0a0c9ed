"""Every turn-taking rule, driven frame by frame with scripted VAD/ASR/LLM/TTS and a manual clock.

Audio time is exact here (20 ms frames), so the rules are checked to the frame, not
within a real-time margin; real models are exercised by tests/integration.
"""

from __future__ import annotations

import asyncio

import pytest

from app import protocol
from app.voice.reply import YIELD_AHEAD_S
from app.voice.reply_audio import LEAD_KEEP_MS

QUESTION = "What is the capital of France?"
ENDPOINT_MS, UNFINISHED_MS, PAUSE_MS = 400, 1200, 96
FRAME_MS, VAD_WINDOW_MS = 20, 32


def committed(conv):
    return lambda: bool(conv.finals())


async def test_a_finished_sentence_commits_after_the_endpoint_silence(conversation):
    conv = conversation()
    await conv.speak(1.0, QUESTION)
    assert conv.of(protocol.SpeechStarted) and not conv.finals()
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    # the VAD places the speech end at the first quiet window; the endpoint counts silence from there
    assert ENDPOINT_MS <= waited_ms <= ENDPOINT_MS + VAD_WINDOW_MS + FRAME_MS
    [final] = conv.finals()
    assert final.text == QUESTION and final.turn_id == 1
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.text == "Paris is the capital of France." and not done.interrupted
    assert conv.audio_s > 0


async def test_a_reply_s_audio_starts_just_before_its_first_word(conversation):
    conv = conversation(llm_pieces=["Paris is the capital of France. ", "It is lovely."])
    conv.session.models.tts.lead_quiet_s = 0.1  # the voice starts each piece with 100 ms of near-silence
    await conv.type("Hi")
    await conv.settle()
    # nine words of 0.25 s; 20 ms of the first piece's quiet, all of the second's (the gap between them)
    assert conv.audio_s == pytest.approx(9 * 0.25 + LEAD_KEEP_MS / 1000 + 0.1, abs=1e-3)


async def test_words_ending_mid_clause_wait_for_the_longer_silence(conversation):
    conv = conversation()
    await conv.speak(1.0, "I would like to visit Paris and")
    await conv.silence(0.9)  # more than the 400 ms endpoint, less than the 1200 ms one
    assert not conv.finals()
    waited_ms = 900 + await conv.silence_until(committed(conv)) * 1000
    assert UNFINISHED_MS <= waited_ms <= UNFINISHED_MS + VAD_WINDOW_MS + FRAME_MS


async def test_going_on_after_a_mid_clause_pause_makes_one_turn(conversation):
    conv = conversation()
    await conv.speak(1.0, "I would like to visit Paris and")
    await conv.silence(0.7)
    await conv.speak(1.0, "I would like to visit Paris and London next summer.")
    await conv.silence_until(committed(conv))
    assert [f.text for f in conv.finals()] == ["I would like to visit Paris and London next summer."]
    assert len(conv.of(protocol.SpeechStarted)) == 2  # the client saw the user resume


async def test_a_speculative_reply_is_held_until_the_endpoint_and_then_released(conversation):
    conv = conversation()
    await conv.speak(1.0, QUESTION)
    await conv.silence(0.2)  # paused, tail transcribed, endpoint not reached
    assert len(conv.llm.calls) == 1, "the reply was not started at the pause"
    assert conv.llm.calls[0][-1] == {"role": "user", "content": QUESTION}
    assert not conv.of(protocol.AssistantText) and conv.audio_s == 0, "a speculation sent something"
    await conv.silence_until(committed(conv))
    await conv.settle()
    assert len(conv.llm.calls) == 1  # released, not asked again
    assert conv.of(protocol.AssistantText) and conv.audio_s > 0
    assert conv.of(protocol.TurnDone)[-1].metrics.speculative is True
    assert conv.session.history[-1] == {"role": "assistant", "content": "Paris is the capital of France."}


async def test_a_speculation_is_dropped_when_the_user_goes_on(conversation):
    conv = conversation()
    await conv.speak(1.0, "Tell me about Paris.")
    await conv.silence(0.2)
    first_request = conv.llm.request_ids[0]
    await conv.speak(0.8, "Tell me about Paris. And London too.")
    assert first_request in conv.llm.closed, "the speculative LLM request was not aborted"
    await conv.silence_until(committed(conv))
    await conv.settle()
    assert [f.text for f in conv.finals()] == ["Tell me about Paris. And London too."]
    requests = conv.llm.request_ids
    assert len(requests) == len(set(requests)) == 2  # the re-speculation has its own request id
    assert conv.llm.calls[-1][-1]["content"] == "Tell me about Paris. And London too."
    assert all(event.turn_id == 1 for event in conv.of(protocol.AssistantText))  # nothing leaked twice
    assert len(conv.of(protocol.TurnDone)) == 1


async def test_no_speculation_without_the_setting(conversation):
    conv = conversation(speculative_reply=False)
    await conv.speak(1.0, QUESTION)
    await conv.silence(0.2)
    assert not conv.llm.calls
    await conv.silence_until(committed(conv))
    assert len(conv.llm.calls) == 1


@pytest.mark.parametrize(("heard", "reason"), [("Mm.", "filler"), ("", "no_words")])
async def test_a_filler_or_speech_with_no_words_is_not_a_turn_and_the_client_is_told(conversation, heard, reason):
    conv = conversation()
    await conv.speak(0.4, heard)
    await conv.silence(1.5)
    assert not conv.finals() and not conv.llm.calls and not conv.session.history
    assert [(e.turn_id, e.reason, e.heard) for e in conv.of(protocol.SpeechDropped)] == [(1, reason, heard)]


async def reply_playing(conv) -> None:
    conv.llm.pieces = ["Once upon a time there was a dragon. ", "It lived in a cave by the sea. ", "The end."]
    await conv.type("Tell me a story.")
    assert conv.audio_s > 3  # the whole reply was produced and sent; it plays in clock time


async def test_sustained_speech_over_a_reply_interrupts_it(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.silence(1.0)  # the user hears a second of the story
    assert not conv.of(protocol.Interrupt)
    spoke = 0.0
    while not conv.of(protocol.Interrupt):
        assert spoke < 1.0, "sustained speech did not interrupt"
        await conv.speak(0.02, "Wait, what is the capital of France?")
        spoke += 0.02
    assert 0.4 <= spoke <= 0.4 + 0.02 + 0.001
    done = conv.of(protocol.TurnDone)[-1]
    assert done.turn_id == 1 and done.interrupted and done.metrics.barge_in


async def test_a_short_burst_over_a_reply_does_not_interrupt(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.silence(0.5)
    await conv.speak(0.3, "Mm-hmm.")  # shorter than barge_in_ms, and a filler
    await conv.silence(1.5)
    assert not conv.of(protocol.Interrupt)
    assert [f.turn_id for f in conv.finals()] == [1]  # only the typed turn


async def test_an_interrupted_reply_leaves_only_what_was_heard_in_the_history(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    full = "Once upon a time there was a dragon. It lived in a cave by the sea. The end."
    await conv.silence(1.5)  # ~6 words played (0.25 s a word), then ~0.4 s more while the user talks
    await conv.speak(0.5, "Wait, stop.")
    assert conv.of(protocol.Interrupt)
    heard = conv.session.history[1]
    assert heard["role"] == "assistant"
    assert full.startswith(heard["content"]) and 0 < len(heard["content"]) < len(full)
    assert 6 <= len(heard["content"].split()) <= 9
    await conv.silence_until(lambda: len(conv.finals()) == 2)  # the interruption becomes the next turn
    assert conv.finals()[-1].text == "Wait, stop."


async def test_each_reply_is_given_the_earlier_replies_its_prompt_leaves_out_too(conversation):
    # the LLM's DRY reads them (``ChatLLM.stream``): a reply not shown to the model is not said again either
    conv = conversation(history_replies="none")
    await conv.type("Hello?")
    await conv.settle()
    await conv.silence(3.0)  # the reply is heard to its end
    await conv.type("And again?")
    await conv.settle()
    assert conv.llm.earlier_replies == [(), ("Paris is the capital of France.",)]
    assert all(m["role"] != "assistant" for m in conv.llm.calls[-1])  # the prompt shows none


async def test_an_interrupted_reply_is_given_to_the_next_as_what_was_heard(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.silence(1.5)
    await conv.speak(0.5, "Wait, stop.")
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    await conv.settle()
    heard = conv.session.history[1]["content"]
    assert conv.llm.earlier_replies[-1] == (heard,) and heard.startswith("Once upon a time")


async def test_playback_reports_from_the_client_decide_what_was_heard(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.session.handle(protocol.parse_client_text('{"type": "playback", "turn_id": 1, "played_ms": 600}'))
    await conv.silence(1.0)
    await conv.speak(0.5, "Stop.")
    assert conv.session.history[1]["content"] == "Once upon"  # 0.6 s of 0.25 s words, whatever the clock says


async def test_partials_only_grow_and_share_the_turn_id(conversation):
    conv = conversation(partial_interval_ms=200)
    conv.asr.partial = "What is"
    await conv.speak(0.5)
    conv.asr.partial = "What is the capital"
    await conv.speak(0.5)
    conv.asr.partial = "What is the capital of France"
    await conv.speak(0.5, QUESTION)
    partials = [t for t in conv.of(protocol.Transcript) if not t.final]
    assert partials, "no partial transcript"
    texts = [p.text for p in partials]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert {p.turn_id for p in partials} == {1}


async def test_an_llm_that_fails_is_told_aloud_and_the_next_turn_is_answered(conversation):
    """A backend that raises (a remote server down): a short sentence aloud, never written as the reply, a typed
    ``llm_unavailable`` error, the question forgotten as any failed turn's; the next turn asks the LLM again."""
    conv = conversation()

    async def failing(request):
        raise ConnectionError("connection refused")
        yield ""  # pragma: no cover

    real_stream = conv.llm.stream
    conv.llm.stream = failing
    await conv.type("Hello?")
    [error] = conv.of(protocol.Error)
    assert error.code == "llm_unavailable" and "connection refused" in error.message and error.turn_id == 1
    assert conv.audio_s > 1.0  # the notice, spoken
    assert not conv.of(protocol.AssistantText) and not conv.of(protocol.TurnDone)
    assert conv.session.history == []
    conv.llm.stream = real_stream
    await conv.type("Hello again?")
    assert conv.of(protocol.TurnDone)[-1].turn_id == 2
    assert [m["content"] for m in conv.session.history] == ["Hello again?", "Paris is the capital of France."]


async def test_an_llm_silent_past_its_wait_is_given_up_and_its_request_closed(conversation):
    """A server that takes the request and says nothing (overloaded, restarting): given up after ``llm_wait_s``."""
    conv = conversation(llm_pieces=[], llm_wait_s=0.05)
    conv.llm.hold = asyncio.Event()  # never set: the stream stays open without a word
    await conv.type("Hello?")
    for _ in range(500):  # (real time: the wait is the event loop's)
        if conv.of(protocol.Error):
            break
        await asyncio.sleep(0.01)
    [error] = conv.of(protocol.Error)
    assert error.code == "llm_unavailable" and "0.05 s" in error.message
    assert conv.llm.closed == conv.llm.request_ids  # the request is closed: its server aborts it
    assert conv.audio_s > 1.0 and conv.session.history == []


async def test_an_error_of_our_own_is_still_a_failed_turn(conversation):
    """Only the LLM's failure is told as the LLM's (here the TTS fails)."""
    conv = conversation()

    def broken(*args, **kwargs):
        raise RuntimeError("tts broke")

    conv.session._replies._wiring.models.tts.synthesize = broken
    await conv.type("Hello?")
    assert [error.code for error in conv.of(protocol.Error)] == ["turn_failed"]


async def test_reset_forgets_the_history_and_close_aborts_the_reply(conversation):
    conv = conversation()
    await conv.type("Hi.")
    assert conv.session.history
    await conv.session.handle(protocol.parse_client_text('{"type": "reset"}'))
    assert conv.session.history == []
    conv.llm.hold = asyncio.Event()  # a reply that is still streaming
    await conv.type("Tell me more.")
    request_id = conv.llm.request_ids[-1]
    assert request_id not in conv.llm.closed
    await conv.session.close()
    assert request_id in conv.llm.closed


async def test_turn_metrics_are_observed_once_per_turn(conversation):
    conv = conversation()
    await conv.speak(1.0, QUESTION)
    await conv.silence_until(committed(conv))
    await conv.settle()
    [metrics] = conv.metrics
    assert metrics.endpoint_ms is not None and 399.9 <= metrics.endpoint_ms <= 460  # clock time, frame-exact
    assert metrics.voice_to_voice_ms is not None and metrics.rtf is not None and metrics.underruns == 0


async def test_a_reply_of_one_short_piece_still_reports_when_it_was_written(conversation):
    conv = conversation(llm_pieces=["Paris."])  # no break follows: the splitter's flush releases it
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].metrics.llm_first_piece_ms is not None


async def test_cancel_stops_the_reply_and_keeps_what_was_heard(conversation):
    conv = conversation()
    await reply_playing(conv)
    await conv.silence(1.0)
    await conv.session.handle(protocol.parse_client_text('{"type": "cancel"}'))
    assert conv.of(protocol.Interrupt)[-1].turn_id == 1
    done = conv.of(protocol.TurnDone)[-1]
    assert done.interrupted and not done.metrics.barge_in  # stopped by the client, not by speech
    assert conv.session.history[0]["content"] == "Tell me a story."
    assert 0 < len(conv.session.history[1]["content"].split()) < 20
    await conv.type("Go on.")  # the conversation continues with what was heard
    assert conv.llm.calls[-1][-2] == conv.session.history[1]


async def test_a_turn_cancelled_before_any_of_its_reply_was_heard_is_taken_back(conversation):
    conv = conversation()
    await conv.type("What is the capital of France?")
    conv.clock.advance(5.0)  # heard in full
    await reply_playing(conv)  # "Tell me a story.": its audio was sent, none of it has played yet
    await conv.session.handle(protocol.parse_client_text('{"type": "cancel"}'))
    assert conv.of(protocol.TurnDone)[-1].interrupted and conv.of(protocol.TurnDone)[-1].text == ""
    assert [m["content"] for m in conv.session.history] == [
        "What is the capital of France?",
        "Paris is the capital of France.",
    ]
    await conv.type("And Italy?")
    assert "Tell me a story." not in [m["content"] for m in conv.llm.calls[-1]]


async def test_config_changes_the_next_turn_and_rejects_what_the_server_lacks(conversation):
    conv = conversation()
    await conv.session.handle(
        protocol.parse_client_text(
            '{"type": "config", "system_prompt": "Answer like a pirate.", "voice": "other-tone"}'
        )
    )
    applied = conv.of(protocol.ConfigApplied)[-1]
    assert applied.system_prompt == "Answer like a pirate." and applied.voice == "other-tone" and applied.barge_in
    await conv.type("Hello?")
    assert conv.llm.calls[-1][0] == {"role": "system", "content": "Answer like a pirate."}
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "voice": "nobody"}'))
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "language": "fr"}'))
    errors = [e for e in conv.of(protocol.Error) if e.code == "bad_config"]
    assert len(errors) == 2 and "nobody" in errors[0].message and "'fr'" in errors[1].message
    assert conv.session.prefs.voice == "other-tone"  # a rejected config changes nothing


async def test_a_text_only_reply_is_written_and_done_without_speech(conversation):
    conv = conversation(llm_pieces=["Paris is the capital of France. ", "It is lovely."])
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "reply_audio": false}'))
    assert conv.of(protocol.ConfigApplied)[-1].reply_audio is False
    await conv.type(QUESTION)
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.text == "Paris is the capital of France. It is lovely." and not done.interrupted
    assert "".join(e.delta for e in conv.of(protocol.AssistantText)) == "Paris is the capital of France. It is lovely."
    assert conv.audio_s == 0 and not conv.of(protocol.AudioStart) and not conv.session.models.tts.spoken
    assert done.metrics.tts_first_audio_ms is None and done.metrics.llm_ttft_ms is not None
    assert conv.session.history[-1] == {"role": "assistant", "content": done.text}
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "reply_audio": true}'))
    await conv.type("Is it far from Rome?")
    await conv.settle()
    assert conv.audio_s > 0 and conv.of(protocol.AudioStart)  # spoken again
    assert conv.llm.calls[-1][1:3] == conv.session.history[:2]  # the same history, whether spoken or not


async def test_a_cancelled_text_only_reply_keeps_the_text_that_was_sent(conversation):
    gate = asyncio.Event()
    conv = conversation(llm_pieces=["Once upon a time ", "there was a dragon."])
    conv.llm.gate = gate  # the second piece waits: the cancel comes after the first was sent
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "reply_audio": false}'))
    await conv.type("Tell me a story.")
    await conv.session.handle(protocol.parse_client_text('{"type": "cancel"}'))
    done = conv.of(protocol.TurnDone)[-1]
    assert done.interrupted and done.text == "Once upon a time"
    assert conv.session.history[-1] == {"role": "assistant", "content": "Once upon a time"}


async def test_without_barge_in_speech_does_not_interrupt(conversation):
    conv = conversation()
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "barge_in": false}'))
    await reply_playing(conv)
    await conv.speak(1.0, "Hello there, listen.")
    assert not conv.of(protocol.Interrupt)


async def test_half_duplex_ignores_the_microphone_while_the_reply_plays(conversation):
    conv = conversation()
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "half_duplex": true}'))
    await reply_playing(conv)
    await conv.speak(1.0, "This is the speaker's echo.")
    await conv.silence(1.0)
    assert not conv.of(protocol.Interrupt) and not conv.of(protocol.SpeechStarted)
    await conv.silence(4.0)  # the reply has played out: the microphone counts again
    await conv.speak(0.8, "Now I speak.")
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert conv.finals()[-1].text == "Now I speak."


COMPLETE_MS = 200


async def test_a_confident_end_of_turn_model_commits_after_a_short_silence(conversation):
    conv = conversation(turn_probability=0.95)
    await conv.speak(1.0, QUESTION)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert COMPLETE_MS <= waited_ms <= COMPLETE_MS + VAD_WINDOW_MS + FRAME_MS
    metrics = (await _done(conv)).metrics
    assert metrics.turn_probability == 0.95 and metrics.turn_detect_ms is not None


async def test_a_model_sure_the_user_is_mid_thought_waits_as_long_as_mid_clause(conversation):
    # Whisper heard "... Paris then." (no "and"): the words look finished, the sound does not
    conv = conversation(turn_probability=0.05)
    await conv.speak(1.0, "I would like to visit Paris then.")
    await conv.silence(0.9)
    assert not conv.finals()
    waited_ms = 900 + await conv.silence_until(committed(conv)) * 1000
    assert UNFINISHED_MS <= waited_ms <= UNFINISHED_MS + VAD_WINDOW_MS + FRAME_MS


async def test_the_end_of_turn_model_runs_on_a_core_the_llm_lent_it(conversation):
    # It runs as a speculative reply's first tokens are written on every core (BesideTheLLM)
    conv = conversation(turn_probability=0.95)
    lent_during_calls = []
    judge = conv.session.models.turn.complete_probability

    def recording(audio):
        lent_during_calls.append(conv.llm.cores_lent)
        return judge(audio)

    conv.session.models.turn.complete_probability = recording
    await conv.speak(1.0, QUESTION)
    await conv.silence_until(committed(conv))
    assert lent_during_calls and all(lent == 1 for lent in lent_during_calls)
    assert conv.llm.cores_lent == 0, "the core is given back after each call"


async def test_the_words_mid_clause_overrule_a_confident_model(conversation):
    conv = conversation(turn_probability=0.99)
    await conv.speak(1.0, "I would like to visit Paris and")
    await conv.silence(0.9)
    assert not conv.finals()


async def test_an_unsure_model_leaves_the_usual_endpoint(conversation):
    conv = conversation(turn_probability=0.35)
    await conv.speak(1.0, QUESTION)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert ENDPOINT_MS <= waited_ms <= ENDPOINT_MS + VAD_WINDOW_MS + FRAME_MS


async def test_a_failing_model_leaves_the_words_to_decide(conversation):
    conv = conversation(turn_probability=RuntimeError("onnx session broke"))
    await conv.speak(1.0, QUESTION)
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert ENDPOINT_MS <= waited_ms <= ENDPOINT_MS + VAD_WINDOW_MS + FRAME_MS
    assert (await _done(conv)).metrics.turn_probability is None


async def test_the_model_hears_the_whole_utterance(conversation):
    conv = conversation(turn_probability=0.9)
    await conv.speak(2.0, QUESTION)
    await conv.silence_until(committed(conv))
    [heard] = conv.session.models.turn.heard_seconds
    assert 2.0 <= heard <= 2.0 + 0.3 + 0.2  # the speech, the pre-roll and the tail pad


async def _done(conv):
    await conv.settle()
    return conv.of(protocol.TurnDone)[-1]


async def test_the_session_language_reaches_every_transcription(conversation):
    conv = conversation()
    await conv.speak(0.6, "Hello.")
    await conv.silence_until(committed(conv))
    assert set(conv.asr.languages_asked) == {"en"}
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "language": ""}'))  # detect it
    conv.asr.languages_asked.clear()
    await conv.speak(0.6, "Hallo.")
    await conv.silence_until(lambda: len(conv.finals()) == 2)
    assert conv.asr.languages_asked and set(conv.asr.languages_asked) == {""}
    assert [f.language for f in conv.finals()] == ["en", "de"]  # the detected language is reported


async def test_a_long_backchannel_over_a_reply_neither_stops_it_nor_becomes_a_turn(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.silence(0.5)
    await conv.speak(0.8, "Mm-hmm, yeah.")  # longer than barge_in_ms: only its words tell it apart
    await conv.silence(1.5)
    assert not conv.of(protocol.Interrupt)
    assert [f.turn_id for f in conv.finals()] == [1]
    assert [(e.turn_id, e.reason, e.heard) for e in conv.of(protocol.SpeechDropped)] == [
        (2, "backchannel", "Mm-hmm, yeah.")
    ]
    assert len(conv.llm.calls) == 1


async def test_a_backchannel_that_goes_on_into_words_interrupts(conversation):
    conv = conversation(barge_in_ms=400)
    await reply_playing(conv)
    await conv.silence(0.5)
    conv.asr.text = "Yeah."
    await conv.speak(0.5)
    assert not conv.of(protocol.Interrupt)
    conv.asr.text = "Yeah, but wait, what about London?"
    await conv.speak(0.6)
    assert conv.of(protocol.Interrupt)


async def test_yeah_as_an_answer_is_a_turn_when_nothing_is_playing(conversation):
    conv = conversation()
    await conv.speak(0.6, "Yeah.")
    await conv.silence_until(committed(conv))
    assert conv.finals()[-1].text == "Yeah."


async def test_without_confirmation_sustained_speech_interrupts_whatever_it_says(conversation):
    conv = conversation(barge_in_ms=400, barge_in_confirm=False)
    await reply_playing(conv)
    await conv.silence(0.5)
    await conv.speak(0.6, "Mm-hmm, yeah.")
    assert conv.of(protocol.Interrupt)


async def test_a_turn_in_another_language_gets_that_language_s_voice_and_reply(conversation):
    conv = conversation()
    await conv.session.handle(
        protocol.parse_client_text('{"type": "config", "language": ""}')
    )  # detect it (the fake hears German)
    await conv.speak(0.8, "Wie spät ist es?")
    await conv.silence_until(committed(conv))
    await conv.settle()
    assert conv.finals()[-1].language == "de"
    assert {voice for voice, _ in conv.session.models.tts.spoken} == {"other-tone"}
    assert conv.llm.calls[-1][0]["content"].endswith("The user speaks German: answer in German.")
    assert not conv.of(protocol.Notice)


async def test_a_language_without_a_voice_is_answered_in_the_default_one_with_a_notice(conversation):
    conv = conversation()
    conv.session.models.tts.voice_for = lambda language: "tone" if language == "en" else None
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "language": ""}'))
    for _ in range(2):
        await conv.speak(0.8, "Wie spät ist es?")
        await conv.silence(1.5)
    notices = [n for n in conv.of(protocol.Notice) if n.code == "no_voice"]
    assert len(notices) == 1 and "German" in notices[0].message  # said once, not every turn
    assert {voice for voice, _ in conv.session.models.tts.spoken} == {"tone"}


async def test_a_voice_the_client_chose_answers_in_every_language(conversation):
    conv = conversation()
    await conv.session.handle(protocol.parse_client_text('{"type": "config", "language": "", "voice": "tone"}'))
    await conv.speak(0.8, "Wie spät ist es?")
    await conv.silence_until(committed(conv))
    await conv.settle()
    assert {voice for voice, _ in conv.session.models.tts.spoken} == {"tone"}


async def test_a_question_mark_outweighs_a_model_that_hears_an_unfinished_turn(conversation):
    conv = conversation(turn_probability=0.03)
    await conv.speak(1.0, "Can you recommend a good book?")
    waited_ms = await conv.silence_until(committed(conv)) * 1000
    assert ENDPOINT_MS <= waited_ms <= ENDPOINT_MS + VAD_WINDOW_MS + FRAME_MS


async def test_no_partial_starts_while_the_speech_may_be_ending(conversation):
    """In the VAD's hangover the next ASR job should be the tail, not a partial that would delay it."""
    conv = conversation(partial_interval_ms=100)
    conv.asr.partial = "What is the capital"
    await conv.speak(1.0, QUESTION)
    assert False in conv.asr.calls, "no partial while speaking"
    spoken_calls = len(conv.asr.calls)
    await conv.silence_until(lambda: True in conv.asr.calls[spoken_calls:])  # the tail
    assert conv.asr.calls[spoken_calls:] == [True]


async def test_with_first_piece_priority_the_first_piece_is_urgent_while_the_llm_waits(conversation):
    pieces = ["Paris is the capital of France. ", "It lies on the Seine. ", "It is big."]
    conv = conversation(llm_pieces=pieces, first_piece_priority=True)
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text.endswith("It is big.")
    assert conv.session.models.tts.urgent == [True, False, False]
    request = conv.llm.request_ids[-1]
    assert conv.llm.pauses == [("pause", request), ("resume", request)]
    plain = conversation(llm_pieces=pieces)  # the default: every piece alike, the LLM never paused
    await plain.type(QUESTION)
    await plain.settle()
    assert plain.session.models.tts.urgent == [False, False, False] and plain.llm.pauses == []
    solo = conversation(llm_pieces=pieces)
    solo.session.models.solo = True  # the server's solo mode: one session open
    await solo.type(QUESTION)
    await solo.settle()
    assert solo.session.models.tts.urgent == [True, False, False] and len(solo.llm.pauses) == 2


async def test_each_piece_asks_tts_for_it_by_when_the_listener_runs_out_of_audio(conversation):
    # WordTTS: a quarter second a word; the clock stands still, so the client has played nothing yet
    pieces = ["Paris is the capital of France. ", "It lies on the Seine. ", "It is big."]
    conv = conversation(llm_pieces=pieces)
    now = conv.clock.now()
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text.endswith("It is big.")
    # the first piece is needed now; each later one when the audio before it has played
    assert conv.session.models.tts.deadlines == pytest.approx([now, now + 6 * 0.25, now + 11 * 0.25])
    # a speculation holds its audio back: a later piece is needed once that audio would have played
    spoken = conversation(llm_pieces=pieces)
    await spoken.speak(1.0, QUESTION)
    await spoken.silence(0.2)  # the speculation ran to its end, all held back
    assert spoken.audio_s == 0 and len(spoken.session.models.tts.deadlines) == 3
    first = spoken.session.models.tts.deadlines[0]
    assert spoken.session.models.tts.deadlines == pytest.approx([first, first + 6 * 0.25, first + 11 * 0.25])


async def test_a_piece_goes_out_as_the_synthesizer_makes_it_head_first(conversation):
    """Piper decodes a piece a listener waits on head first (``PiperSynthesizer``): the head is sent before the
    rest is made, its leading quiet trimmed as a whole piece's was; the rest follows untouched."""
    conv = conversation(llm_pieces=["Paris is the capital of France."])
    tts = conv.session.models.tts
    tts.lead_quiet_s = 0.05
    made = tts.synthesize
    sent_before_the_rest: list[float] = []

    def head_first(text, voice=None, *, urgent=False, deadline=None):
        whole = next(made(text, voice, urgent=urgent, deadline=deadline))
        head = int(0.2 * tts.sample_rate)
        yield whole[:head]
        sent_before_the_rest.append(conv.audio_s)
        yield whole[head:]

    tts.synthesize = head_first
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text == "Paris is the capital of France."
    keep_s = LEAD_KEEP_MS / 1000
    # two pieces ("Paris is the capital" and "of France."), each head sent before its rest was made: the first
    # piece's head with its quiet trimmed, the second's after all of the first piece
    first_piece_s = 4 * 0.25 + keep_s
    assert sent_before_the_rest == pytest.approx([0.2 - 0.05 + keep_s, first_piece_s + 0.2], abs=1e-3)
    assert conv.audio_s == pytest.approx(first_piece_s + 0.05 + 2 * 0.25, abs=1e-3)
    assert len(conv.of(protocol.AudioStart)) == 1


async def test_a_first_head_with_nothing_audible_is_trimmed_with_what_follows(conversation):
    """A voice whose lead-in outlasts the head: the quiet is cut across both chunks, as from a whole piece."""
    conv = conversation(llm_pieces=["Paris is the capital of France."])
    tts = conv.session.models.tts
    tts.lead_quiet_s = 0.3
    made = tts.synthesize

    def head_first(text, voice=None, *, urgent=False, deadline=None):
        whole = next(made(text, voice, urgent=urgent, deadline=deadline))
        yield from (whole[: int(0.2 * tts.sample_rate)], whole[int(0.2 * tts.sample_rate) :])

    tts.synthesize = head_first
    await conv.type(QUESTION)
    await conv.settle()
    # the first piece: its four words and 20 ms of its quiet; the second: its words and all of its quiet
    assert conv.audio_s == pytest.approx(4 * 0.25 + LEAD_KEEP_MS / 1000 + 0.3 + 2 * 0.25, abs=1e-3)


async def test_a_reply_with_seconds_of_audio_ahead_yields_its_llm_steps_to_other_replies(conversation):
    # WordTTS: a quarter second a word; the clock stands still, so all the audio sent is still ahead
    pieces = ["Paris is the capital of France. ", "It lies on the Seine. ", "It is big and very old. "]
    conv = conversation(llm_pieces=pieces)
    await conv.type(QUESTION)
    await conv.settle()
    request = conv.llm.request_ids[-1]
    # 1.5 s after the first piece and 2.75 s after the second are within YIELD_AHEAD_S (3 s); 4.25 s is not
    assert conv.llm.yields == [(request, pytest.approx(4.25 - YIELD_AHEAD_S))]
    longer = conversation(llm_pieces=pieces + ["Many people live there. "])
    await longer.type(QUESTION)
    await longer.settle()
    assert [round(s, 2) for _, s in longer.llm.yields] == [1.25, 2.25]  # 4.25 and 5.25 s ahead
    short = conversation(llm_pieces=pieces[:2])  # 2.75 s of audio in all: never ahead enough
    await short.type(QUESTION)
    await short.settle()
    assert short.of(protocol.TurnDone) and short.llm.yields == []
    never = conversation(llm_pieces=pieces, llm_yield_ahead_s=0)  # the setting turns it off
    await never.type(QUESTION)
    await never.settle()
    assert never.of(protocol.TurnDone) and never.llm.yields == []


async def test_the_tail_starts_before_the_pause_only_while_the_session_is_alone(conversation):
    for solo in (True, False):
        conv = conversation()
        conv.session.models.solo = solo  # the server's solo mode: one session open
        await conv.speak(1.0, QUESTION)
        spoken_calls = len(conv.asr.calls)
        await conv.silence(0.08)  # two quiet VAD windows: tail_start_ms (32) has passed, pause_ms (96) not
        assert not conv.of(protocol.SpeechStopped)
        assert len(conv.asr.calls) - spoken_calls == (1 if solo else 0)
        await conv.silence_until(committed(conv))
        assert len(conv.asr.calls) - spoken_calls == 1 and conv.finals()[-1].text == QUESTION


def test_the_solo_speedups_apply_while_exactly_one_session_is_open():
    from harness import ScriptedLLM

    from app.config import Settings
    from app.stages.registry import SOLO_FIRST_TOKENS, set_open_sessions

    class EngineLLM(ScriptedLLM):
        first_tokens: list[int] = []

        def set_urgent_first_tokens(self, n: int) -> None:
            self.first_tokens.append(n)

    class Models:
        llm, solo = EngineLLM([]), False

    models = Models()
    settings = Settings(llm_prefill_threads_first_tokens=3)
    for open_sessions, solo, first_tokens in (
        (1, True, SOLO_FIRST_TOKENS),
        (2, False, 3),
        (1, True, 12),
        (0, False, 3),
    ):
        set_open_sessions(models, settings, open_sessions)
        assert models.solo is solo and models.llm.first_tokens[-1] == first_tokens
    set_open_sessions(models, Settings(solo_speedups=False), 1)
    assert models.solo is False and models.llm.first_tokens[-1] == 0


async def test_a_reply_that_says_a_sentence_again_ends_before_the_repeat(conversation):
    loop = "I am not sure about today. "
    conv = conversation(llm_pieces=["Good question. ", loop, "It depends on you. ", loop, loop, loop])
    await conv.type(QUESTION)
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.text == "Good question. I am not sure about today. It depends on you."
    assert [text for _, text in conv.session.models.tts.spoken] == [
        "Good question.",
        "I am not sure about today.",
        "It depends on you.",
    ]
    assert conv.session.history[-1] == {"role": "assistant", "content": done.text}
    assert conv.llm.closed == conv.llm.request_ids  # the LLM request was stopped


async def test_a_short_sentence_said_again_ends_the_reply_but_a_two_word_one_does_not(conversation):
    conv = conversation(llm_pieces=["I'm not today. ", "I'm not today. ", "I'm not today."])
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text == "I'm not today."
    conv = conversation(llm_pieces=["I'm not today. ", "I'm not today."])  # the repeat ends the reply
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text == "I'm not today."
    assert [text for _, text in conv.session.models.tts.spoken] == ["I'm not today."]
    conv = conversation(llm_pieces=["Yes, indeed. ", "It is Paris. ", "Yes, indeed."])
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text == "Yes, indeed. It is Paris. Yes, indeed."


async def test_a_reply_looping_inside_a_sentence_ends_after_the_loop_s_first_time(conversation):
    conv = conversation(llm_pieces=["Sure thing. ", "You want a big", *[" ol'"] * 8, " party."])
    await conv.type(QUESTION)
    await conv.settle()
    done = conv.of(protocol.TurnDone)[-1]
    assert done.text == "Sure thing. You want a big ol'"
    assert " ".join(text for _, text in conv.session.models.tts.spoken) == done.text  # said once, not eight times
    assert conv.session.history[-1] == {"role": "assistant", "content": done.text}
    assert conv.llm.closed == conv.llm.request_ids  # the LLM request was stopped


async def test_the_words_so_far_are_prefilled_while_the_user_speaks_and_not_once_speech_may_be_ending(conversation):
    conv = conversation()
    conv.asr.partial = "What is the capital of"
    await conv.speak(1.6, QUESTION)
    shown = [t.text for t in conv.of(protocol.Transcript) if not t.final]
    assert shown, "no partial transcript"
    warmed = list(conv.llm.warmed)
    # the newest hypothesis is prefilled: the words shown are those two hypotheses agree on, one partial behind
    assert warmed and warmed[-1][-1]["role"] == "user" and warmed[-1][-1]["content"].startswith(shown[-1])
    await conv.silence(0.06)  # the VAD's hangover: a partial finishing now must not hold the tail's cores
    conv.session._warmup.words_so_far(shown[-1])
    await conv.settle()
    assert conv.llm.warmed == warmed
    await conv.silence_until(committed(conv))
    await conv.settle()
    [call] = conv.llm.calls
    assert warmed[-1][:-1] == call[:-1]  # the reply's prompt continues what was prefilled
    # after speech: only the history warm-up that follows the reply (its last message is the answer)
    assert all(prompt[-1]["role"] == "assistant" for prompt in conv.llm.warmed[len(warmed) :])


async def test_no_words_are_prefilled_while_a_reply_is_written_or_when_turned_off(conversation):
    conv = conversation(llm_warm_while_speaking=False)
    conv.asr.partial = "What is the capital of"
    await conv.speak(1.6, QUESTION)
    assert conv.of(protocol.Transcript) and not conv.llm.warmed
    conv = conversation()
    conv.llm.forever = True  # the reply is still being written while the user talks over it
    await conv.type("Tell me a story.")
    conv.asr.partial = "Mm-hmm yeah"
    await conv.speak(1.2, "Mm-hmm yeah.")
    assert conv.of(protocol.Transcript) and not any(p[-1]["role"] == "user" for p in conv.llm.warmed)


async def test_the_llm_is_looked_up_at_each_use_so_a_replaced_one_answers_and_is_warmed(conversation):
    conv = conversation()
    replacement = type(conv.llm)(["Rome."])
    conv.session.models.llm = replacement  # (the session test harness sets its LLM after the session is made)
    await conv.type(QUESTION)
    await conv.settle()
    assert conv.of(protocol.TurnDone)[-1].text == "Rome." and not conv.llm.calls
    assert replacement.warmed and not conv.llm.warmed  # the next prompt's start, warmed on the LLM in use
