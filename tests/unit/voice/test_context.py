"""The prompt fitted to the context by tokens; over-long turns truncated with a notice, never failed."""

from __future__ import annotations

from app import protocol
from app.voice.context import TRUNCATION_MARK, fit_to_context


def words(messages) -> int:
    return sum(len(m["content"].split()) + 4 for m in messages)


SYSTEM = {"role": "system", "content": "Be brief."}


def exchange(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"answer {i} " * 5}]


def test_a_prompt_that_fits_is_untouched():
    messages = [SYSTEM, *exchange(1), {"role": "user", "content": "hi"}]
    fitted = fit_to_context(messages, words, 1000)
    assert fitted.messages == messages and not fitted.dropped_messages and not fitted.truncated_chars


def test_oldest_exchanges_go_first_and_the_window_starts_at_a_user_message():
    history = [m for i in range(10) for m in exchange(i)]
    messages = [SYSTEM, *history, {"role": "user", "content": "now"}]
    fitted = fit_to_context(messages, words, 100)
    assert words(fitted.messages) <= 100
    assert fitted.messages[0] == SYSTEM and fitted.messages[-1]["content"] == "now"
    assert fitted.messages[1]["role"] == "user"
    assert fitted.messages[1:-1] == history[-len(fitted.messages[1:-1]) :]  # the newest are kept
    assert fitted.dropped_messages % 2 == 0 and fitted.dropped_messages > 0


def test_a_single_over_long_message_is_cut_at_a_word():
    long = " ".join(f"w{i}" for i in range(500))
    fitted = fit_to_context([SYSTEM, *exchange(1), {"role": "user", "content": long}], words, 60)
    last = fitted.messages[-1]["content"]
    assert words(fitted.messages) <= 60 and len(fitted.messages) == 2
    assert last.endswith(TRUNCATION_MARK) and long.startswith(last.removesuffix(TRUNCATION_MARK))
    assert fitted.truncated_chars > 0


async def test_an_over_long_typed_turn_is_answered_with_a_notice_and_the_next_turn_too(conversation):
    conv = conversation(llm_max_tokens=50)
    conv.llm.context_tokens = 200  # budget 150 "tokens" (words here)
    await conv.type(" ".join(["word"] * 300))  # within the 2000-character frame limit, over the budget
    [notice] = conv.of(protocol.Notice)
    assert notice.code == "truncated" and notice.turn_id == 1
    assert words(conv.llm.calls[-1]) <= 150
    assert conv.of(protocol.TurnDone)[-1].turn_id == 1 and not conv.of(protocol.Error)
    await conv.type("And now a short one?")
    assert conv.of(protocol.TurnDone)[-1].turn_id == 2 and not conv.of(protocol.Error)
    assert words(conv.llm.calls[-1]) <= 150
    assert conv.llm.calls[-1][-1]["content"] == "And now a short one?"


async def test_history_in_memory_is_bounded(conversation):
    conv = conversation(max_history_messages=4)
    for i in range(60):
        await conv.type(f"Question number {i}?")
    assert len(conv.session.history) <= 32 + 2
    assert conv.session.history[-1]["role"] == "assistant"
    assert conv.llm.calls[-1][-1]["content"] == "Question number 59?"
    assert len(conv.llm.calls[-1]) <= 1 + 4 + 1
