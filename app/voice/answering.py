"""The reply the user hears: a committed turn answered (the final transcript sent, the prompt fitted and weighed,
the user's words remembered, and the reply started, or the held speculation that answers them released), and what
the history keeps of it: all of it once produced, only what was heard when it is interrupted.

The session (``app.voice.session``) says which turn and when; the reply is made by the ``ReplyFactory`` and
becomes the session's released reply (``TurnState.reply``).
"""

from __future__ import annotations

from app import protocol
from app.stages.base import Message
from app.voice.clock import Clock
from app.voice.history import History
from app.voice.prefs import Preferences
from app.voice.reply import Reply, SendJson
from app.voice.reply_factory import ReplyFactory
from app.voice.turn_state import TurnState
from app.voice.warmup import PrefixWarmup


class Answering:
    def __init__(
        self,
        replies: ReplyFactory,
        state: TurnState,
        history: History,
        prefs: Preferences,
        warmup: PrefixWarmup,
        *,
        send_json: SendJson,
        clock: Clock,
        withdraw_unheard: bool = True,
    ) -> None:
        """``warmup``: what the words heard while the user spoke gained from the conversation, and the next prompt's
        prefill once the history changed; ``withdraw_unheard``: a ``cancel`` before any of the reply was heard takes
        the turn back (``VoiceSession``)."""
        self._replies, self._state, self._history, self._prefs = replies, state, history, prefs
        self._warmup, self._send_json, self._clock = warmup, send_json, clock
        self._withdraw_unheard = withdraw_unheard
        self._closed = False

    async def start_turn(
        self,
        turn_id: int,
        text: str,
        *,
        speech_end: float,
        commit: float,
        language: str | None = None,
        spoken: bool = True,
        **figures,
    ) -> None:
        """Answer ``text`` afresh (``spoken``: heard, not typed; ``figures``: the utterance's ``TurnMetrics``)."""
        await self._send_json(protocol.Transcript(turn_id=turn_id, text=text, final=True, language=language))
        fitted = self._replies.prompt(text)
        alone = self._replies.alone_prompt(text, fitted.messages)  # (before the words are in the history)
        if fitted.truncated_chars:
            text = fitted.messages[-1]["content"]
            left_out = f"That was too long for the model: {fitted.truncated_chars} characters at the end were left out."
            await self._send_json(protocol.Notice(turn_id=turn_id, code="truncated", message=left_out))
        await self._tell_if_voiceless(turn_id)
        self._history.remember({"role": "user", "content": text})
        heard_gain = self._warmup.heard_gain(text, fitted.messages) if spoken else None
        weighing = self._replies.weigh(fitted.messages, alone, heard_gain, spoken=spoken)
        self.answer(
            turn_id,
            text,
            weighing.messages,
            speech_end=speech_end,
            commit=commit,
            alone=weighing.alone,
            alone_acts_only=weighing.acts_only,
            weighed=weighing.gain,
            **figures,
        )

    async def release(self, speculation: Reply, text: str, *, language: str | None, **timing) -> None:
        """The held speculation answers the committed ``text``: it becomes the reply the user hears (``timing``: when
        the speech ended and the turn was committed, and the utterance's figures)."""
        await self._send_json(
            protocol.Transcript(turn_id=speculation.turn_id, text=text, final=True, language=language)
        )
        await self._tell_if_voiceless(speculation.turn_id)
        self._history.remember({"role": "user", "content": text})
        speculation.timed(**timing, speculative=True)
        self._state.reply = speculation
        await speculation.release()

    def answer(
        self,
        turn_id: int,
        text: str,
        messages: list[Message],
        *,
        speech_end: float,
        commit: float,
        alone: list[Message] | None = None,
        alone_acts_only: bool = False,
        weighed: float | None = None,
        **figures,
    ) -> None:
        """Start the reply the user hears (``text``: what it answers, "" for the history's last results; ``alone``,
        ``alone_acts_only`` and ``weighed``: how the reply weighs the conversation, ``ReplyFactory.weigh``)."""
        reply = self._replies.new(turn_id, text)
        reply.timed(speech_end=speech_end, commit=commit, **figures)
        self._state.reply = reply
        reply.start(messages, released=True, alone=alone, alone_acts_only=alone_acts_only, weighed=weighed)

    def say(self, turn_id: int, words: str) -> None:
        """Words of the server's own (an announcement), spoken as a reply; the history keeps them as said."""
        now = self._clock.now()
        reply = self._replies.new(turn_id, "", script=words)
        reply.timed(speech_end=now, commit=now)
        self._state.reply = reply
        reply.start([], released=True)

    async def _tell_if_voiceless(self, turn_id: int) -> None:
        notice = self._prefs.voiceless_notice(self._state.language, turn_id)
        if notice is not None:
            await self._send_json(notice)

    def record(self, reply: Reply) -> None:
        """The reply was produced to its end: the history keeps its calls and its answer; where the answer is the
        calls' own words (a skill said what it did), the answer alone, as any reply: shown a call, its result and
        their words, the 0.5B default brain made no more calls and said those words again to the next requests."""
        for message in () if reply.written.answered_by_tools else reply.written.tool_messages:
            self._history.remember(message)
        if reply.written.answer:
            self._history.remember({"role": "assistant", "content": reply.written.answer})
        if reply.text or reply.written.tool_messages:
            self._warmup.next_prompt()

    async def interrupt(self, *, barge_in: bool = True) -> None:
        """Barge-in (or ``cancel``): stop the reply, tell the client to stop playing, keep only what was heard."""
        reply, self._state.reply = self._state.reply, None
        if reply is None or not reply.active():
            return
        recorded = reply.finished and reply.released  # (``record`` ran)
        await reply.cancel()  # (the calls it waits for are cancelled: the client is told)
        heard_text = reply.heard_text(self._clock.now())
        if not recorded:
            for message in reply.written.tool_messages:  # calls made and answered stay made
                self._history.remember(message)
        self._history.keep_only_heard(
            reply.written.heard_answer(heard_text),
            reply_was_recorded=recorded and bool(reply.written.answer),
            withdrawn_if_unheard=self._withdraw_unheard and not barge_in,
        )
        self._warmup.next_prompt()
        if self._closed:
            return
        await self._send_json(protocol.Interrupt(turn_id=reply.turn_id))
        reply.metrics.barge_in = barge_in  # (its figures are final: only the turn_done below reads them)
        await self._send_json(
            protocol.TurnDone(turn_id=reply.turn_id, text=heard_text, interrupted=True, metrics=reply.final_metrics())
        )

    async def close(self) -> None:
        """The client is gone: the reply is stopped, and nothing more is sent."""
        self._closed = True
        reply, self._state.reply = self._state.reply, None
        if reply is not None:
            await reply.cancel()
