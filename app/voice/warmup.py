"""Warming the LLM's prefix cache for the next turn, while nobody waits on the LLM.

A turn's prompt is mostly known before the turn: the history (between turns) and the words
heard so far (while the user speaks). Prefilling it then takes that prefill off the next
reply's critical path. Only an LLM that keeps a prefix cache can do it (``warm_prefix`` gives None
otherwise: nothing happens), and it is only an optimisation: a failure is logged and ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from app.config import Settings
from app.stages.base import Message
from app.voice.context import Fitted
from app.voice.reply import cancel_task
from app.voice.text import words as words_of

log = logging.getLogger(__name__)

WarmPrefix = Callable[..., Awaitable[float | None]]
"""Prefill these messages into the LLM's prefix cache (the in-process engine's ``warm``; ``score_words``: and
score the user's words, for a reply that weighs them: ``ReplyFactory.alone_prompt``, returning their mean
log-probability a token)."""

WORDS_TASK = "llm-warm-words"  # the task prefilling the words heard so far (``PrefixWarmup.give_way``)

MIN_HEARD_SHARE = Fraction(1, 2)
"""The words heard so far stand for the whole turn's (``PrefixWarmup.heard_gain``) when they are at least this share
of its words: a turn's first words mostly say whether it follows from the conversation ("And Spain?", "What about").
Measured on SmolLM2-135M (a probe with the engine, the 80 conversation turns of ``bench quality``, each turn's first
words against all of them, threshold 0.9): of 198 first halves or more, with the margin 0.3, 155 chose, 8 of them
otherwise than all the words, all for facts (6 kept the conversation: "What do cows give us" 1.68 nats, all of it
0.78; 2 left it out: "What is the fastest land" 0.49, all of it 1.27); no follow-up's or recalled fact's first
words chose otherwise. With the margin 0.5: 122 chose, 4 otherwise; with two thirds of the words: 95 and 2.
Partial transcripts come every 400 ms: a short turn ("And Spain?") often has none that long, and then keeps the
conversation or weighs both prompts (``history_relevance_spoken``)."""


@dataclass(frozen=True)
class HeardWeighed:
    """The warm-up's weighing of the words heard so far: the conversation it was weighed after (``related``: the
    prompt's messages before the user's), the words, and how much likelier (mean nats a token) the conversation
    made them than the words alone (``ReplyFactory.alone_prompt``)."""

    related: list[Message]
    words: tuple[str, ...]
    gain: float


class Prompts(Protocol):
    """Where the warm-up reads what the next prompt will be (``ReplyFactory`` is the real one)."""

    @property
    def settings(self) -> Settings: ...

    def warm_prefix(self) -> WarmPrefix | None:
        """The LLM's prefill, looked up at each warm-up (the LLM may be replaced; None: no prefix cache)."""
        ...

    def retry_warm_prefix(self) -> WarmPrefix | None:
        """The prefill of the prompt a reply is written again from without tools (None: no reply can be)."""
        ...

    def upcoming_prefix(self) -> list[Message]:
        """What the next turn's prompt starts with (the history)."""
        ...

    def prompt(self, user_text: str | None) -> Fitted:
        """A turn's whole prompt."""
        ...

    def alone_prompt(self, user_text: str, related: list[Message]) -> list[Message] | None:
        """The words without the conversation, when the reply will weigh the two (both are then prefilled with the
        words scored, so the reply finds the scores and the KV computed)."""
        ...


class PrefixWarmup:
    def __init__(self, prompts: Prompts, llm_needed: Callable[[], bool]) -> None:
        """``llm_needed``: a tail transcription or a reply needs the cores now (no words are prefilled)."""
        self._prompts, self._llm_needed = prompts, llm_needed
        self._task: asyncio.Task | None = None
        self._retry: asyncio.Task | None = None  # the prompt without tools, after ``_task``: optional, cancelled first
        self._closed = False
        self._heard: HeardWeighed | None = None  # the last words so far both prompts scored
        self._words_warmed: str | None = None  # the last words so far prefilled

    def next_prompt(self) -> None:
        """Prefill what the next turn's prompt will start with, while the user listens.

        The history just changed (a reply, or what of it was heard); computing its KV now,
        in the gap between turns, takes it off the next turn's critical path. Cheap when
        the prefix cache already holds most of it.
        """
        warm = self._prompts.warm_prefix()
        if warm is None or self._closed or self._prompts.settings.max_history_messages <= 0:
            return
        upcoming = self._prompts.upcoming_prefix()
        self._heard, self._words_warmed = None, None  # a new conversation to weigh words after
        for task in (self._task, self._retry):
            if task is not None:
                task.cancel()
        self._task = asyncio.create_task(self._run(warm, upcoming), name="llm-warm")
        retry = self._prompts.retry_warm_prefix()
        # after it (the next reply's own prompt is the likelier one), and given up for the user's words
        self._retry = None if retry is None else asyncio.create_task(self._after(self._task, retry, upcoming))

    def words_so_far(self, text: str) -> None:
        """Prefill the prompt with the words heard so far, while the user is still speaking.

        The reply's prompt then adds only the last words and the template's few tokens: the
        engine keeps a freed request's partial last block, and the reply's request takes it
        over (prefill costs ~4 ms a token on 2 CPU cores, and a question is 10-20 tokens).
        Skipped in the hangover and at a pause, where the tail transcription is the critical
        path; while a speculation runs or a reply is being written (its decode steps would
        wait for the prefill: the listener could hear a gap); and while an earlier warm-up runs.
        """
        warm = self._prompts.warm_prefix()
        if warm is None or self._closed or not self._prompts.settings.llm_warm_while_speaking:
            return
        if self._llm_needed() or (self._task is not None and not self._task.done()):
            return
        if text == self._words_warmed:
            return  # the same words as at the last partial: prefilled (and weighed) already
        fitted = self._prompts.prompt(text)
        if fitted.truncated_chars:
            return
        self._words_warmed = text
        if self._retry is not None:
            self._retry.cancel()  # the words heard come first: that warm-up serves only a refused call's reply
        alone = self._prompts.alone_prompt(text, fitted.messages)
        if alone is None:
            self._task = asyncio.create_task(self._run(warm, fitted.messages), name=WORDS_TASK)
        else:
            self._task = asyncio.create_task(self._weigh(warm, fitted.messages, alone, text), name=WORDS_TASK)

    def give_way(self) -> None:
        """The turn's words are known (its tail is transcribed) and a reply to them starts: a prefill of the words
        heard before them is cancelled, since the reply's own prompts hold the final words. Left to run, it took the
        reply's first steps (the words alone prefilled beside its second token: 90 ms where 35 were its own)."""
        if self._task is not None and self._task.get_name() == WORDS_TASK:
            self._task.cancel()

    def heard_gain(self, text: str, related: list[Message]) -> float | None:
        """How much likelier the conversation made the words heard so far, where they stand for ``text``'s (the
        turn's words, answered with ``related``, the prompt with the conversation): weighed after the same
        conversation, and their words begin ``text``'s (the last one may be the start of its word) and are at least
        ``MIN_HEARD_SHARE`` of them. None otherwise.

        Why: the reply then starts on the one prompt it would choose (``ReplyFactory.weigh``) instead of on both,
        whose second prefill at the pause costs the first token ~100 ms on two cores
        (app/bench/results/conversation_policy.md).
        """
        heard = self._heard
        if heard is None or heard.related != related[:-1]:
            return None
        words, count = tuple(words_of(text)), len(heard.words)
        if not MIN_HEARD_SHARE * len(words) <= count <= len(words) or words[: count - 1] != heard.words[:-1]:
            return None
        # the hypothesis's last word may be cut with its audio ("sk" for "sky"): its start is enough
        return heard.gain if words[count - 1].startswith(heard.words[-1]) else None

    async def close(self) -> None:
        """No more warm-ups (the client is gone); the one running is cancelled."""
        self._closed = True
        for task in (self._task, self._retry):
            if task is not None:
                await cancel_task(task)

    async def _weigh(self, warm: WarmPrefix, related: list[Message], alone: list[Message], text: str) -> None:
        """Prefill both prompts of the words so far with the words scored (the reply that weighs them finds the
        scores kept, ``engine.prompt_scores``) and keep how much the conversation gained them (``heard_gain``)."""
        try:
            scores = [await warm(related, score_words=True)]
            if self._llm_needed():
                return  # the turn's tail is being transcribed or answered: the cores are the reply's
            scores.append(await warm(alone, score_words=True))
        except asyncio.CancelledError:
            raise
        except Exception:  # only an optimisation: the reply weighs the words itself
            log.debug("prefix warm-up failed", exc_info=True)
            return
        heard = tuple(words_of(text))
        if scores[0] is not None and scores[1] is not None and heard:
            self._heard = HeardWeighed(related[:-1], heard, scores[0] - scores[1])

    @classmethod
    async def _after(cls, first: asyncio.Task, warm: WarmPrefix, messages: list[Message]) -> None:
        """``messages`` warmed once ``first`` has ended (however it ended)."""
        await asyncio.wait([first])
        await cls._run(warm, messages)

    @staticmethod
    async def _run(warm: WarmPrefix, messages: list[Message]) -> None:
        try:
            await warm(messages)
        except asyncio.CancelledError:
            raise
        except Exception:  # only an optimisation: the next turn computes it anyway
            log.debug("prefix warm-up failed", exc_info=True)
