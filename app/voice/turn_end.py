"""Whether a pause ends the user's turn, besides the words' own cue: the LLM reading the words and the end-of-turn
model hearing the sound, each asked at a pause, and what is known of them there (``PauseVerdicts``).

Its own unit because which judge is asked when, and why, is a rule of its own; the utterance tracker
(``app.voice.utterance``) hears, transcribes, and applies the endpoint's rule (``app.voice.turns.Endpointer``)
to what the judges said.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from app.stages.base import TurnDetector, TurnEndVerdict
from app.voice.clock import Clock, RunBlocking
from app.voice.turns import Endpointer, is_filler, looks_unfinished

log = logging.getLogger(__name__)

TextTurnEnd = Callable[[str], Awaitable[float | None]]
"""P(the user's words end here) from their text (the LLM's, ``listening.TextTurnEnd``); None when it cannot say."""
Ask = Callable[[], Awaitable[float | None]]


@dataclass
class PauseVerdicts:
    """What is known at the utterance's current pause of whether the turn ends there."""

    turn_probability: float | None = None  # the end-of-turn model's verdict at this pause
    turn_ms: float | None = None
    text_probability: float | None = None  # the LLM's P that the words end at this pause
    text_ms: float | None = None
    text_asked_at: float | None = None  # when the LLM was asked, while its verdict is awaited
    text_task: asyncio.Task | None = None
    pending: bool = False  # the tail's words are in, the end-of-turn model's verdict is not yet
    heard_whole: np.ndarray | None = None  # what the end-of-turn model hears at this pause (asked for it or not)
    sound_asked: bool = False  # the end-of-turn model was asked at this pause
    sound_running: bool = False  # the end-of-turn model asked after the LLM, in its task (``ask_the_sound``)

    def reset(self) -> None:
        """The user went on: nothing is known of the next pause (``sound_running`` is its task's own to clear)."""
        self.turn_probability = self.turn_ms = None
        self.text_probability = self.text_ms = self.text_asked_at = self.text_task = None
        self.pending, self.heard_whole, self.sound_asked = False, None, False


class TurnEndJudges:
    """The end-of-turn model (``sound``; None: there is none) and the LLM (``words``; None: not asked), asked at a
    pause once the tail is heard.

    Where the LLM is asked, the end-of-turn model (the sound) is asked after its verdict, and only where it
    could change the endpoint (``Endpointer.sound_matters``: the words' P between ~2e-4 and ~0.09); not
    when the verdict is late past ``text_wait_ms`` (the words' own cue decides then: a sound asked at
    that point made four users' endpoint p50 594 ms instead of 398). Where it is not, the sound is asked at
    the pause, beside ASR on another core. Why: its ~100 ms of CPU at the pause slowed the tail's
    transcription and the speculative reply's first tokens beside it (one user, heard p50 699 -> 589 ms
    in ``bench voice``, three runs each), while on the labelled set the words decide nearly alone (accuracy 93.1 % words,
    92.2 % both: app/bench/results/turn_end.md).
    The words are told without waiting for the model: a speculative reply needs only them. The LLM's verdict
    comes from the speculative reply's own prefill where it takes it (``TurnEndVerdict``): the verdict's prompt
    is the reply's up to the words' end, so one prefill gives both, the verdict with the reply's first token.
    Asked apart (no speculation, or one that cannot read it), its prefill of the words ran beside the reply's;
    asked first, the verdict came ~40 ms after the words and the reply's first token ~50 ms after that (asked
    after the reply, the verdict came ~90 ms later: endpoint p50 231 -> 312 ms, ``bench voice``, 8 turns each).
    """

    def __init__(
        self,
        sound: TurnDetector | None,
        words: TextTurnEnd | None,
        *,
        endpointer: Endpointer,
        clock: Clock,
        run_blocking: RunBlocking,
    ) -> None:
        self._sound, self._words, self._endpointer = sound, words, endpointer
        self._clock, self._run = clock, run_blocking

    @property
    def words_first(self) -> bool:
        """Whether the LLM is asked first (the sound only where it matters), else the sound at the pause."""
        return self._words is not None

    def sound_at_pause(self, verdicts: PauseVerdicts, whole: np.ndarray) -> asyncio.Future | None:
        """At a pause, the end-of-turn model hears ``whole`` (the utterance so far), now where the LLM is not asked
        first (its verdict, awaited), else later where it matters (``sound_matters``) and None now."""
        verdicts.heard_whole = whole
        turn_end = None if self.words_first else asyncio.ensure_future(self.hear(whole))
        verdicts.sound_asked = turn_end is not None
        return turn_end

    def sound_where_it_matters(
        self, verdicts: PauseVerdicts, whole: np.ndarray, text: str, language: str | None
    ) -> asyncio.Future | None:
        """Once the words are heard, where the LLM is not asked about them and the sound was not asked at the pause:
        the end-of-turn model's verdict on ``whole`` where it could change the endpoint (not of a filler)."""
        if is_filler(text) or not self.sound_matters(verdicts, text, language):
            return None
        verdicts.sound_asked = True
        return asyncio.ensure_future(self.hear(whole))  # no LLM verdict will come

    async def hear(self, audio: np.ndarray) -> tuple[float | None, float]:
        """The end-of-turn model's probability (None when there is no model, or it failed) and its cost."""
        detector, started = self._sound, self._clock.now()
        if detector is None:
            return None, 0.0
        try:
            probability = await self._run(lambda: detector.complete_probability(audio))
        except Exception:  # the words alone still decide
            log.warning("end-of-turn model failed; using the words alone", exc_info=True)
            probability = None
        return probability, (self._clock.now() - started) * 1000

    def asks_the_words(self, text: str, language: str | None) -> bool:
        """Whether the LLM is asked if the words end the turn: not where the words' own cue already waits."""
        return (
            self._words is not None
            and bool(text.strip())
            and not is_filler(text)
            and not looks_unfinished(text, language)
        )

    def question(self, text: str, verdict: TurnEndVerdict) -> Ask:
        """How the LLM's verdict on ``text`` is awaited: from the speculative reply that took ``verdict``, else asked
        apart (``TextTurnEnd``)."""
        return verdict.wait if verdict.taken else functools.partial(self._words, text)

    async def read_the_words(self, verdicts: PauseVerdicts, ask: Ask) -> None:
        """The LLM's verdict (``question``), kept with what it cost."""
        started = self._clock.now()
        try:
            probability = await ask()
        except Exception:  # the sound and the words' cue still decide
            log.warning("the LLM's end-of-turn probability failed; using the other cues", exc_info=True)
            probability = None
        verdicts.text_probability, verdicts.text_asked_at = probability, None
        verdicts.text_ms = (self._clock.now() - started) * 1000

    def sound_matters(self, verdicts: PauseVerdicts, text: str, language: str | None) -> bool:
        """Whether the end-of-turn model's verdict could change this pause's endpoint, given the words and the
        LLM's (``Endpointer.sound_matters``); not asked already."""
        if verdicts.sound_asked:
            return False
        return self._endpointer.sound_matters(text, language, verdicts.text_probability)

    async def ask_the_sound(self, verdicts: PauseVerdicts) -> None:
        """The end-of-turn model's verdict, asked in the LLM's verdict task after it (cancelled with that task); the
        endpoint waits for it."""
        if verdicts.heard_whole is None:
            return
        verdicts.sound_asked = verdicts.sound_running = verdicts.pending = True
        try:
            verdicts.turn_probability, verdicts.turn_ms = await self.hear(verdicts.heard_whole)
        finally:
            verdicts.sound_running = verdicts.pending = False
