"""The Wyoming door on the real server (``create_app``, a real TCP port), driven by the ``wyoming`` library's own
client, with scripted stand-ins for the models: describe, transcription (whole and streamed), synthesis (whole
and streamed), the conversation over two sentences, and bad input (malformed, oversized, out of order)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import numpy as np
import pytest
from fakes import RATE, FakeStages, ScriptedASR
from fastapi.testclient import TestClient
from harness import ScriptedLLM
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.event import Event
from wyoming.handle import Handled
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from app.config import Settings
from app.server.app import create_app
from app.server.wyoming import connection
from app.server.wyoming.dictation import LEAD_IN_SAMPLES

LEAD_IN_S = LEAD_IN_SAMPLES / 16_000
READ_TIMEOUT_S = 10.0


class RecordingASR(ScriptedASR):
    """Also records how many seconds of 16 kHz audio each call got."""

    def __init__(self, text: str = "", partial: str | None = None) -> None:
        super().__init__(text, partial)
        self.seconds: list[float] = []

    def transcribe(self, audio, *, wait=True, context="", language=None):
        self.seconds.append(len(audio) / 16_000)
        return super().transcribe(audio, wait=wait, context=context, language=language)


class Door:
    """The server with its Wyoming door on a free port, and a way to talk to it."""

    def __init__(self, asr_text: str = "turn on the kitchen lights", partial: str | None = None, **settings) -> None:
        self.asr = RecordingASR(asr_text, partial)
        self.llm = ScriptedLLM(["Nice to meet you, Ada."])
        self.models = FakeStages(self.asr, self.llm)
        self.app = create_app(Settings(wyoming_port=0, **settings), models=self.models)
        self.client = TestClient(self.app, base_url="http://127.0.0.1:8000")

    def __enter__(self) -> Door:
        self.client.__enter__()
        self.port = self.app.state.wyoming.port
        return self

    def __exit__(self, *exc) -> None:
        self.client.__exit__(*exc)

    def wait_until_no_sessions(self) -> None:
        """The server sees a client leave on its own task: wait for it (a slot never freed fails here)."""
        deadline = time.monotonic() + 5
        while self.app.state.sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.app.state.sessions == {}

    def talk(self, script):
        """Run ``script(connect)`` (a coroutine function) in a loop of its own; ``connect()`` opens a client."""

        def connect() -> AsyncTcpClient:
            return AsyncTcpClient("127.0.0.1", self.port, connect_timeout=5, read_timeout=READ_TIMEOUT_S)

        return asyncio.run(script(connect))


async def events_until(client: AsyncTcpClient, last: str) -> list[Event]:
    got = []
    while True:
        event = await client.read_event()
        assert event is not None, f"the connection closed before {last!r}; got {[e.type for e in got]}"
        got.append(event)
        if event.type in (last, "error"):
            return got


def pcm(seconds: float, rate: int = 16_000, channels: int = 1) -> bytes:
    tone = 0.2 * np.sin(np.arange(int(seconds * rate)) * 2 * np.pi * 220 / rate)
    return (np.repeat(tone[:, None], channels, axis=1) * 32767).astype("<i2").tobytes()


async def send_audio(client, audio: bytes, rate=16_000, width=2, channels=1, chunk_s=0.1, pace_s=0.0) -> None:
    await client.write_event(AudioStart(rate=rate, width=width, channels=channels).event())
    step = int(chunk_s * rate) * width * channels
    for offset in range(0, len(audio), step):
        await client.write_event(
            AudioChunk(rate=rate, width=width, channels=channels, audio=audio[offset : offset + step]).event()
        )
        if pace_s:
            await asyncio.sleep(pace_s)
    await client.write_event(AudioStop().event())


def test_describe_offers_streaming_asr_tts_and_the_conversation():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Describe().event())
            return Info.from_event(await client.read_event())

    with Door() as door:
        info = door.talk(script)
    (asr,), (tts,), (handle,) = info.asr, info.tts, info.handle
    assert asr.name == tts.name == handle.name == "parley"
    assert asr.supports_transcript_streaming and tts.supports_synthesize_streaming and handle.supports_handled_streaming
    assert asr.models[0].languages == ["en", "de"]
    assert [(voice.name, voice.languages) for voice in tts.voices] == [("tone", ["en"]), ("other-tone", ["de"])]


def test_audio_sent_at_once_is_transcribed_once_with_the_stream_events_around_it():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Transcribe(language="en-US").event())
            await send_audio(client, pcm(1.5))
            return await events_until(client, "transcript-stop")

    with Door() as door:
        events = door.talk(script)
        assert door.asr.calls == [True]  # no partial delayed it
        assert door.asr.seconds == [pytest.approx(1.5 + LEAD_IN_S, abs=0.01)]  # (with silence put before it)
        assert door.asr.languages_asked == ["en"]
    assert [e.type for e in events] == ["transcript-start", "transcript-chunk", "transcript", "transcript-stop"]
    assert Transcript.from_event(events[2]).text == "turn on the kitchen lights"
    assert events[1].data["text"] == "turn on the kitchen lights"


def test_audio_streamed_as_spoken_gets_partial_chunks_that_add_up_to_the_final():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Transcribe().event())
            await send_audio(client, pcm(0.8), pace_s=0.1)
            return await events_until(client, "transcript-stop")

    with Door(partial="turn on the", partial_interval_ms=100) as door:
        events = door.talk(script)
        assert False in door.asr.calls  # partials ran while the audio came
    chunks = "".join(e.data["text"] for e in events if e.type == "transcript-chunk")
    final = Transcript.from_event(next(e for e in events if e.type == "transcript")).text
    assert chunks == final == "turn on the kitchen lights"


class LengthASR(RecordingASR):
    """Hears how long the audio it was given is ("1.3 seconds"), so a transcript tells what audio it covered."""

    def transcribe(self, audio, *, wait=True, context="", language=None):
        heard = super().transcribe(audio, wait=wait, context=context, language=language)
        return replace(heard, text=f"{len(audio) / 16_000:.1f} seconds")


def silence(seconds: float) -> bytes:
    return bytes(2 * int(seconds * 16_000))


def test_the_final_starts_at_the_pause_and_is_ready_when_the_stream_ends():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Transcribe().event())
            await send_audio(client, pcm(1.0) + silence(1.0))
            return await events_until(client, "transcript-stop")

    with Door() as door:
        door.asr = door.models.asr = LengthASR()
        events = door.talk(script)
        finals = [seconds for seconds, wait in zip(door.asr.seconds, door.asr.calls, strict=True) if wait]
    assert len(finals) == 1 and 1.0 < finals[0] - LEAD_IN_S < 1.5  # one final, made at the pause, not at the end
    assert Transcript.from_event(next(e for e in events if e.type == "transcript")).text == f"{finals[0]:.1f} seconds"


def test_speech_after_a_pause_voids_the_early_final():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Transcribe().event())
            await send_audio(client, pcm(0.6) + silence(0.5) + pcm(0.6) + silence(0.3))
            return await events_until(client, "transcript-stop")

    with Door() as door:
        door.asr = door.models.asr = LengthASR()
        events = door.talk(script)
    heard = Transcript.from_event(next(e for e in events if e.type == "transcript")).text
    assert float(heard.split()[0]) - LEAD_IN_S >= 1.7  # both stretches of speech


def test_any_rate_and_stereo_become_16_khz_mono():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Transcribe().event())
            await send_audio(client, pcm(1.0, 48_000, 2), rate=48_000, channels=2)
            return await events_until(client, "transcript-stop")

    with Door() as door:
        door.talk(script)
        assert door.asr.seconds == [pytest.approx(1.0 + LEAD_IN_S, abs=0.02)]


def test_a_whole_text_is_one_audio_stream_its_first_piece_urgent():
    async def synthesize(client):
        await client.write_event(Synthesize(text="Hello there. How are you today?").event())
        return await events_until(client, "audio-stop")

    async def script(connect):
        async with connect() as client:
            alone = await synthesize(client)
        async with connect() as client, connect() as other:
            await other.write_event(Ping().event())
            await other.read_event()  # (another session is open now)
            await synthesize(client)
        return alone

    with Door() as door:
        events = door.talk(script)
        spoken, urgent = door.models.tts.spoken, door.models.tts.urgent
    assert [e.type for e in events if e.type != "audio-chunk"] == ["audio-start", "audio-stop"]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (RATE, 2, 1)
    samples = sum(len(e.payload) for e in events if e.type == "audio-chunk") // 2
    assert samples == pytest.approx(6 * 0.25 * RATE, abs=2)  # six words, a quarter second each
    assert [text for _, text in spoken] == ["Hello there.", "How are you today?"] * 2
    assert urgent == [True, True, True, False]  # alone, every piece on every core; else the first only


def test_a_long_first_sentence_is_cut_so_its_audio_starts_early():
    async def script(connect):
        async with connect() as client:
            await client.write_event(
                Synthesize(text="The weather today is sunny and warm with a light breeze.").event()
            )
            await events_until(client, "audio-stop")

    with Door() as door:
        door.talk(script)
        spoken = [text for _, text in door.models.tts.spoken]
    assert spoken == ["The weather today", "is sunny and warm with a light breeze."]


def test_streamed_text_is_spoken_piece_by_piece_as_it_arrives():
    async def script(connect):
        async with connect() as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="other-tone")).event())
            await client.write_event(SynthesizeChunk(text="Hallo zusammen. ").event())
            first = await client.read_event()  # its audio starts before the rest of the text is sent
            await client.write_event(SynthesizeChunk(text="Wie geht es euch? ").event())
            await client.write_event(Synthesize(text="Hallo zusammen. Wie geht es euch?").event())  # (compatibility)
            await client.write_event(SynthesizeStop().event())
            return [first, *await events_until(client, "synthesize-stopped")]

    with Door() as door:
        events = door.talk(script)
        spoken = door.models.tts.spoken
    kinds = [e.type for e in events if e.type != "audio-chunk"]
    assert kinds == ["audio-start", "audio-stop", "audio-start", "audio-stop", "synthesize-stopped"]
    assert spoken == [("other-tone", "Hallo zusammen."), ("other-tone", "Wie geht es euch?")]


def test_a_voice_by_language_and_an_unknown_voice_refused():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Synthesize(text="Guten Tag.", voice=SynthesizeVoice(language="de_DE")).event())
            await events_until(client, "audio-stop")
        async with connect() as client:
            await client.write_event(Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event())
            return await events_until(client, "audio-stop"), await client.read_event()

    with Door() as door:
        (error,), after = door.talk(script)
        assert door.models.tts.spoken == [("other-tone", "Guten Tag.")]
    assert (error.type, error.data["code"]) == ("error", "unknown_voice")
    assert after is None  # and the connection is closed


def test_the_conversation_remembers_its_first_sentence_by_conversation_id():
    async def sentence(connect, text, context=None):
        async with connect() as client:
            await client.write_event(Transcript(text=text, context=context).event())
            return await events_until(client, "handled-stop")

    async def script(connect):
        first = await sentence(connect, "My name is Ada.", {"conversation_id": "kitchen-1"})
        second = await sentence(connect, "What is my name?", {"conversation_id": "kitchen-1"})
        other = await sentence(connect, "Hello.")
        return first, second, other

    with Door() as door:
        first, second, other = door.talk(script)
        asked = door.llm.calls
    assert [e.type for e in first][0] == "handled-start" and first[-1].type == "handled-stop"
    handled = Handled.from_event(next(e for e in second if e.type == "handled"))
    assert handled.text == "Nice to meet you, Ada." and handled.context == {"conversation_id": "kitchen-1"}
    chunks = "".join(e.data["text"] for e in first if e.type == "handled-chunk")
    assert chunks == "Nice to meet you, Ada."
    said_second = [m["content"] for m in asked[1] if m["role"] != "system"]
    assert said_second[:2] == ["My name is Ada.", "Nice to meet you, Ada."]
    assert "My name is Ada." not in [m["content"] for m in asked[2]]  # a sentence without an id: a new conversation
    new_id = Handled.from_event(next(e for e in other if e.type == "handled")).context["conversation_id"]
    assert new_id and new_id != "kitchen-1"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"this is not json\n", "bad_json"),
        (b'["a list"]\n', "bad_json"),
        (b'{"type": "Not A Type!"}\n', "bad_event"),
        (json.dumps({"type": "audio-chunk", "payload_length": 10**9}).encode() + b"\n", "event_too_large"),
        (json.dumps({"type": "synthesize", "data_length": -1}).encode() + b"\n", "bad_event"),
        (b'{"type": "synthesize", "data": {"text": "' + b"x" * 20_000 + b'"}}\n', "event_too_large"),
        (json.dumps({"type": "synthesize", "data": {"text": 42}}).encode() + b"\n", "bad_event"),
        (json.dumps({"type": "synthesize-chunk", "data": {"text": "hi"}}).encode() + b"\n", "synthesis_not_started"),
        (json.dumps({"type": "audio-chunk", "data": {"rate": 16000}}).encode() + b"\n", "audio_not_started"),
        (
            json.dumps({"type": "audio-start", "data": {"rate": 16000, "width": 1, "channels": 1}}).encode() + b"\n",
            "bad_audio_format",
        ),
        (json.dumps({"type": "transcribe", "data": {"language": "xx"}}).encode() + b"\n", "unsupported_language"),
        (json.dumps({"type": "transcript", "data": {"text": "x" * 3000}}).encode() + b"\n", "text_too_long"),
        (json.dumps({"type": "select-program", "data": {"name": "other"}}).encode() + b"\n", "unknown_program"),
    ],
)
def test_a_bad_event_gets_a_clear_error_and_the_door_serves_the_next_client(raw, code):
    async def script(connect):
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        writer.write(raw)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        header = json.loads(line)
        data = json.loads(await reader.readexactly(header["data_length"]))
        closed = await asyncio.wait_for(reader.read(), READ_TIMEOUT_S)
        writer.close()
        async with connect() as client:  # the next client is served as ever
            await client.write_event(Ping(text="still there?").event())
            pong = await client.read_event()
        return header["type"], data, closed, pong

    with Door() as door:
        kind, data, closed, pong = door.talk(script)
        door.wait_until_no_sessions()  # nothing left registered
    assert (kind, data["code"]) == ("error", code)
    assert data["text"]
    assert closed == b""
    assert (pong.type, pong.data["text"]) == ("pong", "still there?")


def test_unknown_event_types_are_skipped():
    async def script(connect):
        async with connect() as client:
            await client.write_event(Event(type="run-satellite"))
            await client.write_event(Describe().event())
            return await client.read_event()

    with Door() as door:
        assert door.talk(script).type == "info"


def test_connections_take_session_slots_and_a_full_server_says_so():
    async def script(connect):
        async with connect() as first:
            await first.write_event(Describe().event())
            await first.read_event()
            async with connect() as second:
                await second.write_event(Describe().event())
                refused = await second.read_event()
                try:
                    closed = await second.read_event()
                except ConnectionResetError:  # (the server closed with the describe unread)
                    closed = None
            sessions = len(door.app.state.sessions)
        return refused, closed, sessions

    with Door(max_sessions=1) as door:
        refused, closed, sessions = door.talk(script)
        door.wait_until_no_sessions()
    assert (refused.type, refused.data["code"]) == ("error", "overloaded")
    assert closed is None and sessions == 1


def test_a_flooding_client_is_closed_and_the_others_are_served_meanwhile(monkeypatch):
    monkeypatch.setattr(connection, "FLOOD_CLOSE_S", 0.5)  # (the pace as it is; closed sooner)
    monkeypatch.setattr(connection, "EVENTS_BURST", 100.0)

    async def script(connect):
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        writer.write(b'{"type": "noise"}\n' * 5000)  # skipped events, sent far faster than any client needs
        await writer.drain()
        started = time.monotonic()
        async with connect() as other:
            await other.write_event(Describe().event())
            assert (await other.read_event()).type == "info"
        answered_s = time.monotonic() - started
        line = await asyncio.wait_for(reader.readline(), 30)
        header = json.loads(line)
        data = json.loads(await reader.readexactly(header["data_length"]))
        writer.close()
        return answered_s, header["type"], data["code"]

    with Door() as door:
        answered_s, kind, code = door.talk(script)
        door.wait_until_no_sessions()
        metrics = door.client.get("/metrics").text
    assert answered_s < 5.0
    assert (kind, code) == ("error", "flooding")
    assert 'parley_evictions_total{reason="flooding"} 1.0' in metrics


def test_a_client_that_stops_reading_is_closed_and_its_slot_freed():
    async def script(connect):
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        long_text = "word " * 1999  # ~500 s of audio (16 MB), never read
        writer.write(json.dumps({"type": "synthesize", "data": {"text": long_text}}).encode() + b"\n")
        await writer.drain()
        deadline = time.monotonic() + 15
        while not door.app.state.metrics.evictions.labels(reason="not_reading")._value.get():
            assert time.monotonic() < deadline, "the peer that reads nothing was never evicted"
            await asyncio.sleep(0.05)
        while door.app.state.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        writer.close()

    with Door(send_timeout_s=0.3) as door:
        door.talk(script)
        door.wait_until_no_sessions()
        assert 'parley_evictions_total{reason="not_reading"} 1.0' in door.client.get("/metrics").text


def test_two_conversations_at_once_keep_apart():
    async def sentence(connect, text, conversation_id):
        async with connect() as client:
            await client.write_event(Transcript(text=text, context={"conversation_id": conversation_id}).event())
            return await events_until(client, "handled-stop")

    async def conversation(connect, name):
        await sentence(connect, f"My name is {name}.", name)
        await sentence(connect, "What is my name?", name)

    async def script(connect):
        await asyncio.gather(conversation(connect, "Ada"), conversation(connect, "Grace"))

    with Door() as door:
        door.talk(script)
        asked = [[m["content"] for m in call if m["role"] == "user"] for call in door.llm.calls]
    seconds = [users for users in asked if users[-1] == "What is my name?"]
    assert sorted(users[:-1] for users in seconds) == [["My name is Ada."], ["My name is Grace."]]
