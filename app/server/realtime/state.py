"""One Realtime connection's state, which the inbound and outbound halves share: the session's
configuration as the client set it, the conversation as the client knows it (items, the open
response, the speech held back), the input clock and manual buffer, and the event ids.

Plain data and the small operations on it; nothing here sends an event or calls the session.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler
from app.config import Settings
from app.server.realtime.core import ITEMS_KEPT, PCM_FORMAT, REALTIME_SAMPLE_RATE, new_id


# ---------------------------------------------------------------- session configuration
@dataclass
class TurnDetection:
    type: str = "server_vad"
    threshold: float = 0.5
    silence_duration_ms: int = 400
    prefix_padding_ms: int = 300
    interrupt_response: bool = True
    eagerness: str = "auto"

    @classmethod
    def default(cls, settings: Settings) -> TurnDetection:
        """Server VAD as the server's settings have it (a session's start, or turn detection switched back on)."""
        return cls(threshold=settings.vad_threshold, silence_duration_ms=settings.endpoint_silence_ms)

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
    tools: tuple[protocol.FunctionTool, ...] = ()
    tool_choice: protocol.ToolChoice = "auto"
    parallel_tool_calls: bool = False

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
            "tools": [tool.model_dump() for tool in self.tools],
            "tool_choice": tool_choice_json(self.tool_choice),
            "max_output_tokens": max_output_tokens,
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
            "expires_at": 0,
            "include": sorted(self.include) or None,
        }


def tool_choice_json(choice: protocol.ToolChoice) -> str | dict[str, Any]:
    return choice.model_dump() if isinstance(choice, protocol.NamedFunction) else choice


# ---------------------------------------------------------------- the conversation as the client knows it
@dataclass
class Speech:
    """The user's utterance in progress (server VAD), as the client sees it."""

    item_id: str
    start_ms: int
    announced: bool = False  # speech_started sent
    partial: str = ""  # transcript sent as deltas so far


@dataclass
class Item:
    """An item as the client knows it; ``turn_id`` links an assistant item to Parley's reply. ``message``: what the
    history gets of a function call or its output (a chat message with ``tool_calls``, a ``tool`` message)."""

    payload: dict[str, Any]
    role: str
    text: str = ""
    message: dict[str, Any] | None = None
    turn_id: int | None = None
    audio_ms: float = 0.0
    pending: bool = False  # created by the client, not yet answered
    transcription: asyncio.Task | None = None  # a manual commit being transcribed


@dataclass
class ResponseParams:
    modality: str | None = None
    metadata: dict[str, str] | None = None
    instructions: str | None = None
    tools: list[protocol.FunctionTool] | None = None  # this response's, over the session's
    tool_choice: protocol.ToolChoice | None = None

    def session_config(self) -> protocol.SessionConfig | None:
        """The session preferences this response overrides (None: none)."""
        changes = {"system_prompt": self.instructions or None, "tools": self.tools, "tool_choice": self.tool_choice}
        changes = {name: value for name, value in changes.items() if value is not None}
        return protocol.SessionConfig(**changes) if changes else None


@dataclass
class Response:
    id: str
    turn_id: int
    modality: str
    metadata: dict[str, str] | None
    voice: str
    item_id: str | None = None  # set once the output item is opened (first text or audio)
    text_parts: list[str] = field(default_factory=list)
    calls: list[protocol.CallTool] = field(default_factory=list)  # the client's calls, output after the message
    cancel_reason: str | None = None
    resampler: Any = None
    audio_bytes: int = 0

    def where(self) -> dict[str, Any]:
        """Where a delta or a done event of this response belongs (its one item, its one part)."""
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "text", "text": text} if self.modality == "text" else {"type": "audio", "transcript": text}

    def content(self, text: str) -> list[dict[str, Any]]:
        """The assistant item's content once the reply is done."""
        if self.modality == "text":
            return [{"type": "output_text", "text": text}]
        return [{"type": "output_audio", "transcript": text}]

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


def _input_resampler() -> StreamResampler:
    return StreamResampler(REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)


# ---------------------------------------------------------------- the connection's state
@dataclass(eq=False)
class RealtimeState:
    """Everything one Realtime connection remembers. ``lock`` keeps a change and the events that
    announce it together (the session answers from its own tasks while client events arrive)."""

    config: RealtimeConfig
    max_output_tokens: int
    session_id: str = field(default_factory=lambda: new_id("sess"))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    items: OrderedDict[str, Item] = field(default_factory=OrderedDict)
    last_item_id: str | None = None
    speech: Speech | None = None  # the utterance in progress (server VAD)
    response: Response | None = None  # the response open now
    last_turn_id: int = 0  # the newest Parley turn a response was opened for
    typed: ResponseParams | None = None  # a typed turn sent to the session, response not opened yet
    input: StreamResampler = field(default_factory=_input_resampler)  # 24 kHz -> the session's 16 kHz
    input_ms: float = 0.0  # audio appended so far (the clock of audio_start_ms / audio_end_ms)
    manual: list[np.ndarray] = field(default_factory=list)  # 24 kHz float32, turn_detection null
    manual_samples: int = 0
    client_event_id: str | None = None  # of the client event being handled: its errors carry it back
    _event_prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _event_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def new(cls, settings: Settings, models, model: str = "parley") -> RealtimeState:
        """A connection's start: Parley's prompt, first voice and language, and server VAD."""
        voices, languages = list(models.tts.voices), list(models.asr.languages)
        config = RealtimeConfig(
            model=model,
            instructions=settings.system_prompt,
            voice=voices[0] if voices else "default",
            language=languages[0] if languages else "en",
            turn_detection=TurnDetection.default(settings),
        )
        return cls(config=config, max_output_tokens=settings.llm_max_tokens)

    def next_event_id(self) -> str:
        return f"event_{self._event_prefix}{next(self._event_ids)}"

    def session_json(self) -> dict[str, Any]:
        return self.config.session_json(self.session_id, self.max_output_tokens)

    # ------------------------------------------------------------------ items
    def follow(self, item_id: str) -> str | None:
        """``item_id`` becomes the conversation's last item; returns the one before it (``previous_item_id``)."""
        previous, self.last_item_id = self.last_item_id, item_id
        return previous

    def remember(self, item: Item) -> None:
        self.items[item.payload["id"]] = item
        self.items.move_to_end(item.payload["id"])
        while len(self.items) > ITEMS_KEPT:
            oldest = next(iter(self.items))
            if self.items[oldest].pending:
                break  # never forget what a response.create will need
            self.items.popitem(last=False)

    def pending(self) -> list[Item]:
        return [item for item in self.items.values() if item.pending]

    def settle_pending(self, history: list | None) -> list[Item]:
        """Client items not answered yet stop waiting and join ``history`` (the session's) as they are; returns them."""
        settled = self.pending()
        for item in settled:
            item.pending = False
            if history is not None and (item.message or item.text):
                history.append(item.message or {"role": item.role, "content": item.text})
        return settled

    def current(self, turn_id: int) -> Response | None:
        """The open response, if it answers Parley's turn ``turn_id``."""
        response = self.response
        return response if response is not None and response.turn_id == turn_id else None

    # ------------------------------------------------------------------ input
    def add_manual(self, samples: np.ndarray) -> None:
        self.manual.append(samples)
        self.manual_samples += len(samples)

    def take_manual(self) -> np.ndarray:
        """The manual buffer's audio, emptying it (it must hold some)."""
        audio = np.concatenate(self.manual)
        self.clear_manual()
        return audio

    def clear_manual(self) -> None:
        self.manual, self.manual_samples = [], 0

    def reset_input(self) -> None:
        """Forget the manual buffer and what the input resampler holds (turn-taking changed)."""
        self.clear_manual()
        self.input = _input_resampler()
