"""Realtime client events -> the conversation: typed session calls (``VoiceSession.handle``,
``feed_audio``, ``tune``), the state's changes, and the events that acknowledge them.

Each event is validated first (``schema``: the ``openai`` package's models); the handlers read
typed values and check what the SDK does not: Parley's bounds (ids, texts, audio sizes, item
counts) and what it refuses (MCP tools, formats other than 24 kHz PCM...). What
``session.update`` and ``response.create`` ask for is worked out in ``configure``.

Function calls: a response ends at the calls it makes (its function_call items); the client adds
each one's ``function_call_output`` and a ``response.create`` answers from them
(``VoiceSession.respond``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import logging
from collections.abc import Callable

import numpy as np
from openai.types.realtime import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
    InputAudioBufferAppendEvent,
    ResponseCancelEvent,
    ResponseCreateEvent,
)
from pydantic import BaseModel

from app import protocol
from app.audio import ASR_SAMPLE_RATE, pcm16_to_float, resample
from app.config import Settings
from app.server.connection import AudioRateLimit
from app.server.limits import Every
from app.server.realtime.configure import response_params, session_change, turn_settings
from app.server.realtime.core import (
    MAX_APPEND_AUDIO_BYTES,
    MAX_APPEND_BASE64_CHARS,
    MAX_CONTENT_PARTS,
    MAX_ID_CHARS,
    MAX_PENDING_ITEMS,
    MIN_COMMIT_MS,
    REALTIME_SAMPLE_RATE,
    TRANSCRIBE_TIMEOUT_S,
    RealtimeError,
    message_item,
    new_id,
    unsupported,
)
from app.server.realtime.outbound import Outbound
from app.server.realtime.schema import (
    ItemTruncate,
    RealtimeSession,
    SessionUpdate,
    bounded,
    event_id,
    load_event,
    validate_event,
)
from app.server.realtime.state import Item, RealtimeState, ResponseParams, TurnDetection
from app.stages.base import ToolCall
from app.voice.clock import run_in_thread
from app.voice.session import VoiceSession
from app.voice.text import without_trailing_loop
from app.voice.tools import calls_message, output_text, result_message

log = logging.getLogger(__name__)


class Inbound:
    """The client's text frames, handled one at a time: the state changes, the session is told in
    typed values, and ``outbound`` answers the client. The session is attached after both exist."""

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

    def __init__(
        self,
        state: RealtimeState,
        outbound: Outbound,
        settings: Settings,
        models,
        *,
        on_rate_limited: Callable[[float], None] | None = None,
    ) -> None:
        self.state = state
        self.outbound = outbound
        self.settings = settings
        self.models = models
        self.session: VoiceSession | None = None
        self._rate = AudioRateLimit(settings.max_audio_rate, on_rate_limited)
        self._warn_full = Every(1.0)
        self._tasks: set[asyncio.Task] = set()

    async def handle_client(self, raw: str) -> None:
        """One text frame from the client; every problem is answered with an ``error`` event."""
        self.state.client_event_id = None
        try:
            data = load_event(raw)
            self.state.client_event_id = event_id(data)
            event = validate_event(data)
            handler = self._HANDLERS.get(data["type"])
            if handler is None:  # a client event of a newer SDK than this server
                raise unsupported("type", f"the client event {data['type'][:60]!r}")
            await getattr(self, handler)(event)
        except RealtimeError as error:
            await self._answer_error(error)

    async def handle_binary(self) -> None:
        self.state.client_event_id = None
        await self._answer_error(
            RealtimeError(
                "invalid_event",
                "binary frames are not part of the Realtime API: send audio as input_audio_buffer.append",
            )
        )

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _answer(self, event: dict) -> None:
        async with self.state.lock:
            await self.outbound.emit(event)

    async def _answer_error(self, error: RealtimeError) -> None:
        async with self.state.lock:
            await self.outbound.error(error)

    async def _parley(self, message: protocol.ClientMessageType) -> None:
        """A typed client message to the session (never while holding the lock: it answers through outbound)."""
        if self.session is not None:
            await self.session.handle(message)

    def _settle_pending(self) -> list[Item]:
        return self.state.settle_pending(self.session.history if self.session is not None else None)

    # ------------------------------------------------------------------ session.update
    async def _session_update(self, event: SessionUpdate) -> None:
        if not isinstance(event.session, RealtimeSession):
            raise RealtimeError("unsupported_session_type", "transcription sessions are not supported", "session.type")
        change = session_change(event.session, self.state.config, self.settings, self.models)
        for error in change.errors:
            await self._answer_error(error)
        previous, self.state.config = self.state.config, change.config
        if change.prefs:
            await self._parley(protocol.SessionConfig(**change.prefs))
        if change.turn_detection_set:
            await self._apply_turn_detection(previous.turn_detection, change.config.turn_detection)
        await self._answer({"type": "session.updated", "session": self.state.session_json()})

    async def _apply_turn_detection(self, before: TurnDetection | None, after: TurnDetection | None) -> None:
        """Per-session VAD and endpoint settings; the session rebuilds its VAD when they change."""
        session = self.session
        if session is None:
            return
        updates = turn_settings(after, self.settings)
        changed = {k: v for k, v in updates.items() if getattr(session.settings, k) != v}
        mode_changed = (before is None) != (after is None)
        if changed or mode_changed:
            await self._drop_input(changed)

    async def _drop_input(self, tuned: dict[str, float] | None = None) -> None:
        """Forget the utterance in progress and the manual buffer; the session rebuilds its VAD (with ``tuned``)."""
        self.state.reset_input()
        async with self.state.lock:
            self.state.speech = None
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
        state = self.state
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
        if self.session is not None:
            await self.session.feed_audio(state.input(samples))

    async def _commit(self, event: BaseModel) -> None:
        state = self.state
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
            emit = self.outbound.emit
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
        try:
            audio16 = resample(audio, REALTIME_SAMPLE_RATE, ASR_SAMPLE_RATE)
            asr = self.models.asr
            kwargs = {}
            if "language" in inspect.signature(asr.transcribe).parameters:
                kwargs["language"] = self.state.config.language
            result = await run_in_thread(lambda: asr.transcribe(audio16, **kwargs))
            text = (
                without_trailing_loop(result.text.strip(), len(audio16) / ASR_SAMPLE_RATE) if result is not None else ""
            )
        except Exception as exc:
            log.exception("manual turn: transcription failed")
            await self._answer(
                {
                    "type": "conversation.item.input_audio_transcription.failed",
                    "item_id": item_id,
                    "content_index": 0,
                    "error": {"type": "server_error", "code": "transcription_failed", "message": str(exc)[:200]},
                }
            )
            return
        async with self.state.lock:
            item.text = text
            item.payload = message_item(item_id, "user", [{"type": "input_audio", "transcript": text}])
            if self.state.config.transcription:
                await self.outbound.emit(
                    {
                        "type": "conversation.item.input_audio_transcription.completed",
                        "item_id": item_id,
                        "content_index": 0,
                        "transcript": text,
                        "usage": {"type": "duration", "seconds": round(len(audio) / REALTIME_SAMPLE_RATE, 3)},
                    }
                )
            await self.outbound.emit(
                {"type": "conversation.item.done", "previous_item_id": previous, "item": item.payload}
            )

    async def _clear(self, event: BaseModel) -> None:
        if self.state.config.turn_detection is None:
            self.state.clear_manual()
        else:
            await self._drop_input()
        await self._answer({"type": "input_audio_buffer.cleared"})

    # ------------------------------------------------------------------ items
    async def _item_create(self, event: ConversationItemCreateEvent) -> None:
        item = event.item
        if item.type in ("function_call", "function_call_output"):
            await self._function_item_create(item)
            return
        if item.type != "message":
            raise RealtimeError("invalid_value", f"unsupported item type {item.type[:40]!r}", "item.type")
        role = item.role
        text = _message_text(item.content)
        item_id = bounded(item.id, "item.id", MAX_ID_CHARS) or new_id("item")
        state = self.state
        if item_id in state.items:
            raise RealtimeError("duplicate_item_id", f"an item with id {item_id!r} exists", "item.id")
        if role == "system":
            instructions = f"{state.config.instructions}\n\n{text}".strip()
            if len(instructions) > protocol.MAX_SYSTEM_PROMPT_CHARS:
                raise RealtimeError(
                    "string_above_max_length",
                    f"system items are added to the instructions, which hold {protocol.MAX_SYSTEM_PROMPT_CHARS} "
                    "characters at most",
                    "item.content",
                )
            state.config.instructions = instructions
            await self._parley(protocol.SessionConfig(system_prompt=instructions))
        elif len(state.pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        content_out = (
            [{"type": "output_text", "text": text}] if role == "assistant" else [{"type": "input_text", "text": text}]
        )
        payload = message_item(item_id, role, content_out)
        async with state.lock:
            previous = state.follow(item_id)
            state.remember(Item(payload, role, text, pending=role != "system"))
            await self.outbound.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
            await self.outbound.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": payload})

    async def _function_item_create(self, item) -> None:
        """A call's output (what the next ``response.create`` answers from), or a call for the history."""
        item_id = bounded(item.id, "item.id", MAX_ID_CHARS) or new_id("item")
        call_id = bounded(item.call_id, "item.call_id", MAX_ID_CHARS)
        state = self.state
        if item_id in state.items:
            raise RealtimeError("duplicate_item_id", f"an item with id {item_id!r} exists", "item.id")
        if len(state.pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        if item.type == "function_call_output":
            output = output_text(item.output)
            payload = {"type": "function_call_output", "call_id": call_id, "output": output}
            stored = Item({}, "tool", output, message=result_message(call_id, output), pending=True)
        else:
            if not call_id:
                raise RealtimeError(
                    "missing_required_parameter", "missing required parameter: 'item.call_id'", "item.call_id"
                )
            name, arguments = bounded(item.name, "item.name", 64), item.arguments
            payload = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
            message = calls_message("", [ToolCall(call_id, name, arguments)])
            stored = Item({}, "assistant", message=message, pending=True)
        stored.payload = {"id": item_id, "object": "realtime.item", "status": "completed", **payload}
        async with state.lock:
            previous = state.follow(item_id)
            state.remember(stored)
            for kind in ("conversation.item.added", "conversation.item.done"):
                await self.outbound.emit({"type": kind, "previous_item_id": previous, "item": stored.payload})

    async def _item_truncate(self, event: ItemTruncate) -> None:
        item_id, end_ms = bounded(event.item_id, "item_id", MAX_ID_CHARS), event.audio_end_ms
        if end_ms < 0:
            raise RealtimeError("invalid_value", "audio_end_ms must be >= 0", "audio_end_ms")
        item = self.state.items.get(item_id)
        if item is None or item.role != "assistant":
            raise RealtimeError(
                "item_truncate_invalid_item_id", f"no assistant item {item_id!r} with audio to truncate", "item_id"
            )
        played_ms = min(end_ms, int(item.audio_ms))
        if item.turn_id is not None:
            # where the client's playback stands; a later barge-in or cancel keeps only what was heard
            await self._parley(protocol.Playback(turn_id=item.turn_id, played_ms=played_ms))
        await self._answer(
            {"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0, "audio_end_ms": played_ms}
        )

    def _known_item(self, item_id: str, code: str) -> Item:
        item = self.state.items.get(bounded(item_id, "item_id", MAX_ID_CHARS))
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
        del self.state.items[item_id]
        await self._answer({"type": "conversation.item.deleted", "item_id": item_id})

    async def _item_retrieve(self, event: ConversationItemRetrieveEvent) -> None:
        item = self._known_item(event.item_id, "item_retrieve_invalid_item_id")
        await self._answer({"type": "conversation.item.retrieved", "item": item.payload})

    # ------------------------------------------------------------------ responses
    async def _response_create(self, event: ResponseCreateEvent) -> None:
        state = self.state
        if state.response is not None or state.typed is not None:
            raise RealtimeError(
                "conversation_already_has_active_response",
                "a response is in progress; cancel it or wait for response.done",
            )
        params = response_params(event, state.config)
        for item in state.pending():  # manual commits still being transcribed
            if item.transcription is not None and not item.transcription.done():
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(item.transcription), TRANSCRIBE_TIMEOUT_S)
        pending = state.pending()
        turn: list[Item] = []
        while pending and pending[-1].role == "user":
            turn.insert(0, pending.pop())
        for item in turn:
            item.pending = False  # answered now, as this turn
        settled = self._settle_pending()  # what came before it joins the history as it is
        text = "\n".join(item.text for item in turn if item.text)[: protocol.MAX_USER_TEXT_CHARS]
        if not text and any(item.role == "tool" for item in settled):
            await self._answer_results(params)
            return
        if not text:
            # Parley answers a user's message, or the results of its calls; it has no turn of its own to take
            error = {
                "type": "invalid_request_error",
                "code": "no_user_message",
                "message": "nothing to answer: add a user item (conversation.item.create or a commit) "
                "or a function_call_output first",
            }
            async with state.lock:
                await self.outbound.fail_response(params, error)
            return
        overrides = params.session_config()
        if overrides is not None:
            await self._parley(overrides)
        state.typed = params
        try:
            await self._parley(protocol.UserText(text=text))
        finally:
            state.typed = None
            if overrides is not None:
                await self._restore_session_config()

    async def _answer_results(self, params: ResponseParams) -> None:
        """A response that answers from the function_call_output items just added (no new user message)."""
        if self.session is None:
            return
        overrides = params.session_config()
        if overrides is not None:
            await self._parley(overrides)
        try:
            turn_id = await self.session.respond()
            # no await before the lock: the reply's first event (sent under the same lock) comes after response.created
            async with self.state.lock:
                await self.outbound.open_response(turn_id, params)
        finally:
            if overrides is not None:
                await self._restore_session_config()

    async def _restore_session_config(self) -> None:
        """The session's own instructions and tools again, after a response that overrode them."""
        config = self.state.config
        await self._parley(
            protocol.SessionConfig(
                system_prompt=config.instructions, tools=list(config.tools), tool_choice=config.tool_choice
            )
        )

    async def _response_cancel(self, event: ResponseCancelEvent) -> None:
        response_id = bounded(event.response_id, "response_id", MAX_ID_CHARS) or None
        response = self.state.response
        if response is None or (response_id is not None and response_id != response.id):
            if response_id is None and self.session is not None and self.session.busy:
                await self._parley(protocol.Cancel())  # the last reply still plays (by Parley's estimate): stop it
                return
            raise RealtimeError("response_cancel_not_active", "there is no active response to cancel", "response_id")
        response.cancel_reason = "client_cancelled"
        await self._parley(protocol.Cancel())
        async with self.state.lock:
            if self.state.response is response:  # the session had nothing left to stop: close it here
                await self.outbound.finish(response, "cancelled", "".join(response.text_parts).strip())

    async def _output_clear(self, event: BaseModel) -> None:
        raise unsupported(
            "type",
            "output_audio_buffer.clear (WebRTC/SIP only; over WebSocket, stop playback and send response.cancel)",
        )


def _message_text(content: list) -> str:
    """The text of a ``conversation.item.create`` message: its text parts and transcripts, joined."""
    if len(content) > MAX_CONTENT_PARTS:
        raise RealtimeError("array_above_max_length", f"at most {MAX_CONTENT_PARTS} content parts", "item.content")
    texts = []
    for index, part in enumerate(content):
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
    return text
