"""The speculative reply: started at a pause in the user's speech, held back, used only if the turn ends there.

At a pause the tail of the utterance is transcribed; answering it at once, unheard, means the
reply is already under way when the endpoint commits the turn. The reply also gives the LLM's
end-of-turn verdict on the words where it can (``TurnEndVerdict``), read from its own prefill. If the committed
text is the speculated one the held reply is handed over (the session releases it); any other text, or the
user going on, cancels it. The session (``app.voice.session``) says when; replies come from the
``ReplyFactory``, in the turn's language.
"""

from __future__ import annotations

from typing import Protocol

from app.stages.base import Message
from app.voice.reply import Reply
from app.voice.reply_factory import ReplyFactory
from app.voice.utterance import TailText


class HeardGain(Protocol):
    def heard_gain(self, text: str, related: list[Message]) -> float | None:
        """What the words heard so far gained from the conversation (``PrefixWarmup.heard_gain``)."""
        ...


class Speculation:
    def __init__(self, replies: ReplyFactory, heard: HeardGain) -> None:
        """``replies`` makes the reply (in the turn's language, ``TurnState.language``); ``heard``: what the words
        heard so far gained from the conversation."""
        self._replies, self._heard = replies, heard
        self._reply: Reply | None = None  # a reply to the utterance in progress, held back

    @property
    def running(self) -> bool:
        return self._reply is not None

    async def start(self, tail: TailText) -> None:
        """Start answering ``tail`` before the endpoint; nothing is sent unless the turn commits with its text."""
        if self._reply is not None and self._reply.user_text == tail.text:
            return
        await self.cancel()
        fitted = self._replies.prompt(tail.text)
        if fitted.truncated_chars:
            return  # an over-long turn is answered (with a notice) once committed
        reply = self._replies.new(tail.turn_id, tail.text)
        reply.timed(speech_end=tail.speech_end)
        self._reply = reply
        alone = self._replies.alone_prompt(tail.text, fitted.messages)
        heard_gain = self._heard.heard_gain(tail.text, fitted.messages)
        weighing = self._replies.weigh(fitted.messages, alone, heard_gain, spoken=True)
        turn_end = self._replies.take_turn_end(tail.verdict, weighing.messages)
        reply.start(
            weighing.messages,
            released=False,
            alone=weighing.alone,
            alone_acts_only=weighing.acts_only,
            turn_end=turn_end,
            weighed=weighing.gain,
        )

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
