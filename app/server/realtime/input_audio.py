"""The client's ``input_audio_buffer`` events: append, commit and clear.

With server VAD (turn detection on) appended audio goes straight to the session, which finds the
turns itself; with turn detection null it waits in the state's manual buffer until the client
commits it, and the commit is transcribed here (the shared ASR) into a user item that the next
``response.create`` answers. Apart from ``Inbound`` because the audio path has its own limits
(append size, audio rate, buffer size) and its own background work (the commits' transcriptions).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import logging
from collections.abc import Callable

import numpy as np
from openai.types.realtime import InputAudioBufferAppendEvent
from pydantic import BaseModel

from app.audio import ASR_SAMPLE_RATE, pcm16_to_float, resample
from app.config import Settings
from app.server.connection import AudioRateLimit
from app.server.limits import Every
from app.server.realtime.context import InboundContext
from app.server.realtime.core import (
    MAX_APPEND_AUDIO_BYTES,
    MAX_APPEND_BASE64_CHARS,
    MAX_PENDING_ITEMS,
    MIN_COMMIT_MS,
    REALTIME_SAMPLE_RATE,
    RealtimeError,
    message_item,
    new_id,
)
from app.server.realtime.state import Item
from app.voice.clock import run_in_thread
from app.voice.text import without_trailing_loop

log = logging.getLogger(__name__)


class InputAudioBuffer:
    """``input_audio_buffer.append`` / ``.commit`` / ``.clear``, and dropping the input in progress
    (also when ``session.update`` changes turn-taking). ``close`` stops the transcriptions running."""

    def __init__(
        self,
        context: InboundContext,
        settings: Settings,
        models,
        *,
        on_rate_limited: Callable[[float], None] | None = None,
    ) -> None:
        self.context = context
        self.settings = settings
        self.models = models
        self._rate = AudioRateLimit(settings.max_audio_rate, on_rate_limited)
        self._warn_full = Every(1.0)
        self._tasks: set[asyncio.Task] = set()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def append(self, event: InputAudioBufferAppendEvent) -> None:
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
        state = self.context.state
        if state.config.turn_detection is None:
            limit = int(self.settings.max_utterance_s * REALTIME_SAMPLE_RATE)
            if state.manual_samples + len(samples) > limit:
                if self._warn_full():
                    raise RealtimeError(
                        "input_audio_buffer_full",
                        f"the input buffer holds at most {self.settings.max_utterance_s:g} s; commit or clear it",
                        "audio",
                    )
                return
            state.add_manual(samples)
            state.input_ms += seconds * 1000
            return
        state.input_ms += seconds * 1000
        session = self.context.session
        if session is not None:
            await session.feed_audio(state.input(samples))

    async def commit(self, event: BaseModel) -> None:
        state = self.context.state
        if state.config.turn_detection is not None:
            raise RealtimeError(
                "input_audio_buffer_commit_unsupported",
                "with turn_detection on, the server commits turns itself; set turn_detection to null to commit",
            )
        if state.manual_samples < MIN_COMMIT_MS * REALTIME_SAMPLE_RATE // 1000:
            raise RealtimeError(
                "input_audio_buffer_commit_empty",
                f"buffer too small: {state.manual_samples / REALTIME_SAMPLE_RATE * 1000:.0f} ms of audio; "
                f"at least {MIN_COMMIT_MS} ms are needed",
            )
        if len(state.pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        audio = state.take_manual()
        item_id = new_id("item")
        async with state.lock:
            previous = state.follow(item_id)
            payload = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "in_progress")
            item = Item(payload, "user", pending=True)
            state.remember(item)
            emit = self.context.outbound.emit
            await emit({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
            await emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
        item.transcription = self._spawn(self._transcribe(item, audio, previous))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _transcribe(self, item: Item, audio: np.ndarray, previous: str | None) -> None:
        item_id = item.payload["id"]
        state = self.context.state
        try:
            audio16 = resample(audio, REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
            asr = self.models.asr
            kwargs = {}
            if "language" in inspect.signature(asr.transcribe).parameters:
                kwargs["language"] = state.config.language
            result = await run_in_thread(lambda: asr.transcribe(audio16, **kwargs))
            text = (
                without_trailing_loop(result.text.strip(), len(audio16) / ASR_SAMPLE_RATE) if result is not None else ""
            )
        except Exception as exc:
            log.exception("manual turn: transcription failed")
            await self.context.answer(
                {
                    "type": "conversation.item.input_audio_transcription.failed",
                    "item_id": item_id,
                    "content_index": 0,
                    "error": {"type": "server_error", "code": "transcription_failed", "message": str(exc)[:200]},
                }
            )
            return
        outbound = self.context.outbound
        async with state.lock:
            item.text = text
            item.payload = message_item(item_id, "user", [{"type": "input_audio", "transcript": text}])
            if state.config.transcription:
                await outbound.emit(
                    {
                        "type": "conversation.item.input_audio_transcription.completed",
                        "item_id": item_id,
                        "content_index": 0,
                        "transcript": text,
                        "usage": {"type": "duration", "seconds": round(len(audio) / REALTIME_SAMPLE_RATE, 3)},
                    }
                )
            await outbound.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item.payload})

    async def clear(self, event: BaseModel) -> None:
        if self.context.state.config.turn_detection is None:
            self.context.state.clear_manual()
        else:
            await self.drop()
        await self.context.answer({"type": "input_audio_buffer.cleared"})

    async def drop(self, tuned: dict[str, float] | None = None) -> None:
        """Forget the utterance in progress and the manual buffer; the session rebuilds its VAD (with ``tuned``)."""
        state = self.context.state
        state.reset_input()
        async with state.lock:
            state.speech = None
        session = self.context.session
        if session is not None:
            await session.tune(**(tuned or {}))
