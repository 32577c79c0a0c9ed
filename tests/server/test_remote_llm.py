"""The voice server on a remote OpenAI-compatible LLM: `parley engine serve` in another process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from harness import (
    NO_BREAKER,
    TEST_MAX_SESSIONS,
    THERMOSTAT_TOOL,
    assert_barged_in,
    assert_spoken_or_json_held_back,
    recv_until,
    talk_over_a_long_reply,
)
from heard import heard_as

from app import protocol
from app.bench.launcher import ServerProcess
from app.bench.user import speak_turn
from app.clients.core import open_connection
from app.voice.text import words

pytestmark = pytest.mark.models  # two real servers


@pytest.fixture(scope="module")
def engine_and_voice(output_dir):
    engine = ServerProcess(["engine", "serve"], output_dir / "remote-engine.log")
    llm_url = engine.base_url + "/v1"
    try:
        voice = ServerProcess(
            # stories long enough to be still streaming when a test cuts or kills them, on a fast CPU too
            ["serve", "--llm-backend", "openai", "--llm-url", llm_url, "--llm-max-tokens", "400"]
            + [*NO_BREAKER, *TEST_MAX_SESSIONS],
            output_dir / "remote-voice.log",
        )
    except Exception:
        engine.stop()
        raise
    yield engine.base_url, voice.base_url.replace("http://", "ws://") + "/ws", engine
    voice.stop()
    engine.stop()


def engine_figure(engine_url: str, name: str) -> float:
    for line in httpx.get(engine_url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the engine's /metrics")


async def test_spoken_question_answered_by_the_remote_engine(engine_and_voice, speech):
    engine_url, voice_url, _ = engine_and_voice
    finished_before = engine_figure(engine_url, "parley_engine_requests_finished_total")
    result = await speak_turn(voice_url, speech("What is the capital of France?"), trailing_silence_s=1.5)
    assert heard_as(result.final_transcript, "What is the capital of France?"), result.final_transcript
    assert words(result.assistant_text)
    assert len(result.reply_samples) > 0
    assert engine_figure(engine_url, "parley_engine_requests_finished_total") > finished_before


async def test_barge_in_closes_the_remote_stream_and_the_engine_aborts(engine_and_voice, speech):
    engine_url, voice_url, _ = engine_and_voice
    aborted_before = engine_figure(engine_url, "parley_engine_requests_aborted_total")
    events = await talk_over_a_long_reply(voice_url, speech("Wait what is the capital of France?"))
    assert_barged_in(events)
    for _ in range(100):
        if engine_figure(engine_url, "parley_engine_requests_aborted_total") > aborted_before:
            break
        await asyncio.sleep(0.1)
    assert engine_figure(engine_url, "parley_engine_requests_aborted_total") >= aborted_before + 1
    for _ in range(100):
        if engine_figure(engine_url, "parley_engine_kv_blocks_used") == 0:
            break
        await asyncio.sleep(0.1)
    assert engine_figure(engine_url, "parley_engine_kv_blocks_used") == 0


THERMOSTAT = protocol.FunctionTool(**THERMOSTAT_TOOL)


async def test_a_tool_call_and_its_result_pass_through_the_remote_engine(engine_and_voice):
    """/ws tools on the openai backend: the tools go to `parley engine serve`, whose required call (decoded under
    the schema's grammar) comes back as a ``tool_call``; the result goes back and the answer is spoken."""
    _, voice_url, _ = engine_and_voice
    connection = await open_connection(voice_url)

    try:
        await recv_until(connection, protocol.Ready)  # (sent again after ``start``)
        await connection.send(protocol.SessionConfig(tools=[THERMOSTAT], tool_choice="required"))
        await recv_until(connection, protocol.ConfigApplied)
        await connection.send_text("Make the bedroom warmer, 22 degrees please.")
        call, _ = await recv_until(connection, protocol.CallTool)
        arguments = json.loads(call.arguments)
        assert call.name == "set_thermostat" and call.runs_on == "client"
        assert set(arguments) == {"room", "celsius"} and arguments["room"] in ("kitchen", "bedroom", "living room")
        assert isinstance(arguments["celsius"], int | float) and 10 <= arguments["celsius"] <= 30
        await connection.send(protocol.ToolResult(call_id=call.call_id, output='{"done": true}'))
        done, audio = await recv_until(connection, protocol.TurnDone)
        assert done.metrics.tool_calls == 1
        assert_spoken_or_json_held_back(done, audio)
    finally:
        await connection.close()


async def test_the_llm_server_killed_mid_reply_is_told_and_the_turn_after_its_restart_is_answered(
    engine_and_voice, output_dir
):
    """The LLM server dies while a reply streams (SIGKILL): the user gets a typed ``llm_unavailable`` within 5 s,
    the session stays open, ``/healthz`` names the LLM degraded, and once the server is back where it was the
    next question is answered. (Last in this module: it replaces the module's engine with a new one.)"""
    engine_url, voice_url, engine = engine_and_voice
    health_url = voice_url.replace("ws://", "http://").removesuffix("/ws") + "/healthz"
    connection = await open_connection(voice_url)
    restarted = None
    try:
        await connection.send_text("Tell me a very long story about a dragon and a princess.")
        while not isinstance(await connection.recv(timeout_s=60), bytes):
            pass  # the reply is being spoken: its request streams from the engine
        os.kill(engine.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        while not isinstance(item := await connection.recv(timeout_s=10), protocol.Error):
            pass
        assert item.code == "llm_unavailable" and not item.fatal, item
        assert time.monotonic() - killed < 5
        for _ in range(40):  # the backend's health is asked at most every 5 s
            health = httpx.get(health_url, timeout=10)
            if health.status_code == 503:
                break
            await asyncio.sleep(0.25)
        assert health.status_code == 503 and health.json()["degraded"] == ["llm"]
        restarted = ServerProcess(["engine", "serve"], output_dir / "remote-engine-again.log", port=engine.port)
        await connection.send_text("What is the capital of France?")
        while not isinstance(done := await connection.recv(timeout_s=120), protocol.TurnDone):
            assert not isinstance(done, protocol.Error), done
        assert words(done.text) and not done.interrupted
    finally:
        await connection.close()
        if restarted is not None:
            restarted.stop()
