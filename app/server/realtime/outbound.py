"""Session events -> Realtime server events: every event the client gets goes out through ``Outbound``.

``on_parley`` / ``on_parley_audio`` are the session's ``send_json`` / ``send_bytes``: Parley's
``protocol.ServerMessage`` values and its reply audio become Realtime events in the GA order.
``emit`` / ``error`` are also how the inbound half answers the client's own events.

A reply's calls of the client's functions (``tool_call`` events) become function_call items of
its response, after its message item (the words said before the calls) is done:
``response.output_item.added``, ``conversation.item.added``,
``response.function_call_arguments.delta`` and ``.done``, ``response.output_item.done``,
``conversation.item.done``, then ``response.done`` with all the output items. Calls of the
server's own tools stay inside the reply.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import soxr

from app import protocol
from app.audio import float_to_pcm16, pcm16_to_float
from app.server.realtime.core import REALTIME_SAMPLE_RATE, RealtimeError, SendEvent, message_item, new_id, zero_usage
from app.server.realtime.state import Item, RealtimeState, Response, ResponseParams, Speech
from app.voice.session import VoiceSession

INCLUDE_TURN_METRICS = "parley.turn_metrics"


def function_call_item(item_id: str, call: protocol.CallTool, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": status,
        "call_id": call.call_id,
        "name": call.name,
        "arguments": arguments,
    }


INCLUDE_NOTICES = "parley.notice"


class Outbound:
    """Parley's events as Realtime server events, sent with ``send`` (one JSON-able event at a time).

    The session is attached after both exist (it sends through this object).
    """

    def __init__(self, state: RealtimeState, send: SendEvent) -> None:
        self.state = state
        self.session: VoiceSession | None = None
        self._send = send

    # ------------------------------------------------------------------ sending
    async def emit(self, event: dict[str, Any]) -> None:
        await self._send({"event_id": self.state.next_event_id(), **event})

    async def error(self, error: RealtimeError) -> None:
        await self.emit(
            {
                "type": "error",
                "error": {
                    "type": error.kind,
                    "code": error.code,
                    "message": error.message,
                    "param": error.param,
                    "event_id": self.state.client_event_id,
                },
            }
        )

    async def start(self) -> None:
        await self.emit({"type": "session.created", "session": self.state.session_json()})

    # ------------------------------------------------------------------ the session's events
    async def on_parley(self, message: protocol.ServerMessage) -> None:
        async with self.state.lock:
            await self._translate(message)

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
                await self._on_assistant_text(message)
            case protocol.AudioStart():
                await self._on_audio_start(message)
            case protocol.Interrupt():
                await self._on_interrupt(message)
            case protocol.TurnDone():
                await self._on_turn_done(message)
            case protocol.CallTool():
                self._on_tool_call(message)
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
    def _response(self, turn_id: int, params: ResponseParams) -> Response:
        config = self.state.config
        return Response(new_id("resp"), turn_id, params.modality or config.modality, params.metadata, config.voice)

    async def open_response(self, turn_id: int, params: ResponseParams) -> None:
        """``response.created`` for Parley's turn ``turn_id``; the response is the open one until it finishes."""
        response = self.state.response = self._response(turn_id, params)
        await self.emit({"type": "response.created", "response": response.payload("in_progress")})

    async def fail_response(self, params: ResponseParams, error: dict[str, Any]) -> None:
        """A ``response.create`` Parley has no turn to answer: created, then done as ``failed`` at once."""
        response = self._response(-1, params)
        await self.emit({"type": "response.created", "response": response.payload("in_progress")})
        await self.finish(response, "failed", "", error)

    async def _open_output(self, response: Response) -> None:
        """The assistant item and its content part, opened on the reply's first text or audio."""
        if response.item_id is not None:
            return
        response.item_id = new_id("item")
        item = message_item(response.item_id, "assistant", [], "in_progress")
        self.state.remember(Item(item, "assistant", turn_id=response.turn_id))
        previous = self.state.follow(response.item_id)
        where = {"response_id": response.id, "output_index": 0}
        await self.emit({"type": "response.output_item.added", **where, "item": item})
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        await self.emit(
            {
                "type": "response.content_part.added",
                **where,
                "item_id": response.item_id,
                "content_index": 0,
                "part": response.part(""),
            }
        )

    async def _on_assistant_text(self, message: protocol.AssistantText) -> None:
        response = self.state.current(message.turn_id)
        if response is None:
            return
        await self._open_output(response)
        response.text_parts.append(message.delta)
        kind = "response.output_text.delta" if response.modality == "text" else "response.output_audio_transcript.delta"
        await self.emit({"type": kind, **response.where(), "delta": message.delta})

    async def _on_audio_start(self, message: protocol.AudioStart) -> None:
        response = self.state.current(message.turn_id)
        if response is None:
            return
        if message.sample_rate != REALTIME_SAMPLE_RATE:
            response.resampler = soxr.ResampleStream(message.sample_rate, REALTIME_SAMPLE_RATE, 1, dtype="float32")
        if response.modality == "text" and self.session is not None:
            # no audio is played: tell the session so, or it would count the reply as playing (barge-in, idle)
            await self.session.handle(protocol.Playback(turn_id=message.turn_id, played_ms=1e9))

    async def on_parley_audio(self, data: bytes) -> None:
        async with self.state.lock:
            response = self.state.response
            if response is None or response.modality == "text" or not data:
                return
            await self._open_output(response)
            samples = pcm16_to_float(data)
            if response.resampler is not None:
                samples = response.resampler.resample_chunk(samples)
            await self._audio_delta(response, samples)

    async def _audio_delta(self, response: Response, samples: np.ndarray) -> None:
        if not len(samples):
            return
        pcm = float_to_pcm16(samples)
        response.audio_bytes += len(pcm)
        item = self.state.items.get(response.item_id or "")
        if item is not None:
            item.audio_ms = response.audio_bytes / 2 / REALTIME_SAMPLE_RATE * 1000
        await self.emit(
            {"type": "response.output_audio.delta", **response.where(), "delta": base64.b64encode(pcm).decode()}
        )

    def _on_tool_call(self, message: protocol.CallTool) -> None:
        response = self.state.current(message.turn_id)
        if response is not None and message.runs_on == "client":
            response.calls.append(message)  # sent as a function_call item once the message item is done

    async def _function_call(self, response: Response, call: protocol.CallTool, index: int) -> dict[str, Any]:
        """One function_call output item of ``response``, announced and done at once (its arguments are whole)."""
        item_id = new_id("item")
        opened = function_call_item(item_id, call, "", "in_progress")
        self.state.remember(Item(opened, "assistant", turn_id=response.turn_id))
        previous = self.state.follow(item_id)
        where = {"response_id": response.id, "output_index": index}
        await self.emit({"type": "response.output_item.added", **where, "item": opened})
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": opened})
        arguments = {**where, "item_id": item_id, "call_id": call.call_id}
        await self.emit({"type": "response.function_call_arguments.delta", **arguments, "delta": call.arguments})
        await self.emit(
            {
                "type": "response.function_call_arguments.done",
                **arguments,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        done = function_call_item(item_id, call, call.arguments, "completed")
        self.state.items[item_id].payload = done
        await self.emit({"type": "response.output_item.done", **where, "item": done})
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": done})
        return done

    async def _on_interrupt(self, message: protocol.Interrupt) -> None:
        speech = self.state.speech
        if speech is not None and not speech.announced:
            await self._announce(speech)  # barge-in confirmed: now the client may stop its playback
        response = self.state.current(message.turn_id)
        if response is not None and response.cancel_reason is None:
            response.cancel_reason = "turn_detected"

    async def _on_turn_done(self, message: protocol.TurnDone) -> None:
        response = self.state.current(message.turn_id)
        ids: dict[str, Any] = {}
        if response is not None:
            ids = {"response_id": response.id, "item_id": response.item_id}
            status = "cancelled" if message.interrupted else "completed"
            await self.finish(response, status, message.text)
        if INCLUDE_TURN_METRICS in self.state.config.include:
            await self.emit(
                {
                    "type": "parley.turn_metrics",
                    "turn_id": message.turn_id,
                    **ids,
                    "interrupted": message.interrupted,
                    "metrics": message.metrics.model_dump(exclude_none=True),
                }
            )

    async def finish(self, response: Response, status: str, text: str, error: dict | None = None) -> None:
        """Close the response: its content part, item and the response itself, in the Realtime order."""
        if self.state.response is response:
            self.state.response = None
        output = []
        if response.item_id is not None:
            where = response.where()
            if response.modality == "text":
                await self.emit({"type": "response.output_text.done", **where, "text": text})
            else:
                if status == "completed" and response.resampler is not None:
                    tail = response.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
                    await self._audio_delta(response, tail)
                await self.emit({"type": "response.output_audio.done", **where})
                await self.emit({"type": "response.output_audio_transcript.done", **where, "transcript": text})
            await self.emit({"type": "response.content_part.done", **where, "part": response.part(text)})
            content = response.content(text)
            item = message_item(
                response.item_id, "assistant", content, "completed" if status == "completed" else "incomplete"
            )
            stored = self.state.items.get(response.item_id)
            if stored is not None:
                stored.payload, stored.text = item, text
            await self.emit(
                {"type": "response.output_item.done", "response_id": response.id, "output_index": 0, "item": item}
            )
            await self.emit({"type": "conversation.item.done", "item": item})
            output = [item]
        for call in response.calls:
            output.append(await self._function_call(response, call, len(output)))
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": response.cancel_reason or "turn_detected"}
        elif status == "failed":
            details = {"type": "failed", "error": error}
        await self.emit({"type": "response.done", "response": response.payload(status, output, details, zero_usage())})

    async def _on_parley_error(self, message: protocol.Error) -> None:
        response = self.state.response
        if message.code == "turn_failed" and response is not None:
            error = {"type": "server_error", "code": message.code, "message": message.message}
            await self.finish(response, "failed", "".join(response.text_parts).strip(), error)
            return
        kind = "server_error" if message.code in ("internal", "overloaded", "turn_failed") else "invalid_request_error"
        await self.error(RealtimeError(message.code, message.message, kind=kind))
