"""Continued turns: the user goes on speaking right after a turn was committed.

A short endpoint answers quickly, and so it also commits at some mid-sentence pauses ("I
want to visit Paris. ... and London next summer"): Smart Turn hears a finished sentence and
Whisper writes a period. Rather than answer half a question, or make every endpoint slower,
speech that starts soon after a spoken turn's commit, before much of its reply was heard,
continues that turn (``protocol.TurnContinued``): its reply is held while the new words are
heard; more words withdraw it and the whole turn is answered, a cough or a "mm-hmm" lets it
go on. The rule, the state and the holding and withdrawing (``ContinuedTurns``) are here;
the session (``app.voice.session``) says when speech starts and what was committed, and
lends what it takes: the history, the utterance tracker, a way to start a turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from app import protocol
from app.voice.clock import Clock
from app.voice.history import History
from app.voice.reply import Reply, SendJson
from app.voice.text import text_after
from app.voice.turn_state import TurnState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContinuationRule:
    window_ms: int = 1500  # speech must start this soon after the commit (0: never continue)
    heard_ms: int = 500  # and before this much of the reply has played

    def applies(self, reply: Reply | None, spoken_turn: int | None, onset: float) -> bool:
        """Whether speech that began at ``onset`` continues the turn ``reply`` answers.

        Only a turn committed from speech (``spoken_turn``; a typed one is complete as sent),
        whose reply is still being produced or played. Both limits are judged at the speech's
        onset, not when the VAD confirmed it: the ~0.1 s the VAD takes is more reply played,
        which the user resuming did not hear before they began.
        """
        if not self.window_ms or reply is None or reply.turn_id != spoken_turn or not reply.commit:
            return False
        if not reply.active() or (onset - reply.commit) * 1000 > self.window_ms:
            return False
        return reply.playback.played_s(onset) * 1000 <= self.heard_ms


@dataclass
class Continuation:
    """A committed turn the user went on with; its reply is held until the new words are known."""

    reply: Reply
    withdrawn: bool = False  # the reply was cancelled and the client told so

    def new_words(self, text: str) -> str:
        """What ``text`` (the whole turn so far) adds to what was committed before."""
        return text_after(text, self.reply.user_text)


class StartTurn(Protocol):
    async def __call__(self, turn_id: int, text: str, *, speech_end: float, commit: float) -> None: ...


class ContinuedTurns:
    """Holds the reply of a spoken turn the user goes on with, then withdraws or releases it."""

    def __init__(
        self,
        rule: ContinuationRule,
        state: TurnState,
        *,
        history: History,
        clock: Clock,
        send_json: SendJson,
        start_turn: StartTurn,
    ) -> None:
        """``state``: the session's released reply (``reply``; ``let_go`` forgets it), and the utterance tracker that
        goes on with a turn (``UtteranceTracker.continue_turn``); ``start_turn``: answer a turn afresh."""
        self._rule, self._state = rule, state
        self._history, self._clock, self._send_json = history, clock, send_json
        self._start_turn = start_turn
        self._held: Continuation | None = None  # the last turn, which the user may be going on with
        self._spoken_turn: int | None = None  # the last turn committed from speech (only those continue)

    @property
    def holding(self) -> bool:
        return self._held is not None

    def new_words(self, text: str) -> str:
        """What the utterance adds to the turn it continues (all of ``text`` when it continues none)."""
        return self._held.new_words(text) if self._held is not None else text

    async def speech_started(self, onset: float) -> None:
        """Speech right after a spoken turn was committed, before its reply was heard, goes on with that turn.

        People pause mid-sentence ("I want to visit Paris ... and London"); a short endpoint
        commits at the pause. Rather than answer half a question (or make the endpoint slow for
        everyone), the reply is held and, if words follow, withdrawn and the whole answered.
        """
        await self.end()  # one left by an utterance that ended without a verdict
        reply = self._state.reply
        if reply is None or not self._rule.applies(reply, self._spoken_turn, onset):
            return
        now = self._clock.now()
        log.info(
            "turn %s continued: speech began %.0f ms after the commit, with %.0f ms of the reply heard (%.0f by now)",
            reply.turn_id,
            (onset - reply.commit) * 1000,
            reply.playback.played_s(onset) * 1000,
            reply.playback.played_s(now) * 1000,
        )
        reply.hold()
        self._history.withdraw(reply.user_text)
        if self._state.tracker is not None:
            self._state.tracker.continue_turn(reply.turn_id, reply.user_text)
        self._held = Continuation(reply)

    async def committed(self, turn_id: int) -> None:
        """A spoken turn was committed: the one it continued (if any) is withdrawn, and it may be continued next."""
        self._spoken_turn = turn_id
        held, self._held = self._held, None
        if held is not None:
            await self._withdraw(held)

    async def withdraw_if_held(self) -> bool:
        """The user is saying more: the reply playing, if a continued turn's, is withdrawn (True)."""
        held = self._held
        if held is None or held.reply is not self._state.reply:
            return False
        await self._withdraw(held)
        return True

    async def end(self) -> None:
        """Nothing was added after all (a cough, "mm-hmm"): the turn stands and its reply goes on."""
        held, self._held = self._held, None
        if held is None:
            return
        reply = held.reply
        if held.withdrawn:  # already stopped at the client: answer the turn again
            now = self._clock.now()
            await self._start_turn(reply.turn_id, reply.user_text, speech_end=now, commit=now)
            return
        # the utterance's partials showed the turn's words and more: they stand as committed
        await self._send_json(protocol.Transcript(turn_id=reply.turn_id, text=reply.user_text, final=True))
        self._history.remember({"role": "user", "content": reply.user_text})
        await reply.release()  # (records the reply if it was complete)

    def abandon(self) -> None:
        """Typed input, cancel or reset: the held turn is an ordinary turn again (its reply is stopped next)."""
        held, self._held = self._held, None
        if held is not None and not held.withdrawn:
            self._history.remember({"role": "user", "content": held.reply.user_text})

    async def _withdraw(self, held: Continuation) -> None:
        """Cancel the continued turn's reply and tell the client to drop it; the whole turn is answered next."""
        if held.withdrawn:
            return
        held.withdrawn = True
        self._state.let_go(held.reply)
        await held.reply.cancel()
        await self._send_json(protocol.TurnContinued(turn_id=held.reply.turn_id))
