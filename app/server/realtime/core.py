"""What the two halves of the Realtime adapter share: the API's bounds, its errors, the session's
configuration, the conversation as the client knows it, and the adapter's state and sending."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler
from app.config import Settings
from app.server.connection import AudioRateLimit
from app.server.limits import Every
from app.voice.session import VoiceSession

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


class RealtimeError(Exception):
    """A client event that cannot be served; becomes an ``error`` event and the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind


def unsupported(param: str, what: str) -> RealtimeError:
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
class Speech:
    """The user's utterance in progress (server VAD), as the client sees it."""

    item_id: str
    start_ms: int
    announced: bool = False  # speech_started sent
    partial: str = ""  # transcript sent as deltas so far


@dataclass
class Item:
    """An item as the client knows it; ``turn_id`` links an assistant item to Parley's reply."""

    payload: dict[str, Any]
    role: str
    text: str = ""
    turn_id: int | None = None
    audio_ms: float = 0.0
    pending: bool = False  # created by the client, not yet answered
    transcription: asyncio.Task | None = None  # a manual commit being transcribed


@dataclass
class ResponseParams:
    modality: str | None = None
    metadata: dict[str, str] | None = None
    instructions: str | None = None


@dataclass
class Response:
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
def zero_usage() -> dict[str, Any]:
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


def message_item(item_id: str, role: str, content: list[dict], status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# ---------------------------------------------------------------- the adapter's state
SendEvent = Callable[[dict[str, Any]], Awaitable[None]]


class AdapterCore:
    """The state of one Realtime connection and how events reach the client.

    ``Translator`` (Parley events -> server events) and ``RealtimeAdapter`` (client events ->
    the session) build on it; the adapter is the whole of it.
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
        self.session_id = new_id("sess")
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
        self._rate = AudioRateLimit(settings.max_audio_rate, on_rate_limited)
        self._warn_full = Every(1.0)
        self._drop_after_s = drop_after_s
        self._input = StreamResampler(REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
        self._input_ms = 0.0  # audio appended so far (the clock of audio_start_ms / audio_end_ms)
        self._manual: list[np.ndarray] = []  # 24 kHz float32, turn_detection null
        self._manual_samples = 0
        self._speech: Speech | None = None
        self._drop_task: asyncio.Task | None = None
        self._response: Response | None = None
        self._typed: ResponseParams | None = None  # a typed turn sent to the session, response not opened yet
        self._items: OrderedDict[str, Item] = OrderedDict()
        self._last_item_id: str | None = None
        self._client_event_id: str | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

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

    def _remember(self, item: Item) -> None:
        self._items[item.payload["id"]] = item
        self._items.move_to_end(item.payload["id"])
        while len(self._items) > ITEMS_KEPT:
            oldest = next(iter(self._items))
            if self._items[oldest].pending:
                break  # never forget what a response.create will need
            self._items.popitem(last=False)

    def _pending(self) -> list[Item]:
        return [item for item in self._items.values() if item.pending]

    def _pending_into_history(self) -> None:
        """Client items not answered yet join the session's history as they are (user and assistant messages)."""
        for item in self._pending():
            item.pending = False
            if item.text and self.session is not None:
                self.session.history.append({"role": item.role, "content": item.text})

    async def _parley(self, message: protocol.ClientMessageType) -> None:
        """A typed client message to the session (never while holding the lock: it answers through on_parley)."""
        if self.session is not None:
            await self.session.handle(message)
