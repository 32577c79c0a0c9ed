"""The connection loop shared by /ws and /v1/realtime, on fake sockets: send deadline, idle close,
an idle session giving its slot up to a newcomer, and the read pace under a flood."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from fakes import FakeStages, ManualClock, ScriptedASR, run_inline
from harness import ScriptedLLM
from starlette.datastructures import State
from starlette.websockets import WebSocketState

from app import protocol
from app.config import Settings
from app.server import connection as connection_module
from app.server.admission import Admission
from app.server.connection import (
    CLIENT_FRAMES_BURST,
    CLIENT_FRAMES_PER_S,
    CLOSE_IDLE,
    CLOSE_NOT_READING,
    CLOSE_OVERLOADED,
    CLOSE_POLICY,
    Connection,
)
from app.server.metrics import VoiceMetrics
from app.voice.session import VoiceSession


class FakeSocket:
    """``reads``: whether the client takes what is sent; it sends nothing itself."""

    client_state = WebSocketState.CONNECTED
    headers: dict = {}

    def __init__(self, reads: bool = True) -> None:
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


class FloodSocket(FakeSocket):
    """A client whose frames are already buffered: each ``receive`` returns one at once, for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.frames = seconds, 0
        self._until: float | None = None

    async def receive(self) -> dict:
        self._until = self._until or time.monotonic() + self.seconds
        if time.monotonic() >= self._until:
            return {"type": "websocket.disconnect"}
        self.frames += 1
        return {"type": "websocket.receive", "bytes": b"\0" * 640}


def new_state(**settings) -> tuple[State, Settings]:
    state = State()
    config = Settings(**settings)
    state.sessions, state.metrics = {}, VoiceMetrics()
    state.admission = Admission(config, memory=lambda: 0.1, gpu_memory=lambda: None, headroom=lambda red_line: 1 << 33)
    return state, config


def serve_task(socket: FakeSocket, state: State, config: Settings, clock=time.monotonic, on_bytes=None):
    connection = Connection(socket, state, config, clock=clock)  # type: ignore[arg-type]
    session = VoiceSession(
        FakeStages(ScriptedASR(), ScriptedLLM(["Hi."])),
        config,
        lambda message: connection.send(protocol.encode(message)),
        connection.send,
        run_blocking=run_inline,
    )

    async def handle_json(raw: str) -> None:
        await session.handle(protocol.parse_client_text(raw))

    serving = connection.serve(session, handle_json, on_bytes or session.handle_audio, internal_error="{}")
    return connection, asyncio.create_task(asyncio.wait_for(serving, timeout=10))


async def serve(socket: FakeSocket, **settings) -> tuple[State, Settings]:
    state, config = new_state(**settings)
    await serve_task(socket, state, config)[1]
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


async def one_idle_session_and_a_newcomer(idle_s: float):
    """A full server (one slot), its session silent for ``idle_s``; then a new client asks to come in."""
    clock = ManualClock()
    state, config = new_state(max_sessions=1, idle_evict_s=30, idle_timeout_s=300)
    holder = FakeSocket()
    _, serving = serve_task(holder, state, config, clock.now)
    while not holder.sent:  # its `ready`
        await asyncio.sleep(0)
    clock.advance(idle_s)
    newcomer = FakeSocket()
    admitted = await Connection(newcomer, state, config, clock=clock.now).admit(protocol.encode)  # type: ignore[arg-type]
    return state, holder, serving, newcomer, admitted


async def test_a_session_idle_past_idle_evict_s_gives_its_slot_to_a_newcomer():
    state, holder, serving, newcomer, admitted = await one_idle_session_and_a_newcomer(31)
    assert admitted and not newcomer.sent and newcomer.closed is None
    assert holder.closed == (CLOSE_IDLE, "idle for 31 s while the server was full")
    assert not state.sessions  # freed before the newcomer was let in
    assert state.metrics.evictions.labels(reason="idle_full")._value.get() == 1
    await serving


async def test_a_newcomer_is_told_to_retry_when_the_idle_session_will_be_evictable():
    state, holder, serving, newcomer, admitted = await one_idle_session_and_a_newcomer(27)
    assert not admitted and newcomer.closed == (CLOSE_OVERLOADED, "")
    refusal = json.loads(newcomer.sent[0])
    assert refusal["code"] == "overloaded" and refusal["retry_after_s"] == 3.0
    assert holder.closed is None and len(state.sessions) == 1
    assert state.admission.refused["sessions"] == 1
    serving.cancel()


async def test_a_session_listening_to_a_reply_is_not_idle():
    state, config = new_state()
    clock = ManualClock()
    connection = Connection(FakeSocket(), state, config, clock=clock.now)  # type: ignore[arg-type]
    clock.advance(100)
    assert connection.idle_for() == 100
    connection.session = SimpleNamespace(busy=True)  # type: ignore[assignment]
    assert connection.idle_for() == 0


async def test_a_flood_of_buffered_frames_is_read_at_a_pace_and_leaves_the_loop_free():
    """Frames that arrive faster than the pace wait unread; other tasks keep running meanwhile."""
    state, config = new_state(idle_timeout_s=60)
    socket, dropped = FloodSocket(seconds=0.5), []

    async def drop(data: bytes) -> None:
        dropped.append(len(data))  # what an over-rate frame costs: nothing but counting it

    lags: list[float] = []

    async def ticker() -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - started - 0.01)

    ticking = asyncio.create_task(ticker())
    await serve_task(socket, state, config, on_bytes=drop)[1]
    ticking.cancel()
    assert len(dropped) == socket.frames > 0
    assert socket.frames <= CLIENT_FRAMES_BURST + CLIENT_FRAMES_PER_S * 0.5 * 1.5
    assert max(lags) < 0.2, max(lags)  # unpaced, the loop would be held for the whole 0.5 s


async def test_a_client_that_keeps_the_pace_full_is_closed(monkeypatch):
    monkeypatch.setattr(connection_module, "FLOOD_CLOSE_S", 0.25)
    state, config = new_state(idle_timeout_s=60)
    socket = FloodSocket(seconds=5)

    async def drop(data: bytes) -> None:
        pass

    started = time.monotonic()
    await serve_task(socket, state, config, on_bytes=drop)[1]
    assert socket.closed == (CLOSE_POLICY, "over 200 frames a second")
    assert time.monotonic() - started < 4  # not when the flood ended (5 s)
    assert state.metrics.evictions.labels(reason="flooding")._value.get() == 1
