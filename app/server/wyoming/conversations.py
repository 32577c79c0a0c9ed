"""Wyoming conversation (``handle``): a ``transcript`` in, the assistant's reply out, remembered per conversation id.

Home Assistant opens a connection per sentence and names the conversation in the ``transcript``'s
context (``conversation_id``). Each id gets one text-only ``VoiceSession`` (``reply_audio`` off: the
reply is written, not spoken; Home Assistant speaks it with its TTS, which may be this server's), the
same conversation ``/ws`` runs: its history, its policy, the server's skills and MCP tools. A sentence
with no id starts a new conversation, whose id the reply's context carries back.

Sessions are kept ``keep_s`` after their last turn and at most ``max_kept`` at once (the least recently
used goes first). The reply streams as ``handled-start``, ``handled-chunk``…, then ``handled`` (the whole
text, for clients that do not stream) and ``handled-stop``; a reply that fails is ``not-handled`` with why.
A skill's later news (a timer that rings) has no connection to go to here, and is not delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from wyoming.event import Event
from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop, NotHandled

from app import protocol
from app.server.wyoming.wire import WireError
from app.voice.reply import SendJson
from app.voice.session import VoiceSession

Send = Callable[[Event], Awaitable[None]]
MakeSession = Callable[[SendJson], VoiceSession]
MAX_CONVERSATION_ID_CHARS = 128
REPLY_TIMEOUT_S = 120.0  # a reply with tool rounds on a slow CPU stays well inside this


@dataclass(eq=False)
class _Conversation:
    session: VoiceSession
    used_at: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sentence at a time
    events: asyncio.Queue | None = None  # the sentence being answered gets the session's events


class Conversations:
    """Conversation id -> its session, bounded in number and in time."""

    def __init__(
        self,
        make_session: MakeSession,
        *,
        max_kept: int,
        keep_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make, self._max_kept, self._keep_s, self._clock = make_session, max_kept, keep_s, clock
        self._kept: OrderedDict[str, _Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    async def answer(self, text: str, conversation_id: str | None, send: Send) -> None:
        """Answer ``text`` in the conversation ``conversation_id`` (None: a new one), the reply sent through ``send``."""
        text = text.strip()
        if not text:
            raise WireError("empty_text", "a transcript to answer needs text")
        if len(text) > protocol.MAX_USER_TEXT_CHARS:
            raise WireError("text_too_long", f"a transcript to answer is over {protocol.MAX_USER_TEXT_CHARS} chars")
        if conversation_id is not None and not (
            isinstance(conversation_id, str) and 0 < len(conversation_id) <= MAX_CONVERSATION_ID_CHARS
        ):
            raise WireError("bad_conversation_id", f"conversation_id: a string of 1-{MAX_CONVERSATION_ID_CHARS} chars")
        conversation_id = conversation_id or uuid.uuid4().hex
        conversation = await self._conversation(conversation_id)
        context = {"conversation_id": conversation_id}
        async with conversation.lock:
            conversation.events = events = asyncio.Queue()
            try:
                await conversation.session.handle(protocol.UserText(text=text))
                await send(HandledStart(context=context).event())
                async with asyncio.timeout(REPLY_TIMEOUT_S):
                    reply, failure = await _reply(events, send)
            except TimeoutError:
                await conversation.session.handle(protocol.Cancel())
                reply, failure = None, f"no reply within {REPLY_TIMEOUT_S:g} s"
            finally:
                conversation.events = None
                conversation.used_at = self._clock()
        if failure is not None:
            await send(NotHandled(text=failure, context=context).event())
        else:
            await send(Handled(text=reply, context=context).event())
        await send(HandledStop().event())

    async def close(self) -> None:
        while self._kept:
            _, conversation = self._kept.popitem()
            await conversation.session.close()

    async def _conversation(self, conversation_id: str) -> _Conversation:
        await self._forget_stale()
        conversation = self._kept.get(conversation_id)
        if conversation is not None:
            self._kept.move_to_end(conversation_id)
            return conversation
        while len(self._kept) >= self._max_kept:
            _, oldest = self._kept.popitem(last=False)
            await _close(oldest)
        conversation = _Conversation(session=None, used_at=self._clock())  # type: ignore[arg-type]

        async def to_sentence(message: protocol.ServerMessage) -> None:
            if conversation.events is not None:
                conversation.events.put_nowait(message)

        conversation.session = session = self._make(to_sentence)
        await session.start()
        await session.handle(protocol.SessionConfig(reply_audio=False))
        self._kept[conversation_id] = conversation
        return conversation

    async def _forget_stale(self) -> None:
        now = self._clock()
        stale = [
            key for key, kept in self._kept.items() if now - kept.used_at > self._keep_s and not kept.lock.locked()
        ]
        for key in stale:
            await _close(self._kept.pop(key))


async def _close(conversation: _Conversation) -> None:
    with contextlib.suppress(Exception):
        await conversation.session.close()


async def _reply(events: asyncio.Queue, send: Send) -> tuple[str | None, str | None]:
    """The reply's text as it streams (``handled-chunk``), until its ``turn_done``: (the text, None) or (None, why)."""
    while True:
        message = await events.get()
        if isinstance(message, protocol.AssistantText) and message.delta:
            await send(HandledChunk(text=message.delta).event())
        elif isinstance(message, protocol.TurnDone):
            return message.text, None
        elif isinstance(message, protocol.Error):
            return None, message.message
