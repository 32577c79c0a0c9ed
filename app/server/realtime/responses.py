"""Parley's replies as Realtime responses: ``response.created``, the message item and its content
part opened on the first text or audio, the transcript (or text) and audio deltas, the client's
function calls as function_call items after the message, and ``response.done``, in the GA order.

Apart from ``Outbound``, which routes the session's events and tells the client about the user's
speech: a response's life is the larger half of the outbound translation, and it is the part the
inbound half also drives (``response.create`` opens or fails one, ``response.cancel`` may finish
one).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import soxr

from app import protocol
from app.audio import float_to_pcm16, pcm16_to_float
from app.server.realtime.core import REALTIME_SAMPLE_RATE, message_item, new_id, zero_usage
from app.server.realtime.sender import EventSender
from app.server.realtime.state import Item, RealtimeState, Response, ResponseParams

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


class ResponseEvents:
    """The open response (``state.response``) and its events; callers hold ``state.lock``."""

    def __init__(self, state: RealtimeState, sender: EventSender) -> None:
        self.state = state
        self.sender = sender

    def _new(self, turn_id: int, params: ResponseParams) -> Response:
        config = self.state.config
        return Response(new_id("resp"), turn_id, params.modality or config.modality, params.metadata, config.voice)

    async def open(self, turn_id: int, params: ResponseParams) -> None:
        """``response.created`` for Parley's turn ``turn_id``; the response is the open one until it finishes."""
        response = self.state.response = self._new(turn_id, params)
        self.state.last_turn_id = max(self.state.last_turn_id, turn_id)
        await self.sender.emit({"type": "response.created", "response": response.payload("in_progress")})

    async def fail(self, params: ResponseParams, error: dict[str, Any]) -> None:
        """A ``response.create`` Parley has no turn to answer: created, then done as ``failed`` at once."""
        response = self._new(-1, params)
        await self.sender.emit({"type": "response.created", "response": response.payload("in_progress")})
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
        emit = self.sender.emit
        await emit({"type": "response.output_item.added", **where, "item": item})
        await emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        await emit(
            {
                "type": "response.content_part.added",
                **where,
                "item_id": response.item_id,
                "content_index": 0,
                "part": response.part(""),
            }
        )

    async def assistant_text(self, message: protocol.AssistantText) -> None:
        response = self.state.current(message.turn_id)
        if response is None:
            return
        await self._open_output(response)
        response.text_parts.append(message.delta)
        kind = "response.output_text.delta" if response.modality == "text" else "response.output_audio_transcript.delta"
        await self.sender.emit({"type": kind, **response.where(), "delta": message.delta})

    def audio_start(self, message: protocol.AudioStart) -> Response | None:
        """The reply's audio is about to start at ``message.sample_rate``: resampled to 24 kHz from here on.
        Returns the response it belongs to (None: not the open one)."""
        response = self.state.current(message.turn_id)
        if response is not None and message.sample_rate != REALTIME_SAMPLE_RATE:
            response.resampler = soxr.ResampleStream(message.sample_rate, REALTIME_SAMPLE_RATE, 1, dtype="float32")
        return response

    async def audio(self, data: bytes) -> None:
        """Reply audio (PCM16 at the reply's rate) as ``response.output_audio.delta`` of the open response."""
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
        await self.sender.emit(
            {"type": "response.output_audio.delta", **response.where(), "delta": base64.b64encode(pcm).decode()}
        )

    def tool_call(self, message: protocol.CallTool) -> None:
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
        emit = self.sender.emit
        await emit({"type": "response.output_item.added", **where, "item": opened})
        await emit({"type": "conversation.item.added", "previous_item_id": previous, "item": opened})
        arguments = {**where, "item_id": item_id, "call_id": call.call_id}
        await emit({"type": "response.function_call_arguments.delta", **arguments, "delta": call.arguments})
        await emit(
            {
                "type": "response.function_call_arguments.done",
                **arguments,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        done = function_call_item(item_id, call, call.arguments, "completed")
        self.state.items[item_id].payload = done
        await emit({"type": "response.output_item.done", **where, "item": done})
        await emit({"type": "conversation.item.done", "previous_item_id": previous, "item": done})
        return done

    async def turn_done(self, message: protocol.TurnDone) -> None:
        response = self.state.current(message.turn_id)
        ids: dict[str, Any] = {}
        if response is not None:
            ids = {"response_id": response.id, "item_id": response.item_id}
            status = "cancelled" if message.interrupted else "completed"
            await self.finish(response, status, message.text)
        if INCLUDE_TURN_METRICS in self.state.config.include:
            await self.sender.emit(
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
        emit = self.sender.emit
        output = []
        if response.item_id is not None:
            where = response.where()
            if response.modality == "text":
                await emit({"type": "response.output_text.done", **where, "text": text})
            else:
                if status == "completed" and response.resampler is not None:
                    tail = response.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
                    await self._audio_delta(response, tail)
                await emit({"type": "response.output_audio.done", **where})
                await emit({"type": "response.output_audio_transcript.done", **where, "transcript": text})
            await emit({"type": "response.content_part.done", **where, "part": response.part(text)})
            content = response.content(text)
            item = message_item(
                response.item_id, "assistant", content, "completed" if status == "completed" else "incomplete"
            )
            stored = self.state.items.get(response.item_id)
            if stored is not None:
                stored.payload, stored.text = item, text
            await emit(
                {"type": "response.output_item.done", "response_id": response.id, "output_index": 0, "item": item}
            )
            await emit({"type": "conversation.item.done", "item": item})
            output = [item]
        for call in response.calls:
            output.append(await self._function_call(response, call, len(output)))
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": response.cancel_reason or "turn_detected"}
        elif status == "failed":
            details = {"type": "failed", "error": error}
        await emit({"type": "response.done", "response": response.payload(status, output, details, zero_usage())})
