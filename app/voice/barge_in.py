"""Barge-in: the user speaking over a reply stops it, unless all they say is a backchannel.

Sustained speech (``Settings.barge_in_ms``) over a reply that is still produced or played
stops it. Hearing the words first costs one short transcription (~0.1 s) before the reply
stops; it is what keeps "mm-hmm" or "yeah, right" from cutting the assistant off. The check
is repeated as the speech goes on, so "yeah, but wait" still interrupts. The session
(``app.voice.session``) says when speech starts and how long it has gone on; the reply and the
words are read from its ``TurnState``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from app.voice.reply import Reply, cancel_task
from app.voice.turn_state import TurnState
from app.voice.turns import is_backchannel

BARGE_IN_RECHECK_MS = 300  # after a backchannel verdict, listen this much more speech before judging again


class BargeIn:
    def __init__(self, state: TurnState, stop: Callable[[], Awaitable[None]]) -> None:
        """``state.reply``: the reply the user hears now; ``state.tracker``: the words of the speech so far;
        ``stop``: stop the reply."""
        self._state, self._stop = state, stop
        self._check: asyncio.Task | None = None
        self._checked_ms = 0.0  # speech length at the last check of this utterance
        self._over_reply = False  # a reply was playing when the utterance began

    def speech_started(self, reply_playing: bool) -> None:
        self._checked_ms = 0.0
        self._over_reply = reply_playing

    def only_backchannel(self, said: str) -> bool:
        """The utterance began over a playing reply and ``said`` is only a backchannel ("mm-hmm"): no turn."""
        return self._over_reply and is_backchannel(said)

    async def speaking(self, speech_ms: float, *, confirm: bool) -> None:
        """Sustained speech over a reply: stop it, unless (``confirm``) the words so far are only a backchannel."""
        reply = self._state.reply
        if reply is None or not reply.active():
            return
        if not confirm:
            await self._stop()
            return
        checking = self._check is not None and not self._check.done()
        if checking or speech_ms < self._checked_ms + BARGE_IN_RECHECK_MS:
            return
        self._checked_ms = speech_ms
        self._check = asyncio.create_task(self._confirm(reply), name="barge-in-check")

    async def _confirm(self, reply: Reply) -> None:
        tracker = self._state.tracker
        text = await tracker.transcribe_speech_so_far() if tracker is not None else ""
        if reply is not self._state.reply or is_backchannel(text):
            return
        await self._stop()

    async def close(self) -> None:
        if self._check is not None:
            await cancel_task(self._check)
