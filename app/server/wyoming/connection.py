"""One Wyoming TCP connection: admitted like a WebSocket, its events read with bounds and a pace, then dispatched.

Like ``app.server.connection`` for ``/ws`` and ``/v1/realtime``: the connection takes a session slot
while it is open (``state.sessions``: the cap, ``/healthz``, ``/metrics``, the solo speed-ups), is
refused with an ``error`` event (code ``overloaded``) when the server is full, closed after
``idle_timeout_s`` without an event (unless a request is being answered), closed when a send waits
past ``send_timeout_s`` (a peer that stopped reading), and read at most ``EVENTS_PER_S`` events a
second (a flood waits in TCP buffers; a peer that keeps over half that pace is closed). A bad event (``WireError``: malformed, oversized, out of order)
is answered with an ``error`` event and the connection closes; unknown event types are skipped, as
the protocol asks of servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from starlette.datastructures import State
from wyoming.asr import Transcribe, Transcript
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Describe, SelectProgram
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart

from app.config import Settings
from app.server.connection import CLIENT_FRAMES_BURST, CLIENT_FRAMES_PER_S, FLOOD_CLOSE_S
from app.server.limits import ReadPace
from app.server.wyoming.conversations import Conversations
from app.server.wyoming.describe import PROGRAM, describe
from app.server.wyoming.dictation import Dictation, language_code
from app.server.wyoming.speech import Speech, chosen_voice
from app.server.wyoming.wire import MAX_PAYLOAD_BYTES, WireError, read_event
from app.stages.registry import set_open_sessions
from app.voice.listening import vad_config

log = logging.getLogger(__name__)

# The pace of ``app.server.connection``: streamed audio comes in 10-60 chunks a second, a recording sent at
# once in a few hundred; past the burst reading waits, and a peer that keeps over half the pace for about
# FLOOD_CLOSE_S is closed (its backlog would otherwise hold its slot long after it left).
EVENTS_PER_S, EVENTS_BURST = CLIENT_FRAMES_PER_S, CLIENT_FRAMES_BURST
CLOSE_WAIT_S = 2.0


class WyomingConnection:
    """One peer's connection (Home Assistant opens one per request). It is its own entry in ``state.sessions``:
    ``close``, ``idle_for``, ``close_soon`` and ``freed`` are what the server asks of an open session."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        state: State,
        settings: Settings,
        conversations: Conversations,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader, self._writer, self._state, self._settings = reader, writer, state, settings
        self._conversations, self._clock = conversations, clock
        self._send_lock = asyncio.Lock()
        self._dictation: Dictation | None = None
        self._speech: Speech | None = None
        self._working = False  # a request is being answered
        self._closing = asyncio.Event()
        self.heard_at = clock()
        self.freed = asyncio.Event()
        self.session_id = f"wyoming-{id(self):x}"

    # ---------------------------------------------------------------- what the server asks of a session
    def idle_for(self) -> float:
        if self._closing.is_set() or self._working or self._speech is not None:
            return 0.0
        return self._clock() - self.heard_at

    def close_soon(self, code: int, reason: str, label: str) -> None:
        log.warning("wyoming connection closed: %s", reason)
        self._state.metrics.evictions.labels(reason=label).inc()
        self._closing.set()

    async def close(self) -> None:
        self._closing.set()
        self._writer.close()

    # ---------------------------------------------------------------- the connection's life
    async def serve(self) -> None:
        state = self._state
        verdict = state.admission.check(len(state.sessions))
        if verdict is not None:
            refusal = state.admission.refuse(verdict)
            await self.send(Error(text=refusal.message, code=refusal.code).event())
            await self._shut()
            return
        state.sessions[self] = self
        set_open_sessions(state.models, self._settings, len(state.sessions))
        try:
            reading = asyncio.create_task(self._read_loop())
            closing = asyncio.create_task(self._closing.wait())
            await asyncio.wait({reading, closing}, return_when=asyncio.FIRST_COMPLETED)
            for task in (reading, closing):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading
        finally:
            state.sessions.pop(self, None)
            self.freed.set()
            set_open_sessions(state.models, self._settings, len(state.sessions))
            self._end_requests()
            await self._shut()

    async def _read_loop(self) -> None:
        idle_s = self._settings.idle_timeout_s
        pace = ReadPace(EVENTS_PER_S, EVENTS_BURST, FLOOD_CLOSE_S, self._clock)
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    event = await read_event(self._reader)
            except TimeoutError:
                if self.idle_for() == 0.0:
                    continue
                self.close_soon(1000, f"idle for {idle_s:g} s", "idle")
                return
            except WireError as error:
                await self.send(error.event())
                return
            except (ConnectionError, OSError):
                return
            if event is None:
                return
            self.heard_at = self._clock()
            try:
                self._working = True
                await self._dispatch(event)
            except WireError as error:
                await self.send(error.event())
                return
            except Exception:
                log.exception("wyoming: serving a %s event failed", event.type)
                await self.send(Error(text="internal server error", code="internal").event())
                return
            finally:
                self._working = False
            wait_s = pace.took()
            if wait_s is None:
                why = f"over {pace.flood_rate:g} events a second"
                await self.send(WireError("flooding", why).event())
                self.close_soon(1008, why, "flooding")
                return
            if wait_s:
                await asyncio.sleep(wait_s)

    async def send(self, event: Event) -> None:
        """One event to the peer within ``send_timeout_s``; past it the connection closes (nothing more is sent)."""
        if self._writer.is_closing():
            return
        async with self._send_lock:
            try:
                async with asyncio.timeout(self._settings.send_timeout_s):
                    await async_write_event(event, self._writer)
            except TimeoutError:
                self.close_soon(4001, f"peer read nothing for {self._settings.send_timeout_s:g} s", "not_reading")
            except (ConnectionError, OSError):
                self._closing.set()

    async def _shut(self) -> None:
        """Close cleanly: our side first (what was sent, an error say, is delivered), and what the peer had still
        sent is read and dropped for a moment: closed with it unread, the socket would reset the connection,
        and a reset can discard the error before the peer reads it."""
        with contextlib.suppress(Exception):
            if self._writer.can_write_eof():
                self._writer.write_eof()
            async with asyncio.timeout(CLOSE_WAIT_S):
                while await self._reader.read(MAX_PAYLOAD_BYTES):
                    pass
        self._writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self._writer.wait_closed()

    def _end_requests(self) -> None:
        for request in (self._dictation, self._speech):
            if request is not None:
                request.close()
        self._dictation = self._speech = None

    # ---------------------------------------------------------------- events
    async def _dispatch(self, event: Event) -> None:
        kind = event.type
        if Describe.is_type(kind):
            await self.send(describe(self._state.models, self._settings).event())
        elif Ping.is_type(kind):
            await self.send(Pong(text=_text(event, "text", required=False)).event())
        elif SelectProgram.is_type(kind):
            name = event.data.get("name")
            if name != PROGRAM:
                raise WireError("unknown_program", f"no program {str(name)[:64]!r}; this server has {PROGRAM!r}")
        elif kind in ("transcribe", "audio-start", "audio-chunk", "audio-stop"):
            await self._on_audio(event)
        elif kind in ("synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop"):
            await self._on_text_to_speak(event)
        elif Transcript.is_type(kind):
            context = event.data.get("context")
            conversation_id = context.get("conversation_id") if isinstance(context, dict) else None
            await self._conversations.answer(_text(event, "text"), conversation_id, self.send)
        else:
            log.debug("wyoming: skipped an event of type %r", kind)

    async def _on_audio(self, event: Event) -> None:
        kind, models = event.type, self._state.models
        if kind == "transcribe" or (kind == "audio-start" and self._dictation is None):
            language = Transcribe.from_event(event).language if kind == "transcribe" else None
            if self._dictation is not None:
                self._dictation.close()
            self._dictation = Dictation(
                models.asr,
                self.send,
                language=language_code(_optional_text(language), models.asr.languages),
                max_seconds=self._settings.max_utterance_s,
                partial_interval_s=self._settings.partial_interval_ms / 1000,
                vad=models.vad_stream(vad_config(self._settings)),
            )
            if kind == "transcribe":
                return
        if self._dictation is None:
            raise WireError("audio_not_started", f"{kind} before audio-start")
        if kind == "audio-start":
            await self._dictation.start(event)
        elif kind == "audio-chunk":
            await self._dictation.chunk(event)
        else:
            dictation, self._dictation = self._dictation, None
            await dictation.stop()

    async def _on_text_to_speak(self, event: Event) -> None:
        kind, speech = event.type, self._speech
        if kind == "synthesize":
            if speech is not None:
                return  # inside a stream: the whole text again, for servers that do not stream
            request = Synthesize.from_event(_with_voice(_with_text(event)))
            whole = self._new_speech(request.voice, streamed=False)
            try:
                whole.add(request.text, whole=True)
                await whole.finish()
            finally:
                whole.close()
        elif kind == "synthesize-start":
            if speech is not None:
                speech.close()
            self._speech = self._new_speech(SynthesizeStart.from_event(_with_voice(event)).voice, streamed=True)
        elif speech is None:
            raise WireError("synthesis_not_started", f"{kind} before synthesize-start")
        elif kind == "synthesize-chunk":
            speech.add(SynthesizeChunk.from_event(_with_text(event)).text)
        else:
            self._speech = None
            try:
                await speech.finish()
            finally:
                speech.close()

    def _new_speech(self, voice, *, streamed: bool) -> Speech:
        tts = self._state.models.tts
        return Speech(
            tts,
            self.send,
            voice=chosen_voice(tts, voice),
            streamed=streamed,
            first_clause_chars=self._settings.first_clause_chars,
            first_piece_words=self._settings.first_piece_words,
            solo=lambda: self._state.models.solo,
        )


def _with_voice(event: Event) -> Event:
    """``voice``, where given, is an object of short strings (the package's parser takes it as it comes)."""
    voice = event.data.get("voice")
    if voice is None:
        return event
    if not isinstance(voice, dict) or not all(
        isinstance(voice.get(key), str | None) and len(voice.get(key) or "") <= 200
        for key in ("name", "language", "speaker")
    ):
        raise WireError("bad_event", f"{event.type}: voice must be an object of name, language, speaker strings")
    return event


def _with_text(event: Event) -> Event:
    _text(event, "text")
    return event


def _text(event: Event, key: str, required: bool = True) -> str | None:
    value = event.data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise WireError("bad_event", f"{event.type}: {key} must be a string")
    return value


def _optional_text(value: object) -> str | None:
    return value if isinstance(value, str) else None
