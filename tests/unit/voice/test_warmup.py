"""The prefix warm-up on its own: a recording ``warm``, scripted session state, no LLM.

What the conversation warms and when (a partial, a reply recorded) is checked in test_conversation;
here, when the unit starts, skips, replaces and stops a warm-up.
"""

from __future__ import annotations

import asyncio
import logging

from app.config import Settings
from app.voice.context import Fitted
from app.voice.warmup import PrefixWarmup

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]


class Scene:
    """A ``PrefixWarmup`` whose ``warm`` records each prompt (and waits for ``gate`` when it is set); the scene gives it
    its prompts, as the reply factory does (``warmup.Prompts``)."""

    def __init__(self, warms: bool = True, **settings) -> None:
        self.warms = warms
        self.settings = Settings(**settings)
        self.warmed: list[list[dict]] = []
        self.finished: list[list[dict]] = []
        self.gate: asyncio.Event | None = None
        self.failure: Exception | None = None
        self.llm_needed = False
        self.truncated_chars = 0
        self.scored: list[bool] = []
        self.alone: list[dict] | None = None  # what alone_prompt says (None: the words are not weighed)
        self.related_score, self.alone_score = -1.0, -2.5
        self.retries = False  # whether a reply can be written again without tools (the session has skills)
        self.retry_warmed: list[list[dict]] = []
        self.retry_gate: asyncio.Event | None = None  # (if set) the warm-up without tools waits for it
        self.warmup = PrefixWarmup(self, lambda: self.llm_needed)

    def warm_prefix(self):
        return self._warm if self.warms else None

    def retry_warm_prefix(self):
        return self._retry_warm if self.warms and self.retries else None

    async def _retry_warm(self, messages) -> None:
        self.retry_warmed.append(messages)
        if self.retry_gate is not None:
            await self.retry_gate.wait()
        await self._warm(messages)

    def upcoming_prefix(self) -> list[dict]:
        return HISTORY

    def alone_prompt(self, text: str, related: list[dict]) -> list[dict] | None:
        return None if self.alone is None else [*self.alone, {"role": "user", "content": text}]

    async def _warm(self, messages, *, score_words: bool = False) -> float | None:
        self.warmed.append(messages)
        self.scored.append(score_words)
        if self.gate is not None:
            await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        self.finished.append(messages)
        if not score_words:
            return None
        # the words' mean log-probability a token: ``related_score`` after the conversation, else ``alone_score``
        return self.alone_score if messages[0] == (self.alone or [None])[0] else self.related_score

    def prompt(self, text: str) -> Fitted:
        return Fitted([*HISTORY, {"role": "user", "content": text}], truncated_chars=self.truncated_chars)

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)


def said(text: str) -> list[dict]:
    return [*HISTORY, {"role": "user", "content": text}]


async def test_the_next_prompt_s_start_is_warmed_and_a_newer_one_replaces_a_running_warm_up():
    scene = Scene()
    scene.gate = asyncio.Event()
    scene.warmup.next_prompt()
    await scene.settle()
    scene.warmup.next_prompt()  # the history changed again: the first warm-up is cancelled
    await scene.settle()
    scene.gate.set()
    await scene.settle()
    assert scene.warmed == [HISTORY, HISTORY] and scene.finished == [HISTORY]


async def test_the_prompt_a_refused_call_s_reply_is_written_from_is_warmed_second():
    """With skills, a reply whose call was refused as not asked is written again without tools: that prompt (the
    same conversation, no tools in its system turn) is warmed too, after the one the next reply will most likely
    use; a newer conversation replaces both."""
    scene = Scene()
    scene.retries = True
    scene.gate = asyncio.Event()
    scene.warmup.next_prompt()
    await scene.settle()
    assert scene.warmed == [HISTORY] and scene.retry_warmed == []  # the reply's own prompt first
    scene.gate.set()
    await scene.settle()
    assert scene.retry_warmed == [HISTORY] and scene.finished == [HISTORY, HISTORY]
    scene.gate.clear()
    scene.warmup.next_prompt()
    await scene.settle()
    scene.warmup.next_prompt()  # the first one is cancelled before it reaches the prompt without tools
    await scene.settle()
    scene.gate.set()
    await scene.settle()
    assert scene.retry_warmed == [HISTORY, HISTORY] and len(scene.finished) == 4


async def test_the_words_heard_are_warmed_at_once_and_the_prompt_without_tools_is_given_up_for_them():
    scene = Scene()
    scene.retries = True
    scene.retry_gate = asyncio.Event()
    scene.warmup.next_prompt()
    await scene.settle()
    assert scene.finished == [HISTORY] and scene.retry_warmed == [HISTORY]  # the one without tools under way
    scene.warmup.words_so_far("What is")  # the user speaks: not skipped for it, and it is cancelled
    await scene.settle()
    scene.retry_gate.set()
    await scene.settle()
    assert scene.warmed == scene.finished == [HISTORY, said("What is")]


async def test_no_history_warm_up_when_no_history_is_sent():
    scene = Scene(max_history_messages=0)
    scene.warmup.next_prompt()
    await scene.settle()
    assert scene.warmed == []


async def test_the_words_so_far_are_warmed_unless_a_warm_up_runs():
    scene = Scene()
    scene.gate = asyncio.Event()
    scene.warmup.words_so_far("What is")
    await scene.settle()
    scene.warmup.words_so_far("What is the capital")  # the first one still runs: skipped, not replaced
    scene.gate.set()
    await scene.settle()
    scene.warmup.words_so_far("What is the capital of")
    await scene.settle()
    scene.warmup.words_so_far("What is the capital of")  # the next partial heard the same: prefilled already
    await scene.settle()
    assert scene.warmed == [said("What is"), said("What is the capital of")] == scene.finished


async def test_words_a_reply_will_weigh_are_warmed_scored_in_both_prompts():
    scene = Scene()
    scene.warmup.words_so_far("What is")
    await scene.settle()
    scene.alone = [{"role": "system", "content": "Be brief."}]
    scene.warmup.words_so_far("What is two")
    await scene.settle()
    alone = [*scene.alone, {"role": "user", "content": "What is two"}]
    assert scene.warmed == [said("What is"), said("What is two"), alone]
    assert scene.scored == [False, True, True]


async def test_no_words_are_warmed_when_the_llm_is_needed_the_prompt_is_cut_or_the_setting_is_off():
    needed = Scene()
    needed.llm_needed = True  # a tail transcription, a speculation or a reply's writing
    cut = Scene()
    cut.truncated_chars = 12
    off = Scene(llm_warm_while_speaking=False)
    for scene in (needed, cut, off):
        scene.warmup.words_so_far("What is")
        await scene.settle()
        assert scene.warmed == []
    off.warmup.next_prompt()  # (the history's warm-up is not that setting's)
    await off.settle()
    assert off.warmed == [HISTORY]


async def test_a_reply_starting_cancels_the_words_prefill_and_its_second_prompt_never_starts():
    """Its tail transcribed, the turn is answered from its final words: a prefill of earlier words would take the
    reply's first steps. The history's warm-up is the reply's own prefix and is left to run."""
    scene = Scene()
    scene.alone = [{"role": "system", "content": "Be brief."}]
    scene.gate = asyncio.Event()
    scene.warmup.words_so_far("What is two")
    await scene.settle()
    scene.llm_needed = True  # the tail is being transcribed: the words alone are not prefilled after these
    scene.gate.set()
    await scene.settle()
    assert scene.warmed == [said("What is two")], "the words alone given up once the cores were needed"
    scene.llm_needed, scene.gate = False, asyncio.Event()
    scene.warmup.words_so_far("What is three")
    await scene.settle()
    scene.warmup.give_way()
    scene.gate.set()
    await scene.settle()
    assert scene.finished == [said("What is two")], "the running words prefill was cancelled"
    scene.gate = asyncio.Event()
    scene.warmup.next_prompt()
    await scene.settle()
    scene.warmup.give_way()
    scene.gate.set()
    await scene.settle()
    assert scene.finished[-1] == HISTORY, "the history's warm-up runs on"


async def test_without_a_prefix_cache_nothing_is_warmed():
    scene = Scene(warms=False)
    scene.warmup.next_prompt()
    scene.warmup.words_so_far("What is")
    await scene.settle()
    assert scene.warmed == []


async def test_a_failed_warm_up_is_only_a_lost_optimisation(caplog):
    scene = Scene()
    scene.failure = RuntimeError("engine busy")
    with caplog.at_level(logging.DEBUG, logger="app.voice.warmup"):
        scene.warmup.next_prompt()
        await scene.settle()
    assert "prefix warm-up failed" in caplog.text  # logged, not left in the task
    scene.failure = None
    scene.warmup.words_so_far("What is")  # the failed one is done: this one runs
    await scene.settle()
    assert scene.warmed == [HISTORY, said("What is")] and scene.finished == [said("What is")]


async def test_close_cancels_the_running_warm_up_and_starts_no_more():
    scene = Scene()
    scene.gate = asyncio.Event()
    scene.warmup.next_prompt()
    await scene.settle()
    await scene.warmup.close()
    scene.gate.set()
    scene.warmup.next_prompt()
    scene.warmup.words_so_far("What is")
    await scene.settle()
    assert scene.warmed == [HISTORY] and scene.finished == []


ALONE = [{"role": "system", "content": "Be brief, alone."}]


async def test_the_words_so_far_weighed_stand_for_a_turn_they_begin():
    scene = Scene()
    scene.alone = ALONE
    scene.warmup.words_so_far("What is the capital")
    await scene.settle()
    gain = scene.warmup.heard_gain
    related = said("What is the capital of France?")
    assert gain("What is the capital of France?", related) == 1.5  # -1.0 against -2.5 a token
    assert gain("What is the capitalism of France?", related) == 1.5  # the last word heard may be cut short
    assert gain("What is the capital", related) == 1.5  # all the words heard
    assert gain("What is the", related) is None  # fewer words than heard: another hypothesis
    assert gain("What was the capital of France?", related) is None
    assert gain("what's the capital of France", related) is None  # other words
    assert gain("What is the capital of the United Kingdom, please?", related) is None  # under half its words
    assert gain("What is the capital of France?", [{"role": "system", "content": "Other."}, *related[1:]]) is None
    scene.warmup.next_prompt()  # a reply was recorded: a new conversation to weigh words after
    await scene.settle()
    assert gain("What is the capital of France?", related) is None


async def test_words_are_not_weighed_where_one_prompt_could_not_be_scored_or_the_warm_up_is_cut_short():
    unscored = Scene()
    unscored.alone, unscored.alone_score = ALONE, None
    failing = Scene()
    failing.alone, failing.failure = ALONE, RuntimeError("engine busy")
    unweighed = Scene()  # alone_prompt gives None: no weighing at all
    for scene in (unscored, failing, unweighed):
        scene.warmup.words_so_far("What is the capital")
        await scene.settle()
        assert scene.warmup.heard_gain("What is the capital of France?", said("What is the capital of France?")) is None
    cut = Scene()
    cut.alone, cut.gate = ALONE, asyncio.Event()
    cut.warmup.words_so_far("What is the capital")
    await cut.settle()
    await cut.warmup.close()  # the client went away between the two prompts
    assert cut.warmup.heard_gain("What is the capital of France?", said("What is the capital of France?")) is None
