"""The Wyoming door: Home Assistant's Assist pipeline (and any Wyoming client) reaches Parley over TCP.

``parley serve --wyoming-port 10700`` also listens for the Wyoming protocol (the ``wyoming`` package's
events; on ``wyoming_host``, loopback by default) and offers three programs, all named ``parley``, on
the server's one set of models (nothing is loaded twice):

  asr     ``transcribe`` + audio -> ``transcript``, streaming (``dictation.py``)
  tts     ``synthesize`` or ``synthesize-start``/``-chunk``/``-stop`` -> audio, streaming (``speech.py``)
  handle  ``transcript`` -> ``handled``: the assistant's conversation, remembered per
          ``conversation_id`` (``conversations.py``)

  wire.py          events read with bounds (header, data, payload) and the server's bounded JSON parser
  connection.py    one TCP connection: admitted, paced, timed out and closed like a WebSocket session
  describe.py      ``describe`` -> ``info``

Not announced over zeroconf: Home Assistant is pointed at the host and port by hand (README).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import State

from app.config import Settings
from app.server.wyoming.connection import WyomingConnection
from app.server.wyoming.conversations import Conversations
from app.server.wyoming.wire import STREAM_LIMIT
from app.voice.session import VoiceSession

log = logging.getLogger(__name__)

CONVERSATIONS_KEPT = 32  # conversations remembered at once (the least recently used is forgotten first)
STOP_WAIT_S = 2.0
CONVERSATION_KEEP_S = 300.0  # how long one is remembered after its last sentence (Home Assistant's own: 5 min)


class WyomingDoor:
    """The TCP listener and what its connections share (the conversations)."""

    def __init__(self, state: State, settings: Settings) -> None:
        self._state, self._settings = state, settings
        self.conversations = Conversations(self._make_session, max_kept=CONVERSATIONS_KEPT, keep_s=CONVERSATION_KEEP_S)
        self._server: asyncio.Server | None = None
        self._connections: set[WyomingConnection] = set()
        self.port = settings.wyoming_port

    def _make_session(self, send_json) -> VoiceSession:
        async def no_audio(_: bytes) -> None:  # (replies are text only here)
            return None

        return VoiceSession(self._state.models, self._settings, send_json, no_audio, skills=self._state.skills)

    async def start(self) -> str:
        """Listen; returns the line to print. A port in use fails the server's start, as the HTTP port's would."""
        self._server = await asyncio.start_server(
            self._accept, self._settings.wyoming_host, self._settings.wyoming_port, limit=STREAM_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return f"wyoming (asr, tts, handle) on tcp://{self._settings.wyoming_host}:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = WyomingConnection(reader, writer, self._state, self._settings, self.conversations)
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)

    async def stop(self) -> None:
        """No new connections; the open ones closed (each frees its slot), then the conversations."""
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                await connection.close()
            deadline = asyncio.get_running_loop().time() + STOP_WAIT_S
            while self._connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            await self._server.wait_closed()
        await self.conversations.close()
