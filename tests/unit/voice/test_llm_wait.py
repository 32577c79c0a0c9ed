"""``app.voice.llm_wait.bounded``: the first event waited for at most the wait, later ones as they come; a
backend's failure at any point is ``LLMUnavailable``."""

from __future__ import annotations

import asyncio

import pytest

from app.voice.llm_wait import LLMUnavailable, bounded


async def events(*script):
    """Yields each str; a number is a pause of that many seconds; an exception is raised."""
    for step in script:
        if isinstance(step, Exception):
            raise step
        if isinstance(step, float):
            await asyncio.sleep(step)
        else:
            yield step


async def collect(stream) -> list:
    return [event async for event in stream]


async def test_a_reply_that_speaks_may_then_wait_longer_than_the_first_word_may():
    """Once speaking, a reply's own request may wait (it lets other conversations go first): not cut."""
    assert await collect(bounded(events("Hello", 0.15, " there."), 0.05)) == ["Hello", " there."]


async def test_silence_before_the_first_word_past_the_wait_gives_the_reply_up():
    with pytest.raises(LLMUnavailable, match="no word from the LLM in 0.05 s"):
        await collect(bounded(events(0.5, "late"), 0.05))


async def test_a_failure_at_any_point_is_the_llm_s():
    with pytest.raises(LLMUnavailable, match="connection reset"):
        await collect(bounded(events("Hello", ConnectionError("connection reset")), 0.05))
    assert await collect(bounded(events(0.05, "ok"), None)) == ["ok"]  # no bound at all
