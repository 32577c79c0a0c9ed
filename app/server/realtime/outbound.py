"""Session events -> Realtime server events: every event the client gets goes out through ``Outbound``.

``on_parley`` / ``on_parley_audio`` are the session's ``send_json`` / ``send_bytes``: Parley's
``protocol.ServerMessage`` values and its reply audio become Realtime events in the GA order.
``emit`` / ``error`` are also how the inbound half answers the client's own events. The user's
speech (speech_started held back while a reply is audible, the transcript, the committed item) is
told here; the responses are written by ``responses`` (``ResponseEvents``), and every event is sent
by ``sender``.

A reply's calls of the client's functions (``tool_call`` events) become function_call items of
its response, after its message item (the words said before the calls) is done:
``response.output_item.added``, ``conversation.item.added``,
``response.function_call_arguments.delta`` and ``.done``, ``response.output_item.done``,
``conversation.item.done``, then ``response.done`` with all the output items. Calls of the
server's own tools stay inside the reply.
"""

from __future__ import annotations

from typing import Any

from app import protocol
from app.server.realtime.core import RealtimeError, SendEvent, message_item, new_id
from app.server.realtime.responses import ResponseEvents
from app.server.realtime.sender import EventSender
from app.server.realtime.state import Item, RealtimeState, Response, ResponseParams, Speech
from app.voice.session import VoiceSession

INCLUDE_NOTICES = "parley.notice"
# the errors that end a turn in place of its turn_done (``protocol.Error.turn_id``): its response fails
TURN_ENDING_ERRORS = ("turn_failed", "llm_unavailable")


class Outbound:
    """Parley's events as Realtime server events, sent with ``send`` (one JSON-able event at a time).

    The session is attached after both exist (it sends through this object).
    """

    def __init__(self, state: RealtimeState, send: SendEvent) -> None:
        self.state = state
        self.session: VoiceSession | None = None
        self.sender = EventSender(state, send)
        self.responses = ResponseEvents(state, self.sender)

    # ------------------------------------------------------------------ sending
    async def emit(self, event: dict[str, Any]) -> None:
        await self.sender.emit(event)

    async def error(self, error: RealtimeError) -> None:
        await self.sender.error(error)

    async def start(self) -> None:
        await self.emit({"type": "session.created", "session": self.state.session_json()})

    # ------------------------------------------------------------------ the responses (also driven by the inbound half)
    async def open_response(self, turn_id: int, params: ResponseParams) -> None:
        """``response.created`` for Parley's turn ``turn_id``; the response is the open one until it finishes."""
        await self.responses.open(turn_id, params)

    async def fail_response(self, params: ResponseParams, error: dict[str, Any]) -> None:
        """A ``response.create`` Parley has no turn to answer: created, then done as ``failed`` at once."""
        await self.responses.fail(params, error)

    async def finish(self, response: Response, status: str, text: str, error: dict | None = None) -> None:
        """Close the response: its content part, item and the response itself, in the Realtime order."""
        await self.responses.finish(response, status, text, error)

    # ------------------------------------------------------------------ the session's events
    async def on_parley(self, message: protocol.ServerMessage) -> None:
        async with self.state.lock:
            await self._translate(message)

    async def on_parley_audio(self, data: bytes) -> None:
        async with self.state.lock:
            await self.responses.audio(data)

    async def _translate(self, message: protocol.ServerMessage) -> None:
        match message:
            case protocol.Ready() | protocol.ConfigApplied():
                return  # the client got session.created / session.updated from us
            case protocol.SpeechStarted():
                await self._on_speech_started()
            case protocol.SpeechStopped():
                return  # a pause: the utterance ends when its turn commits (transcript) or it is dropped
            case protocol.SpeechDropped():
                await self._on_speech_dropped()
            case protocol.Transcript(final=False):
                await self._on_partial(message)
            case protocol.Transcript():
                await self._on_final(message)
            case protocol.AssistantText():
                await self._open_if_own(message.turn_id)
                await self.responses.assistant_text(message)
            case protocol.AudioStart():
                await self._open_if_own(message.turn_id)
                await self._on_audio_start(message)
            case protocol.Interrupt():
                await self._on_interrupt(message)
            case protocol.TurnDone():
                await self.responses.turn_done(message)
            case protocol.CallTool():
                self.responses.tool_call(message)
            case protocol.ToolDone():
                return  # a server tool's result stays inside the reply; the client's results are its own
            case protocol.TurnContinued():
                return  # never sent here: Realtime sessions run with continuation_ms 0
            case protocol.Notice():
                if INCLUDE_NOTICES in self.state.config.include:
                    await self.emit({"type": "parley.notice", **message.model_dump(exclude={"type"})})
            case protocol.Error():
                await self._on_parley_error(message)

    def _reply_audible(self) -> bool:
        return self.state.response is not None or (self.session is not None and self.session.busy)

    # ------------------------------------------------------------------ the user's speech
    async def _on_speech_started(self) -> None:
        state = self.state
        if state.speech is not None:
            return  # the user went on after a pause: the same item
        state.speech = Speech(item_id=new_id("item"), start_ms=int(state.input_ms))
        if not self._reply_audible():
            await self._announce(state.speech)
        # else: held back until Parley confirms the barge-in (interrupt) or the turn commits

    async def _announce(self, speech: Speech) -> None:
        speech.announced = True
        await self.emit(
            {"type": "input_audio_buffer.speech_started", "audio_start_ms": speech.start_ms, "item_id": speech.item_id}
        )

    async def _on_speech_dropped(self) -> None:
        """The utterance is not a turn (noise, a filler, a backchannel over the reply): it ends with no item."""
        speech, self.state.speech = self.state.speech, None
        if speech is not None and speech.announced:
            await self.emit(
                {
                    "type": "input_audio_buffer.speech_stopped",
                    "audio_end_ms": int(self.state.input_ms),
                    "item_id": speech.item_id,
                }
            )

    async def _on_partial(self, message: protocol.Transcript) -> None:
        speech = self.state.speech
        if not self.state.config.transcription or speech is None or not speech.announced:
            return
        if not message.text.startswith(speech.partial):
            return  # partials only grow; a rewrite is left to the completed transcript
        delta = message.text[len(speech.partial) :]
        if delta:
            speech.partial = message.text
            await self.emit(
                {
                    "type": "conversation.item.input_audio_transcription.delta",
                    "item_id": speech.item_id,
                    "content_index": 0,
                    "delta": delta,
                }
            )

    async def _on_final(self, message: protocol.Transcript) -> None:
        state = self.state
        if state.typed is not None:  # the typed turn response.create just sent: its items exist already
            params, state.typed = state.typed, None
            await self.open_response(message.turn_id, params)
            return
        speech = state.speech
        state.speech = None
        if speech is None:
            speech = Speech(item_id=new_id("item"), start_ms=int(state.input_ms))
        if not speech.announced:
            await self._announce(speech)
        end_ms = int(state.input_ms)
        await self.emit(
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end_ms, "item_id": speech.item_id}
        )
        # client items not answered yet come before this turn
        state.settle_pending(self.session.history if self.session is not None else None)
        previous = state.follow(speech.item_id)
        await self.emit(
            {"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": speech.item_id}
        )
        content = [{"type": "input_audio", "transcript": None}]
        await self.emit(
            {
                "type": "conversation.item.added",
                "previous_item_id": previous,
                "item": message_item(speech.item_id, "user", content, "in_progress"),
            }
        )
        if state.config.transcription:
            await self.emit(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    "item_id": speech.item_id,
                    "content_index": 0,
                    "transcript": message.text,
                    "usage": {"type": "duration", "seconds": round(max(0.0, end_ms - speech.start_ms) / 1000, 3)},
                }
            )
        done = message_item(speech.item_id, "user", [{"type": "input_audio", "transcript": message.text}])
        state.remember(Item(done, "user", message.text))
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": done})
        await self.open_response(message.turn_id, ResponseParams())  # Parley answers every spoken turn

    # ------------------------------------------------------------------ the reply
    async def _open_if_own(self, turn_id: int) -> None:
        """A reply to a turn no response was opened for, newer than every one that was: a turn of the assistant's
        own (a skill's news: a timer rang, a reminder is due; ``app.voice.announcements``), said when nobody speaks
        or listens. It gets a response of its own, as a server-initiated one: ``response.created`` with no user item
        before it. (A user's turn opens its response at its transcript, before any of its reply; a cancelled
        response's late events are of an older turn.)"""
        state = self.state
        if state.response is None and state.typed is None and state.speech is None and turn_id > state.last_turn_id:
            await self.open_response(turn_id, ResponseParams())

    async def _on_audio_start(self, message: protocol.AudioStart) -> None:
        response = self.responses.audio_start(message)
        if response is not None and response.modality == "text" and self.session is not None:
            # no audio is played: tell the session so, or it would count the reply as playing (barge-in, idle)
            await self.session.handle(protocol.Playback(turn_id=message.turn_id, played_ms=1e9))

    async def _on_interrupt(self, message: protocol.Interrupt) -> None:
        speech = self.state.speech
        if speech is not None and not speech.announced:
            await self._announce(speech)  # barge-in confirmed: now the client may stop its playback
        response = self.state.current(message.turn_id)
        if response is not None and response.cancel_reason is None:
            response.cancel_reason = "turn_detected"

    async def _on_parley_error(self, message: protocol.Error) -> None:
        """An error that ended a turn (it names it) fails that turn's response; any other is an ``error`` event."""
        response = self.state.response
        if message.turn_id is not None:
            response = self.state.current(message.turn_id)
        if message.code in TURN_ENDING_ERRORS and response is not None:
            error = {"type": "server_error", "code": message.code, "message": message.message}
            await self.responses.finish(response, "failed", "".join(response.text_parts).strip(), error)
            return
        kind = (
            "server_error"
            if message.code in ("internal", "overloaded", *TURN_ENDING_ERRORS)
            else "invalid_request_error"
        )
        await self.error(RealtimeError(message.code, message.message, kind=kind))
