"""End to end through a real `parley serve` (uvicorn) on a loopback port, with the bundled models."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import pytest
import websockets
from harness import assert_barged_in, talk_over_a_long_reply
from heard import heard_as

from app import protocol
from app.audio import resample
from app.bench.user import speak_turn
from app.clients.core import decode
from app.stages.asr import Transcriber
from app.voice.text import words

QUESTION = "What is the capital of France?"
STOP_WORDS = {"the", "a", "an", "is", "of", "and", "to", "in", "it", "i", "you"}


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://") + "/ws"


async def test_spoken_question_gets_a_spoken_answer(live_server, speech, output_dir):
    result = await speak_turn(ws_url(live_server), speech(QUESTION), trailing_silence_s=1.5)

    assert heard_as(result.final_transcript, QUESTION), result.final_transcript
    reply = result.assistant_text
    assert words(reply), "assistant text must arrive"
    assert result.event(protocol.AudioStart) is not None
    audio = result.reply_samples
    assert len(audio) / result.output_sample_rate > 0.5

    heard = Transcriber().transcribe(resample(audio, result.output_sample_rate, 16000)).text
    shared = (set(words(heard)) & set(words(reply))) - STOP_WORDS
    assert shared, f"reply audio {heard!r} does not say the reply text {reply!r}"
    assert result.voice_to_voice_ms is not None and result.voice_to_voice_ms > 0
    (output_dir / "ws_turn.json").write_text(
        json.dumps(
            {
                "transcript": result.final_transcript,
                "reply": reply,
                "heard": heard,
                "voice_to_voice_ms": result.voice_to_voice_ms,
                "server_metrics": result.server_metrics.model_dump(exclude_none=True),
            },
            indent=2,
        )
    )


@pytest.mark.slow
async def test_voice_to_voice_baseline(live_server, speech, output_dir):
    """Records (does not assert) the first-baseline latency: median of a few turns."""
    latencies = []
    for _ in range(3):
        result = await speak_turn(ws_url(live_server), speech(QUESTION), trailing_silence_s=1.0)
        latencies.append(result.voice_to_voice_ms)
    assert all(latency is not None for latency in latencies)
    (output_dir / "voice_to_voice_baseline.json").write_text(
        json.dumps({"runs_ms": latencies, "median_ms": statistics.median(latencies)})
    )


async def test_bad_frames_get_errors_and_the_session_still_answers(live_server):
    async with websockets.connect(ws_url(live_server)) as ws:
        assert isinstance(decode(await ws.recv()), protocol.Ready)
        for frame, code in [
            ("{oops", "bad_json"),
            ('{"type":"x"}', "unknown_type"),
            (b"\x00" * 5, "bad_audio"),
            (b"\x00" * 70_000, "frame_too_large"),
        ]:
            await ws.send(frame)
            event = decode(await asyncio.wait_for(ws.recv(), 10))
            assert isinstance(event, protocol.Error) and event.code == code
        await ws.send(protocol.encode(protocol.UserText(text="Say hello.")))
        while not isinstance(decode(await asyncio.wait_for(ws.recv(), 60)), protocol.TurnDone):
            pass


async def test_oversized_websocket_message_closes_only_that_session(live_server):
    async with websockets.connect(ws_url(live_server), max_size=None) as ws:
        await ws.recv()
        await ws.send(b"\x00" * (2 << 20))  # over the server's 1 MiB WebSocket limit
        with pytest.raises(websockets.ConnectionClosed):
            for _ in range(10):
                await asyncio.wait_for(ws.recv(), 10)
    assert httpx.get(live_server + "/healthz").status_code == 200


async def test_disconnect_mid_reply_frees_the_session_and_others_are_served(live_server, speech):
    async with websockets.connect(ws_url(live_server)) as ws:
        await ws.recv()
        await ws.send(protocol.encode(protocol.UserText(text="Tell me a long story about a dragon.")))
        while not isinstance(decode(await asyncio.wait_for(ws.recv(), 60)), protocol.AssistantText):
            pass
    # gone mid-reply; the server must drop that session and keep answering others
    for _ in range(100):
        if httpx.get(live_server + "/healthz").json()["sessions"] == 0:
            break
        await asyncio.sleep(0.1)
    assert httpx.get(live_server + "/healthz").json()["sessions"] == 0
    result = await speak_turn(ws_url(live_server), speech(QUESTION), trailing_silence_s=1.0)
    assert heard_as(result.final_transcript, QUESTION), result.final_transcript
    assert len(result.reply_samples) > 0


def test_healthz_and_page(live_server):
    assert httpx.get(live_server + "/healthz").json()["status"] == "ok"
    page = httpx.get(live_server + "/")
    assert page.status_code == 200 and "<html" in page.text.lower()


def llm_figure(base_url: str, figure: str) -> float:
    """One of the engine's ``parley_engine_*`` figures, as the voice server exports them."""
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(f"parley_engine_{figure} "):
            return float(line.split()[-1])
    raise AssertionError(f"parley_engine_{figure} not in /metrics")


async def test_barge_in_aborts_the_engine_request_and_frees_its_blocks(live_server, speech):
    aborted_before = llm_figure(live_server, "requests_aborted_total")
    events = await talk_over_a_long_reply(ws_url(live_server), speech("Wait what is the capital of France?"))
    assert_barged_in(events)
    assert llm_figure(live_server, "requests_aborted_total") >= aborted_before + 1
    for _ in range(100):  # the new turn's request ends once the socket is gone
        if llm_figure(live_server, "kv_blocks_used") == 0 and llm_figure(live_server, "requests_running") == 0:
            break
        await asyncio.sleep(0.1)
    assert llm_figure(live_server, "kv_blocks_used") == 0


def test_metrics_export_stage_histograms(live_server):
    text = httpx.get(live_server + "/metrics").text
    for name in [
        "parley_voice_to_voice_seconds",
        "parley_endpoint_seconds",
        "parley_llm_ttft_seconds",
        "parley_tts_first_audio_seconds",
        "parley_rtf",
        "parley_underruns_total",
        "parley_barge_ins_total",
    ]:
        assert name in text
