"""Realtime client events -> the conversation: the half of the adapter that listens to the client."""

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

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float, resample
from app.server.realtime.core import (
    EAGERNESS_MS,
    MAX_APPEND_AUDIO_BYTES,
    MAX_APPEND_BASE64_CHARS,
    MAX_CONTENT_PARTS,
    MAX_EVENT_CHARS,
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
from app.server.realtime.translate import Translator

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- parsing helpers
def parse_client_event(raw: str) -> dict[str, Any]:
    """One client event: a JSON object with a string ``type`` (``protocol.load_json``: bounded depth and numbers)."""
    if len(raw) > MAX_EVENT_CHARS:
        raise RealtimeError("event_too_large", f"event over {MAX_EVENT_CHARS} characters")
    try:
        data = protocol.load_json(raw)
    except protocol.ProtocolError as error:
        raise RealtimeError("invalid_json", error.event.message) from None
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
        errors.append(unsupported(f"{prefix}.tools", "function calling (tools)"))
    choice = data.get("tool_choice")
    if choice not in (None, "auto", "none"):
        errors.append(unsupported(f"{prefix}.tool_choice", f"tool_choice {repr(choice)[:60]}"))
    if data.get("prompt") is not None:
        errors.append(unsupported(f"{prefix}.prompt", "prompt templates"))
    return errors


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
            event = parse_client_event(raw)
            event_id = event.get("event_id")
            if isinstance(event_id, str) and len(event_id) <= MAX_ID_CHARS:
                self._client_event_id = event_id
            handler = self._HANDLERS.get(event["type"])
            if handler is None:
                shown = event["type"][:60]
                raise RealtimeError("unknown_event_type", f"unknown client event type {shown!r}", "type")
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
                raise unsupported("session.audio.output.speed", "a speed other than 1.0")

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
            raise unsupported(f"{param}.create_response", "create_response false (Parley answers each detected turn)")
        if value.get("idle_timeout_ms") is not None:
            raise unsupported(f"{param}.idle_timeout_ms", "idle_timeout_ms")
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
            raise unsupported("item.type", "function calling (function_call items)")
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
                raise unsupported(
                    f"{param}.audio", "audio in conversation.item.create (send it with input_audio_buffer.append)"
                )
            else:
                raise unsupported(f"{param}.type", f"content of type {str(part_type)[:40]!r}")
        text = "\n".join(t.strip() for t in texts if t and t.strip())
        if not text:
            raise RealtimeError("invalid_value", "the item has no text", "item.content")
        if len(text) > protocol.MAX_USER_TEXT_CHARS:
            raise RealtimeError(
                "string_above_max_length", f"at most {protocol.MAX_USER_TEXT_CHARS} characters", "item.content"
            )
        item_id = _client_id(item, "id", "item.id") or new_id("item")
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
        payload = message_item(item_id, role, content_out)
        async with self._lock:
            previous, self._last_item_id = self._last_item_id, item_id
            self._remember(Item(payload, role, text, pending=role != "system"))
            await self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
            await self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": payload})

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
            raise unsupported("item_id", "deleting an item that was answered (Parley keeps the answered history)")
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
    def _response_params(self, event: dict) -> ResponseParams:
        spec = _field(event, "response", dict, "response") or {}
        errors = _check_tools(spec, "response")
        if errors:
            raise errors[0]
        if spec.get("conversation") not in (None, "auto"):
            raise unsupported("response.conversation", "responses outside the conversation (conversation 'none')")
        if spec.get("input") is not None:
            raise unsupported("response.input", "a custom response input")
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
        return ResponseParams(
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
        raise unsupported(
            "type",
            "output_audio_buffer.clear (WebRTC/SIP only; over WebSocket, stop playback and send response.cancel)",
        )


_SESSION_KEYS = frozenset(
    {"type", "instructions", "output_modalities", "audio", "include", "tools", "tool_choice", "prompt"}
    | _IGNORED_SESSION_KEYS
)
