"""Realtime client events -> the conversation: typed session calls (``VoiceSession.handle``,
``feed_audio``, ``tune``), the state's changes, and the events that acknowledge them.

Each event is validated first (``schema``: the ``openai`` package's models); the handlers read
typed values and check what the SDK does not: Parley's bounds (ids, texts, audio sizes, item
counts) and what it refuses (MCP tools, formats other than 24 kHz PCM...). What
``session.update`` and ``response.create`` ask for is worked out in ``configure``. ``Inbound``
routes each event to its handler: the input audio buffer's are in ``input_audio``, the
conversation items' in ``items``; the session's and the responses' are here.

Function calls: a response ends at the calls it makes (its function_call items); the client adds
each one's ``function_call_output`` and a ``response.create`` answers from them
(``VoiceSession.respond``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from openai.types.realtime import ResponseCancelEvent, ResponseCreateEvent
from pydantic import BaseModel

from app import protocol
from app.config import Settings
from app.server.realtime.configure import response_params, session_change, turn_settings
from app.server.realtime.context import InboundContext
from app.server.realtime.core import MAX_ID_CHARS, TRANSCRIBE_TIMEOUT_S, RealtimeError, unsupported
from app.server.realtime.input_audio import InputAudioBuffer
from app.server.realtime.items import ConversationItems
from app.server.realtime.outbound import Outbound
from app.server.realtime.schema import RealtimeSession, SessionUpdate, bounded, event_id, load_event, validate_event
from app.server.realtime.state import Item, RealtimeState, ResponseParams, TurnDetection
from app.voice.session import VoiceSession


class Inbound:
    """The client's text frames, handled one at a time: the state changes, the session is told in
    typed values, and ``outbound`` answers the client. The session is attached after both exist."""

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
        self.context = InboundContext(state, outbound)
        self.audio = InputAudioBuffer(self.context, settings, models, on_rate_limited=on_rate_limited)
        self.items = ConversationItems(self.context)
        self._handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self.audio.append,
            "input_audio_buffer.commit": self.audio.commit,
            "input_audio_buffer.clear": self.audio.clear,
            "conversation.item.create": self.items.create,
            "conversation.item.truncate": self.items.truncate,
            "conversation.item.delete": self.items.delete,
            "conversation.item.retrieve": self.items.retrieve,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear,
        }

    @property
    def session(self) -> VoiceSession | None:
        return self.context.session

    @session.setter
    def session(self, session: VoiceSession | None) -> None:
        self.context.session = session

    async def handle_client(self, raw: str) -> None:
        """One text frame from the client; every problem is answered with an ``error`` event."""
        self.state.client_event_id = None
        try:
            data = load_event(raw)
            self.state.client_event_id = event_id(data)
            event = validate_event(data)
            handler = self._handlers.get(data["type"])
            if handler is None:  # a client event of a newer SDK than this server
                raise unsupported("type", f"the client event {data['type'][:60]!r}")
            await handler(event)
        except RealtimeError as error:
            await self.context.answer_error(error)

    async def handle_binary(self) -> None:
        self.state.client_event_id = None
        await self.context.answer_error(
            RealtimeError(
                "invalid_event",
                "binary frames are not part of the Realtime API: send audio as input_audio_buffer.append",
            )
        )

    def close(self) -> None:
        self.audio.close()

    # ------------------------------------------------------------------ session.update
    async def _session_update(self, event: SessionUpdate) -> None:
        if not isinstance(event.session, RealtimeSession):
            raise RealtimeError("unsupported_session_type", "transcription sessions are not supported", "session.type")
        change = session_change(event.session, self.state.config, self.settings, self.models)
        for error in change.errors:
            await self.context.answer_error(error)
        previous, self.state.config = self.state.config, change.config
        if change.prefs:
            await self.context.parley(protocol.SessionConfig(**change.prefs))
        if change.turn_detection_set:
            await self._apply_turn_detection(previous.turn_detection, change.config.turn_detection)
        await self.context.answer({"type": "session.updated", "session": self.state.session_json()})

    async def _apply_turn_detection(self, before: TurnDetection | None, after: TurnDetection | None) -> None:
        """Per-session VAD and endpoint settings; the session rebuilds its VAD when they change."""
        session = self.session
        if session is None:
            return
        updates = turn_settings(after, self.settings)
        changed = {k: v for k, v in updates.items() if getattr(session.settings, k) != v}
        mode_changed = (before is None) != (after is None)
        if changed or mode_changed:
            await self.audio.drop(changed)

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
        settled = self.context.settle_pending()  # what came before it joins the history as it is
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
            await self.context.parley(overrides)
        state.typed = params
        try:
            await self.context.parley(protocol.UserText(text=text))
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
            await self.context.parley(overrides)
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
        await self.context.parley(
            protocol.SessionConfig(
                system_prompt=config.instructions, tools=list(config.tools), tool_choice=config.tool_choice
            )
        )

    async def _response_cancel(self, event: ResponseCancelEvent) -> None:
        response_id = bounded(event.response_id, "response_id", MAX_ID_CHARS) or None
        response = self.state.response
        if response is None or (response_id is not None and response_id != response.id):
            if response_id is None and self.session is not None and self.session.busy:
                # the last reply still plays (by Parley's estimate): stop it
                await self.context.parley(protocol.Cancel())
                return
            raise RealtimeError("response_cancel_not_active", "there is no active response to cancel", "response_id")
        response.cancel_reason = "client_cancelled"
        await self.context.parley(protocol.Cancel())
        async with self.state.lock:
            if self.state.response is response:  # the session had nothing left to stop: close it here
                await self.outbound.finish(response, "cancelled", "".join(response.text_parts).strip())

    async def _output_clear(self, event: BaseModel) -> None:
        raise unsupported(
            "type",
            "output_audio_buffer.clear (WebRTC/SIP only; over WebSocket, stop playback and send response.cancel)",
        )
