"""One client WebSocket, whichever door it came in by (``/ws`` or ``/v1/realtime``).

Both endpoints admit, limit and close their connections here, and keep only their
translation: ``Connection.accept`` checks the origin and API key (refused before the
handshake: HTTP 403) and accepts; ``admit`` refuses a connection the server has no room
for (code 1013), unless a session idle for ``idle_evict_s`` gives up its slot to it (that one
is closed with code 4000); ``serve`` runs one ``VoiceSession`` until the client leaves, with

* a deadline on every send (``send_timeout_s``): a client that stops reading is closed
  (code 4001) and its session freed, instead of wedging with its slot held;
* an idle timeout: no frames for ``idle_timeout_s``, and no reply playing, closes it (code 4000);
* a read pace: at most ``CLIENT_FRAMES_PER_S`` frames a second are read; beyond that the socket
  is left unread, so a flood waits in TCP buffers instead of spending the event loop, and a
  client that keeps over half the pace is closed (code 1008) after about ``FLOOD_CLOSE_S``;
* the session registered in ``state.sessions`` (capacity, ``/healthz``, ``/metrics``) while it runs.

``AudioRateLimit`` drops microphone audio beyond ``max_audio_rate`` times real time, with
one warning a second; each endpoint reports that warning in its own vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from fastapi import WebSocket, WebSocketDisconnect
from starlette.datastructures import State
from starlette.websockets import WebSocketState

from app import protocol
from app.config import Settings
from app.server.access import CLOSE_POLICY
from app.server.admission import Refusal
from app.server.limits import Every, ReadPace, TokenBucket
from app.stages.registry import set_open_sessions
from app.voice.session import VoiceSession

log = logging.getLogger(__name__)

CLOSE_OVERLOADED = 1013  # RFC 6455 "try again later"
CLOSE_IDLE = 4000
CLOSE_NOT_READING = 4001
CLOSE_WAIT_S = 2.0  # a close handshake with a client that does not read must not hold the session
# A browser sends 50 audio frames a second and a few events; 2x real time in 10 ms frames is 200.
# Past the burst, reading waits: a flood of small frames costs the server this many a second at most.
CLIENT_FRAMES_PER_S = 400.0
CLIENT_FRAMES_BURST = 400.0
# A client that averages over half the pace is flooding on purpose: read at the full pace, it is
# closed (1008) after about FLOOD_CLOSE_S, so the backlog it left in the socket buffers cannot
# hold its slot long after it leaves.
FLOOD_CLOSE_S = 5.0
AUDIO_BURST_S = 2.0


class AudioRateLimit:
    """Admits microphone audio up to ``rate`` times real time; what is dropped is counted (``on_dropped``)."""

    def __init__(self, rate: float, on_dropped: Callable[[float], None] | None = None) -> None:
        self.rate = rate
        self._budget = TokenBucket(rate, AUDIO_BURST_S)
        self._warn = Every(1.0)
        self._on_dropped = on_dropped

    def admit(self, seconds: float) -> tuple[bool, str | None]:
        """Whether ``seconds`` of audio may pass; if not, the warning to send (at most one a second), or None."""
        if self._budget.admit(seconds):
            return True, None
        if self._on_dropped is not None:
            self._on_dropped(seconds)
        return False, f"audio arrives faster than {self.rate:g}x real time; dropped" if self._warn() else None


class Connection:
    """An admitted client WebSocket: guarded sends, a paced receive loop with an idle timeout, one close."""

    def __init__(
        self,
        websocket: WebSocket,
        state: State,
        settings: Settings,
        label: str = "session",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.websocket, self.state, self.settings, self.label = websocket, state, settings, label
        headers = websocket.headers
        self.offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        self.session: VoiceSession | None = None
        self._clock = clock
        self.heard_at = clock()  # the client's last frame
        self._send_lock = asyncio.Lock()
        self._closing = asyncio.Event()  # the server closes it (``_close_why``): it stopped reading, or idled
        self._close_why: tuple[int, str, str] = (1000, "", "")  # code, reason, eviction label
        self.freed = asyncio.Event()  # its slot is free again

    async def accept(self, subprotocol: str, key_protocols: Iterable[str] = ()) -> bool:
        """Origin and API key (``key_protocols``: more subprotocols that may carry the key), then the handshake."""
        websocket, access, headers = self.websocket, self.state.access, self.websocket.headers
        if not access.origin_allowed(headers.get("origin"), headers.get("host")):
            log.warning("refused %s from origin %r (allowed_origins)", websocket.url.path, headers.get("origin"))
            await websocket.close(code=CLOSE_POLICY, reason="origin not allowed")  # before accept: HTTP 403
            return False
        if not access.key_ok(headers, websocket.query_params, [*self.offered, *key_protocols]):
            await websocket.close(code=CLOSE_POLICY, reason="api key required")
            return False
        await websocket.accept(subprotocol=subprotocol if subprotocol in self.offered else None)
        return True

    async def admit(self, refusal: Callable[[protocol.Error], str]) -> bool:
        """Room for one more session? If not, the client gets ``refusal(error)`` and the close code 1013.

        When every slot is taken, the session idle longest gives its slot up if it has been idle
        for ``idle_evict_s``; else the refused client is told to come back when one will have.
        """
        admission, sessions = self.state.admission, self.state.sessions
        verdict = admission.check(len(sessions))
        if verdict is not None and verdict.reason == "sessions":
            verdict = await self._make_room(verdict)
        if verdict is None:
            return True
        await self.refuse(refusal(admission.refuse(verdict)), CLOSE_OVERLOADED)
        return False

    async def _make_room(self, full: Refusal) -> Refusal | None:
        """Evict the idlest session if it idled ``idle_evict_s``; the refusal that remains (None: admitted)."""
        evict_s = self.settings.idle_evict_s
        idlest = max(self.state.sessions.values(), key=Connection.idle_for, default=None)
        if idlest is None:
            return full
        idle = idlest.idle_for()
        if idle < evict_s:
            return full.retry_sooner(evict_s - idle)
        idlest.close_soon(CLOSE_IDLE, f"idle for {idle:.0f} s while the server was full", "idle_full")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await idlest.freed.wait()
        return self.state.admission.check(len(self.state.sessions))

    def idle_for(self) -> float:
        """Seconds since the client's last frame; 0 while a reply is produced or played (it is listening) or it closes."""
        if self._closing.is_set() or (self.session is not None and self.session.busy):
            return 0.0
        return self._clock() - self.heard_at

    def close_soon(self, code: int, reason: str, label: str) -> None:
        """Have ``serve`` close this connection with ``code`` and count an eviction ``label``; nothing more is sent."""
        if not self._closing.is_set():
            self._close_why = (code, reason, label)
            self._closing.set()

    async def refuse(self, text: str, code: int) -> None:
        """One last text frame, then the close (an accepted connection that will not get a session)."""
        await self.websocket.send_text(text)
        await self.websocket.close(code=code)

    async def send(self, data: str | bytes) -> None:
        """A frame to the client within ``send_timeout_s``; past it the client is evicted (nothing more is sent)."""
        websocket = self.websocket
        if websocket.client_state != WebSocketState.CONNECTED or self._closing.is_set():
            return
        async with self._send_lock:
            try:
                async with asyncio.timeout(self.settings.send_timeout_s):
                    if isinstance(data, bytes):
                        await websocket.send_bytes(data)
                    else:
                        await websocket.send_text(data)
            except TimeoutError:
                reason = f"client read nothing for {self.settings.send_timeout_s:g} s"
                self.close_soon(CLOSE_NOT_READING, reason, "not_reading")
            except (WebSocketDisconnect, RuntimeError):
                pass

    async def serve(
        self,
        session: VoiceSession,
        on_text: Callable[[str], Awaitable[None]],
        on_bytes: Callable[[bytes], Awaitable[None]],
        *,
        internal_error: str,
        started: Callable[[], Awaitable[None]] | None = None,
        closing: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Run ``session`` until the client leaves, idles out or stops reading; then free it and close.

        ``started`` runs once the session has started, ``closing`` before it is closed;
        ``internal_error`` is the last frame sent when serving fails.
        """
        state, settings, metrics = self.state, self.settings, self.state.metrics
        session.on_turn_metrics = metrics.observe_turn
        self.session, self.heard_at = session, self._clock()
        state.sessions[session] = self
        set_open_sessions(session.models, settings, len(state.sessions))
        close_code, close_reason = 1000, ""
        receiving = asyncio.create_task(self._receive(session, on_text, on_bytes), name=f"{self.label}-receive")
        watching = asyncio.create_task(self._closing.wait(), name=f"{self.label}-closing")
        try:
            await session.start()
            if started is not None:
                await started()
            await asyncio.wait({receiving, watching}, return_when=asyncio.FIRST_COMPLETED)
            if self._closing.is_set():
                close_code, close_reason, label = self._close_why
                metrics.evictions.labels(reason=label).inc()
                log.warning("%s %s: %s; closing it", self.label, session.session_id, close_reason)
            else:
                close_code, close_reason = receiving.result()
                if close_code == CLOSE_IDLE:
                    metrics.evictions.labels(reason="idle").inc()
        except Exception:
            log.exception("%s %s failed", self.label, session.session_id)
            with contextlib.suppress(Exception):
                await self.send(internal_error)
            close_code = 1011
        finally:
            for task in (receiving, watching):
                task.cancel()
            state.sessions.pop(session, None)
            self.freed.set()
            set_open_sessions(session.models, settings, len(state.sessions))
            if closing is not None:
                await closing()
            await session.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await self.websocket.close(code=close_code, reason=close_reason)

    async def _receive(
        self,
        session: VoiceSession,
        on_text: Callable[[str], Awaitable[None]],
        on_bytes: Callable[[bytes], Awaitable[None]],
    ) -> tuple[int, str]:
        """Client frames to the handlers until the client leaves or idles out; returns the close code and reason.

        Frames the server has already buffered come back from ``receive`` without a pause, so
        without the pace one client's flood would hold the event loop (and every other client)
        until it stops.
        """
        idle_s = self.settings.idle_timeout_s
        pace = ReadPace(CLIENT_FRAMES_PER_S, CLIENT_FRAMES_BURST, FLOOD_CLOSE_S, self._clock)
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    message = await self.websocket.receive()
            except TimeoutError:
                if session.busy:
                    continue  # listening to a long reply is not idling
                return CLOSE_IDLE, f"idle for {idle_s:g} s"
            self.heard_at = self._clock()
            if message["type"] == "websocket.disconnect":
                return 1000, ""
            if message.get("bytes") is not None:
                await on_bytes(message["bytes"])
            elif message.get("text") is not None:
                await on_text(message["text"])
            wait_s = pace.took()
            if wait_s is None:
                self.state.metrics.evictions.labels(reason="flooding").inc()
                return CLOSE_POLICY, f"over {pace.flood_rate:g} frames a second"
            if wait_s:
                await asyncio.sleep(wait_s)
