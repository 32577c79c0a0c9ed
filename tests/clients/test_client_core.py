"""The shared WebSocket client core (app/clients/core.py), without models: typed decoding, the
reconnect policy, and ``speak_turn`` against a scripted server on loopback.

Nothing here waits on a timing margin: the fake server acts on what it has received (the
client's ``start``, a count of audio frames), never on the clock.
"""

from __future__ import annotations

import asyncio
import json
import typing
from http import HTTPStatus
from itertools import islice

import numpy as np
import pytest
import websockets
from harness import ScriptedServer
from websockets.frames import Close

from app import protocol
from app.audio import float_to_pcm16
from app.bench.user import CLIENT_MEASURED, TurnResult, speak_turn
from app.clients import core
from app.clients.core import (
    STAGE_LABELS,
    Connection,
    ConnectionRefused,
    backoff_delays,
    decode,
    describe_failure,
    open_connection,
    stay_connected,
)

READY = protocol.Ready(input_sample_rate=16_000, output_sample_rate=22_050)
METRICS = protocol.TurnMetrics(
    endpoint_ms=300.0, asr_final_ms=80.0, llm_ttft_ms=50.0, tts_first_audio_ms=90.0, voice_to_voice_ms=520.0, rtf=3.5
)
EVERY_EVENT = [
    READY,
    protocol.SpeechStarted(),
    protocol.SpeechStopped(),
    protocol.SpeechDropped(turn_id=4, reason="filler", heard="Um."),
    protocol.Transcript(turn_id=1, text="hello", final=False),
    protocol.Transcript(turn_id=1, text="Hello there.", final=True),
    protocol.AssistantText(turn_id=1, delta="Hi"),
    protocol.AudioStart(turn_id=1, sample_rate=22_050),
    protocol.Interrupt(turn_id=1),
    protocol.TurnContinued(turn_id=1),
    protocol.TurnDone(turn_id=1, text="Hi", interrupted=True, metrics=METRICS),
    protocol.Notice(turn_id=2, code="truncated", message="cut to fit"),
    protocol.CallTool(turn_id=3, call_id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
    protocol.ToolDone(turn_id=3, call_id="call_1", name="get_weather", status="completed", output="21"),
    protocol.ConfigApplied(system_prompt="Be brief.", voice="joe", language="en", barge_in=True, half_duplex=False),
    protocol.Error(code="overloaded", message="busy", fatal=True),
]


# ------------------------------------------------------------------ decoding
@pytest.mark.parametrize("event", EVERY_EVENT, ids=lambda e: e.type)
def test_every_server_event_decodes_to_its_typed_model(event):
    decoded = decode(protocol.encode(event))
    assert type(decoded) is type(event) and decoded == event


def test_every_event_type_of_the_protocol_is_covered():
    union = typing.get_args(typing.get_args(protocol.ServerMessage)[0])
    assert {model.model_fields["type"].default for model in union} == {event.type for event in EVERY_EVENT}


def test_turn_done_metrics_are_typed_and_omit_missing_figures():
    wire = protocol.encode(protocol.TurnDone(turn_id=2, text="ok", metrics=protocol.TurnMetrics(llm_ttft_ms=40.0)))
    assert "voice_to_voice_ms" not in json.loads(wire)["metrics"]
    done = decode(wire)
    assert isinstance(done, protocol.TurnDone)
    assert done.metrics.llm_ttft_ms == 40.0 and done.metrics.voice_to_voice_ms is None


def test_binary_frames_are_reply_audio():
    assert decode(b"\x01\x00\x02\x00") == b"\x01\x00\x02\x00"


@pytest.mark.parametrize(
    "raw",
    [
        '{"type": "first_audio"}',  # not an event of this protocol
        '{"type": "transcript", "turn_id": 1, "text": "hi"}',  # a field missing
        '{"type": "interrupt", "turn_id": 1, "extra": true}',  # a field the protocol does not have
        "[1, 2]",
    ],
)
def test_anything_else_is_rejected(raw):
    with pytest.raises(ValueError):
        decode(raw)


# ------------------------------------------------------------------ reconnect policy and figures
def test_backoff_doubles_from_half_a_second_up_to_eight():
    assert list(islice(backoff_delays(), 7)) == [0.5, 1, 2, 4, 8, 8, 8]
    assert list(islice(backoff_delays(first=1, cap=3), 4)) == [1, 2, 3, 3]


def test_failures_are_described_in_words():
    restart = websockets.ConnectionClosed(Close(1012, "restart"), None)
    assert describe_failure(restart) == "the server is restarting"
    assert describe_failure(websockets.ConnectionClosed(None, None)) == "the connection dropped (code None)"
    assert describe_failure(ConnectionRefusedError(111, "Connection refused")) == "Connection refused"
    assert describe_failure(TimeoutError()) == "TimeoutError"


def test_figure_names_are_turn_metrics_fields():
    assert set(STAGE_LABELS) <= set(protocol.LATENCY_FIELDS)
    assert CLIENT_MEASURED <= set(protocol.TurnMetrics.model_fields)
    assert "voice_to_voice_ms" in CLIENT_MEASURED


def test_turn_result_reads_typed_events_and_measures_the_client_side():
    result = TurnResult(output_sample_rate=1000, speech_end_sent=10.0, first_audio_received=10.25)
    result.events = [
        protocol.Transcript(turn_id=1, text="Hi", final=False),
        protocol.Transcript(turn_id=1, text="Hi there.", final=True),
        protocol.AssistantText(turn_id=1, delta="Hel"),
        protocol.AssistantText(turn_id=1, delta="lo."),
        protocol.TurnDone(turn_id=1, text="Hello.", metrics=METRICS),
    ]
    result.reply_audio.extend(b"\x00\x00" * 1500)
    # 0.5 s of audio at t=10.25 plays until 10.75: the chunk at 10.9 is late (one underrun), the one at 11.0 is not
    result.audio_arrivals = [(10.25, 500), (10.9, 500), (11.0, 500)]
    assert result.final_transcript == "Hi there." and result.assistant_text == "Hello."
    assert result.turn_done.text == "Hello." and result.server_metrics == METRICS
    assert result.event(protocol.Interrupt) is None
    measured = result.client_metrics()
    assert measured.voice_to_voice_ms == pytest.approx(250.0)
    assert measured.reply_audio_s == pytest.approx(1.5)
    assert measured.underruns == 1
    assert measured.underrun_s == pytest.approx(0.15)  # silent from 10.75 to 10.9
    assert TurnResult().server_metrics == protocol.TurnMetrics()


def test_voice_to_voice_counts_to_the_first_audible_sample_not_the_quiet_a_voice_starts_with():
    result = TurnResult(output_sample_rate=1000, speech_end_sent=10.0, first_audio_received=10.25)
    quiet = np.full(150, 0.005, np.float32)  # near-silence before the first word
    loud = np.full(350, 0.3, np.float32)
    result.reply_audio.extend(float_to_pcm16(np.concatenate([quiet[:100], quiet[100:], loud, loud])))
    # two chunks: the first (100 quiet samples) arrives at 10.25 and plays to 10.35; the second
    # arrives late, at 10.5, and plays its own 50 quiet samples first
    result.audio_arrivals = [(10.25, 100), (10.5, 750)]
    assert result.voice_to_voice_ms == pytest.approx(550.0)
    result.audio_arrivals = [(10.25, 100), (10.3, 750)]  # on time: played gaplessly, heard at 10.4
    assert result.voice_to_voice_ms == pytest.approx(400.0)
    silent = TurnResult(output_sample_rate=1000, speech_end_sent=10.0, first_audio_received=10.25)
    silent.reply_audio.extend(b"\x00\x00" * 500)
    silent.audio_arrivals = [(10.25, 500)]
    assert silent.voice_to_voice_ms == pytest.approx(250.0)  # nothing audible: from its first audio


def test_a_continued_turn_keeps_only_its_whole_transcript_and_its_last_reply():
    result = TurnResult(output_sample_rate=1000, first_audio_received=9.5)
    result.reply_audio.extend(b"\x00\x00" * 300)  # 0.3 s of the first half's reply, heard mid-question
    result.events = [
        protocol.Transcript(turn_id=1, text="I want to visit Paris.", final=True),
        protocol.AssistantText(turn_id=1, delta="Paris is lovely."),
    ]
    result.speech_end_sent = 10.0
    result.events.append(protocol.TurnContinued(turn_id=1))
    result.withdraw_reply()
    result.events += [
        protocol.Transcript(turn_id=1, text="I want to visit Paris. and London.", final=True),
        protocol.AssistantText(turn_id=1, delta="Both are lovely."),
    ]
    assert result.final_transcript == "I want to visit Paris. and London."
    assert result.assistant_text == "Both are lovely."
    assert result.withdrawn_audio_s == pytest.approx(0.3) and result.withdrawn_audio_before_speech_end
    assert result.first_audio_received is None and not result.reply_audio  # the real answer's audio is still to come


# ------------------------------------------------------------------ against a scripted server
def audio_frames(inbox: list) -> int:
    return sum(isinstance(m, bytes) for m in inbox)


SPEECH = (0.3 * np.sin(np.arange(3200) / 5)).astype(np.float32)  # 200 ms at 16 kHz: 10 frames
REPLY = [float_to_pcm16(np.full(2205, v, np.float32)) for v in (0.1, -0.2)]  # 2 x 100 ms at 22.05 kHz


async def test_speak_turn_collects_a_whole_turn():
    server: ScriptedServer

    async def script(ws, inbox, _number) -> None:
        # 5 frames of leading silence + 10 of speech: reply once the last speech frame is in
        await server.wait_until(lambda: audio_frames(inbox) >= 15)
        for event in [
            protocol.SpeechStarted(),
            protocol.SpeechStopped(),
            protocol.Transcript(turn_id=1, text="What is it?", final=True),
            protocol.AssistantText(turn_id=1, delta="It is "),
            protocol.AssistantText(turn_id=1, delta="Paris."),
            protocol.AudioStart(turn_id=1, sample_rate=22_050),
        ]:
            await ws.send(protocol.encode(event))
        for chunk in REPLY:
            await ws.send(chunk)
        await ws.send(protocol.encode(protocol.TurnDone(turn_id=1, text="It is Paris.", metrics=METRICS)))
        await asyncio.Event().wait()  # the client hangs up

    server = ScriptedServer(script)
    async with server as url:
        result = await speak_turn(
            url, SPEECH, leading_silence_s=0.1, trailing_silence_s=0.1, realtime=False, timeout_s=60
        )

    inbox = server.inboxes[0]
    assert inbox[0] == {"type": "start", "sample_rate": 16_000}
    assert {len(m) for m in inbox if isinstance(m, bytes)} == {640}  # 20 ms PCM16 frames
    assert [type(e) for e in result.events] == [
        protocol.SpeechStarted,
        protocol.SpeechStopped,
        protocol.Transcript,
        protocol.AssistantText,
        protocol.AssistantText,
        protocol.AudioStart,
        protocol.TurnDone,
    ]
    assert len(result.event_times) == len(result.events)
    assert result.final_transcript == "What is it?"
    assert result.assistant_text == "It is Paris."
    assert result.output_sample_rate == 22_050
    assert bytes(result.reply_audio) == b"".join(REPLY)
    assert result.reply_seconds == pytest.approx(0.2)
    assert result.turn_done.metrics == METRICS and result.server_metrics.voice_to_voice_ms == 520.0
    assert result.voice_to_voice_ms is not None and result.voice_to_voice_ms >= 0  # audio came after the speech
    assert [n for _, n in result.audio_arrivals] == [2205, 2205]


async def test_a_fatal_error_ends_the_turn():
    server: ScriptedServer

    async def script(ws, inbox, _number) -> None:
        await server.wait_until(lambda: audio_frames(inbox) >= 1)
        await ws.send(protocol.encode(protocol.Error(code="overloaded", message="too many sessions", fatal=True)))
        await asyncio.Event().wait()

    server = ScriptedServer(script)
    async with server as url:
        result = await speak_turn(url, SPEECH, trailing_silence_s=0.1, realtime=False, timeout_s=60)
    assert result.event(protocol.Error).code == "overloaded"
    assert result.turn_done is None and result.voice_to_voice_ms is None


async def test_an_unknown_event_fails_the_turn_at_once():
    async def script(ws, inbox, _number) -> None:
        await ws.send(json.dumps({"type": "first_audio", "turn_id": 1}))
        await asyncio.Event().wait()

    async with ScriptedServer(script) as url:
        with pytest.raises(ValueError, match="not a server event"):
            await speak_turn(url, SPEECH, trailing_silence_s=0.1, realtime=False, timeout_s=60)


async def test_a_server_that_hangs_up_fails_the_turn_at_once():
    server: ScriptedServer

    async def script(ws, inbox, _number) -> None:
        await server.wait_until(lambda: audio_frames(inbox) >= 1)
        await ws.close()

    server = ScriptedServer(script)
    async with server as url:
        with pytest.raises((ConnectionError, websockets.ConnectionClosed)):
            await speak_turn(url, SPEECH, trailing_silence_s=0.1, realtime=False, timeout_s=60)


async def test_connection_sends_typed_messages_and_receive_can_skip_unknown_events():
    server: ScriptedServer

    async def script(ws, inbox, _number) -> None:
        await server.wait_until(lambda: len(inbox) >= 4)
        await ws.send(json.dumps({"type": "first_audio"}))
        await ws.send(protocol.encode(protocol.AssistantText(turn_id=1, delta="ok")))
        await ws.send(b"\x00\x00")
        await ws.close()

    server = ScriptedServer(script)
    async with server as url:
        connection = await open_connection(url, sample_rate=48_000)
        assert connection.ready == READY and connection.output_sample_rate == 22_050
        await connection.send_audio(np.zeros(960, np.float32))
        await connection.send_text("Hello?")
        await connection.send(protocol.Playback(turn_id=1, played_ms=120.0))
        skipped: list[ValueError] = []
        received = [item async for item in connection.receive(on_unknown=skipped.append)]
        await connection.close()
    assert server.inboxes[0] == [
        {"type": "start", "sample_rate": 48_000},
        b"\x00\x00" * 960,
        {"type": "text", "text": "Hello?"},
        {"type": "playback", "turn_id": 1, "played_ms": 120.0},
    ]
    assert received == [protocol.AssistantText(turn_id=1, delta="ok"), b"\x00\x00"]
    assert len(skipped) == 1


async def test_handshake_needs_ready_first():
    async def script(ws, inbox, _number) -> None:
        await ws.send(protocol.encode(protocol.SpeechStarted()))
        await asyncio.Event().wait()

    async with ScriptedServer(script, ready=False) as url:
        with pytest.raises(OSError, match="expected 'ready'"):
            await open_connection(url)


async def test_stay_connected_reconnects_after_a_drop_and_reports_why():
    said: list[str] = []
    finished = asyncio.Event()
    server: ScriptedServer

    async def script(ws, inbox, number) -> None:
        if number == 1:
            await server.wait_until(lambda: len(inbox) >= 1)  # the client said `start`
            await ws.close(1012)  # a server restart
        await asyncio.Event().wait()

    async def converse(connection: Connection) -> None:
        conversations.append(connection.ready)
        if len(conversations) == 2:
            finished.set()
            return
        async for _ in connection:
            pass

    conversations: list[protocol.Ready] = []
    lost: list[int] = []
    server = ScriptedServer(script)
    async with server as url:
        await stay_connected(
            url,
            converse,
            finished=finished,
            say=said.append,
            backoff=lambda: iter([0.01, 0.02]),
            on_lost=lambda: lost.append(1),
        )
    assert len(conversations) == 2 and len(lost) == 1
    assert said == [
        f"connecting to {url} ...",
        "connection lost (the server is restarting); retrying in 0.01 s",
        f"connecting to {url} ...",
    ]


async def test_stay_connected_retries_a_server_that_is_not_there_with_growing_delays():
    said: list[str] = []
    finished = asyncio.Event()

    def say(line: str) -> None:
        said.append(line)
        if sum("retrying" in s for s in said) == 3:
            finished.set()

    async def never(_connection) -> None:
        raise AssertionError("nothing listens there")

    with socket_without_listener() as port:
        await stay_connected(
            f"ws://127.0.0.1:{port}/ws", never, finished=finished, say=say, backoff=lambda: iter([0, 0.001, 0.002])
        )
    retries = [line for line in said if "retrying" in line]
    assert all(line.startswith("cannot connect (") for line in retries)
    assert [line.rsplit(" ", 2)[1] for line in retries] == ["0", "0.001", "0.002"]


async def test_stay_connected_gives_up_on_an_http_error_that_retrying_will_not_fix():
    async def not_found(connection, request):
        return connection.respond(HTTPStatus.NOT_FOUND, "not here\n")

    async def never(_connection) -> None:
        raise AssertionError("no WebSocket here")

    async with websockets.serve(lambda ws: None, "127.0.0.1", 0, process_request=not_found) as served:
        port = next(iter(served.sockets)).getsockname()[1]
        with pytest.raises(ConnectionRefused, match="answered HTTP 404"):
            await stay_connected(f"ws://127.0.0.1:{port}/ws", never, finished=asyncio.Event(), say=lambda _: None)


class socket_without_listener:  # noqa: N801 - used as a context manager
    """A loopback port that is bound (so no one else takes it) but not listening: connects are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_the_core_is_the_only_websocket_client():
    """mic.py and the benchmark reach the server only through the core (no raw json events)."""
    from pathlib import Path

    root = Path(core.__file__).resolve().parents[1]
    for path in [root / "clients" / "mic.py", root / "bench" / "voice.py", root / "bench" / "user.py"]:
        source = path.read_text()
        assert "json.loads" not in source and "websockets.connect" not in source, path
