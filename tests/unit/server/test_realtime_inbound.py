"""The Realtime door's inbound half alone: client events in, typed session calls out (recorded by a
stub session), acknowledged through the outbound half to a recording sender; no server, no model."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from openai.types.realtime.realtime_audio_input_turn_detection import SemanticVad
from realtime_stubs import check_ga, parts

from app import protocol
from app.audio import float_to_pcm16
from app.server.realtime.configure import turn_detection, turn_settings
from app.server.realtime.core import REALTIME_SAMPLE_RATE, message_item
from app.server.realtime.schema import ServerVadTurns
from app.server.realtime.state import Item


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def pcm(seconds: float, level: float = 0.3) -> str:
    """``seconds`` of a 24 kHz tone, as ``input_audio_buffer.append`` carries it."""
    t = np.arange(int(seconds * REALTIME_SAMPLE_RATE)) / REALTIME_SAMPLE_RATE
    return base64.b64encode(float_to_pcm16((level * np.sin(2 * np.pi * 220 * t)).astype(np.float32))).decode()


async def test_session_update_becomes_one_session_config_and_one_tune():
    rt = parts()
    await rt.send(
        type="session.update",
        session={
            "type": "realtime",
            "instructions": "You are a pirate.",
            "audio": {
                "input": {
                    "transcription": {"model": "whisper-1", "language": "de"},
                    "turn_detection": {
                        "type": "server_vad",
                        "threshold": 0.6,
                        "silence_duration_ms": 700,
                        "interrupt_response": False,
                    },
                },
                "output": {"voice": "bob"},
            },
        },
    )
    assert rt.session.calls == [
        protocol.SessionConfig(system_prompt="You are a pirate.", voice="bob", language="de", barge_in=False),
        ("tune", {"vad_threshold": 0.6, "endpoint_silence_ms": 700}),  # only what changed
    ]
    [updated] = rt.client.events
    check_ga(updated)
    assert updated["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 700
    assert updated["session"]["audio"]["input"]["transcription"]["model"] == "whisper-1"
    assert rt.state.config.voice == "bob"
    # the same turn detection again changes nothing in the session; an OpenAI voice name keeps Parley's
    rt.session.calls.clear()
    same = {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 700, "interrupt_response": False}
    await rt.send(
        type="session.update", session={"audio": {"input": {"turn_detection": same}, "output": {"voice": "marin"}}}
    )
    assert rt.session.calls == [protocol.SessionConfig(barge_in=False)]
    assert rt.state.config.voice == "bob" and not rt.client.errors()
    rt.close()


async def test_a_refused_field_is_an_error_and_the_rest_of_the_update_applies():
    rt = parts()
    await rt.send(
        type="session.update",
        event_id="evt_1",
        session={
            "instructions": "Be brief.",
            "tools": [{"type": "mcp", "server_label": "home"}],
            "voice": "alloy",
            "audio": {"output": {"voice": "nobody"}},
        },
    )
    errors = rt.client.errors()
    assert [e["param"] for e in errors] == ["session.tools[0].type", "session.voice", "session.audio.output.voice"]
    assert {e["event_id"] for e in errors} == {"evt_1"}
    assert rt.client.types()[-1] == "session.updated"
    assert rt.session.calls == [protocol.SessionConfig(system_prompt="Be brief.")]
    # a refused turn detection leaves the session's turn-taking alone
    rt.session.calls.clear()
    await rt.send(type="session.update", session={"audio": {"input": {"turn_detection": {"create_response": False}}}})
    assert rt.session.calls == [] and rt.client.errors()[-1]["param"].endswith("turn_detection.create_response")
    rt.close()


def test_turn_detection_maps_onto_parleys_vad_and_endpoint():
    settings = parts().settings
    server = turn_detection(ServerVadTurns.model_validate({"threshold": 0.7}), None, settings)
    assert (server.type, server.threshold, server.silence_duration_ms) == ("server_vad", 0.7, 400)
    assert turn_settings(server, settings) == {
        "vad_threshold": 0.7,
        "endpoint_silence_ms": 400,
        "endpoint_unfinished_silence_ms": settings.endpoint_unfinished_silence_ms,
    }
    assert turn_detection(False, server, settings) is None and turn_settings(None, settings) == {}
    low = turn_detection(SemanticVad(type="semantic_vad", eagerness="low"), server, settings)
    assert (low.type, low.threshold) == ("semantic_vad", 0.7), "what semantic VAD does not set is kept"
    assert turn_settings(low, settings) == {"endpoint_silence_ms": 800, "endpoint_unfinished_silence_ms": 2500}


async def test_server_vad_audio_is_fed_at_16_khz_and_clear_drops_the_utterance():
    rt = parts()
    for _ in range(5):
        await rt.send(type="input_audio_buffer.append", audio=pcm(0.1))
    fed = [call[1] for call in rt.session.calls if call[0] == "feed_audio"]
    assert len(fed) == 5 and sum(map(len, fed)) == pytest.approx(8000, abs=200)
    assert rt.state.input_ms == pytest.approx(500) and not rt.client.events
    rt.state.speech = object()  # an utterance in progress
    await rt.send(type="input_audio_buffer.clear")
    assert rt.session.calls[-1] == ("tune", {}) and rt.state.speech is None
    assert rt.client.types() == ["input_audio_buffer.cleared"]
    rt.close()


async def test_manual_turns_buffer_commit_transcribe_then_answer_as_one_typed_turn():
    rt = parts()
    await rt.send(type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    assert rt.session.calls == [("tune", {})], "leaving server VAD drops the utterance in progress"
    rt.session.calls.clear()
    await rt.send(type="input_audio_buffer.append", audio=pcm(0.05))
    await rt.send(type="input_audio_buffer.commit", event_id="c0")
    assert rt.client.errors()[-1]["code"] == "input_audio_buffer_commit_empty"
    await rt.send(type="input_audio_buffer.append", audio=pcm(1.0))
    assert rt.session.calls == [], "no server VAD: the audio waits in the manual buffer"
    mark = len(rt.client.events)
    await rt.send(type="input_audio_buffer.commit")
    assert rt.client.types(mark) == ["input_audio_buffer.committed", "conversation.item.added"]
    await rt.send(type="response.create")
    assert rt.client.types(mark)[2:] == [
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
    ]
    assert rt.models.asr.heard == [(pytest.approx(16_800, abs=50), "en")]
    assert rt.session.messages() == [protocol.UserText(text=rt.models.asr.text)]
    assert rt.state.manual_samples == 0 and not rt.state.pending()
    for event in rt.client.events[mark:]:
        check_ga(event)
    rt.close()


async def test_response_create_sends_the_waiting_user_items_as_one_turn_with_its_instructions():
    rt = parts()
    typed_during: list = []
    handle = rt.session.handle

    async def handle_and_look(message):
        typed_during.append(rt.state.typed)
        await handle(message)

    rt.session.handle = handle_and_look
    await rt.send(type="conversation.item.create", item=user_text("My name is Ada."))
    assistant = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]}
    await rt.send(type="conversation.item.create", item=assistant)
    await rt.send(type="conversation.item.create", item=user_text("What is"))
    await rt.send(type="conversation.item.create", item=user_text("my name?"))
    assert rt.client.types() == ["conversation.item.added", "conversation.item.done"] * 4
    added = rt.client.of("conversation.item.added")
    assert added[1]["previous_item_id"] == added[0]["item"]["id"]
    await rt.send(type="response.create", response={"instructions": "Answer in one word.", "metadata": {"k": "v"}})
    assert rt.session.messages() == [
        protocol.SessionConfig(system_prompt="Answer in one word."),
        protocol.UserText(text="What is\nmy name?"),
        protocol.SessionConfig(system_prompt=rt.settings.system_prompt, tools=[], tool_choice="auto"),
    ]
    assert typed_during[1].metadata == {"k": "v"} and typed_during[2] is None
    assert rt.session.history == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
    ]
    rt.close()


async def test_response_create_with_nothing_to_answer_fails_its_response_and_a_second_is_refused():
    rt = parts()
    await rt.send(type="response.create")
    created, done = rt.client.events
    assert (created["type"], done["response"]["status"]) == ("response.created", "failed")
    assert done["response"]["status_details"]["error"]["code"] == "no_user_message"
    assert rt.session.calls == []
    rt.state.response = object()  # a response is open
    await rt.send(type="response.create", event_id="again")
    assert rt.client.errors()[-1]["code"] == "conversation_already_has_active_response"
    rt.close()


TIMER = {
    "type": "function",
    "name": "set_timer",
    "description": "Start a timer",
    "parameters": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1}}},
}


async def test_session_tools_become_the_session_s_and_refused_ones_change_nothing():
    rt = parts()
    await rt.send(
        type="session.update",
        session={
            "tools": [TIMER],
            "tool_choice": {"type": "function", "name": "set_timer"},
            "parallel_tool_calls": False,
        },
    )
    timer = protocol.FunctionTool(name="set_timer", description="Start a timer", parameters=TIMER["parameters"])
    assert rt.session.calls == [
        protocol.SessionConfig(
            tools=[timer], tool_choice=protocol.NamedFunction(name="set_timer"), parallel_tool_calls=False
        )
    ]
    session = rt.client.of("session.updated")[-1]["session"]
    check_ga(rt.client.of("session.updated")[-1])
    assert session["tools"] == [timer.model_dump()] and session["tool_choice"] == {
        "type": "function",
        "name": "set_timer",
    }
    rt.session.calls.clear()
    for bad, param in [
        ({"tools": [{"type": "function", "name": "no spaces"}]}, "session.tools[0].name"),
        ({"tools": [TIMER, TIMER]}, "session.tools"),
        ({"tools": [{"type": "function", "description": "nameless"}]}, "session.tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "get_time"}}, "session.tool_choice"),
        ({"tools": [{"type": "mcp", "server_label": "home"}]}, "session.tools[0].type"),
    ]:
        await rt.send(type="session.update", session={"instructions": "Be brief.", **bad})
        assert rt.client.errors()[-1]["param"] == param, bad
        assert all(not isinstance(call, protocol.SessionConfig) or call.tools is None for call in rt.session.calls)
    assert rt.state.config.tools == (timer,), "a refused update keeps the tools there were"
    rt.close()


async def test_function_call_outputs_join_the_history_and_response_create_answers_them():
    rt = parts()
    call = {"type": "function_call", "call_id": "c1", "name": "set_timer", "arguments": '{"minutes": 5}'}
    await rt.send(type="conversation.item.create", item=call)
    long_output = "x " * 5000
    await rt.send(
        type="conversation.item.create", item={"type": "function_call_output", "call_id": "c1", "output": long_output}
    )
    for event in rt.client.events:
        check_ga(event)
    output_item = rt.client.of("conversation.item.done")[-1]["item"]
    assert (
        output_item["type"] == "function_call_output" and len(output_item["output"]) <= protocol.MAX_TOOL_OUTPUT_CHARS
    )
    await rt.send(type="response.create", response={"tool_choice": "none"})
    assert rt.session.calls == [
        protocol.SessionConfig(tool_choice="none"),
        ("respond", {}),
        protocol.SessionConfig(system_prompt=rt.settings.system_prompt, tools=[], tool_choice="auto"),
    ]
    called, result = rt.session.history
    assert called["tool_calls"][0]["function"] == {"name": "set_timer", "arguments": '{"minutes": 5}'}
    assert result["role"] == "tool" and result["tool_call_id"] == "c1" and result["content"] == output_item["output"]
    created = rt.client.of("response.created")[-1]
    check_ga(created)
    assert rt.state.response is not None and rt.state.response.turn_id == 99
    rt.close()


async def test_a_system_item_extends_the_instructions():
    rt = parts()
    await rt.send(type="session.update", session={"instructions": "Be brief."})
    rt.session.calls.clear()
    await rt.send(
        type="conversation.item.create",
        item={
            **user_text("Speak French."),
            "role": "system",
            "content": [{"type": "input_text", "text": "Speak French."}],
        },
    )
    assert rt.session.calls == [protocol.SessionConfig(system_prompt="Be brief.\n\nSpeak French.")]
    assert rt.state.config.instructions == "Be brief.\n\nSpeak French." and not rt.state.pending()
    rt.close()


async def test_truncate_reports_the_playback_heard_and_cancel_stops_the_reply():
    rt = parts()
    rt.state.remember(Item(message_item("item_a", "assistant", []), "assistant", "Hi", turn_id=3, audio_ms=1200.0))
    await rt.send(type="conversation.item.truncate", item_id="item_a", audio_end_ms=5000)
    assert rt.session.calls == [protocol.Playback(turn_id=3, played_ms=1200)]
    assert rt.client.events[-1]["audio_end_ms"] == 1200
    # no response open: an error, unless the last reply still plays
    rt.session.calls.clear()
    await rt.send(type="response.cancel", event_id="nothing")
    assert rt.client.errors()[-1]["code"] == "response_cancel_not_active" and rt.session.calls == []
    rt.session.busy = True
    mark = len(rt.client.events)
    await rt.send(type="response.cancel")
    assert rt.session.calls == [protocol.Cancel()] and len(rt.client.events) == mark
    # an open response the session does not close (the stub answers nothing): closed here, cancelled
    await rt.outbound.on_parley(protocol.Transcript(turn_id=4, text="Hi", final=True))
    await rt.outbound.on_parley(protocol.AssistantText(turn_id=4, delta="Hel"))
    await rt.send(type="response.cancel")
    done = rt.client.events[-1]["response"]
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["output"][0]["content"][0]["transcript"] == "Hel" and rt.state.response is None
    rt.close()


async def test_bad_frames_are_errors_that_carry_the_client_event_id():
    rt = parts()
    await rt.send(type="session.frobnicate", event_id="e1")
    await rt.send(type="input_audio_buffer.append", audio="not base64!", event_id="e2")
    await rt.send(type="conversation.item.delete", item_id="nope", event_id="e3")
    await rt.inbound.handle_binary()
    assert [(e["code"], e["event_id"]) for e in rt.client.errors()] == [
        ("unknown_event_type", "e1"),
        ("invalid_audio", "e2"),
        ("item_delete_invalid_item_id", "e3"),
        ("invalid_event", None),
    ]
    assert rt.session.calls == []
    for event in rt.client.events:
        check_ga(event)
    rt.close()


async def test_deleting_a_waiting_item_cancels_its_transcription():
    rt = parts()
    never = asyncio.Event()
    transcription = asyncio.create_task(never.wait())
    item = Item(message_item("item_u", "user", []), "user", pending=True, transcription=transcription)
    rt.state.remember(item)
    await rt.send(type="conversation.item.delete", item_id="item_u")
    await asyncio.sleep(0)
    assert transcription.cancelled() and "item_u" not in rt.state.items
    assert rt.client.events[-1] | {"event_id": None} == {
        "event_id": None,
        "type": "conversation.item.deleted",
        "item_id": "item_u",
    }
    rt.close()
