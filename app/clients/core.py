"""The WebSocket client core shared by every Python client of ``/ws``.

``parley mic`` (app/clients/mic.py), the scripted user of the benchmarks and end-to-end tests
(``app.bench.user``) all talk to the server through this module:

* ``open_connection`` / ``Connection``: connect, wait for ``ready``, declare the sample rate with
  ``start``; then send audio frames and typed client messages, and receive typed server events
  (``protocol.parse_server_message``) or reply audio (``bytes``).
* ``stay_connected``: the reconnect loop (backoff 0.5 s, 1 s, 2 s, 4 s, 8 s, 8 s, ...) with a
  one-line reason for every drop.

No client reads server events as raw dicts: they are the typed models of ``app.protocol``, and
per-turn figures are ``protocol.TurnMetrics`` fields.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import numpy as np
import websockets

from app import protocol
from app.audio import float_to_pcm16

FRAME_MS = 20
MAX_MESSAGE_BYTES = 1 << 22  # reply audio arrives in chunks far below this
READY_TIMEOUT_S = 10.0

Received = protocol.ServerMessage | bytes  # a typed event, or reply audio (PCM16 LE)
ClientMessage = protocol.ClientMessageType
Event = TypeVar("Event", bound=protocol.ServerMessage)

# Short labels of the stages on voice-to-voice's critical path, in order (console and tables).
STAGE_LABELS = {
    "endpoint_ms": "endpoint",
    "asr_final_ms": "asr",
    "llm_ttft_ms": "llm first token",
    "llm_first_piece_ms": "llm first piece",
    "tts_first_audio_ms": "tts first audio",
}  # read with getattr(metrics, name): a name TurnMetrics lacks fails loudly (and tests/clients checks them)


class ServerRefused(OSError):
    """The server accepted the socket but refused the session (``overloaded``, with a retry hint)."""

    def __init__(self, event: protocol.Error) -> None:
        super().__init__(f"the server refused the session: {event.message}")
        self.event = event


class ConnectionRefused(Exception):
    """The server answered the WebSocket upgrade with an HTTP error that a retry will not fix (4xx)."""


# ------------------------------------------------------------------ decoding and reconnect policy
def decode(message: str | bytes) -> Received:
    """A WebSocket message from the server: binary is reply audio (returned as is), text a typed event.

    Raises ``ValueError`` for text that is not a known server event.
    """
    if isinstance(message, bytes):
        return message
    return protocol.parse_server_message(message)


def backoff_delays(first: float = 0.5, cap: float = 8.0) -> Iterator[float]:
    """Reconnect delays: 0.5, 1, 2, 4, 8, 8, ... seconds."""
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def describe_failure(error: BaseException) -> str:
    """Why a connection attempt failed or a connection ended, in a few words for the user."""
    if isinstance(error, websockets.InvalidStatus):
        return f"the server answered HTTP {error.response.status_code}"
    if isinstance(error, websockets.ConnectionClosed):
        code = error.rcvd.code if error.rcvd is not None else None
        named = {1000: "the server closed the connection", 1001: "the server is going away"}
        return named.get(code, "the server is restarting" if code == 1012 else f"the connection dropped (code {code})")
    return (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__


# ------------------------------------------------------------------ one connection
class Connection:
    """An open ``/ws`` session after the handshake: typed events in, audio and typed messages out."""

    def __init__(self, ws, ready: protocol.Ready, sample_rate: int) -> None:
        self.ws, self.ready, self.sample_rate = ws, ready, sample_rate

    @classmethod
    async def handshake(
        cls, ws, sample_rate: int = protocol.INPUT_SAMPLE_RATE, timeout_s: float = READY_TIMEOUT_S
    ) -> Connection:
        """Wait for the server's ``ready``, then declare the microphone's rate with ``start``."""
        try:
            first = decode(await asyncio.wait_for(ws.recv(), timeout_s))
        except ValueError as error:
            raise OSError(f"expected 'ready' from the server: {error}") from None
        if isinstance(first, protocol.Error):
            raise ServerRefused(first)
        if not isinstance(first, protocol.Ready):
            kind = "audio" if isinstance(first, bytes) else first.type
            raise OSError(f"expected 'ready' from the server, got {kind!r}")
        connection = cls(ws, first, sample_rate)
        await connection.send(protocol.Start(sample_rate=sample_rate))
        return connection

    @property
    def output_sample_rate(self) -> int:
        return self.ready.output_sample_rate

    async def send(self, message: ClientMessage) -> None:
        await self.ws.send(protocol.encode(message))

    async def send_audio(self, audio: np.ndarray | bytes) -> None:
        """One microphone frame: float samples in [-1, 1], or PCM16 LE bytes, at ``sample_rate``."""
        await self.ws.send(audio if isinstance(audio, bytes) else float_to_pcm16(audio))

    async def send_text(self, text: str) -> None:
        """A typed user turn."""
        await self.send(protocol.UserText(text=text))

    async def recv(self, timeout_s: float | None = None) -> Received:
        return decode(await asyncio.wait_for(self.ws.recv(), timeout_s))

    async def receive(self, on_unknown: Callable[[ValueError], None] | None = None) -> AsyncIterator[Received]:
        """Everything the server sends until it closes normally.

        A text frame that is not a known event raises ``ValueError``, or, with ``on_unknown``, is
        reported to it and skipped (a client that should keep going with a newer server).
        """
        async for message in self.ws:
            try:
                item = decode(message)
            except ValueError as error:
                if on_unknown is None:
                    raise
                on_unknown(error)
                continue
            yield item

    def __aiter__(self) -> AsyncIterator[Received]:
        return self.receive()

    async def close(self) -> None:
        await self.ws.close()


def _connect(url: str, open_timeout: float):
    """Open the socket; a server with an ``api_key`` gets it from ``PARLEY_API_KEY`` as a Bearer header."""
    key = os.environ.get("PARLEY_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return websockets.connect(url, max_size=MAX_MESSAGE_BYTES, open_timeout=open_timeout, additional_headers=headers)


async def open_connection(
    url: str, sample_rate: int = protocol.INPUT_SAMPLE_RATE, *, open_timeout: float = 10.0
) -> Connection:
    """Connect to ``url`` and do the handshake; close it with ``Connection.close``."""
    ws = await _connect(url, open_timeout)
    try:
        return await Connection.handshake(ws, sample_rate)
    except BaseException:
        await ws.close()
        raise


async def stay_connected(
    url: str,
    converse: Callable[[Connection], Awaitable[None]],
    *,
    sample_rate: int = protocol.INPUT_SAMPLE_RATE,
    finished: asyncio.Event,
    say: Callable[[str], None] = print,
    backoff: Callable[[], Iterator[float]] = backoff_delays,
    on_lost: Callable[[], None] | None = None,
    open_timeout: float = 5.0,
) -> None:
    """Connect and ``converse``; whenever the connection fails or ends, wait and reconnect.

    Returns once ``finished`` is set (and ``converse`` has returned). Each attempt and each drop is
    reported through ``say`` ("connecting to ...", "connection lost (why); retrying in 1 s");
    ``on_lost`` runs before each wait. A fresh ``backoff`` schedule starts after every successful
    connection. Raises ``ConnectionRefused`` when the server answers HTTP 4xx (other than 429).
    """
    delays = backoff()
    while not finished.is_set():
        say(f"connecting to {url} ...")
        connected = False
        try:
            async with _connect(url, open_timeout) as ws:
                connected = True
                delays = backoff()
                await converse(await Connection.handshake(ws, sample_rate))
            if finished.is_set():
                return
            reason = "the server closed the connection"
        except websockets.InvalidStatus as error:
            status = error.response.status_code
            if 400 <= status < 500 and status != 429:
                raise ConnectionRefused(f"{url} answered HTTP {status}: is this a Parley /ws URL?") from None
            reason = describe_failure(error)
        except (TimeoutError, OSError, websockets.WebSocketException) as error:
            reason = describe_failure(error)
        if on_lost is not None:
            on_lost()
        delay = next(delays)
        what = "connection lost" if connected else "cannot connect"
        say(f"{what} ({reason}); retrying in {delay:g} s")
        await asyncio.sleep(delay)
