"""The voice WebSocket (``/ws``): one connection is one conversation (a ``VoiceSession``).

This is the only place that speaks Parley's own protocol on the socket: it turns frames into
session calls and sends the session's events and audio back. Admission (origin, key,
capacity), send deadlines, the idle timeout and closing are ``app.server.connection``'s,
shared with ``/v1/realtime``; microphone audio beyond ``max_audio_rate`` times real time is
dropped, with one ``rate_limited`` error a second.
"""

from __future__ import annotations

from fastapi import WebSocket
from starlette.datastructures import State

from app import protocol
from app.config import Settings
from app.server.access import PROTOCOL_SUBPROTOCOL
from app.server.connection import AudioRateLimit, Connection
from app.voice.session import VoiceSession


async def serve_voice(websocket: WebSocket, state: State, settings: Settings) -> None:
    """Run one conversation until the client leaves; ``state`` holds the models, sessions, metrics and access policy."""
    connection = Connection(websocket, state, settings)
    if not await connection.accept(PROTOCOL_SUBPROTOCOL) or not await connection.admit(protocol.encode):
        return

    async def send_json(message: protocol.ServerMessage) -> None:
        await connection.send(protocol.encode(message))

    session = VoiceSession(state.models, settings, send_json, connection.send, skills=state.skills)
    rate = AudioRateLimit(settings.max_audio_rate, state.metrics.rate_limited.inc)

    async def on_audio(data: bytes) -> None:
        try:
            protocol.check_audio_frame(data)  # a frame that cannot be audio is refused as such, not rate-limited
        except protocol.ProtocolError as error:
            await session.report(error.event)
            return
        admitted, warning = rate.admit(len(data) / 2 / session.input_sample_rate)
        if admitted:
            await session.handle_audio(data)
        elif warning is not None:
            await session.report(protocol.Error(code="rate_limited", message=warning))

    async def on_text(raw: str) -> None:
        try:
            message = protocol.parse_client_text(raw)  # the wire is parsed here, once; the session gets typed values
        except protocol.ProtocolError as error:
            await session.report(error.event)
            return
        await session.handle(message)

    internal = protocol.encode(protocol.Error(code="internal", message="internal server error", fatal=True))
    await connection.serve(session, on_text, on_audio, internal_error=internal)
