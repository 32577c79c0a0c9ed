"""Warming the LLM's prefix cache for the next turn, while nobody waits on the LLM.

A turn's prompt is mostly known before the turn: the history (between turns) and the words
heard so far (while the user speaks). Prefilling it then takes that prefill off the next
reply's critical path. Only an LLM that keeps a prefix cache can do it (``warm_of`` gives None
otherwise: nothing happens), and it is only an optimisation: a failure is logged and ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from app.config import Settings
from app.stages.base import Message
from app.voice.context import Fitted
from app.voice.reply import cancel_task

log = logging.getLogger(__name__)

WarmPrefix = Callable[..., Awaitable[None]]
"""Prefill these messages into the LLM's prefix cache (the in-process engine's ``warm``; ``score_words``: and
score the user's words, for a reply that weighs them: ``ReplyFactory.alone_prompt``)."""


class PrefixWarmup:
    def __init__(
        self,
        warm_of: Callable[[], WarmPrefix | None],
        *,
        settings: Callable[[], Settings],
        upcoming_prefix: Callable[[], list[Message]],
        prompt: Callable[[str], Fitted],
        llm_needed: Callable[[], bool],
        alone_prompt: Callable[[str, list[Message]], list[Message] | None] = lambda text, related: None,
    ) -> None:
        """``warm_of``: the LLM's prefill, looked up at each warm-up (the LLM may be replaced; None: no prefix cache);
        ``upcoming_prefix``: what the next turn's prompt starts with (the history); ``prompt``: a turn's whole
        prompt; ``llm_needed``: a tail transcription or a reply needs the cores now (no words are prefilled);
        ``alone_prompt``: the words without the conversation, when the reply will weigh the two (both are then
        prefilled with the words scored, so the reply finds the scores and the KV computed).
        """
        self._alone_prompt = alone_prompt
        self._warm_of = warm_of
        self._settings, self._upcoming_prefix, self._prompt, self._llm_needed = (
            settings,
            upcoming_prefix,
            prompt,
            llm_needed,
        )
        self._task: asyncio.Task | None = None
        self._closed = False

    def next_prompt(self) -> None:
        """Prefill what the next turn's prompt will start with, while the user listens.

        The history just changed (a reply, or what of it was heard); computing its KV now,
        in the gap between turns, takes it off the next turn's critical path. Cheap when
        the prefix cache already holds most of it.
        """
        warm = self._warm_of()
        if warm is None or self._closed or self._settings().max_history_messages <= 0:
            return
        upcoming = self._upcoming_prefix()
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._run(warm, [upcoming]), name="llm-warm")

    def words_so_far(self, text: str) -> None:
        """Prefill the prompt with the words heard so far, while the user is still speaking.

        The reply's prompt then adds only the last words and the template's few tokens: the
        engine keeps a freed request's partial last block, and the reply's request takes it
        over (prefill costs ~4 ms a token on 2 CPU cores, and a question is 10-20 tokens).
        Skipped in the hangover and at a pause, where the tail transcription is the critical
        path; while a speculation runs or a reply is being written (its decode steps would
        wait for the prefill: the listener could hear a gap); and while an earlier warm-up runs.
        """
        warm = self._warm_of()
        if warm is None or self._closed or not self._settings().llm_warm_while_speaking:
            return
        if self._llm_needed() or (self._task is not None and not self._task.done()):
            return
        fitted = self._prompt(text)
        if fitted.truncated_chars:
            return
        alone = self._alone_prompt(text, fitted.messages)
        prompts = [fitted.messages] if alone is None else [fitted.messages, alone]
        self._task = asyncio.create_task(self._run(warm, prompts, score_words=alone is not None), name="llm-warm-words")

    async def close(self) -> None:
        """No more warm-ups (the client is gone); the one running is cancelled."""
        self._closed = True
        if self._task is not None:
            await cancel_task(self._task)

    @staticmethod
    async def _run(warm: WarmPrefix, prompts: list[list[Message]], *, score_words: bool = False) -> None:
        try:
            for messages in prompts:
                await (warm(messages, score_words=True) if score_words else warm(messages))
        except asyncio.CancelledError:
            raise
        except Exception:  # only an optimisation: the next turn computes it anyway
            log.debug("prefix warm-up failed", exc_info=True)
