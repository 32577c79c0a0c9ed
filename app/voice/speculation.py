"""The speculative reply: started at a pause in the user's speech, held back, used only if the turn ends there.

At a pause the tail of the utterance is transcribed; answering it at once, unheard, means the
reply is already under way when the endpoint commits the turn. If the committed text is the
speculated one the held reply is handed over (the session releases it); any other text, or the
user going on, cancels it. The session (``app.voice.session``) says when; replies come from the
``ReplyFactory`` and the turn's language from a callable, read at each use.

Making the prompt may wait on the LLM (``ReplyFactory.answer_prompt`` asks it whether the words need the
conversation), so a start runs as a task of its own: the session goes on handling the utterance's events,
and a commit of the same words waits for the start to finish and takes its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from app.voice.reply import Reply
from app.voice.reply_factory import ReplyFactory
from app.voice.utterance import TailText

log = logging.getLogger(__name__)


class Speculation:
    def __init__(self, replies: ReplyFactory, language: Callable[[], str | None]) -> None:
        """``language``: the language of the turn being answered, when known."""
        self._replies, self._language = replies, language
        self._reply: Reply | None = None  # a reply to the utterance in progress, held back
        self._starting: tuple[str, asyncio.Task] | None = None  # (its words, the task making its prompt)

    @property
    def running(self) -> bool:
        return self._reply is not None or self._starting is not None

    @property
    def _words(self) -> str | None:
        """The words speculated on (held or still starting)."""
        if self._starting is not None:
            return self._starting[0]
        return None if self._reply is None else self._reply.user_text

    async def start(self, tail: TailText) -> None:
        """Start answering ``tail`` before the endpoint; nothing is sent unless the turn commits with its text."""
        if self._words == tail.text:
            return
        await self.cancel()
        self._starting = (tail.text, asyncio.create_task(self._begin(tail), name=f"speculation-{tail.turn_id}"))

    async def _begin(self, tail: TailText) -> None:
        try:
            fitted = await self._replies.answer_prompt(tail.text, self._language())
        except Exception:
            log.exception("making the speculative reply's prompt failed; the turn is answered once committed")
            return
        if fitted.truncated_chars:
            return  # an over-long turn is answered (with a notice) once committed
        reply = self._replies.new(tail.turn_id, tail.text, self._language())
        reply.speech_end = tail.speech_end
        self._reply = reply
        reply.start(fitted.messages, released=False)

    async def settled(self) -> None:
        """Wait for a start under way to finish (it is quick: one short prefill at most)."""
        if self._starting is not None:
            task = self._starting[1]
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
            if self._starting is not None and self._starting[1] is task:
                self._starting = None

    async def cancel(self) -> None:
        starting, self._starting = self._starting, None
        if starting is not None:
            starting[1].cancel()
            await asyncio.gather(starting[1], return_exceptions=True)
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.cancel()

    async def take(self, committed_text: str) -> Reply | None:
        """At the commit: the held reply if it answers exactly ``committed_text`` (still held), else cancel it."""
        if self._words == committed_text:
            await self.settled()
        reply = self._reply
        if reply is not None and reply.user_text == committed_text and self._starting is None:
            self._reply = None
            return reply
        await self.cancel()
        return None
