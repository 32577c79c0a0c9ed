"""Realtime client events -> the conversation: the half of the adapter that listens to the client.

Each event is validated first (``schema``: the ``openai`` package's models); the handlers read
typed values and check what the SDK does not: Parley's bounds (ids, texts, audio sizes, item
counts) and what it refuses (tools, formats other than 24 kHz PCM, function-call items...).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from openai.types.realtime import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
    InputAudioBufferAppendEvent,
    RealtimeAudioConfigOutput,
    RealtimeResponseCreateParams,
    ResponseCancelEvent,
    ResponseCreateEvent,
)
from openai.types.realtime.audio_transcription import AudioTranscription
from openai.types.realtime.realtime_audio_input_turn_detection import SemanticVad, ServerVad
from pydantic import BaseModel

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float, resample
from app.server.realtime.core import (
    EAGERNESS_MS,
    MAX_APPEND_AUDIO_BYTES,
    MAX_APPEND_BASE64_CHARS,
    MAX_CONTENT_PARTS,
    MAX_ID_CHARS,
    MAX_METADATA_CHARS,
    MAX_METADATA_KEYS,
    MAX_PENDING_ITEMS,
    MIN_COMMIT_MS,
    OPENAI_VOICES,
    REALTIME_SAMPLE_RATE,
    TRANSCRIBE_TIMEOUT_S,
    Item,
    RealtimeConfig,
    RealtimeError,
    Response,
    ResponseParams,
    TurnDetection,
    message_item,
    new_id,
    unsupported,
)
from app.server.realtime.schema import (
    FUNCTION_ITEM_TYPES,
    AudioConfig,
    AudioInput,
    ItemTruncate,
    RealtimeSession,
    SessionUpdate,
    bounded,
    check_format,
    event_id,
    load_event,
    tool_refusals,
    validate_event,
)
from app.server.realtime.translate import Translator
from app.voice.clock import run_in_thread
from app.voice.text import without_trailing_loop

log = logging.getLogger(__name__)

_READ_ONLY_SESSION_KEYS = frozenset({"object", "id", "expires_at", "client_secret"})  # echoes of session.created
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


def _modality(value: list[str] | None, param: str) -> str | None:
    if value is None:
        return None
    if not value:
        raise RealtimeError("invalid_value", f"'{param}' must be ['audio'] or ['text']", param)
    return "audio" if "audio" in value else "text"  # ["audio", "text"] is the beta default: audio + transcript


def _collect(errors: list[RealtimeError], apply: Callable[..., None], *args: Any) -> None:
    """``apply(*args)``; its error joins ``errors`` (the rest of a session.update still applies)."""
    try:
        apply(*args)
    except RealtimeError as error:
        errors.append(error)


# ---------------------------------------------------------------- the adapter
class RealtimeAdapter(Translator):
    """Translates one Realtime connection to and from one ``VoiceSession``.

    ``on_parley`` / ``on_parley_audio`` are the session's ``send_json`` / ``send_bytes``;
    ``handle_client`` takes the client's text frames. The session is attached after both exist.
    """

    _HANDLERS = {
        "session.update": "_session_update",
        "input_audio_buffer.append": "_append",
        "input_audio_buffer.commit": "_commit",
        "input_audio_buffer.clear": "_clear",
        "conversation.item.create": "_item_create",
        "conversation.item.truncate": "_item_truncate",
        "conversation.item.delete": "_item_delete",
        "conversation.item.retrieve": "_item_retrieve",
        "response.create": "_response_create",
        "response.cancel": "_response_cancel",
        "output_audio_buffer.clear": "_output_clear",
    }

    async def handle_client(self, raw: str) -> None:
        """One text frame from the client; every problem is answered with an ``error`` event."""
        self._client_event_id = None
        try:
            data = load_event(raw)
            self._client_event_id = event_id(data)
            event = validate_event(data)
            handler = self._HANDLERS.get(data["type"])
            if handler is None:  # a client event of a newer SDK than this server
                raise unsupported("type", f"the client event {data['type'][:60]!r}")
            await getattr(self, handler)(event)
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

    # ------------------------------------------------------------------ session.update
    async def _session_update(self, event: SessionUpdate) -> None:
        session = event.session
        if not isinstance(session, RealtimeSession):
            raise RealtimeError("unsupported_session_type", "transcription sessions are not supported", "session.type")
        config = replace(self.config)
        parley: dict[str, Any] = {}
        errors = tool_refusals("session", session.tools, session.tool_choice, session.prompt)
        for key in session.model_extra or {}:
            if key in _BETA_HINTS:
                errors.append(
                    RealtimeError(
                        "unknown_parameter",
                        f"unknown parameter 'session.{key}': this server speaks the GA Realtime API "
                        f"(use {_BETA_HINTS[key]})",
                        f"session.{key}",
                    )
                )
            elif key not in _READ_ONLY_SESSION_KEYS:
                errors.append(
                    RealtimeError("unknown_parameter", f"unknown parameter 'session.{key}'", f"session.{key[:60]}")
                )
        if session.model is not None:
            config.model = session.model[:MAX_ID_CHARS]
        _collect(errors, self._apply_instructions, session.instructions, config, parley)
        _collect(errors, self._apply_modality, session.output_modalities, config)
        if session.include is not None:
            config.include = frozenset(v for v in session.include if v.startswith("parley."))
        audio = session.audio or AudioConfig()
        audio_in, audio_out = audio.input or AudioInput(), audio.output or RealtimeAudioConfigOutput()
        _collect(errors, check_format, audio_in.format, "session.audio.input.format")
        _collect(errors, check_format, audio_out.format, "session.audio.output.format")
        if "transcription" in audio_in.model_fields_set:
            _collect(errors, self._apply_transcription, audio_in.transcription, config, parley)
        _collect(errors, self._apply_voice, audio_out.voice, config, parley)
        if audio_out.speed is not None and abs(audio_out.speed - 1.0) > 1e-6:
            errors.append(unsupported("session.audio.output.speed", "a speed other than 1.0"))
        turn_change = False
        if "turn_detection" in audio_in.model_fields_set:
            try:
                config.turn_detection = self._turn_detection(audio_in.turn_detection, config.turn_detection)
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
            await self._parley(protocol.SessionConfig(**parley))
        if turn_change:
            await self._apply_turn_detection(previous.turn_detection, config.turn_detection)
        async with self._lock:
            await self._emit({"type": "session.updated", "session": self._session_json()})

    def _apply_instructions(self, text: str | None, config: RealtimeConfig, parley: dict) -> None:
        if bounded(text, "session.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS) is not None:
            config.instructions = text.strip() or self.settings.system_prompt  # "" restores the default
            parley["system_prompt"] = config.instructions

    def _apply_modality(self, modalities: list[str] | None, config: RealtimeConfig) -> None:
        config.modality = _modality(modalities, "session.output_modalities") or config.modality

    def _apply_transcription(self, value: AudioTranscription | None, config: RealtimeConfig, parley: dict) -> None:
        config.transcription = value is not None
        if value is None:
            return
        if value.model:
            config.transcription_model = value.model[:MAX_ID_CHARS]  # echoed; Parley's own Whisper transcribes
        language = bounded(value.language, "session.audio.input.transcription.language", 16)
        if language is not None:
            languages = list(self.models.asr.languages)
            if language not in languages:
                raise RealtimeError(
                    "invalid_value",
                    f"the speech model does not take language {language!r}; it takes {languages}",
                    "session.audio.input.transcription.language",
                )
            config.language = parley["language"] = language

    def _apply_voice(self, voice: str | BaseModel | None, config: RealtimeConfig, parley: dict) -> None:
        if voice is None:
            return
        value = voice if isinstance(voice, str) else voice.id  # a string or {"id": ...}
        voices = list(self.models.tts.voices)
        if value in voices:
            config.voice = parley["voice"] = value
        elif value not in OPENAI_VOICES:  # an OpenAI voice name keeps Parley's voice (clients send one by default)
            raise RealtimeError(
                "invalid_value", f"no voice {value[:60]!r}; voices: {voices}", "session.audio.output.voice"
            )

    def _turn_detection(
        self, value: ServerVad | SemanticVad | bool | None, current: TurnDetection | None
    ) -> TurnDetection | None:
        param = "session.audio.input.turn_detection"
        if value is None or value is False:  # pipecat writes "turn detection off" as false
            return None
        if value.create_response is False:
            raise unsupported(f"{param}.create_response", "create_response false (Parley answers each detected turn)")
        if getattr(value, "idle_timeout_ms", None) is not None:
            raise unsupported(f"{param}.idle_timeout_ms", "idle_timeout_ms")
        base = current or TurnDetection(
            threshold=self.settings.vad_threshold, silence_duration_ms=self.settings.endpoint_silence_ms
        )
        detection = replace(base, type=value.type)
        if isinstance(value, ServerVad):
            if value.threshold is not None:
                if not 0.0 < value.threshold < 1.0:
                    raise RealtimeError("invalid_value", "threshold must be between 0 and 1", f"{param}.threshold")
                detection.threshold = value.threshold
            if value.silence_duration_ms is not None:
                if not 100 <= value.silence_duration_ms <= 3000:
                    raise RealtimeError(
                        "invalid_value", "silence_duration_ms must be 100..3000", f"{param}.silence_duration_ms"
                    )
                detection.silence_duration_ms = value.silence_duration_ms
            if value.prefix_padding_ms is not None:
                detection.prefix_padding_ms = value.prefix_padding_ms  # echoed only: Parley keeps 300 ms of pre-roll
        else:
            detection.eagerness = value.eagerness or "auto"
        if value.interrupt_response is not None:
            detection.interrupt_response = value.interrupt_response
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
        if changed or mode_changed:
            await self._drop_input(changed)

    async def _drop_input(self, tuned: dict[str, float] | None = None) -> None:
        """Forget the utterance in progress and the manual buffer; the session rebuilds its VAD (with ``tuned``)."""
        self._manual, self._manual_samples = [], 0
        self._input = StreamResampler(REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
        async with self._lock:
            self._speech = None
            self._cancel_drop_timer()
        if self.session is not None:
            await self.session.tune(**(tuned or {}))

    # ------------------------------------------------------------------ audio
    async def _append(self, event: InputAudioBufferAppendEvent) -> None:
        audio = event.audio
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
        admitted, warning = self._rate.admit(seconds)
        if not admitted:
            if warning is not None:
                raise RealtimeError("rate_limited", warning, "audio")
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

    async def _commit(self, event: BaseModel) -> None:
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
        item_id = new_id("item")
        async with self._lock:
            previous, self._last_item_id = self._last_item_id, item_id
            payload = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "in_progress")
            item = Item(payload, "user", pending=True)
            self._remember(item)
            await self._emit({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
            await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
        item.transcription = self._spawn(self._transcribe(item, audio, previous))

    async def _transcribe(self, item: Item, audio: np.ndarray, previous: str | None) -> None:
        item_id = item.payload["id"]
        try:
            audio16 = resample(audio, REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
            asr = self.models.asr
            kwargs = {}
            if "language" in inspect.signature(asr.transcribe).parameters:
                kwargs["language"] = self.config.language
            result = await run_in_thread(lambda: asr.transcribe(audio16, **kwargs))
            text = (
                without_trailing_loop(result.text.strip(), len(audio16) / ASR_SAMPLE_RATE) if result is not None else ""
            )
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
            item.payload = message_item(item_id, "user", [{"type": "input_audio", "transcript": text}])
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

    async def _clear(self, event: BaseModel) -> None:
        if self.config.turn_detection is None:
            self._manual, self._manual_samples = [], 0
        else:
            await self._drop_input()
        async with self._lock:
            await self._emit({"type": "input_audio_buffer.cleared"})

    # ------------------------------------------------------------------ items
    async def _item_create(self, event: ConversationItemCreateEvent) -> None:
        item = event.item
        if item.type in FUNCTION_ITEM_TYPES:
            raise unsupported("item.type", "function calling (function_call items)")
        if item.type != "message":
            raise RealtimeError("invalid_value", f"unsupported item type {item.type[:40]!r}", "item.type")
        role = item.role
        if len(item.content) > MAX_CONTENT_PARTS:
            raise RealtimeError("array_above_max_length", f"at most {MAX_CONTENT_PARTS} content parts", "item.content")
        texts = []
        for index, part in enumerate(item.content):
            param = f"item.content[{index}]"
            transcript = getattr(part, "transcript", None)  # system parts have none
            if part.type in ("input_text", "output_text"):
                if part.text is None:
                    raise RealtimeError(
                        "missing_required_parameter", f"missing required parameter: '{param}.text'", f"{param}.text"
                    )
                texts.append(bounded(part.text, f"{param}.text", protocol.MAX_USER_TEXT_CHARS))
            elif part.type in ("input_audio", "output_audio") and transcript is not None:
                texts.append(bounded(transcript, f"{param}.transcript", protocol.MAX_USER_TEXT_CHARS))
            elif part.type in ("input_audio", "output_audio"):
                raise unsupported(
                    f"{param}.audio", "audio in conversation.item.create (send it with input_audio_buffer.append)"
                )
            else:
                raise unsupported(f"{param}.type", f"content of type {str(part.type)[:40]!r}")
        text = "\n".join(t.strip() for t in texts if t and t.strip())
        if not text:
            raise RealtimeError("invalid_value", "the item has no text", "item.content")
        if len(text) > protocol.MAX_USER_TEXT_CHARS:
            raise RealtimeError(
                "string_above_max_length", f"at most {protocol.MAX_USER_TEXT_CHARS} characters", "item.content"
            )
        item_id = bounded(item.id, "item.id", MAX_ID_CHARS) or new_id("item")
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
            await self._parley(protocol.SessionConfig(system_prompt=instructions))
        elif len(self._pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        content_out = (
            [{"type": "output_text", "text": text}] if role == "assistant" else [{"type": "input_text", "text": text}]
        )
        payload = message_item(item_id, role, content_out)
        async with self._lock:
            previous, self._last_item_id = self._last_item_id, item_id
            self._remember(Item(payload, role, text, pending=role != "system"))
            await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
            await self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": payload})

    async def _item_truncate(self, event: ItemTruncate) -> None:
        item_id, end_ms = bounded(event.item_id, "item_id", MAX_ID_CHARS), event.audio_end_ms
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
            await self._parley(protocol.Playback(turn_id=item.turn_id, played_ms=played_ms))
        async with self._lock:
            await self._emit(
                {
                    "type": "conversation.item.truncated",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": played_ms,
                }
            )

    def _known_item(self, item_id: str, code: str) -> Item:
        item = self._items.get(bounded(item_id, "item_id", MAX_ID_CHARS))
        if item is None:
            raise RealtimeError(code, f"no item {item_id!r}", "item_id")
        return item

    async def _item_delete(self, event: ConversationItemDeleteEvent) -> None:
        item_id = event.item_id
        item = self._known_item(item_id, "item_delete_invalid_item_id")
        if not item.pending:
            raise unsupported("item_id", "deleting an item that was answered (Parley keeps the answered history)")
        if item.transcription is not None:
            item.transcription.cancel()
        del self._items[item_id]
        async with self._lock:
            await self._emit({"type": "conversation.item.deleted", "item_id": item_id})

    async def _item_retrieve(self, event: ConversationItemRetrieveEvent) -> None:
        item = self._known_item(event.item_id, "item_retrieve_invalid_item_id")
        async with self._lock:
            await self._emit({"type": "conversation.item.retrieved", "item": item.payload})

    # ------------------------------------------------------------------ responses
    def _response_params(self, event: ResponseCreateEvent) -> ResponseParams:
        spec = event.response or RealtimeResponseCreateParams()
        errors = tool_refusals("response", spec.tools, spec.tool_choice, spec.prompt)
        if errors:
            raise errors[0]
        if spec.conversation not in (None, "auto"):
            raise unsupported("response.conversation", "responses outside the conversation (conversation 'none')")
        if spec.input is not None:
            raise unsupported("response.input", "a custom response input")
        if spec.audio is not None and spec.audio.output is not None:
            check_format(spec.audio.output.format, "response.audio.output.format")
        metadata = spec.metadata
        if metadata is not None and (
            len(metadata) > MAX_METADATA_KEYS
            or any(len(k) > 64 or len(v) > MAX_METADATA_CHARS for k, v in metadata.items())
        ):
            raise RealtimeError(
                "invalid_value",
                f"metadata holds at most {MAX_METADATA_KEYS} string pairs (values up to {MAX_METADATA_CHARS})",
                "response.metadata",
            )
        return ResponseParams(
            modality=_modality(spec.output_modalities, "response.output_modalities"),
            metadata=metadata,
            instructions=bounded(spec.instructions, "response.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS),
        )

    async def _response_create(self, event: ResponseCreateEvent) -> None:
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
        turn: list[Item] = []
        while pending and pending[-1].role == "user":
            turn.insert(0, pending.pop())
        for item in turn:
            item.pending = False  # answered now, as this turn
        self._pending_into_history()  # what came before it joins the history as it is
        text = "\n".join(item.text for item in turn if item.text)[: protocol.MAX_USER_TEXT_CHARS]
        if not text:
            # Parley answers a user's message; it has no turn of its own to take
            async with self._lock:
                response = Response(
                    new_id("resp"), -1, params.modality or self.config.modality, params.metadata, self.config.voice
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
            await self._parley(protocol.SessionConfig(system_prompt=params.instructions))
        self._typed = params
        try:
            await self._parley(protocol.UserText(text=text))
        finally:
            self._typed = None
            if params.instructions:
                await self._parley(protocol.SessionConfig(system_prompt=self.config.instructions))

    async def _response_cancel(self, event: ResponseCancelEvent) -> None:
        response_id = bounded(event.response_id, "response_id", MAX_ID_CHARS) or None
        response = self._response
        if response is None or (response_id is not None and response_id != response.id):
            if response_id is None and self.session is not None and self.session.busy:
                await self._parley(protocol.Cancel())  # the last reply still plays (by Parley's estimate): stop it
                return
            raise RealtimeError("response_cancel_not_active", "there is no active response to cancel", "response_id")
        response.cancel_reason = "client_cancelled"
        await self._parley(protocol.Cancel())
        async with self._lock:
            if self._response is response:  # the session had nothing left to stop: close it here
                await self._finish(response, "cancelled", "".join(response.text_parts).strip())

    async def _output_clear(self, event: BaseModel) -> None:
        raise unsupported(
            "type",
            "output_audio_buffer.clear (WebRTC/SIP only; over WebSocket, stop playback and send response.cancel)",
        )
