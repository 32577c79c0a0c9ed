"""The voice WebSocket (``/ws``): one connection is one conversation (a ``VoiceSession``).

This is the only place that knows the socket: it admits or refuses the connection, turns
frames into session calls, and sends the session's events and audio back.
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
from app.voice.session import VoiceSession

log = logging.getLogger(__name__)


async def serve_voice(websocket: WebSocket, state: State, settings: Settings) -> None:
    """Run one conversation until the client leaves; ``state`` holds the models, sessions and metrics."""
    await websocket.accept()
    if len(state.sessions) >= settings.max_sessions:
        await websocket.send_text(
            protocol.encode(protocol.Error(code="overloaded", message="too many sessions; try later", fatal=True))
        )
        await websocket.close(code=1013)
        return
    send_lock = asyncio.Lock()

    async def send_json(message: protocol.ServerMessage) -> None:
        if websocket.client_state != WebSocketState.CONNECTED:
            return
        async with send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await websocket.send_text(protocol.encode(message))

    async def send_bytes(data: bytes) -> None:
        if websocket.client_state != WebSocketState.CONNECTED:
            return
        async with send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await websocket.send_bytes(data)

    session = VoiceSession(state.models, settings, send_json, send_bytes)
    session.on_turn_metrics = state.metrics.observe_turn
    state.sessions.add(session)
    try:
        await session.start()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            if message.get("bytes") is not None:
                await session.handle_audio(message["bytes"])
            elif message.get("text") is not None:
                await session.handle_text(message["text"])
    except WebSocketDisconnect:
        pass
    except Exception:
        log.exception("session %s failed", session.session_id)
        await send_json(protocol.Error(code="internal", message="internal server error", fatal=True))
    finally:
        state.sessions.discard(session)
        await session.close()
        with contextlib.suppress(Exception):
            await websocket.close()
