"""The connection loop shared by /ws and /v1/realtime, on a fake socket: send deadline and idle close."""

from __future__ import annotations

import asyncio

from fakes import FakeStages, ScriptedASR, run_inline
from harness import ScriptedLLM
from starlette.datastructures import State
from starlette.websockets import WebSocketState

from app import protocol
from app.config import Settings
from app.server.connection import CLOSE_IDLE, CLOSE_NOT_READING, Connection
from app.server.metrics import VoiceMetrics
from app.voice.session import VoiceSession


class FakeSocket:
    """``reads``: whether the client takes what is sent; it sends nothing itself."""

    client_state = WebSocketState.CONNECTED
    headers: dict = {}

    def __init__(self, reads: bool) -> None:
        self.reads = reads
        self.sent: list = []
        self.closed: tuple[int, str] | None = None
        self._never = asyncio.Event()

    async def send_text(self, text: str) -> None:
        if not self.reads:
            await self._never.wait()  # a full socket buffer: the send never completes
        self.sent.append(text)

    send_bytes = send_text

    async def receive(self) -> dict:
        await self._never.wait()
        return {"type": "websocket.disconnect"}

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)


async def serve(socket: FakeSocket, **settings) -> tuple[State, Settings]:
    state = State()
    state.sessions, state.metrics = set(), VoiceMetrics()
    config = Settings(**settings)
    connection = Connection(socket, state, config)  # type: ignore[arg-type]
    session = VoiceSession(
        FakeStages(ScriptedASR(), ScriptedLLM(["Hi."])),
        config,
        lambda message: connection.send(protocol.encode(message)),
        connection.send,
        run_blocking=run_inline,
    )

    async def handle_json(raw: str) -> None:
        await session.handle(protocol.parse_client_text(raw))

    await asyncio.wait_for(
        connection.serve(session, handle_json, session.handle_audio, internal_error="{}"), timeout=10
    )
    return state, config


async def test_a_client_that_reads_nothing_is_closed_with_4001_and_its_session_freed():
    socket = FakeSocket(reads=False)
    state, _ = await serve(socket, send_timeout_s=0.05, idle_timeout_s=60)
    assert socket.closed is not None and socket.closed[0] == CLOSE_NOT_READING
    assert "read nothing" in socket.closed[1]
    assert not state.sessions
    assert state.metrics.evictions.labels(reason="not_reading")._value.get() == 1


async def test_a_silent_client_is_closed_after_the_idle_timeout():
    socket = FakeSocket(reads=True)
    state, _ = await serve(socket, send_timeout_s=5, idle_timeout_s=0.1)
    assert socket.closed == (CLOSE_IDLE, "idle for 0.1 s")
    assert '"type":"ready"' in socket.sent[0] and not state.sessions
