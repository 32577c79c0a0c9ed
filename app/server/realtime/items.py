"""The client's ``conversation.item`` events: create, truncate, delete and retrieve.

Items the client creates wait (``pending``) until a ``response.create`` answers them: user text
becomes the typed turn, assistant text and function calls join the history, function_call_output
items are what a response answers from, and system text is added to the instructions. Apart from
``Inbound`` because the items are the conversation as the client writes it, with its own checks
(ids, content parts, texts, how many may wait).
"""

from __future__ import annotations

from openai.types.realtime import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
)

from app import protocol
from app.server.realtime.context import InboundContext
from app.server.realtime.core import (
    MAX_CONTENT_PARTS,
    MAX_ID_CHARS,
    MAX_PENDING_ITEMS,
    RealtimeError,
    message_item,
    new_id,
    unsupported,
)
from app.server.realtime.schema import ItemTruncate, bounded
from app.server.realtime.state import Item
from app.stages.base import ToolCall
from app.voice.tools import calls_message, output_text, result_message


class ConversationItems:
    """``conversation.item.create`` / ``.truncate`` / ``.delete`` / ``.retrieve`` on the state's items."""

    def __init__(self, context: InboundContext) -> None:
        self.context = context

    async def create(self, event: ConversationItemCreateEvent) -> None:
        item = event.item
        if item.type in ("function_call", "function_call_output"):
            await self._create_function_item(item)
            return
        if item.type != "message":
            raise RealtimeError("invalid_value", f"unsupported item type {item.type[:40]!r}", "item.type")
        role = item.role
        text = message_text(item.content)
        item_id = bounded(item.id, "item.id", MAX_ID_CHARS) or new_id("item")
        state = self.context.state
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
            await self.context.parley(protocol.SessionConfig(system_prompt=instructions))
        elif len(state.pending()) >= MAX_PENDING_ITEMS:
            raise RealtimeError("too_many_items", f"at most {MAX_PENDING_ITEMS} items may wait for a response.create")
        content_out = (
            [{"type": "output_text", "text": text}] if role == "assistant" else [{"type": "input_text", "text": text}]
        )
        payload = message_item(item_id, role, content_out)
        outbound = self.context.outbound
        async with state.lock:
            previous = state.follow(item_id)
            state.remember(Item(payload, role, text, pending=role != "system"))
            await outbound.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": payload})
            await outbound.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": payload})

    async def _create_function_item(self, item) -> None:
        """A call's output (what the next ``response.create`` answers from), or a call for the history."""
        item_id = bounded(item.id, "item.id", MAX_ID_CHARS) or new_id("item")
        call_id = bounded(item.call_id, "item.call_id", MAX_ID_CHARS)
        state = self.context.state
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
                await self.context.outbound.emit({"type": kind, "previous_item_id": previous, "item": stored.payload})

    async def truncate(self, event: ItemTruncate) -> None:
        item_id, end_ms = bounded(event.item_id, "item_id", MAX_ID_CHARS), event.audio_end_ms
        if end_ms < 0:
            raise RealtimeError("invalid_value", "audio_end_ms must be >= 0", "audio_end_ms")
        item = self.context.state.items.get(item_id)
        if item is None or item.role != "assistant":
            raise RealtimeError(
                "item_truncate_invalid_item_id", f"no assistant item {item_id!r} with audio to truncate", "item_id"
            )
        played_ms = min(end_ms, int(item.audio_ms))
        if item.turn_id is not None:
            # where the client's playback stands; a later barge-in or cancel keeps only what was heard
            await self.context.parley(protocol.Playback(turn_id=item.turn_id, played_ms=played_ms))
        await self.context.answer(
            {"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0, "audio_end_ms": played_ms}
        )

    def _known(self, item_id: str, code: str) -> Item:
        item = self.context.state.items.get(bounded(item_id, "item_id", MAX_ID_CHARS))
        if item is None:
            raise RealtimeError(code, f"no item {item_id!r}", "item_id")
        return item

    async def delete(self, event: ConversationItemDeleteEvent) -> None:
        item_id = event.item_id
        item = self._known(item_id, "item_delete_invalid_item_id")
        if not item.pending:
            raise unsupported("item_id", "deleting an item that was answered (Parley keeps the answered history)")
        if item.transcription is not None:
            item.transcription.cancel()
        del self.context.state.items[item_id]
        await self.context.answer({"type": "conversation.item.deleted", "item_id": item_id})

    async def retrieve(self, event: ConversationItemRetrieveEvent) -> None:
        item = self._known(event.item_id, "item_retrieve_invalid_item_id")
        await self.context.answer({"type": "conversation.item.retrieved", "item": item.payload})


def message_text(content: list) -> str:
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
