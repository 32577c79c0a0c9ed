"""``/v1/realtime``: the OpenAI Realtime API (GA) over Parley's conversation.

Most tests are model-free: the adapter drives a ``VoiceSession`` on scripted stages, and every
event it sends must validate against the OpenAI SDK's GA server-event models. Its parts alone
(inbound, outbound, on stubs) are tested in ``tests/unit/server/test_realtime_*.py``. The
conformance test at the end drives a real ``parley serve`` with the official ``openai`` client,
spoken audio and all.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json

import numpy as np
import pytest
from fakes import ToolScriptedLLM
from fastapi.testclient import TestClient
from harness import THERMOSTAT_TOOL, ScriptedLLM
from realtime_stubs import check_ga
from starlette.websockets import WebSocketDisconnect

from app.audio import float_to_pcm16, pcm16_to_float, resample
from app.config import Settings
from app.server.app import create_app
from app.server.realtime import REALTIME_SAMPLE_RATE, RealtimeAdapter
from app.stages.base import ToolCall, Transcription
from app.stages.vad import VadStream
from app.voice.text import words

QUESTION = "What is the capital of France?"
TTS_RATE = 22_050
KEY = "k" * 24


# ---------------------------------------------------------------- scripted stages (no model is loaded)
class EnergyVadModel:
    def probability(self, window_with_context, state):
        window = window_with_context[-512:]
        return (1.0 if float(np.sqrt(np.mean(window**2))) > 0.05 else 0.0), state


class ScriptedASR:
    languages = ["en"]

    def __init__(self, text: str = QUESTION) -> None:
        self.text = text
        self.heard_s: list[float] = []

    def transcribe(self, audio, *, wait=True, context="", language=None):
        self.heard_s.append(len(audio) / 16_000)
        return Transcription(self.text, len(audio) / 16_000, 0.0)


class ToneTTS:
    """A quarter second of tone per word, at Piper's rate (so the 24 kHz resampling is exercised)."""

    sample_rate = TTS_RATE
    voices = ["tone", "other-tone"]

    def voice_for(self, language):
        return "tone" if language == "en" else None

    def synthesize(self, text, voice=None, *, urgent=False, deadline=None):
        yield np.full(int(len(text.split()) * 0.25 * TTS_RATE), 0.1, np.float32)


class FakeStages:
    turn = None  # no end-of-turn model
    solo = False

    def __init__(self, llm: ScriptedLLM, asr: ScriptedASR | None = None) -> None:
        self.llm, self.asr, self.tts = llm, asr or ScriptedASR(), ToneTTS()

    def vad_stream(self, config):
        return VadStream(EnergyVadModel(), config)

    def close(self) -> None:
        pass


class Rig:
    """A ``RealtimeAdapter`` in front of a ``VoiceSession`` on scripted stages; records every event sent."""

    def __init__(
        self,
        pieces: list[str] | None = None,
        gate: asyncio.Event | None = None,
        llm: ScriptedLLM | None = None,
        **settings,
    ) -> None:
        self.settings = Settings(**{"max_audio_rate": 1000.0, **settings})
        self.llm = llm or ScriptedLLM(pieces or ["Paris is the capital of France."], gate=gate)
        self.models = FakeStages(self.llm)
        self.events: list[dict] = []
        self.adapter = RealtimeAdapter(self._send, self.settings, self.models)
        self.session = self.adapter.open_session()

    async def _send(self, event: dict) -> None:
        json.dumps(event)  # what goes on the wire is JSON
        self.events.append(event)

    async def start(self) -> None:
        await self.session.start()
        await self.adapter.start()

    async def send(self, **event) -> None:
        await self.adapter.handle_client(json.dumps(event))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def wait_for(self, kind: str, timeout: float = 20, after: int = 0, **match) -> dict:
        async def poll():
            while True:
                for event in self.events[after:]:
                    if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                        return event
                await asyncio.sleep(0.01)

        return await asyncio.wait_for(poll(), timeout)

    async def append(self, samples_24k: np.ndarray, chunk_s: float = 0.1) -> None:
        step = int(chunk_s * REALTIME_SAMPLE_RATE)
        for offset in range(0, len(samples_24k), step):
            pcm = float_to_pcm16(samples_24k[offset : offset + step])
            await self.send(type="input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
            await asyncio.sleep(0)

    def audio_s(self, after: int = 0) -> float:
        data = b"".join(
            base64.b64decode(e["delta"]) for e in self.events[after:] if e["type"] == "response.output_audio.delta"
        )
        return len(data) / 2 / REALTIME_SAMPLE_RATE

    def errors(self) -> list[dict]:
        return [e["error"] for e in self.of("error")]


def tone(seconds: float, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * REALTIME_SAMPLE_RATE)) / REALTIME_SAMPLE_RATE
    return (level * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * REALTIME_SAMPLE_RATE), np.float32)


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def close(rig: Rig) -> None:
    await rig.adapter.close()
    await rig.session.close()


# ---------------------------------------------------------------- session
async def test_session_created_then_update_maps_onto_the_session():
    rig = Rig()
    await rig.start()
    [created] = rig.events
    check_ga(created)
    assert created["type"] == "session.created"
    assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    await rig.send(
        type="session.update",
        event_id="evt_1",
        session={
            "type": "realtime",
            "instructions": "You are a pirate.",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "transcription": {"model": "whisper-1", "language": "en"},
                    "noise_reduction": {"type": "near_field"},
                    "turn_detection": {
                        "type": "server_vad",
                        "threshold": 0.6,
                        "silence_duration_ms": 700,
                        "prefix_padding_ms": 300,
                        "interrupt_response": False,
                    },
                },
                "output": {"voice": "other-tone"},
            },
            "tool_choice": "auto",
            "tools": [],
            "max_output_tokens": "inf",
        },
    )
    updated = rig.of("session.updated")[-1]
    check_ga(updated)
    assert not rig.errors()
    prefs, settings = rig.session.prefs, rig.session.settings
    assert (prefs.system_prompt, prefs.voice, prefs.barge_in) == ("You are a pirate.", "other-tone", False)
    assert (settings.vad_threshold, settings.endpoint_silence_ms) == (0.6, 700)
    assert updated["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 700
    assert updated["session"]["instructions"] == "You are a pirate."
    # an OpenAI voice name keeps Parley's voice instead of failing the update
    await rig.send(type="session.update", session={"type": "realtime", "audio": {"output": {"voice": "marin"}}})
    assert not rig.errors() and rig.session.prefs.voice == "other-tone"
    await close(rig)


async def test_unsupported_fields_get_errors_and_the_rest_still_applies():
    rig = Rig()
    await rig.start()
    await rig.send(
        type="session.update",
        event_id="evt_tools",
        session={
            "type": "realtime",
            "instructions": "Be brief.",
            "tools": [{"type": "mcp", "server_label": "home"}],
            "tool_choice": {"type": "mcp", "server_label": "home"},
            "audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"voice": "nobody"}},
            "voice": "alloy",
        },
    )
    errors = rig.errors()
    params = {e["param"] for e in errors}
    assert {
        "session.tools[0].type",
        "session.tool_choice",
        "session.audio.input.format",
        "session.audio.output.voice",
        "session.voice",
    } <= params
    assert all(e["event_id"] == "evt_tools" and e["type"] == "invalid_request_error" for e in errors)
    assert "session.audio.output.voice" in next(e["message"] for e in errors if e["param"] == "session.voice")
    for event in rig.of("error"):
        check_ga(event)
    assert rig.types()[-1] == "session.updated"
    assert rig.session.prefs.system_prompt == "Be brief."
    rig.events.clear()
    await rig.send(type="session.update", session={"type": "realtime", "instructions": "x" * 5000})
    assert rig.errors()[0]["code"] == "string_above_max_length"
    rig.events.clear()
    semantic = {"type": "semantic_vad", "eagerness": "low", "create_response": False}
    await rig.send(
        type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": semantic}}}
    )
    assert [e["param"] for e in rig.errors()] == ["session.audio.input.turn_detection.create_response"]
    assert rig.session.settings.endpoint_silence_ms == 400, "a refused turn_detection changes nothing"
    del semantic["create_response"]
    await rig.send(
        type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": semantic}}}
    )
    assert (
        rig.session.settings.endpoint_silence_ms == 800 and rig.session.settings.endpoint_unfinished_silence_ms == 2500
    )
    await close(rig)


# ---------------------------------------------------------------- turns
async def test_a_typed_turn_streams_a_response_in_the_realtime_order():
    rig = Rig()
    await rig.start()
    await rig.send(type="conversation.item.create", item=user_text(QUESTION))
    await rig.send(type="response.create")
    done = await rig.wait_for("response.done")
    for event in rig.events:
        check_ga(event)
    order = [t for t in rig.types() if not t.endswith(".delta")]
    assert order == [
        "session.created",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert done["response"]["status"] == "completed"
    # fields strict clients read (pipecat validates these and reads usage on every response.done)
    assert done["response"]["status_details"] is None and done["response"]["object"] == "realtime.response"
    assert {"input_tokens", "output_tokens", "input_token_details", "output_token_details"} <= set(
        done["response"]["usage"]
    )
    transcription = rig.events[0]["session"]["audio"]["input"]["transcription"]
    assert set(transcription) == {"model", "language", "prompt"}
    [item] = done["response"]["output"]
    assert item["content"][0]["transcript"] == "Paris is the capital of France."
    assert (
        "".join(e["delta"] for e in rig.of("response.output_audio_transcript.delta"))
        == item["content"][0]["transcript"]
    )
    # the tone is 6 words x 0.25 s at 22.05 kHz; resampled to 24 kHz it lasts as long
    assert rig.audio_s() == pytest.approx(1.5, abs=0.02)
    assert rig.llm.calls[0][-1] == {"role": "user", "content": QUESTION}
    await close(rig)


async def test_a_spoken_turn_with_server_vad():
    rig = Rig()
    await rig.start()
    await rig.append(np.concatenate([silence(0.3), tone(1.2), silence(1.5)]))
    done = await rig.wait_for("response.done")
    for event in rig.events:
        check_ga(event)
    kinds = rig.types()
    first = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert [k for k in kinds if k in first] == first
    assert kinds.index("conversation.item.input_audio_transcription.completed") < kinds.index("response.created")
    started, stopped = rig.of("input_audio_buffer.speech_started")[0], rig.of("input_audio_buffer.speech_stopped")[0]
    assert started["item_id"] == stopped["item_id"] == rig.of("input_audio_buffer.committed")[0]["item_id"]
    assert 200 <= started["audio_start_ms"] <= 500 < stopped["audio_end_ms"]
    assert rig.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == QUESTION
    assert done["response"]["status"] == "completed" and rig.audio_s() > 1.0
    await close(rig)


async def test_manual_turns_commit_then_response_create():
    rig = Rig()
    await rig.start()
    await rig.send(type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    assert rig.of("session.updated")[-1]["session"]["audio"]["input"]["turn_detection"] is None
    await rig.send(type="input_audio_buffer.commit", event_id="c0")
    assert rig.errors()[-1]["code"] == "input_audio_buffer_commit_empty"
    await rig.append(np.concatenate([tone(1.0), silence(1.0)]))
    await asyncio.sleep(0.2)
    assert not rig.of("input_audio_buffer.speech_started"), "no server VAD in manual mode"
    await rig.send(type="input_audio_buffer.commit")
    await rig.send(type="response.create")
    done = await rig.wait_for("response.done")
    for event in rig.events:
        if event["type"] != "error":
            check_ga(event)
    kinds = rig.types()
    assert kinds.index("input_audio_buffer.committed") < kinds.index(
        "conversation.item.input_audio_transcription.completed"
    )
    assert done["response"]["status"] == "completed"
    assert rig.models.asr.heard_s == [pytest.approx(2.0, abs=0.05)]
    assert rig.llm.calls[-1][-1] == {"role": "user", "content": QUESTION}
    await close(rig)


async def test_response_cancel_stops_the_reply_and_keeps_the_history():
    gate = asyncio.Event()
    rig = Rig(pieces=["Once upon a time, there was a dragon. ", "It lived in a cave. ", "The end."], gate=gate)
    await rig.start()
    await rig.send(type="response.cancel", event_id="nothing")
    assert rig.errors()[-1] == {
        "type": "invalid_request_error",
        "code": "response_cancel_not_active",
        "message": "there is no active response to cancel",
        "param": "response_id",
        "event_id": "nothing",
    }
    await rig.send(type="conversation.item.create", item=user_text("Tell me a story."))
    await rig.send(type="response.create")
    await rig.wait_for("response.output_audio.delta")
    await rig.send(type="response.create", event_id="again")
    assert rig.errors()[-1]["code"] == "conversation_already_has_active_response"
    await rig.send(type="response.cancel")
    done = await rig.wait_for("response.done")
    check_ga(done)
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["response"]["output"][0]["status"] == "incomplete"
    assert rig.session.history[0] == {"role": "user", "content": "Tell me a story."}
    gate.set()
    mark = len(rig.events)
    await rig.send(type="conversation.item.create", item=user_text("And then?"))
    await rig.send(type="response.create")
    done = await rig.wait_for("response.done", after=mark)
    assert done["response"]["status"] == "completed"
    prompt = rig.llm.calls[-1]
    assert prompt[1] == {"role": "user", "content": "Tell me a story."}
    assert prompt[-1] == {"role": "user", "content": "And then?"}
    await close(rig)


async def test_text_modality_sends_text_events_and_no_audio():
    rig = Rig()
    await rig.start()
    await rig.send(type="session.update", session={"type": "realtime", "output_modalities": ["text"]})
    await rig.send(type="conversation.item.create", item=user_text(QUESTION))
    await rig.send(type="response.create")
    done = await rig.wait_for("response.done")
    for event in rig.events:
        check_ga(event)
    assert rig.of("response.output_text.delta") and not rig.of("response.output_audio.delta")
    assert rig.of("response.output_text.done")[0]["text"] == "Paris is the capital of France."
    assert done["response"]["output"][0]["content"] == [
        {"type": "output_text", "text": "Paris is the capital of France."}
    ]
    assert not rig.session.busy, "a reply nobody hears must not count as playing"
    await close(rig)


async def test_history_items_and_a_response_with_nothing_to_answer():
    rig = Rig()
    await rig.start()
    await rig.send(type="response.create")
    failed = await rig.wait_for("response.done")
    check_ga(failed)
    assert failed["response"]["status"] == "failed" and not rig.of("error")
    assert failed["response"]["status_details"]["error"]["code"] == "no_user_message"
    mark = len(rig.events)
    await rig.send(type="conversation.item.create", item=user_text("My name is Ada."))
    assert rig.of("conversation.item.added")[-1]["item"]["role"] == "user"
    await rig.send(
        type="conversation.item.create",
        item={"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
    )
    await rig.send(type="conversation.item.create", item=user_text("What is my name?"))
    await rig.send(type="response.create", response={"metadata": {"topic": "names"}})
    done = await rig.wait_for("response.done", after=mark)
    assert done["response"]["metadata"] == {"topic": "names"}
    assert rig.llm.calls[-1][1:] == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    item_id = done["response"]["output"][0]["id"]
    await rig.send(type="conversation.item.retrieve", item_id=item_id)
    assert rig.of("conversation.item.retrieved")[-1]["item"]["id"] == item_id
    await rig.send(type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=500)
    assert rig.of("conversation.item.truncated")[-1]["audio_end_ms"] == 500
    await close(rig)


async def test_bad_events_get_realtime_errors_and_the_session_goes_on():
    rig = Rig()
    await rig.start()
    sends = [
        ("{oops", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        (json.dumps({"type": "session.frobnicate", "event_id": "e1"}), "unknown_event_type"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "not base64!"}), "invalid_audio"),
        (
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00" * 3).decode()}),
            "invalid_audio",
        ),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 700_000}), "audio_too_large"),
        (json.dumps({"type": "input_audio_buffer.append"}), "missing_required_parameter"),
        (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_unsupported"),
        (
            json.dumps({"type": "conversation.item.create", "item": {"type": "function_call_output"}}),
            "missing_required_parameter",
        ),
        (json.dumps({"type": "conversation.item.create", "item": user_text("x" * 3000)}), "string_above_max_length"),
        (
            json.dumps({"type": "response.create", "response": {"tools": [{"type": "function"}]}}),
            "missing_required_parameter",
        ),
        (
            json.dumps({"type": "response.create", "response": {"tools": [{"type": "mcp", "server_label": "x"}]}}),
            "unsupported_parameter",
        ),
        (json.dumps({"type": "output_audio_buffer.clear"}), "unsupported_parameter"),
        (
            json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 1}),
            "item_truncate_invalid_item_id",
        ),
        ('{"type": "session.update", "session": {"type": "realtime", "instructions": 1e999}}', "invalid_json"),
    ]
    for raw, code in sends:
        before = len(rig.events)
        await rig.adapter.handle_client(raw)
        [event] = rig.events[before:]
        check_ga(event)
        assert event["error"]["code"] == code, (raw[:80], event)
    assert rig.of("error")[2]["error"]["event_id"] == "e1"
    await rig.adapter.handle_binary()
    assert rig.errors()[-1]["code"] == "invalid_event"
    await rig.send(type="conversation.item.create", item=user_text(QUESTION))
    await rig.send(type="response.create")
    assert (await rig.wait_for("response.done"))["response"]["status"] == "completed"
    await close(rig)


async def test_client_events_are_validated_by_the_sdk_models():
    """The openai package's models are the schema: a field they refuse is an error naming its path."""
    rig = Rig()
    await rig.start()
    sends = [
        (
            {"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": "500"},
            ("invalid_type", "audio_end_ms"),
        ),
        (
            {"type": "session.update", "session": {"type": "realtime", "instructions": ["Be brief."]}},
            ("invalid_type", "session.instructions"),
        ),
        (
            {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}}},
            ("invalid_value", "session.audio.input.turn_detection.type"),
        ),
        (
            {"type": "session.update", "session": {"audio": {"output": {"voice": {"id": 7}}}}},
            ("invalid_type", "session.audio.output.voice.id"),
        ),
        (
            {
                "type": "session.update",
                "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            },
            ("unsupported_audio_format", "session.audio.input.format"),
        ),
        (
            {"type": "conversation.item.create", "item": {"role": "user", "content": [{"type": "input_text"}]}},
            ("missing_required_parameter", "item.type"),
        ),
        (
            {"type": "conversation.item.create", "item": {**user_text("Hi"), "role": "robot"}},
            ("invalid_value", "item.role"),
        ),
        (
            {"type": "conversation.item.create", "item": {**user_text("Hi"), "content": [{"type": "output_text"}]}},
            ("invalid_value", "item.content[0].type"),
        ),
        (
            {"type": "response.create", "response": {"metadata": {"topic": 1}}},
            ("invalid_type", "response.metadata.topic"),
        ),
        (
            {"type": "response.create", "response": {"tool_choice": {"type": "function"}}},
            ("missing_required_parameter", "response.tool_choice.name"),
        ),
    ]
    for index, (event, (code, param)) in enumerate(sends):
        before = len(rig.events)
        await rig.send(**event, event_id=f"bad_{index}")
        [error] = rig.events[before:]
        check_ga(error)
        assert (error["error"]["code"], error["error"]["param"]) == (code, param), (event, error)
        assert error["error"]["event_id"] == f"bad_{index}"
    assert "'server_vad' or 'semantic_vad'" in rig.errors()[2]["message"]
    assert not rig.of("session.updated"), "an update that does not validate changes nothing"
    assert (rig.session.settings.vad_threshold, rig.session.prefs.system_prompt) == (0.5, rig.settings.system_prompt)
    # what Parley takes beyond the SDK's schema: no session.type, its own include, turn detection without a type
    louder = {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7}}}
    await rig.send(type="session.update", session={"include": ["parley.notice"], "audio": louder})
    assert not rig.errors()[len(sends) :] and rig.session.settings.vad_threshold == 0.7
    assert rig.of("session.updated")[-1]["session"]["include"] == ["parley.notice"]
    await rig.send(type="session.update", session={"audio": {"input": {"turn_detection": False}}})
    assert rig.of("session.updated")[-1]["session"]["audio"]["input"]["turn_detection"] is None
    await rig.send(
        type="session.update", session={"audio": {"input": {"turn_detection": {"silence_duration_ms": 900}}}}
    )
    detection = rig.of("session.updated")[-1]["session"]["audio"]["input"]["turn_detection"]
    assert (detection["type"], detection["silence_duration_ms"]) == ("server_vad", 900)
    assert len(rig.errors()) == len(sends)
    await close(rig)


# ---------------------------------------------------------------- function calling
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_ORDER = [
    "response.output_item.added",
    "conversation.item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
]


def tool_rig(before_call: list[str]) -> Rig:
    llm = ToolScriptedLLM(
        [[*before_call, ToolCall("call_r1", "get_weather", '{"city": "Paris"}')], ["It is sunny in Paris."]]
    )
    return Rig(llm=llm)


async def test_a_function_call_ends_the_response_and_its_output_gets_the_answer():
    rig = tool_rig(["Let me check."])
    await rig.start()
    await rig.send(
        type="session.update",
        session={"type": "realtime", "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    )
    updated = rig.of("session.updated")[-1]["session"]
    assert updated["tools"][0]["name"] == "get_weather" and updated["tool_choice"] == "required"
    await rig.send(type="conversation.item.create", item=user_text("What is the weather in Paris?"))
    await rig.send(type="response.create")
    done = await rig.wait_for("response.done")
    for event in rig.events:
        check_ga(event)
    assert rig.llm.specs[0].choice == "required" and rig.llm.specs[0].parallel is False
    order = [t for t in rig.types() if t != "response.output_audio.delta"]
    after_message = order[order.index("response.output_item.done") + 2 :]  # the message item, then the call's
    assert after_message == [*CALL_ORDER, "response.done"]
    message, call = done["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["transcript"] == "Let me check."
    assert (call["type"], call["call_id"], call["name"], call["status"]) == (
        "function_call",
        "call_r1",
        "get_weather",
        "completed",
    )
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    arguments = rig.of("response.function_call_arguments.done")[0]
    assert arguments["output_index"] == 1 and arguments["item_id"] == call["id"]
    assert done["response"]["status"] == "completed"

    # the client runs it and asks for the answer
    before = len(rig.events)
    output = {"type": "function_call_output", "call_id": "call_r1", "output": '{"sky": "sunny"}'}
    await rig.send(type="conversation.item.create", item=output)
    await rig.send(type="response.create")
    answer = await rig.wait_for("response.done", after=before)
    for event in rig.events[before:]:
        check_ga(event)
    assert answer["response"]["status"] == "completed"
    assert answer["response"]["output"][0]["content"][0]["transcript"] == "It is sunny in Paris."
    assert rig.audio_s(after=before) > 0
    asked = rig.llm.calls[-1]
    assert asked[-2]["tool_calls"][0]["id"] == "call_r1"
    assert asked[-1] == {"role": "tool", "tool_call_id": "call_r1", "content": '{"sky": "sunny"}'}
    await close(rig)


async def test_a_call_alone_is_output_index_0_and_response_create_can_force_it():
    rig = tool_rig([])
    await rig.start()
    await rig.send(type="session.update", session={"type": "realtime", "tools": [WEATHER_TOOL]})
    await rig.send(type="conversation.item.create", item=user_text("Weather?"))
    named = {"type": "function", "name": "get_weather"}
    await rig.send(type="response.create", response={"tool_choice": named})
    done = await rig.wait_for("response.done")
    for event in rig.events:
        check_ga(event)
    [call] = done["response"]["output"]
    assert call["type"] == "function_call" and rig.of("response.output_item.added")[0]["output_index"] == 0
    assert rig.llm.specs[0].choice == {"type": "function", "function": {"name": "get_weather"}}
    assert rig.session.prefs.tool_choice == "auto", "the override was this response's only"
    bad = {"type": "function", "name": "get_time"}
    await rig.send(type="response.create", response={"tool_choice": bad})
    assert rig.errors()[-1]["param"] == "response.tool_choice"
    await close(rig)


async def test_function_call_items_join_the_history_and_nothing_to_answer_is_still_refused():
    rig = Rig(llm=ToolScriptedLLM([["Done."]]))
    await rig.start()
    call = {"type": "function_call", "call_id": "c1", "name": "set_timer", "arguments": '{"minutes": 5}'}
    await rig.send(type="conversation.item.create", item=call)
    await rig.send(
        type="conversation.item.create", item={"type": "function_call_output", "call_id": "c1", "output": "ok"}
    )
    for event in rig.events:
        check_ga(event)
    await rig.send(type="response.create")
    await rig.wait_for("response.done")
    assert [m["role"] for m in rig.llm.calls[-1]][-2:] == ["assistant", "tool"]
    assert rig.llm.calls[-1][-2]["tool_calls"][0]["function"]["name"] == "set_timer"
    await rig.send(type="response.create")
    failed = await rig.wait_for("response.done", after=len(rig.events) - 1)
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["status_details"]["error"]["code"] == "no_user_message"
    await close(rig)


# ---------------------------------------------------------------- the route: admission and keys (in-process)
def realtime_app(**settings):
    settings.setdefault("max_sessions", 16)  # not the machine's default cap: tests open several sessions
    return create_app(Settings(**settings), models=FakeStages(ScriptedLLM(["Hello there."])))


def test_route_takes_the_key_as_bearer_or_openai_subprotocol_and_refuses_without():
    app = realtime_app(api_key=KEY)
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        url = "ws://127.0.0.1:8000/v1/realtime?model=gpt-realtime"
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect(url) as ws:
                ws.receive_text()
        assert refused.value.code == 1008
        with client.websocket_connect(url, headers={"Authorization": f"Bearer {KEY}"}) as ws:
            created = json.loads(ws.receive_text())
            check_ga(created)
            assert created["session"]["model"] == "gpt-realtime"
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1"]
        with client.websocket_connect(url, subprotocols=protocols) as ws:
            assert ws.accepted_subprotocol == "realtime"
            assert json.loads(ws.receive_text())["type"] == "session.created"
            ws.send_text(json.dumps({"type": "conversation.item.create", "item": user_text("Hi")}))
            ws.send_text(json.dumps({"type": "response.create"}))
            kinds = []
            while "response.done" not in kinds:
                kinds.append(json.loads(ws.receive_text())["type"])
            assert "response.output_audio.delta" in kinds
        with pytest.raises(WebSocketDisconnect) as hostile:
            with client.websocket_connect(
                url, headers={"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"}
            ) as ws:
                ws.receive_text()
        assert hostile.value.code == 1008


def test_route_refuses_over_capacity_with_a_realtime_error():
    with TestClient(realtime_app(max_sessions=1), base_url="http://127.0.0.1:8000") as client:
        url = "ws://127.0.0.1:8000/v1/realtime"
        with client.websocket_connect(url) as first:
            assert json.loads(first.receive_text())["type"] == "session.created"
            with client.websocket_connect(url) as second:
                event = json.loads(second.receive_text())
                check_ga(event)
                assert (event["error"]["type"], event["error"]["code"]) == ("server_error", "overloaded")


# ---------------------------------------------------------------- conformance: the official SDK, real models
async def next_event(conn, received: list, kind: str, timeout: float = 120):
    """The SDK connection's next event of ``kind``, those before it kept in ``received``; an error event fails."""

    async def loop():
        while True:
            event = await conn.recv()
            received.append(event)
            if event.type == "error":
                raise AssertionError(f"server error: {event.error}")
            if event.type == kind:
                return event

    return await asyncio.wait_for(loop(), timeout)


async def talk(conn, audio: np.ndarray) -> None:
    """Send ``audio`` (24 kHz float) to an SDK connection at about real-time pace."""
    step = REALTIME_SAMPLE_RATE // 10
    for offset in range(0, len(audio), step):
        pcm = float_to_pcm16(audio[offset : offset + step])
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        await asyncio.sleep(0.1)


async def test_openai_sdk_drives_a_spoken_turn_and_a_cancel(live_server, speech):
    """``AsyncOpenAI(base_url=.../v1).realtime.connect()`` against ``parley serve`` with the bundled models."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=live_server + "/v1", api_key="sk-unused")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        received: list = []

        until = functools.partial(next_event, conn, received)

        assert (await until("session.created")).session.type == "realtime"
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"transcription": {"model": "whisper-1"}, "turn_detection": {"type": "server_vad"}},
                    "output": {"voice": "marin"},
                },
            }
        )
        await until("session.updated")

        # turn 1: spoken, at about real-time pace, then silence
        question = resample(np.asarray(speech(QUESTION), np.float32), 16_000, REALTIME_SAMPLE_RATE)
        audio = np.concatenate([silence(0.3), question, silence(1.5)])

        talking = asyncio.create_task(talk(conn, audio))
        done = await until("response.done", timeout=120)
        await talking
        kinds = [e.type for e in received]
        assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.committed" in kinds
        transcript = next(
            e.transcript for e in received if e.type == "conversation.item.input_audio_transcription.completed"
        )
        assert "capital" in words(transcript), transcript
        reply = b"".join(base64.b64decode(e.delta) for e in received if e.type == "response.output_audio.delta")
        assert len(reply) / 2 / REALTIME_SAMPLE_RATE > 0.5
        assert done.response.status == "completed"
        assert np.abs(pcm16_to_float(reply)).max() > 0.01, "reply audio is silent"

        # turn 2: typed, cancelled as soon as its audio starts
        received.clear()
        await conn.conversation.item.create(item=user_text("Tell me a long story about a dragon and a princess."))
        await conn.response.create()
        await until("response.output_audio.delta")
        await conn.response.cancel()
        cancelled = await until("response.done")
        assert cancelled.response.status == "cancelled"

        # turn 3: the conversation goes on after the cancel
        received.clear()
        await conn.conversation.item.create(item=user_text("Thank you. What is two plus two?"))
        await conn.response.create()
        last = await until("response.done", timeout=120)
        assert last.response.status == "completed"
        assert any(e.type == "response.output_audio.delta" for e in received)


async def test_openai_sdk_gets_a_valid_function_call_and_then_the_answer(live_server, speech):
    """The bundled SmolLM2-135M through ``parley serve``: a spoken request with ``tool_choice`` required decodes the
    call under a grammar, so its arguments parse and match the schema; after its ``function_call_output`` the answer
    is spoken."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=live_server + "/v1", api_key="sk-unused")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        received: list = []

        until = functools.partial(next_event, conn, received)

        await until("session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "tools": [THERMOSTAT_TOOL],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
            }
        )
        await until("session.updated")
        request = resample(
            np.asarray(speech("Set the bedroom to twenty two degrees."), np.float32), 16_000, REALTIME_SAMPLE_RATE
        )
        talking = asyncio.create_task(talk(conn, np.concatenate([silence(0.3), request, silence(1.5)])))
        done = await until("response.done")  # the turn committed by the server's VAD, answered with a call
        await talking
        assert "input_audio_buffer.committed" in [e.type for e in received]
        assert done.response.status == "completed"
        [call] = [item for item in done.response.output if item.type == "function_call"]
        arguments = json.loads(call.arguments)
        assert arguments["room"] in ("kitchen", "bedroom", "living room") and set(arguments) == {"room", "celsius"}
        assert isinstance(arguments["celsius"], int | float) and 10 <= arguments["celsius"] <= 30
        streamed = [e for e in received if e.type == "response.function_call_arguments.delta"]
        assert "".join(e.delta for e in streamed) == call.arguments

        received.clear()
        output = json.dumps({"room": arguments["room"], "celsius": arguments["celsius"], "done": True})
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": output}
        )
        await conn.response.create(response={"tool_choice": "none"})  # (required would ask for a call again)
        answer = await until("response.done")
        assert answer.response.status == "completed"
        outputs = [item.type for item in answer.response.output]
        assert outputs == ["message"], (outputs, [e.type for e in received])
        [message] = answer.response.output
        assert words(message.content[0].transcript)
        reply = b"".join(base64.b64decode(e.delta) for e in received if e.type == "response.output_audio.delta")
        assert len(reply) / 2 / REALTIME_SAMPLE_RATE > 0.3


def test_the_server_skills_act_here_too_and_their_news_is_a_response_of_the_server_s_own(tmp_path):
    """A Realtime client that declares no tools gets the server's skills, as ``/ws`` does: a timer set by a call
    (the skill's words are the response's), and when it rings, its words said as a response nobody asked for:
    ``response.created`` with no user item before it, then the message item, audio and ``response.done``."""
    from fakes import FakeStages as ScriptedStages
    from fakes import ScriptedASR as QuietASR

    set_it = ToolCall("call_1", "set_timer", json.dumps({"duration": "one second", "label": "tea"}))
    llm = ToolScriptedLLM([[set_it], ["Your tea timer is set."]])
    app = create_app(Settings(max_sessions=4, data_dir=str(tmp_path)), models=ScriptedStages(QuietASR(), llm))
    with (
        TestClient(app, base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect("ws://127.0.0.1:8000/v1/realtime") as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "session.created"

        def until_done() -> list[dict]:
            events = []
            while not events or events[-1]["type"] != "response.done":
                events.append(json.loads(ws.receive_text()))
                check_ga(events[-1])
            return events

        ws.send_text(json.dumps({"type": "conversation.item.create", "item": user_text("Set a tea timer for 1 s.")}))
        ws.send_text(json.dumps({"type": "response.create"}))
        asked = until_done()
        said = asked[-1]["response"]["output"][0]["content"][0]["transcript"]
        assert said == "Your tea timer is set for 1 second." and asked[-1]["response"]["status"] == "completed"
        rang = until_done()  # nothing sent by the client: the timer's news
        kinds = [e["type"] for e in rang if e["type"] != "response.output_audio.delta"]
        assert kinds[0] == "response.created" and "conversation.item.added" in kinds
        assert not [e for e in rang if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"]
        news = rang[-1]["response"]
        assert news["status"] == "completed" and "tea" in news["output"][0]["content"][0]["transcript"]
        assert any(e["type"] == "response.output_audio.delta" for e in rang)
    assert {t["function"]["name"] for t in llm.specs[0].tools} >= {"set_timer", "get_time"}
