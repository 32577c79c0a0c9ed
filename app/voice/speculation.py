"""The speculative reply: started at a pause in the user's speech, held back, used only if the turn ends there.

At a pause the tail of the utterance is transcribed; answering it at once, unheard, means the
reply is already under way when the endpoint commits the turn. The reply also gives the LLM's
end-of-turn verdict on the words where it can (``TurnEndVerdict``), read from its own prefill. If the committed
text is the speculated one the held reply is handed over (the session releases it); any other text, or the
user going on, cancels it. The session (``app.voice.session``) says when; replies come from the
``ReplyFactory`` and the turn's language from a callable, read at each use.
"""

from __future__ import annotations

from collections.abc import Callable

from app.stages.base import Message
from app.voice.reply import Reply
from app.voice.reply_factory import ReplyFactory
from app.voice.utterance import TailText


class Speculation:
    def __init__(
        self,
        replies: ReplyFactory,
        language: Callable[[], str | None],
        heard_gain: Callable[[str, list[Message]], float | None] = lambda text, related: None,
    ) -> None:
        """``language``: the language of the turn being answered, when known; ``heard_gain``: what the words heard
        so far gained from the conversation (``PrefixWarmup.heard_gain``)."""
        self._replies, self._language, self._heard_gain = replies, language, heard_gain
        self._reply: Reply | None = None  # a reply to the utterance in progress, held back

    @property
    def running(self) -> bool:
        return self._reply is not None

    async def start(self, tail: TailText) -> None:
        """Start answering ``tail`` before the endpoint; nothing is sent unless the turn commits with its text."""
        if self._reply is not None and self._reply.user_text == tail.text:
            return
        await self.cancel()
        language = self._language()
        fitted = self._replies.prompt(tail.text, language)
        if fitted.truncated_chars:
            return  # an over-long turn is answered (with a notice) once committed
        reply = self._replies.new(tail.turn_id, tail.text, language)
        reply.speech_end = tail.speech_end
        self._reply = reply
        alone = self._replies.alone_prompt(tail.text, language, fitted.messages)
        weighing = self._replies.weigh(
            fitted.messages, alone, self._heard_gain(tail.text, fitted.messages), spoken=True
        )
        turn_end = self._replies.take_turn_end(tail.verdict, weighing.messages) if weighing.alone is None else None
        reply.start(weighing.messages, released=False, alone=weighing.alone, turn_end=turn_end, weighed=weighing.gain)

    async def cancel(self) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.cancel()

    async def take(self, committed_text: str) -> Reply | None:
        """At the commit: the held reply if it answers exactly ``committed_text`` (still held), else cancel it."""
        reply = self._reply
        if reply is not None and reply.user_text == committed_text:
            self._reply = None
            return reply
        await self.cancel()
        return None
