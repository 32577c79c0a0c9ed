"""Continued turns: the user goes on speaking right after a turn was committed.

A short endpoint answers quickly, and so it also commits at some mid-sentence pauses ("I
want to visit Paris. ... and London next summer"): Smart Turn hears a finished sentence and
Whisper writes a period. Rather than answer half a question, or make every endpoint slower,
speech that starts soon after a spoken turn's commit, before much of its reply was heard,
continues that turn (``protocol.TurnContinued``): its reply is held while the new words are
heard; more words withdraw it and the whole turn is answered, a cough or a "mm-hmm" lets it
go on. The session (``app.voice.session``) does the holding and the swapping; the rule and
the state are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.voice.reply import Reply
from app.voice.text import text_after


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
