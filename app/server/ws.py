"""The voice WebSocket (``/ws``): one connection is one conversation (a ``VoiceSession``).

This is the only place that knows the socket. It admits or refuses the connection (origin,
key, capacity), turns frames into session calls, sends the session's events and audio
back, and enforces the per-connection limits:

* every send has a deadline (``send_timeout_s``): a client that stops reading is closed
  (code 4001) and its session freed, instead of wedging with its slot held;
* a connection with no frames for ``idle_timeout_s``, and no reply playing, is closed (code 4000);
* microphone audio beyond ``max_audio_rate`` times real time is dropped, with one
  ``rate_limited`` error a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import WebSocket, WebSocketDisconnect
from starlette.datastructures import State
from starlette.websockets import WebSocketState

from app import protocol
from app.config import Settings
from app.server.access import CLOSE_POLICY, PROTOCOL_SUBPROTOCOL
from app.server.limits import AudioBudget, Every
from app.server.metrics import VoiceMetrics
from app.voice.session import VoiceSession

log = logging.getLogger(__name__)

CLOSE_OVERLOADED = 1013  # RFC 6455 "try again later"
CLOSE_IDLE = 4000
CLOSE_NOT_READING = 4001
CLOSE_WAIT_S = 2.0  # a close handshake with a client that does not read must not hold the session


class ClientNotReading(Exception):
    """A send to the client did not complete within ``send_timeout_s``."""


async def serve_voice(websocket: WebSocket, state: State, settings: Settings) -> None:
    """Run one conversation until the client leaves; ``state`` holds the models, sessions, metrics and access policy."""
    access = state.access
    headers = websocket.headers
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if not access.origin_allowed(headers.get("origin"), headers.get("host")):
        log.warning("refused /ws from origin %r (allowed_origins)", headers.get("origin"))
        await websocket.close(code=CLOSE_POLICY, reason="origin not allowed")  # before accept: HTTP 403
        return
    if not access.key_ok(headers, websocket.query_params, offered):
        await websocket.close(code=CLOSE_POLICY, reason="api key required")
        return
    await websocket.accept(subprotocol=PROTOCOL_SUBPROTOCOL if PROTOCOL_SUBPROTOCOL in offered else None)
    refusal = state.admission.refuse_reason(len(state.sessions))
    if refusal is not None:
        await websocket.send_text(protocol.encode(refusal))
        await websocket.close(code=CLOSE_OVERLOADED)
        return

    send_lock = asyncio.Lock()
    evicted = asyncio.Event()

    async def send(data: str | bytes) -> None:
        if websocket.client_state != WebSocketState.CONNECTED or evicted.is_set():
            return
        async with send_lock:
            try:
                async with asyncio.timeout(settings.send_timeout_s):
                    if isinstance(data, bytes):
                        await websocket.send_bytes(data)
                    else:
                        await websocket.send_text(data)
            except TimeoutError:
                evicted.set()
            except (WebSocketDisconnect, RuntimeError):
                pass

    async def send_json(message: protocol.ServerMessage) -> None:
        await send(protocol.encode(message))

    session = VoiceSession(state.models, settings, send_json, send)
    session.on_turn_metrics = state.metrics.observe_turn
    state.sessions.add(session)
    close_code, close_reason = 1000, ""
    receiving = asyncio.create_task(_receive(websocket, session, settings, state.metrics), name="ws-receive")
    watching = asyncio.create_task(evicted.wait(), name="ws-evicted")
    try:
        await session.start()
        await asyncio.wait({receiving, watching}, return_when=asyncio.FIRST_COMPLETED)
        if evicted.is_set():
            state.metrics.evictions.labels(reason="not_reading").inc()
            close_code, close_reason = CLOSE_NOT_READING, f"client read nothing for {settings.send_timeout_s:g} s"
            log.warning("session %s: %s; closing it", session.session_id, close_reason)
        else:
            close_code, close_reason = receiving.result()
            if close_code == CLOSE_IDLE:
                state.metrics.evictions.labels(reason="idle").inc()
    except Exception:
        log.exception("session %s failed", session.session_id)
        await send_json(protocol.Error(code="internal", message="internal server error", fatal=True))
        close_code = 1011
    finally:
        for task in (receiving, watching):
            task.cancel()
        state.sessions.discard(session)
        await session.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await websocket.close(code=close_code, reason=close_reason)


async def _receive(
    websocket: WebSocket, session: VoiceSession, settings: Settings, metrics: VoiceMetrics
) -> tuple[int, str]:
    """Feed client frames to the session until it leaves or idles out; returns the close code and reason."""
    budget = AudioBudget(settings.max_audio_rate)
    warn = Every(1.0)
    while True:
        try:
            async with asyncio.timeout(settings.idle_timeout_s):
                message = await websocket.receive()
        except TimeoutError:
            if session.busy:
                continue  # listening to a long reply is not idling
            return CLOSE_IDLE, f"idle for {settings.idle_timeout_s:g} s"
        if message["type"] == "websocket.disconnect":
            return 1000, ""
        if message.get("bytes") is not None:
            data = message["bytes"]
            seconds = len(data) / 2 / session.input_sample_rate
            if budget.admit(seconds):
                await session.handle_audio(data)
                continue
            metrics.rate_limited.inc(seconds)
            if warn():
                await session.report(
                    protocol.Error(
                        code="rate_limited",
                        message=f"audio arrives faster than {settings.max_audio_rate:g}x real time; dropped",
                    )
                )
        elif message.get("text") is not None:
            await session.handle_text(message["text"])
