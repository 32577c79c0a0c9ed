"""The Realtime door's outbound half alone: Parley's events and reply audio in, Realtime server
events out (recorded by a stub sender), with a stub session; no server, no model."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from realtime_stubs import check_ga, parts

from app import protocol
from app.audio import float_to_pcm16
from app.server.realtime.core import REALTIME_SAMPLE_RATE, message_item
from app.server.realtime.state import Item, ResponseParams

TTS_RATE = 22_050


def reply_audio(seconds: float) -> list[bytes]:
    """Reply audio at Piper's rate, in 100 ms chunks (so the 24 kHz resampling is exercised)."""
    samples = np.full(int(seconds * TTS_RATE), 0.1, np.float32)
    chunk = TTS_RATE // 10
    return [float_to_pcm16(samples[i : i + chunk]) for i in range(0, len(samples), chunk)]


def audio_s(events: list[dict]) -> float:
    data = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    return len(data) / 2 / REALTIME_SAMPLE_RATE


async def test_a_spoken_turn_goes_out_in_the_ga_order():
    rt = parts()
    feed = rt.outbound.on_parley
    rt.state.input_ms = 300.0
    await feed(protocol.SpeechStarted())
    await feed(protocol.Transcript(turn_id=1, text="What", final=False))
    await feed(protocol.Transcript(turn_id=1, text="What is", final=False))
    await feed(protocol.SpeechStopped())
    rt.state.input_ms = 1500.0
    await feed(protocol.Transcript(turn_id=1, text="What is it?", final=True))
    await feed(protocol.AssistantText(turn_id=1, delta="It is "))
    await feed(protocol.AudioStart(turn_id=1, sample_rate=TTS_RATE))
    for chunk in reply_audio(0.5):
        await rt.outbound.on_parley_audio(chunk)
    await feed(protocol.AssistantText(turn_id=1, delta="Paris."))
    await feed(protocol.TurnDone(turn_id=1, text="It is Paris."))
    events = rt.client.events
    for event in events:
        check_ga(event)
    assert [t for t in rt.client.types() if t != "response.output_audio.delta"] == [
        "input_audio_buffer.speech_started",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert [e["delta"] for e in rt.client.of("conversation.item.input_audio_transcription.delta")] == ["What", " is"]
    started, stopped = (
        rt.client.of("input_audio_buffer.speech_started")[0],
        rt.client.of("input_audio_buffer.speech_stopped")[0],
    )
    assert (started["audio_start_ms"], stopped["audio_end_ms"]) == (300, 1500)
    user_id = started["item_id"]
    assert rt.client.of("input_audio_buffer.committed")[0]["item_id"] == user_id
    completed = rt.client.of("conversation.item.input_audio_transcription.completed")[0]
    assert (completed["transcript"], completed["usage"]["seconds"]) == ("What is it?", 1.2)
    assistant = rt.client.of("response.output_item.added")[0]["item"]["id"]
    assert rt.client.of("conversation.item.added")[1]["previous_item_id"] == user_id
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["transcript"] == "It is Paris."
    assert audio_s(events) == pytest.approx(0.5, abs=0.01), "the resampler's tail is flushed on completion"
    # what truncate / retrieve will read: the item as last sent, with the audio it carried
    assert rt.state.items[assistant].payload == done["output"][0]
    assert rt.state.items[assistant].audio_ms == pytest.approx(500, abs=10)
    assert rt.state.response is None and rt.state.speech is None
    rt.close()


async def test_speech_over_an_audible_reply_is_announced_only_when_parley_barges_in():
    rt = parts()
    feed = rt.outbound.on_parley
    await feed(protocol.SpeechStarted())
    await feed(protocol.Transcript(turn_id=1, text="Hi", final=False))
    await feed(protocol.SpeechStopped())
    await feed(protocol.Transcript(turn_id=1, text="Hi there", final=True))
    await feed(protocol.AssistantText(turn_id=1, delta="Hello! "))
    await feed(protocol.AudioStart(turn_id=1, sample_rate=TTS_RATE))
    for chunk in reply_audio(1.0):
        await rt.outbound.on_parley_audio(chunk)
    rt.session.busy = True
    events = rt.client.events
    assert rt.client.types().count("input_audio_buffer.speech_started") == 1
    # a cough while the reply plays: held back, then dropped by Parley (nothing follows), never announced
    mark = len(events)
    await feed(protocol.SpeechStarted())
    await feed(protocol.SpeechStopped())
    await feed(protocol.SpeechDropped(turn_id=2, reason="no_words"))
    assert rt.state.speech is None, "speech Parley dropped is forgotten"
    assert not [t for t in rt.client.types(mark) if t.startswith("input_audio_buffer.")]
    # real speech: announced once Parley interrupts the reply, before the response is cancelled
    await feed(protocol.SpeechStarted())
    await feed(protocol.Transcript(turn_id=3, text="Wait", final=False))
    assert not [t for t in rt.client.types(mark) if t.startswith("input_audio_buffer.")]
    await feed(protocol.Interrupt(turn_id=1))
    await feed(protocol.TurnDone(turn_id=1, text="Hello!", interrupted=True))
    kinds = rt.client.types(mark)
    assert kinds[0] == "input_audio_buffer.speech_started" and kinds[-1] == "response.done"
    done = events[-1]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
    assert done["output"][0]["content"][0]["transcript"] == "Hello!"
    for event in events:
        check_ga(event)
    assert audio_s(events) == pytest.approx(1.0, abs=0.05)  # cut: no resampler flush
    rt.close()


async def test_an_announced_utterance_the_session_drops_is_closed_at_once_and_a_pause_closes_nothing():
    rt = parts()
    await rt.outbound.on_parley(protocol.SpeechStarted())
    rt.state.input_ms = 800.0
    await rt.outbound.on_parley(protocol.SpeechStopped())
    await rt.outbound.on_parley(protocol.SpeechStarted())  # the user went on after the pause: the same item
    assert rt.client.types() == ["input_audio_buffer.speech_started"] and rt.state.speech is not None
    item_id = rt.state.speech.item_id
    rt.state.input_ms = 1300.0
    await rt.outbound.on_parley(protocol.SpeechDropped(turn_id=3, reason="no_words"))
    assert rt.client.types() == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"]
    assert rt.client.events[-1]["audio_end_ms"] == 1300 and rt.client.events[-1]["item_id"] == item_id
    assert rt.state.speech is None
    # a backchannel said over a reply was never announced: dropped, it ends without an event
    rt.session.busy = True  # a reply is playing
    await rt.outbound.on_parley(protocol.SpeechStarted())
    await rt.outbound.on_parley(protocol.SpeechDropped(turn_id=4, reason="backchannel", heard="yeah"))
    assert len(rt.client.events) == 2 and rt.state.speech is None
    rt.close()


async def test_client_items_not_answered_join_the_history_before_a_spoken_turn():
    rt = parts()
    for role, text in (("user", "My name is Ada."), ("assistant", "Hello Ada.")):
        item_id = f"item_{role}"
        rt.state.remember(Item(message_item(item_id, role, []), role, text, pending=True))
        rt.state.follow(item_id)
    await rt.outbound.on_parley(protocol.Transcript(turn_id=1, text="What is my name?", final=True))
    assert rt.session.history == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
    ]
    assert not rt.state.pending()
    assert rt.client.of("input_audio_buffer.committed")[0]["previous_item_id"] == "item_assistant"
    rt.close()


async def test_a_typed_turn_opens_its_response_with_the_params_response_create_gave():
    rt = parts()
    rt.state.typed = ResponseParams(modality="text", metadata={"topic": "x"})
    await rt.outbound.on_parley(protocol.Transcript(turn_id=4, text="Hi", final=True))
    assert rt.client.types() == ["response.created"], "a typed turn's items were sent by response.create"
    assert rt.state.typed is None and rt.state.response.turn_id == 4
    created = rt.client.events[0]["response"]
    assert (created["output_modalities"], created["metadata"]) == (["text"], {"topic": "x"})
    # no audio is played in text modality: the session hears it all played at once
    await rt.outbound.on_parley(protocol.AudioStart(turn_id=4, sample_rate=TTS_RATE))
    assert rt.session.messages() == [protocol.Playback(turn_id=4, played_ms=1e9)]
    await rt.outbound.on_parley(protocol.AssistantText(turn_id=4, delta="Hello."))
    for chunk in reply_audio(0.3):
        await rt.outbound.on_parley_audio(chunk)
    await rt.outbound.on_parley(protocol.TurnDone(turn_id=4, text="Hello."))
    assert "response.output_audio.delta" not in rt.client.types()
    assert rt.client.of("response.output_text.done")[0]["text"] == "Hello."
    for event in rt.client.events:
        check_ga(event)
    rt.close()


async def test_turn_metrics_and_notices_travel_only_when_included():
    rt = parts()
    notice = protocol.Notice(code="slow", message="the model is slow")
    await rt.outbound.on_parley(protocol.Transcript(turn_id=1, text="Hi", final=True))
    await rt.outbound.on_parley(protocol.TurnDone(turn_id=1, text="", metrics=protocol.TurnMetrics(llm_ttft_ms=12.0)))
    await rt.outbound.on_parley(notice)
    assert not [t for t in rt.client.types() if t.startswith("parley.")]
    rt.state.config.include = frozenset({"parley.turn_metrics", "parley.notice"})
    await rt.outbound.on_parley(protocol.Transcript(turn_id=2, text="Hi", final=True))
    await rt.outbound.on_parley(
        protocol.TurnDone(turn_id=2, text="Hello.", metrics=protocol.TurnMetrics(llm_ttft_ms=12.0))
    )
    await rt.outbound.on_parley(notice)
    [metrics] = rt.client.of("parley.turn_metrics")
    assert metrics["turn_id"] == 2 and metrics["metrics"]["llm_ttft_ms"] == 12.0
    assert rt.client.events[-3]["type"] == "response.done"
    assert metrics["response_id"] == rt.client.events[-3]["response"]["id"]
    assert rt.client.events[-1] | {"event_id": None} == {
        "event_id": None,
        "type": "parley.notice",
        "turn_id": None,
        "code": "slow",
        "message": "the model is slow",
    }
    rt.close()


async def test_a_failed_turn_fails_its_response_and_other_errors_are_error_events():
    rt = parts()
    await rt.outbound.on_parley(protocol.Transcript(turn_id=1, text="Hi", final=True))
    await rt.outbound.on_parley(protocol.AssistantText(turn_id=1, delta="Hel"))
    await rt.outbound.on_parley(protocol.Error(code="turn_failed", message="could not answer: boom"))
    done = rt.client.events[-1]
    check_ga(done)
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "turn_failed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Hel"
    # the LLM that did not answer ends the next turn's response as failed too, named by its turn
    await rt.outbound.on_parley(protocol.Transcript(turn_id=2, text="Again", final=True))
    await rt.outbound.on_parley(protocol.Error(code="llm_unavailable", message="no word in 10 s", turn_id=2))
    done = rt.client.events[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "llm_unavailable"
    rt.state.client_event_id = "evt_7"
    await rt.outbound.on_parley(protocol.Error(code="overloaded", message="busy"))
    await rt.outbound.on_parley(protocol.Error(code="bad_config", message="no"))
    assert [(e["type"], e["code"], e["event_id"]) for e in rt.client.errors()] == [
        ("server_error", "overloaded", "evt_7"),
        ("invalid_request_error", "bad_config", "evt_7"),
    ]
    mark = len(rt.client.events)
    await rt.outbound.on_parley(protocol.Ready(input_sample_rate=16_000, output_sample_rate=22_050))
    assert len(rt.client.events) == mark, "session.created / session.updated come from the door itself"
    rt.close()


async def test_a_response_with_nothing_to_answer_fails_at_once_and_leaves_the_open_one_alone():
    rt = parts()
    await rt.outbound.on_parley(protocol.Transcript(turn_id=1, text="Hi", final=True))
    open_response = rt.state.response
    mark = len(rt.client.events)
    await rt.outbound.fail_response(
        ResponseParams(metadata={"k": "v"}), {"type": "invalid_request_error", "code": "x", "message": "m"}
    )
    created, done = rt.client.events[mark:]
    assert (created["type"], done["type"]) == ("response.created", "response.done")
    assert created["response"]["id"] == done["response"]["id"] != open_response.id
    assert done["response"]["status_details"]["error"]["code"] == "x" and done["response"]["metadata"] == {"k": "v"}
    assert rt.state.response is open_response
    rt.close()


async def test_event_ids_are_unique_and_session_created_shows_the_config():
    rt = parts()
    await rt.outbound.start()
    await rt.outbound.emit({"type": "input_audio_buffer.cleared"})
    created, cleared = rt.client.events
    check_ga(created)
    assert created["session"]["id"] == rt.state.session_id and created["session"]["audio"]["output"]["voice"] == "amy"
    assert created["event_id"] != cleared["event_id"] and cleared["event_id"].startswith("event_")
    rt.close()
