"""The OpenAI Realtime API (GA) at ``/v1/realtime``: a second door to the same conversation as ``/ws``.

The official OpenAI SDKs (``client.realtime.connect()`` with ``base_url=http://HOST:PORT/v1``),
pipecat's ``OpenAIRealtimeLLMService(base_url="ws://HOST:PORT/v1/realtime")`` and LiveKit's
OpenAI realtime plugin talk to Parley here unchanged. One connection is one ``VoiceSession``,
admitted and limited exactly like ``/ws`` (origin, API key, capacity, send deadlines, idle
timeout, audio rate); ``RealtimeAdapter`` translates between the two vocabularies.

Client events -> the conversation
  session.update                 instructions -> system prompt; audio.output.voice -> voice (a Parley
                                 voice name, or an OpenAI voice name, which keeps the current voice);
                                 audio.input.transcription.language -> language; transcription null ->
                                 no transcription events (Parley still transcribes: it needs the words);
                                 turn_detection: server_vad/semantic_vad -> Parley's own VAD and endpoint
                                 (threshold -> VAD threshold, silence_duration_ms -> endpoint silence,
                                 semantic eagerness -> endpoint silences, interrupt_response -> barge-in:
                                 when false, speaking over a reply does not stop it, but a turn that
                                 commits still does, as Parley answers the latest turn),
                                 null -> manual turns (commit + response.create); output_modalities
                                 ["audio"] or ["text"]; include ["parley.turn_metrics", "parley.notice"]
                                 opts in to Parley's own extra events.
                                 Ignored (accepted, no effect): audio.input.noise_reduction,
                                 turn_detection.prefix_padding_ms (Parley keeps 300 ms of pre-roll),
                                 transcription.model/prompt/delay/keywords, max_output_tokens (the
                                 server's llm_max_tokens applies), tracing, truncation (Parley fits the
                                 history to the model's context itself), reasoning, parallel_tool_calls,
                                 model. Refused with an error (the rest of the update still applies):
                                 non-empty tools, tool_choice other than auto/none, prompt templates,
                                 audio formats other than 24 kHz PCM, speed other than 1,
                                 create_response false, idle_timeout_ms, transcription sessions.
  input_audio_buffer.append      base64 PCM16 24 kHz mono -> 16 kHz -> VoiceSession.feed_audio (server
                                 VAD), or into the manual buffer (turn_detection null)
  input_audio_buffer.commit      manual turns: the buffer is transcribed (the shared ASR) and becomes a
                                 user item, answered on response.create
  input_audio_buffer.clear       drops the utterance in progress (or the manual buffer)
  conversation.item.create       user text -> held until response.create, then one typed turn;
                                 assistant text -> history; system text -> appended to the instructions
  response.create                answers the user items created since the last answer (a typed turn);
                                 response.instructions apply to that turn only
  response.cancel                Parley ``cancel``: the reply stops, the history keeps what was heard
  conversation.item.truncate     Parley ``playback`` (how much of the reply was played)
  conversation.item.retrieve     the item as the server last sent it
  conversation.item.delete       only items not yet answered

The conversation -> server events
  speech_started                 input_audio_buffer.speech_started (held back while a reply is
                                 audible, see below)
  transcript (partial)           conversation.item.input_audio_transcription.delta
  transcript (final, spoken)     input_audio_buffer.speech_stopped, .committed, conversation.item.added,
                                 ...input_audio_transcription.completed, conversation.item.done,
                                 response.created (Parley answers every spoken turn at once)
  assistant_text                 response.output_audio_transcript.delta (or output_text.delta)
  reply audio                    response.output_audio.delta (resampled to 24 kHz, streaming)
  interrupt                      the held-back speech_started; the response ends ``cancelled``
  turn_done                      response.output_audio.done, ...transcript.done, content_part.done,
                                 output_item.done, conversation.item.done, response.done
                                 (+ parley.turn_metrics when included)
  error                          error {"error": {"type", "code", "message", "param", "event_id"}}

OpenAI clients stop their playback on ``input_audio_buffer.speech_started``. Parley decides
barge-in itself (speech longer than ``barge_in_ms``; a cough is not a turn), so while a reply
is audible that event is held back until Parley confirms the interruption (its ``interrupt``)
or the user's turn commits; a dropped utterance is never announced. Speculative replies are
held back by the session until their turn commits, so they are invisible here too.

No event type outside the GA server-event set is sent unless the client asks for it with
``include``: some clients (pipecat) stop on an event type they do not know.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import itertools
import json
import logging
import math
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import soxr
from fastapi import WebSocket, WebSocketDisconnect
from starlette.datastructures import State
from starlette.websockets import WebSocketState

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, float_to_pcm16, pcm16_to_float, resample
from app.config import Settings
from app.server.access import CLOSE_POLICY, KEY_SUBPROTOCOL_PREFIX
from app.server.limits import AudioBudget, Every
from app.server.ws import CLOSE_IDLE, CLOSE_NOT_READING, CLOSE_OVERLOADED, CLOSE_WAIT_S
from app.voice.session import VoiceSession

log = logging.getLogger(__name__)

REALTIME_SUBPROTOCOL = "realtime"
OPENAI_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."  # what OpenAI's browser clients send the key as
REALTIME_SAMPLE_RATE = 24_000  # the only PCM rate of the Realtime API, both ways
PCM_FORMAT = {"type": "audio/pcm", "rate": REALTIME_SAMPLE_RATE}

# Bounds. Frames over 1 MiB are closed by uvicorn itself (``ws_max_size``, code 1009).
MAX_EVENT_CHARS = 1 << 20
MAX_APPEND_AUDIO_BYTES = REALTIME_SAMPLE_RATE * 2 * 10  # 10 s of audio in one append
MAX_APPEND_BASE64_CHARS = (MAX_APPEND_AUDIO_BYTES + 2) // 3 * 4
MIN_COMMIT_MS = 100  # what OpenAI requires of a manual commit
MAX_ID_CHARS = 64
MAX_CONTENT_PARTS = 16
MAX_PENDING_ITEMS = 64  # client items waiting for a response.create
ITEMS_KEPT = 128  # items remembered for truncate / retrieve / delete
MAX_METADATA_KEYS, MAX_METADATA_CHARS = 16, 512
TRANSCRIBE_TIMEOUT_S = 60.0

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})
INCLUDE_TURN_METRICS = "parley.turn_metrics"
INCLUDE_NOTICES = "parley.notice"
# semantic_vad eagerness -> (endpoint silence, silence after words that end mid-clause), in ms
EAGERNESS_MS = {"high": (250, 700), "low": (800, 2500)}

# session fields accepted and ignored (read-only echoes, or settings Parley has no use for)
_IGNORED_SESSION_KEYS = frozenset(
    {"object", "id", "expires_at", "client_secret", "model", "max_output_tokens", "tracing", "truncation"}
    | {"reasoning", "parallel_tool_calls"}
)
_BETA_HINTS = {  # beta-API session fields, and where the GA API puts them
    "modalities": "session.output_modalities",
    "voice": "session.audio.output.voice",
    "input_audio_format": "session.audio.input.format",
    "output_audio_format": "session.audio.output.format",
    "input_audio_transcription": "session.audio.input.transcription",
    "input_audio_noise_reduction": "session.audio.input.noise_reduction",
    "turn_detection": "session.audio.input.turn_detection",
    "max_response_output_tokens": "session.max_output_tokens",
}


class RealtimeError(Exception):
    """A client event that cannot be served; becomes an ``error`` event and the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind


def _unsupported(param: str, what: str) -> RealtimeError:
    return RealtimeError("unsupported_parameter", f"{what} is not supported by this server (Parley)", param)


# ---------------------------------------------------------------- session configuration
@dataclass
class TurnDetection:
    type: str = "server_vad"
    threshold: float = 0.5
    silence_duration_ms: int = 400
    prefix_padding_ms: int = 300
    interrupt_response: bool = True
    eagerness: str = "auto"

    def as_json(self) -> dict[str, Any]:
        common = {"type": self.type, "create_response": True, "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {**common, "eagerness": self.eagerness}
        return {
            **common,
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": None,
        }


@dataclass
class RealtimeConfig:
    """What the client set through ``session.update`` (and Parley's defaults), as ``session`` shows it."""

    model: str
    instructions: str
    voice: str
    language: str
    turn_detection: TurnDetection | None
    transcription: bool = True
    transcription_model: str = "parley-whisper"
    modality: str = "audio"
    include: frozenset[str] = frozenset()

    def session_json(self, session_id: str, max_output_tokens: int) -> dict[str, Any]:
        transcription = (
            {"model": self.transcription_model, "language": self.language or None, "prompt": None}
            if self.transcription
            else None
        )
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": [self.modality],
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": dict(PCM_FORMAT),
                    "transcription": transcription,
                    "noise_reduction": None,
                    "turn_detection": self.turn_detection.as_json() if self.turn_detection else None,
                },
                "output": {"format": dict(PCM_FORMAT), "voice": self.voice, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": max_output_tokens,
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
            "expires_at": 0,
            "include": sorted(self.include) or None,
        }


# ---------------------------------------------------------------- conversation state
@dataclass
class _Speech:
    """The user's utterance in progress (server VAD), as the client sees it."""

    item_id: str
    start_ms: int
    announced: bool = False  # speech_started sent
    partial: str = ""  # transcript sent as deltas so far


@dataclass
class _Item:
    """An item as the client knows it; ``turn_id`` links an assistant item to Parley's reply."""

    payload: dict[str, Any]
    role: str
    text: str = ""
    turn_id: int | None = None
    audio_ms: float = 0.0
    pending: bool = False  # created by the client, not yet answered
    transcription: asyncio.Task | None = None  # a manual commit being transcribed


@dataclass
class _ResponseParams:
    modality: str | None = None
    metadata: dict[str, str] | None = None
    instructions: str | None = None


@dataclass
class _Response:
    id: str
    turn_id: int
    modality: str
    metadata: dict[str, str] | None
    voice: str
    item_id: str | None = None  # set once the output item is opened (first text or audio)
    text_parts: list[str] = field(default_factory=list)
    cancel_reason: str | None = None
    resampler: Any = None
    audio_bytes: int = 0

    def payload(self, status: str, output: list | None = None, status_details=None, usage=None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": status_details,
            "output": output or [],
            "conversation_id": None,
            "output_modalities": [self.modality],
            "max_output_tokens": "inf",
            "audio": {"output": {"format": dict(PCM_FORMAT), "voice": self.voice}},
            "usage": usage,
            "metadata": self.metadata,
        }


# Parley does not meter tokens per turn; the figures are zeros in the shape clients read (pipecat reads them).
def _usage() -> dict[str, Any]:
    return {
        "total_tokens": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "input_token_details": {
            "text_tokens": 0,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": 0,
            "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": 0, "audio_tokens": 0},
    }


def _message_item(item_id: str, role: str, content: list[dict], status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# ---------------------------------------------------------------- parsing helpers
def _bounded_int(text: str) -> int:
    if len(text) > 32:
        raise ValueError("number too long")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text) if len(text) <= 32 else math.inf
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def parse_client_event(raw: str) -> dict[str, Any]:
    """One client event: a JSON object with a string ``type`` (bounded in size and number length)."""
    if len(raw) > MAX_EVENT_CHARS:
        raise RealtimeError("event_too_large", f"event over {MAX_EVENT_CHARS} characters")
    try:
        data = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise RealtimeError("invalid_json", f"event is not valid JSON: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise RealtimeError("invalid_json", f"event is not acceptable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RealtimeError("invalid_event", "an event must be a JSON object")
    if not isinstance(data.get("type"), str):
        raise RealtimeError("missing_required_parameter", "an event needs a string 'type'", "type")
    return data


def _field(data: dict, key: str, kinds: type | tuple, param: str, *, required: bool = False):
    """``data[key]`` if it has one of ``kinds`` (None when absent or null, unless ``required``)."""
    value = data.get(key)
    if value is None:
        if required:
            raise RealtimeError("missing_required_parameter", f"missing required parameter: '{param}'", param)
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        names = "/".join(k.__name__ for k in _as_tuple(kinds))
        raise RealtimeError("invalid_type", f"'{param}' must be {names}, not {type(value).__name__}", param)
    return value


def _as_tuple(kinds: type | tuple) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _text(data: dict, key: str, param: str, max_chars: int, *, required: bool = False) -> str | None:
    value = _field(data, key, str, param, required=required)
    if value is not None and len(value) > max_chars:
        raise RealtimeError(
            "string_above_max_length", f"'{param}' is {len(value)} characters; at most {max_chars}", param
        )
    return value


def _client_id(data: dict, key: str, param: str) -> str | None:
    value = _text(data, key, param, MAX_ID_CHARS)
    return value or None


def _check_format(value: Any, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise RealtimeError("invalid_type", f"'{param}' must be an object", param)
    kind, rate = value.get("type", "audio/pcm"), value.get("rate", REALTIME_SAMPLE_RATE)
    if kind != "audio/pcm" or rate != REALTIME_SAMPLE_RATE:
        raise RealtimeError(
            "unsupported_audio_format",
            f"only audio/pcm at {REALTIME_SAMPLE_RATE} Hz is supported, not {str(kind)[:40]!r} at {str(rate)[:12]}",
            param,
        )


def _modality(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(v in ("audio", "text") for v in value):
        raise RealtimeError("invalid_value", f"'{param}' must be ['audio'] or ['text']", param)
    return "audio" if "audio" in value else "text"  # ["audio", "text"] is the beta default: audio + transcript


def _check_tools(data: dict, prefix: str) -> list[RealtimeError]:
    errors = []
    tools = data.get("tools")
    if tools not in (None, []):
        errors.append(_unsupported(f"{prefix}.tools", "function calling (tools)"))
    choice = data.get("tool_choice")
    if choice not in (None, "auto", "none"):
        errors.append(_unsupported(f"{prefix}.tool_choice", f"tool_choice {repr(choice)[:60]}"))
    if data.get("prompt") is not None:
        errors.append(_unsupported(f"{prefix}.prompt", "prompt templates"))
    return errors


# ---------------------------------------------------------------- the adapter
SendEvent = Callable[[dict[str, Any]], Awaitable[None]]


class RealtimeAdapter:
    """Translates one Realtime connection to and from one ``VoiceSession``.

    ``on_parley`` / ``on_parley_audio`` are the session's ``send_json`` / ``send_bytes``;
    ``handle_client`` takes the client's text frames. The session is attached after both exist.
    """

    def __init__(
        self,
        send: SendEvent,
        settings: Settings,
        models,
        *,
        model: str = "parley",
        on_rate_limited: Callable[[float], None] | None = None,
        drop_after_s: float | None = None,
    ) -> None:
        self._send = send
        self.settings = settings
        self.models = models
        self.session: VoiceSession | None = None
        self.session_id = _new_id("sess")
        self._event_ids = itertools.count(1)
        self._event_prefix = uuid.uuid4().hex[:8]
        self._lock = asyncio.Lock()
        voices, languages = list(models.tts.voices), list(models.asr.languages)
        self.config = RealtimeConfig(
            model=model,
            instructions=settings.system_prompt,
            voice=voices[0] if voices else "default",
            language=languages[0] if languages else "en",
            turn_detection=TurnDetection(
                threshold=settings.vad_threshold, silence_duration_ms=settings.endpoint_silence_ms
            ),
        )
        self._budget = AudioBudget(settings.max_audio_rate)
        self._warn_rate = Every(1.0)
        self._warn_full = Every(1.0)
        self._on_rate_limited = on_rate_limited
        self._drop_after_s = drop_after_s
        self._input = StreamResampler(REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
        self._input_ms = 0.0  # audio appended so far (the clock of audio_start_ms / audio_end_ms)
        self._manual: list[np.ndarray] = []  # 24 kHz float32, turn_detection null
        self._manual_samples = 0
        self._speech: _Speech | None = None
        self._drop_task: asyncio.Task | None = None
        self._response: _Response | None = None
        self._typed: _ResponseParams | None = None  # a typed turn sent to the session, response not opened yet
        self._items: OrderedDict[str, _Item] = OrderedDict()
        self._last_item_id: str | None = None
        self._client_event_id: str | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._handlers: dict[str, Callable[[dict], Awaitable[None]]] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete,
            "conversation.item.retrieve": self._item_retrieve,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear,
        }

    def attach(self, session: VoiceSession) -> None:
        self.session = session

    # ------------------------------------------------------------------ sending
    async def _emit(self, event: dict[str, Any]) -> None:
        event = {"event_id": f"event_{self._event_prefix}{next(self._event_ids)}", **event}
        await self._send(event)

    async def _error(self, error: RealtimeError) -> None:
        await self._emit(
            {
                "type": "error",
                "error": {
                    "type": error.kind,
                    "code": error.code,
                    "message": error.message,
                    "param": error.param,
                    "event_id": self._client_event_id,
                },
            }
        )

    async def start(self) -> None:
        await self._emit({"type": "session.created", "session": self._session_json()})

    def _session_json(self) -> dict[str, Any]:
        return self.config.session_json(self.session_id, self.settings.llm_max_tokens)

    async def close(self) -> None:
        self._closed = True
        for task in [*self._tasks, self._drop_task]:
            if task is not None:
                task.cancel()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _remember(self, item: _Item) -> None:
        self._items[item.payload["id"]] = item
        self._items.move_to_end(item.payload["id"])
        while len(self._items) > ITEMS_KEPT:
            oldest = next(iter(self._items))
            if self._items[oldest].pending:
                break  # never forget what a response.create will need
            self._items.popitem(last=False)

    def _pending(self) -> list[_Item]:
        return [item for item in self._items.values() if item.pending]

    # ================================================================== Parley -> client
    async def on_parley(self, message: protocol.ServerMessage) -> None:
        async with self._lock:
            await self._translate(message)

    async def _translate(self, message: protocol.ServerMessage) -> None:
        match message:
            case protocol.Ready() | protocol.ConfigApplied():
                return  # the client got session.created / session.updated from us
            case protocol.SpeechStarted():
                await self._on_speech_started()
            case protocol.SpeechStopped():
                self._on_speech_paused()
            case protocol.Transcript(final=False):
                await self._on_partial(message)
            case protocol.Transcript():
                await self._on_final(message)
            case protocol.AssistantText():
                await self._on_assistant_text(message)
            case protocol.AudioStart():
                await self._on_audio_start(message)
            case protocol.Interrupt():
                await self._on_interrupt(message)
            case protocol.TurnDone():
                await self._on_turn_done(message)
            case protocol.Notice():
                if INCLUDE_NOTICES in self.config.include:
                    await self._emit({"type": "parley.notice", **message.model_dump(exclude={"type"})})
            case protocol.Error():
                await self._on_parley_error(message)

    def _reply_audible(self) -> bool:
        return self._response is not None or (self.session is not None and self.session.busy)

    async def _on_speech_started(self) -> None:
        self._cancel_drop_timer()
        if self._speech is not None:
            return  # the user went on after a pause: the same item
        self._speech = _Speech(item_id=_new_id("item"), start_ms=int(self._input_ms))
        if not self._reply_audible():
            await self._announce(self._speech)
        # else: held back until Parley confirms the barge-in (interrupt) or the turn commits

    async def _announce(self, speech: _Speech) -> None:
        speech.announced = True
        await self._emit(
            {"type": "input_audio_buffer.speech_started", "audio_start_ms": speech.start_ms, "item_id": speech.item_id}
        )

    def _on_speech_paused(self) -> None:
        """A pause: if no turn commits in time, the utterance was dropped (noise, filler)."""
        speech = self._speech
        if speech is None:
            return
        self._cancel_drop_timer()
        wait_s = self._drop_after_s
        if wait_s is None:
            wait_s = self.settings.endpoint_unfinished_silence_ms / 1000 + 3.0  # the endpoint, and ASR time
        self._drop_task = asyncio.create_task(self._drop_later(speech, wait_s), name="realtime-drop")

    async def _drop_later(self, speech: _Speech, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        async with self._lock:
            if self._speech is not speech:
                return
            self._speech = None
            if speech.announced:
                await self._emit(
                    {
                        "type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": int(self._input_ms),
                        "item_id": speech.item_id,
                    }
                )

    def _cancel_drop_timer(self) -> None:
        if self._drop_task is not None:
            self._drop_task.cancel()
            self._drop_task = None

    async def _on_partial(self, message: protocol.Transcript) -> None:
        speech = self._speech
        if not self.config.transcription or speech is None or not speech.announced:
            return
        if not message.text.startswith(speech.partial):
            return  # partials only grow; a rewrite is left to the completed transcript
        delta = message.text[len(speech.partial) :]
        if delta:
            speech.partial = message.text
            await self._emit(
                {
                    "type": "conversation.item.input_audio_transcription.delta",
                    "item_id": speech.item_id,
                    "content_index": 0,
                    "delta": delta,
                }
            )

    async def _on_final(self, message: protocol.Transcript) -> None:
        if self._typed is not None:  # the typed turn response.create just sent: its items exist already
            params, self._typed = self._typed, None
            await self._open_response(message.turn_id, params)
            return
        speech, self._speech = self._speech, None
        self._cancel_drop_timer()
        if speech is None:
            speech = _Speech(item_id=_new_id("item"), start_ms=int(self._input_ms))
        if not speech.announced:
            await self._announce(speech)
        end_ms = int(self._input_ms)
        await self._emit(
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end_ms, "item_id": speech.item_id}
        )
        self._pending_into_history()  # client items not answered yet come before this turn
        previous, self._last_item_id = self._last_item_id, speech.item_id
        await self._emit(
            {"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": speech.item_id}
        )
        content = [{"type": "input_audio", "transcript": None}]
        await self._emit(
            {
                "type": "conversation.item.added",
                "previous_item_id": previous,
                "item": _message_item(speech.item_id, "user", content, "in_progress"),
            }
        )
        if self.config.transcription:
            await self._emit(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    "item_id": speech.item_id,
                    "content_index": 0,
                    "transcript": message.text,
                    "usage": {"type": "duration", "seconds": round(max(0.0, end_ms - speech.start_ms) / 1000, 3)},
                }
            )
        done = _message_item(speech.item_id, "user", [{"type": "input_audio", "transcript": message.text}])
        self._remember(_Item(done, "user", message.text))
        await self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": done})
        await self._open_response(message.turn_id, _ResponseParams())  # Parley answers every spoken turn

    async def _open_response(self, turn_id: int, params: _ResponseParams) -> None:
        response = _Response(
            id=_new_id("resp"),
            turn_id=turn_id,
            modality=params.modality or self.config.modality,
            metadata=params.metadata,
            voice=self.config.voice,
        )
        self._response = response
        await self._emit({"type": "response.created", "response": response.payload("in_progress")})

    def _current(self, turn_id: int) -> _Response | None:
        response = self._response
        return response if response is not None and response.turn_id == turn_id else None

    def _assistant_content(self, response: _Response, text: str) -> list[dict[str, Any]]:
        if response.modality == "text":
            return [{"type": "output_text", "text": text}]
        return [{"type": "output_audio", "transcript": text}]

    def _part(self, response: _Response, text: str) -> dict[str, Any]:
        return {"type": "text", "text": text} if response.modality == "text" else {"type": "audio", "transcript": text}

    async def _open_output(self, response: _Response) -> None:
        """The assistant item and its content part, opened on the reply's first text or audio."""
        if response.item_id is not None:
            return
        response.item_id = _new_id("item")
        item = _message_item(response.item_id, "assistant", [], "in_progress")
        self._remember(_Item(item, "assistant", turn_id=response.turn_id))
        previous, self._last_item_id = self._last_item_id, response.item_id
        where = {"response_id": response.id, "output_index": 0}
        await self._emit({"type": "response.output_item.added", **where, "item": item})
        await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        await self._emit(
            {
                "type": "response.content_part.added",
                **where,
                "item_id": response.item_id,
                "content_index": 0,
                "part": self._part(response, ""),
            }
        )

    def _where(self, response: _Response) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}

    async def _on_assistant_text(self, message: protocol.AssistantText) -> None:
        response = self._current(message.turn_id)
        if response is None:
            return
        await self._open_output(response)
        response.text_parts.append(message.delta)
        kind = "response.output_text.delta" if response.modality == "text" else "response.output_audio_transcript.delta"
        await self._emit({"type": kind, **self._where(response), "delta": message.delta})

    async def _on_audio_start(self, message: protocol.AudioStart) -> None:
        response = self._current(message.turn_id)
        if response is None:
            return
        if message.sample_rate != REALTIME_SAMPLE_RATE:
            response.resampler = soxr.ResampleStream(message.sample_rate, REALTIME_SAMPLE_RATE, 1, dtype="float32")
        if response.modality == "text" and self.session is not None:
            # no audio is played: tell the session so, or it would count the reply as playing (barge-in, idle)
            await self.session.handle_text(
                json.dumps({"type": "playback", "turn_id": message.turn_id, "played_ms": 1e9})
            )

    async def on_parley_audio(self, data: bytes) -> None:
        async with self._lock:
            response = self._response
            if response is None or response.modality == "text" or not data:
                return
            await self._open_output(response)
            samples = pcm16_to_float(data)
            if response.resampler is not None:
                samples = response.resampler.resample_chunk(samples)
            await self._audio_delta(response, samples)

    async def _audio_delta(self, response: _Response, samples: np.ndarray) -> None:
        if not len(samples):
            return
        pcm = float_to_pcm16(samples)
        response.audio_bytes += len(pcm)
        item = self._items.get(response.item_id or "")
        if item is not None:
            item.audio_ms = response.audio_bytes / 2 / REALTIME_SAMPLE_RATE * 1000
        await self._emit(
            {"type": "response.output_audio.delta", **self._where(response), "delta": base64.b64encode(pcm).decode()}
        )

    async def _on_interrupt(self, message: protocol.Interrupt) -> None:
        speech = self._speech
        if speech is not None and not speech.announced:
            await self._announce(speech)  # barge-in confirmed: now the client may stop its playback
        response = self._current(message.turn_id)
        if response is not None and response.cancel_reason is None:
            response.cancel_reason = "turn_detected"

    async def _on_turn_done(self, message: protocol.TurnDone) -> None:
        response = self._current(message.turn_id)
        ids: dict[str, Any] = {}
        if response is not None:
            ids = {"response_id": response.id, "item_id": response.item_id}
            status = "cancelled" if message.interrupted else "completed"
            await self._finish(response, status, message.text)
        if INCLUDE_TURN_METRICS in self.config.include:
            await self._emit(
                {
                    "type": "parley.turn_metrics",
                    "turn_id": message.turn_id,
                    **ids,
                    "interrupted": message.interrupted,
                    "metrics": message.metrics.model_dump(exclude_none=True),
                }
            )

    async def _finish(self, response: _Response, status: str, text: str, error: dict | None = None) -> None:
        """Close the response: its content part, item and the response itself, in the Realtime order."""
        if self._response is response:
            self._response = None
        output = []
        if response.item_id is not None:
            where = self._where(response)
            if response.modality == "text":
                await self._emit({"type": "response.output_text.done", **where, "text": text})
            else:
                if status == "completed" and response.resampler is not None:
                    tail = response.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
                    await self._audio_delta(response, tail)
                await self._emit({"type": "response.output_audio.done", **where})
                await self._emit({"type": "response.output_audio_transcript.done", **where, "transcript": text})
            await self._emit({"type": "response.content_part.done", **where, "part": self._part(response, text)})
            content = self._assistant_content(response, text)
            item = _message_item(
                response.item_id, "assistant", content, "completed" if status == "completed" else "incomplete"
            )
            stored = self._items.get(response.item_id)
            if stored is not None:
                stored.payload, stored.text = item, text
            await self._emit(
                {"type": "response.output_item.done", "response_id": response.id, "output_index": 0, "item": item}
            )
            await self._emit({"type": "conversation.item.done", "item": item})
            output = [item]
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": response.cancel_reason or "turn_detected"}
        elif status == "failed":
            details = {"type": "failed", "error": error}
        await self._emit({"type": "response.done", "response": response.payload(status, output, details, _usage())})

    async def _on_parley_error(self, message: protocol.Error) -> None:
        if message.code == "turn_failed" and self._response is not None:
            response = self._response
            error = {"type": "server_error", "code": message.code, "message": message.message}
            await self._finish(response, "failed", "".join(response.text_parts).strip(), error)
            return
        kind = "server_error" if message.code in ("internal", "overloaded", "turn_failed") else "invalid_request_error"
        await self._error(RealtimeError(message.code, message.message, kind=kind))

    # ================================================================== client -> Parley
    async def handle_client(self, raw: str) -> None:
        """One text frame from the client; every problem is answered with an ``error`` event."""
        self._client_event_id = None
        try:
            event = parse_client_event(raw)
            event_id = event.get("event_id")
            if isinstance(event_id, str) and len(event_id) <= MAX_ID_CHARS:
                self._client_event_id = event_id
            handler = self._handlers.get(event["type"])
            if handler is None:
                shown = event["type"][:60]
                raise RealtimeError("unknown_event_type", f"unknown client event type {shown!r}", "type")
            await handler(event)
        except RealtimeError as error:
            async with self._lock:
                await self._error(error)

    async def handle_binary(self) -> None:
        self._client_event_id = None
        async with self._lock:
            await self._error(
                RealtimeError(
                    "invalid_event",
                    "binary frames are not part of the Realtime API: send audio as input_audio_buffer.append",
                )
            )

    async def _parley(self, message: dict[str, Any]) -> None:
        """A Parley client message to the session (never while holding the lock: it answers through on_parley)."""
        if self.session is not None:
            await self.session.handle_text(json.dumps(message))

    # ------------------------------------------------------------------ session.update
    async def _session_update(self, event: dict) -> None:
        session = _field(event, "session", dict, "session", required=True)
        kind = session.get("type", "realtime")
        if kind == "transcription":
            raise RealtimeError("unsupported_session_type", "transcription sessions are not supported", "session.type")
        if kind != "realtime":
            raise RealtimeError(
                "invalid_value", f"session.type must be 'realtime', not {repr(kind)[:40]}", "session.type"
            )
        errors: list[RealtimeError] = _check_tools(session, "session")
        config = replace(self.config)
        parley: dict[str, Any] = {}

        def attempt(apply: Callable[[], None]) -> None:
            try:
                apply()
            except RealtimeError as error:
                errors.append(error)

        for key in session:
            if key in _BETA_HINTS:
                errors.append(
                    RealtimeError(
                        "unknown_parameter",
                        f"unknown parameter 'session.{key}': this server speaks the GA Realtime API "
                        f"(use {_BETA_HINTS[key]})",
                        f"session.{key}",
                    )
                )
            elif key not in _SESSION_KEYS:
                errors.append(
                    RealtimeError("unknown_parameter", f"unknown parameter 'session.{key}'", f"session.{key[:60]}")
                )
        if "model" in session and isinstance(session["model"], str):
            config.model = session["model"][:MAX_ID_CHARS]

        def instructions() -> None:
            text = _text(session, "instructions", "session.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS)
            if text is not None:
                config.instructions = text.strip() or self.settings.system_prompt  # "" restores the default
                parley["system_prompt"] = config.instructions

        def modalities() -> None:
            modality = _modality(session.get("output_modalities"), "session.output_modalities")
            if modality is not None:
                config.modality = modality

        def include() -> None:
            values = _field(session, "include", list, "session.include")
            if values is not None:
                config.include = frozenset(v for v in values if isinstance(v, str) and v.startswith("parley."))

        attempt(instructions)
        attempt(modalities)
        attempt(include)
        audio = session.get("audio")
        if audio is not None and not isinstance(audio, dict):
            errors.append(RealtimeError("invalid_type", "'session.audio' must be an object", "session.audio"))
            audio = None
        audio = audio or {}
        audio_in, audio_out = audio.get("input") or {}, audio.get("output") or {}
        if not isinstance(audio_in, dict) or not isinstance(audio_out, dict):
            errors.append(
                RealtimeError("invalid_type", "audio.input and audio.output must be objects", "session.audio")
            )
            audio_in, audio_out = {}, {}
        attempt(lambda: _check_format(audio_in.get("format"), "session.audio.input.format"))
        attempt(lambda: _check_format(audio_out.get("format"), "session.audio.output.format"))
        attempt(lambda: self._apply_transcription(audio_in, config, parley))
        attempt(lambda: self._apply_voice(audio_out, config, parley))

        def speed() -> None:
            value = _field(audio_out, "speed", (int, float), "session.audio.output.speed")
            if value is not None and abs(value - 1.0) > 1e-6:
                raise _unsupported("session.audio.output.speed", "a speed other than 1.0")

        attempt(speed)
        turn_change = False
        if "turn_detection" in audio_in:
            try:
                config.turn_detection = self._turn_detection(audio_in["turn_detection"], config.turn_detection)
                turn_change = True
                if config.turn_detection is not None:
                    parley["barge_in"] = config.turn_detection.interrupt_response
            except RealtimeError as error:
                errors.append(error)

        for error in errors:
            async with self._lock:
                await self._error(error)
        previous = self.config
        self.config = config
        if parley:
            await self._parley({"type": "config", **parley})
        if turn_change:
            await self._apply_turn_detection(previous.turn_detection, config.turn_detection)
        async with self._lock:
            await self._emit({"type": "session.updated", "session": self._session_json()})

    def _apply_transcription(self, audio_in: dict, config: RealtimeConfig, parley: dict) -> None:
        if "transcription" not in audio_in:
            return
        value = audio_in["transcription"]
        if value is None:
            config.transcription = False
            return
        if not isinstance(value, dict):
            raise RealtimeError(
                "invalid_type", "transcription must be an object or null", "session.audio.input.transcription"
            )
        config.transcription = True
        model = value.get("model")
        if isinstance(model, str) and model:
            config.transcription_model = model[:MAX_ID_CHARS]  # echoed; Parley's own Whisper transcribes
        language = _text(value, "language", "session.audio.input.transcription.language", 16)
        if language is not None:
            languages = list(self.models.asr.languages)
            if language not in languages:
                raise RealtimeError(
                    "invalid_value",
                    f"the speech model does not take language {language!r}; it takes {languages}",
                    "session.audio.input.transcription.language",
                )
            config.language = parley["language"] = language

    def _apply_voice(self, audio_out: dict, config: RealtimeConfig, parley: dict) -> None:
        value = audio_out.get("voice")
        if value is None:
            return
        if isinstance(value, dict):
            value = value.get("id")
        if not isinstance(value, str):
            raise RealtimeError("invalid_type", "voice must be a string", "session.audio.output.voice")
        voices = list(self.models.tts.voices)
        if value in voices:
            config.voice = parley["voice"] = value
        elif value not in OPENAI_VOICES:  # an OpenAI voice name keeps Parley's voice (clients send one by default)
            raise RealtimeError(
                "invalid_value", f"no voice {value[:60]!r}; voices: {voices}", "session.audio.output.voice"
            )

    def _turn_detection(self, value: Any, current: TurnDetection | None) -> TurnDetection | None:
        param = "session.audio.input.turn_detection"
        if value is None or value is False:  # pipecat writes "turn detection off" as false
            return None
        if not isinstance(value, dict):
            raise RealtimeError("invalid_type", f"'{param}' must be an object or null", param)
        kind = value.get("type", "server_vad")
        if kind not in ("server_vad", "semantic_vad"):
            raise RealtimeError(
                "invalid_value", "turn_detection.type must be server_vad or semantic_vad", f"{param}.type"
            )
        if value.get("create_response") is False:
            raise _unsupported(f"{param}.create_response", "create_response false (Parley answers each detected turn)")
        if value.get("idle_timeout_ms") is not None:
            raise _unsupported(f"{param}.idle_timeout_ms", "idle_timeout_ms")
        base = current or TurnDetection(
            threshold=self.settings.vad_threshold, silence_duration_ms=self.settings.endpoint_silence_ms
        )
        detection = replace(base, type=kind)
        threshold = _field(value, "threshold", (int, float), f"{param}.threshold")
        if threshold is not None:
            if not 0.0 < threshold < 1.0:
                raise RealtimeError("invalid_value", "threshold must be between 0 and 1", f"{param}.threshold")
            detection.threshold = float(threshold)
        silence = _field(value, "silence_duration_ms", int, f"{param}.silence_duration_ms")
        if silence is not None:
            if not 100 <= silence <= 3000:
                raise RealtimeError(
                    "invalid_value", "silence_duration_ms must be 100..3000", f"{param}.silence_duration_ms"
                )
            detection.silence_duration_ms = silence
        padding = _field(value, "prefix_padding_ms", int, f"{param}.prefix_padding_ms")
        if padding is not None:
            detection.prefix_padding_ms = padding  # echoed only: Parley keeps its own 300 ms pre-roll
        interrupt = _field(value, "interrupt_response", bool, f"{param}.interrupt_response")
        if interrupt is not None:
            detection.interrupt_response = interrupt
        eagerness = value.get("eagerness")
        if kind == "semantic_vad":
            if eagerness not in (None, "auto", "low", "medium", "high"):
                raise RealtimeError(
                    "invalid_value", "eagerness must be low, medium, high or auto", f"{param}.eagerness"
                )
            detection.eagerness = eagerness or "auto"
        return detection

    async def _apply_turn_detection(self, before: TurnDetection | None, after: TurnDetection | None) -> None:
        """Per-session VAD and endpoint settings; the session rebuilds its VAD when they change."""
        session = self.session
        if session is None:
            return
        if after is None:
            updates = {}
        elif after.type == "semantic_vad":
            silence, unfinished = EAGERNESS_MS.get(
                after.eagerness, (self.settings.endpoint_silence_ms, self.settings.endpoint_unfinished_silence_ms)
            )
            updates = {"endpoint_silence_ms": silence, "endpoint_unfinished_silence_ms": unfinished}
        else:
            updates = {
                "vad_threshold": after.threshold,
                "endpoint_silence_ms": after.silence_duration_ms,
                "endpoint_unfinished_silence_ms": max(
                    after.silence_duration_ms, self.settings.endpoint_unfinished_silence_ms
                ),
            }
        changed = {k: v for k, v in updates.items() if getattr(session.settings, k) != v}
        mode_changed = (before is None) != (after is None)
        if changed:
            session.settings = session.settings.model_copy(update=changed)
        if changed or mode_changed:
            await self._drop_input()

    async def _drop_input(self) -> None:
        """Forget the utterance in progress and the manual buffer; a ``start`` rebuilds the session's VAD."""
        self._manual, self._manual_samples = [], 0
        self._input = StreamResampler(REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
        async with self._lock:
            self._speech = None
            self._cancel_drop_timer()
        await self._parley({"type": "start", "sample_rate": protocol.INPUT_SAMPLE_RATE})

    # ------------------------------------------------------------------ audio
    async def _append(self, event: dict) -> None:
        audio = _field(event, "audio", str, "audio", required=True)
        if len(audio) > MAX_APPEND_BASE64_CHARS:
            raise RealtimeError(
                "audio_too_large",
                f"one append may carry at most {MAX_APPEND_AUDIO_BYTES // (REALTIME_SAMPLE_RATE * 2)} s of audio",
                "audio",
            )
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("invalid_audio", "audio is not valid base64", "audio") from None
        if len(data) % 2:
            raise RealtimeError("invalid_audio", "audio must hold whole PCM16 samples (an even byte count)", "audio")
        if not data:
            return
        seconds = len(data) / 2 / REALTIME_SAMPLE_RATE
        if not self._budget.admit(seconds):
            if self._on_rate_limited is not None:
                self._on_rate_limited(seconds)
            if self._warn_rate():
                raise RealtimeError(
                    "rate_limited",
                    f"audio arrives faster than {self.settings.max_audio_rate:g}x real time; dropped",
                    "audio",
                )
            return
        samples = pcm16_to_float(data)
        if self.config.turn_detection is None:
            limit = int(self.settings.max_utterance_s * REALTIME_SAMPLE_RATE)
            if self._manual_samples + len(samples) > limit:
                if self._warn_full():
                    raise RealtimeError(
                        "input_audio_buffer_full",
                        f"the input buffer holds at most {self.settings.max_utterance_s:g} s; commit or clear it",
                        "audio",
                    )
                return
            self._manual.append(samples)
            self._manual_samples += len(samples)
            self._input_ms += seconds * 1000
            return
        self._input_ms += seconds * 1000
        if self.session is not None:
            await self.session.feed_audio(self._input(samples))

    async def _commit(self, event: dict) -> None:
        if self.config.turn_detection is not None:
            raise RealtimeError(
                "input_audio_buffer_commit_unsupported",
                "with turn_detection on, the server commits turns itself; set turn_detection to null to commit",
            )
        if self._manual_samples < MIN_COMMIT_MS * REALTIME_SAMPLE_RATE // 1000:
            raise RealtimeError(
                "input_audio_buffer_commit_empty",
                f"buffer too small: {self._manual_samples / REALTIME_SAMPLE_RATE * 1000:.0f} ms of audio; "
                f"at least {MIN_COMMIT_MS} ms are needed",
            )
        if len(self._pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        audio = np.concatenate(self._manual)
        self._manual, self._manual_samples = [], 0
        item_id = _new_id("item")
        async with self._lock:
            previous, self._last_item_id = self._last_item_id, item_id
            payload = _message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "in_progress")
            item = _Item(payload, "user", pending=True)
            self._remember(item)
            await self._emit({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
            await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
        item.transcription = self._spawn(self._transcribe(item, audio, previous))

    async def _transcribe(self, item: _Item, audio: np.ndarray, previous: str | None) -> None:
        item_id = item.payload["id"]
        try:
            audio16 = resample(audio, REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
            asr = self.models.asr
            kwargs = {}
            if "language" in inspect.signature(asr.transcribe).parameters:
                kwargs["language"] = self.config.language
            result = await asyncio.to_thread(lambda: asr.transcribe(audio16, **kwargs))
            text = result.text.strip() if result is not None else ""
        except Exception as exc:
            log.exception("manual turn: transcription failed")
            async with self._lock:
                await self._emit(
                    {
                        "type": "conversation.item.input_audio_transcription.failed",
                        "item_id": item_id,
                        "content_index": 0,
                        "error": {"type": "server_error", "code": "transcription_failed", "message": str(exc)[:200]},
                    }
                )
            return
        async with self._lock:
            item.text = text
            item.payload = _message_item(item_id, "user", [{"type": "input_audio", "transcript": text}])
            if self.config.transcription:
                await self._emit(
                    {
                        "type": "conversation.item.input_audio_transcription.completed",
                        "item_id": item_id,
                        "content_index": 0,
                        "transcript": text,
                        "usage": {"type": "duration", "seconds": round(len(audio) / REALTIME_SAMPLE_RATE, 3)},
                    }
                )
            await self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item.payload})

    async def _clear(self, event: dict) -> None:
        if self.config.turn_detection is None:
            self._manual, self._manual_samples = [], 0
        else:
            await self._drop_input()
        async with self._lock:
            await self._emit({"type": "input_audio_buffer.cleared"})

    # ------------------------------------------------------------------ items
    async def _item_create(self, event: dict) -> None:
        item = _field(event, "item", dict, "item", required=True)
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            raise _unsupported("item.type", "function calling (function_call items)")
        if kind != "message":
            raise RealtimeError("invalid_value", f"unsupported item type {str(kind)[:40]!r}", "item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError("invalid_value", "item.role must be user, assistant or system", "item.role")
        content = _field(item, "content", list, "item.content", required=True)
        if len(content) > MAX_CONTENT_PARTS:
            raise RealtimeError("array_above_max_length", f"at most {MAX_CONTENT_PARTS} content parts", "item.content")
        texts = []
        for index, part in enumerate(content):
            param = f"item.content[{index}]"
            if not isinstance(part, dict):
                raise RealtimeError("invalid_type", f"'{param}' must be an object", param)
            part_type = part.get("type")
            if part_type in ("input_text", "output_text", "text"):
                texts.append(_text(part, "text", f"{param}.text", protocol.MAX_USER_TEXT_CHARS, required=True))
            elif part_type in ("input_audio", "output_audio", "audio") and isinstance(part.get("transcript"), str):
                texts.append(_text(part, "transcript", f"{param}.transcript", protocol.MAX_USER_TEXT_CHARS))
            elif part_type in ("input_audio", "output_audio", "audio"):
                raise _unsupported(
                    f"{param}.audio", "audio in conversation.item.create (send it with input_audio_buffer.append)"
                )
            else:
                raise _unsupported(f"{param}.type", f"content of type {str(part_type)[:40]!r}")
        text = "\n".join(t.strip() for t in texts if t and t.strip())
        if not text:
            raise RealtimeError("invalid_value", "the item has no text", "item.content")
        if len(text) > protocol.MAX_USER_TEXT_CHARS:
            raise RealtimeError(
                "string_above_max_length", f"at most {protocol.MAX_USER_TEXT_CHARS} characters", "item.content"
            )
        item_id = _client_id(item, "id", "item.id") or _new_id("item")
        if item_id in self._items:
            raise RealtimeError("duplicate_item_id", f"an item with id {item_id!r} exists", "item.id")
        if role == "system":
            instructions = f"{self.config.instructions}\n\n{text}".strip()
            if len(instructions) > protocol.MAX_SYSTEM_PROMPT_CHARS:
                raise RealtimeError(
                    "string_above_max_length",
                    f"system items are added to the instructions, which hold {protocol.MAX_SYSTEM_PROMPT_CHARS} "
                    "characters at most",
                    "item.content",
                )
            self.config.instructions = instructions
            await self._parley({"type": "config", "system_prompt": instructions})
        elif len(self._pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        content_out = (
            [{"type": "output_text", "text": text}] if role == "assistant" else [{"type": "input_text", "text": text}]
        )
        payload = _message_item(item_id, role, content_out)
        async with self._lock:
            previous, self._last_item_id = self._last_item_id, item_id
            self._remember(_Item(payload, role, text, pending=role != "system"))
            await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
            await self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": payload})

    def _pending_into_history(self) -> None:
        """Client items not answered yet join the session's history as they are (user and assistant messages)."""
        for item in self._pending():
            item.pending = False
            if item.text and self.session is not None:
                self.session.history.append({"role": item.role, "content": item.text})

    async def _item_truncate(self, event: dict) -> None:
        item_id = _text(event, "item_id", "item_id", MAX_ID_CHARS, required=True)
        _field(event, "content_index", int, "content_index")
        end_ms = _field(event, "audio_end_ms", int, "audio_end_ms", required=True)
        if end_ms < 0:
            raise RealtimeError("invalid_value", "audio_end_ms must be >= 0", "audio_end_ms")
        item = self._items.get(item_id)
        if item is None or item.role != "assistant":
            raise RealtimeError(
                "item_truncate_invalid_item_id", f"no assistant item {item_id!r} with audio to truncate", "item_id"
            )
        played_ms = min(end_ms, int(item.audio_ms))
        if item.turn_id is not None:
            # where the client's playback stands; a later barge-in or cancel keeps only what was heard
            await self._parley({"type": "playback", "turn_id": item.turn_id, "played_ms": played_ms})
        async with self._lock:
            await self._emit(
                {
                    "type": "conversation.item.truncated",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": played_ms,
                }
            )

    async def _item_delete(self, event: dict) -> None:
        item_id = _text(event, "item_id", "item_id", MAX_ID_CHARS, required=True)
        item = self._items.get(item_id)
        if item is None:
            raise RealtimeError("item_delete_invalid_item_id", f"no item {item_id!r}", "item_id")
        if not item.pending:
            raise _unsupported("item_id", "deleting an item that was answered (Parley keeps the answered history)")
        if item.transcription is not None:
            item.transcription.cancel()
        del self._items[item_id]
        async with self._lock:
            await self._emit({"type": "conversation.item.deleted", "item_id": item_id})

    async def _item_retrieve(self, event: dict) -> None:
        item_id = _text(event, "item_id", "item_id", MAX_ID_CHARS, required=True)
        item = self._items.get(item_id)
        if item is None:
            raise RealtimeError("item_retrieve_invalid_item_id", f"no item {item_id!r}", "item_id")
        async with self._lock:
            await self._emit({"type": "conversation.item.retrieved", "item": item.payload})

    # ------------------------------------------------------------------ responses
    def _response_params(self, event: dict) -> _ResponseParams:
        spec = _field(event, "response", dict, "response") or {}
        errors = _check_tools(spec, "response")
        if errors:
            raise errors[0]
        if spec.get("conversation") not in (None, "auto"):
            raise _unsupported("response.conversation", "responses outside the conversation (conversation 'none')")
        if spec.get("input") is not None:
            raise _unsupported("response.input", "a custom response input")
        audio = spec.get("audio") or {}
        if isinstance(audio, dict) and isinstance(audio.get("output"), dict):
            _check_format(audio["output"].get("format"), "response.audio.output.format")
        metadata = _field(spec, "metadata", dict, "response.metadata")
        if metadata is not None:
            if len(metadata) > MAX_METADATA_KEYS or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= MAX_METADATA_CHARS
                for k, v in metadata.items()
            ):
                raise RealtimeError(
                    "invalid_value",
                    f"metadata holds at most {MAX_METADATA_KEYS} string pairs (values up to {MAX_METADATA_CHARS})",
                    "response.metadata",
                )
        return _ResponseParams(
            modality=_modality(spec.get("output_modalities"), "response.output_modalities"),
            metadata=metadata,
            instructions=_text(spec, "instructions", "response.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS),
        )

    async def _response_create(self, event: dict) -> None:
        if self._response is not None or self._typed is not None:
            raise RealtimeError(
                "conversation_already_has_active_response",
                "a response is in progress; cancel it or wait for response.done",
            )
        params = self._response_params(event)
        pending = self._pending()
        for item in pending:  # manual commits still being transcribed
            if item.transcription is not None and not item.transcription.done():
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(item.transcription), TRANSCRIBE_TIMEOUT_S)
        pending = self._pending()
        turn: list[_Item] = []
        while pending and pending[-1].role == "user":
            turn.insert(0, pending.pop())
        for item in turn:
            item.pending = False  # answered now, as this turn
        self._pending_into_history()  # what came before it joins the history as it is
        text = "\n".join(item.text for item in turn if item.text)[: protocol.MAX_USER_TEXT_CHARS]
        if not text:
            # Parley answers a user's message; it has no turn of its own to take
            async with self._lock:
                response = _Response(
                    _new_id("resp"), -1, params.modality or self.config.modality, params.metadata, self.config.voice
                )
                await self._emit({"type": "response.created", "response": response.payload("in_progress")})
                error = {
                    "type": "invalid_request_error",
                    "code": "no_user_message",
                    "message": "nothing to answer: add a user item (conversation.item.create or a commit) first",
                }
                await self._finish(response, "failed", "", error)
            return
        if params.instructions:
            await self._parley({"type": "config", "system_prompt": params.instructions})
        self._typed = params
        try:
            await self._parley({"type": "text", "text": text})
        finally:
            self._typed = None
            if params.instructions:
                await self._parley({"type": "config", "system_prompt": self.config.instructions})

    async def _response_cancel(self, event: dict) -> None:
        response_id = _client_id(event, "response_id", "response_id")
        response = self._response
        if response is None or (response_id is not None and response_id != response.id):
            if response_id is None and self.session is not None and self.session.busy:
                await self._parley({"type": "cancel"})  # the last reply still plays (by Parley's estimate): stop it
                return
            raise RealtimeError("response_cancel_not_active", "there is no active response to cancel", "response_id")
        response.cancel_reason = "client_cancelled"
        await self._parley({"type": "cancel"})
        async with self._lock:
            if self._response is response:  # the session had nothing left to stop: close it here
                await self._finish(response, "cancelled", "".join(response.text_parts).strip())

    async def _output_clear(self, event: dict) -> None:
        raise _unsupported(
            "type",
            "output_audio_buffer.clear (WebRTC/SIP only; over WebSocket, stop playback and send response.cancel)",
        )


_SESSION_KEYS = frozenset(
    {"type", "instructions", "output_modalities", "audio", "include", "tools", "tool_choice", "prompt"}
    | _IGNORED_SESSION_KEYS
)


# ---------------------------------------------------------------- the WebSocket
def _realtime_error_json(code: str, message: str, kind: str = "invalid_request_error") -> str:
    return json.dumps(
        {
            "type": "error",
            "event_id": _new_id("event"),
            "error": {"type": kind, "code": code, "message": message, "param": None, "event_id": None},
        }
    )


async def serve_realtime(websocket: WebSocket, state: State, settings: Settings) -> None:
    """One Realtime API connection: admitted, limited and closed like ``/ws`` (``app.server.ws``)."""
    access = state.access
    headers = websocket.headers
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if not access.origin_allowed(headers.get("origin"), headers.get("host")):
        log.warning("refused /v1/realtime from origin %r (allowed_origins)", headers.get("origin"))
        await websocket.close(code=CLOSE_POLICY, reason="origin not allowed")
        return
    keys = [
        KEY_SUBPROTOCOL_PREFIX + p[len(OPENAI_KEY_SUBPROTOCOL_PREFIX) :]
        for p in offered
        if p.startswith(OPENAI_KEY_SUBPROTOCOL_PREFIX)
    ]
    if not access.key_ok(headers, websocket.query_params, [*offered, *keys]):
        await websocket.close(code=CLOSE_POLICY, reason="api key required")
        return
    await websocket.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
    if websocket.query_params.get("intent") == "transcription":
        await websocket.send_text(
            _realtime_error_json("unsupported_intent", "transcription sessions are not supported by this server")
        )
        await websocket.close(code=CLOSE_POLICY)
        return
    refusal = state.admission.refuse_reason(len(state.sessions))
    if refusal is not None:
        await websocket.send_text(_realtime_error_json(refusal.code, refusal.message, "server_error"))
        await websocket.close(code=CLOSE_OVERLOADED)
        return

    send_lock = asyncio.Lock()
    evicted = asyncio.Event()

    async def send(event: dict[str, Any]) -> None:
        if websocket.client_state != WebSocketState.CONNECTED or evicted.is_set():
            return
        text = json.dumps(event, separators=(",", ":"))
        async with send_lock:
            try:
                async with asyncio.timeout(settings.send_timeout_s):
                    await websocket.send_text(text)
            except TimeoutError:
                evicted.set()
            except (WebSocketDisconnect, RuntimeError):
                pass

    model = (websocket.query_params.get("model") or "parley")[:MAX_ID_CHARS]
    session_settings = settings.model_copy()  # per connection: session.update may change its turn-taking
    adapter = RealtimeAdapter(
        send, session_settings, state.models, model=model, on_rate_limited=state.metrics.rate_limited.inc
    )
    session = VoiceSession(state.models, session_settings, adapter.on_parley, adapter.on_parley_audio)
    adapter.attach(session)
    session.on_turn_metrics = state.metrics.observe_turn
    state.sessions.add(session)
    close_code, close_reason = 1000, ""
    receiving = asyncio.create_task(_receive(websocket, adapter, session, settings), name="realtime-receive")
    watching = asyncio.create_task(evicted.wait(), name="realtime-evicted")
    try:
        await session.start()
        await adapter.start()
        await asyncio.wait({receiving, watching}, return_when=asyncio.FIRST_COMPLETED)
        if evicted.is_set():
            state.metrics.evictions.labels(reason="not_reading").inc()
            close_code, close_reason = CLOSE_NOT_READING, f"client read nothing for {settings.send_timeout_s:g} s"
            log.warning("realtime session %s: %s; closing it", session.session_id, close_reason)
        else:
            close_code, close_reason = receiving.result()
            if close_code == CLOSE_IDLE:
                state.metrics.evictions.labels(reason="idle").inc()
    except Exception:
        log.exception("realtime session %s failed", session.session_id)
        with contextlib.suppress(Exception):
            await send(json.loads(_realtime_error_json("internal", "internal server error", "server_error")))
        close_code = 1011
    finally:
        for task in (receiving, watching):
            task.cancel()
        state.sessions.discard(session)
        await adapter.close()
        await session.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await websocket.close(code=close_code, reason=close_reason)


async def _receive(
    websocket: WebSocket, adapter: RealtimeAdapter, session: VoiceSession, settings: Settings
) -> tuple[int, str]:
    """Client frames to the adapter until the client leaves or idles out; returns the close code and reason."""
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
        if message.get("text") is not None:
            await adapter.handle_client(message["text"])
        elif message.get("bytes") is not None:
            await adapter.handle_binary()
