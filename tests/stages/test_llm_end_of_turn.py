"""The in-process engine's end-of-turn signal on the bundled model: finished words end a turn more likely
than the same words cut mid-clause (clear pairs only; the calibration set is `parley bench turn-end`)."""

from __future__ import annotations

import math

import pytest

from app.stages.base import GenerationSettings, ReplyRequest, StandAlone, TurnEndVerdict
from app.stages.llm_engine import EngineChatLLM
from engine.config import EngineConfig

pytestmark = pytest.mark.models


SHORT = GenerationSettings(max_tokens=3)


@pytest.fixture(scope="module")
def llm():
    backend = EngineChatLLM(EngineConfig(dtype="bfloat16", device="cpu", num_threads=1))
    yield backend
    backend.close()


CONVERSATION = [{"role": "system", "content": "You are a helpful AI assistant named Parley. Keep your answers short."}]
PAIRS = [
    ("Set a timer for ten minutes.", "Set a timer for"),
    ("Can you tell me a joke about cats?", "Can you tell"),
    ("I would like to hear a song by the Beatles.", "I would like to hear"),
    ("Remind me to call my mother tomorrow.", "Remind me to call"),
    ("Please say hello to my sister.", "Please say hello to"),
]


def test_the_template_s_end_of_turn_token_is_found(llm):
    token, after = llm.marks.turn_end
    assert llm.engine.tokenizer.convert_ids_to_tokens(token) == "<|im_end|>" and after >= 1


@pytest.mark.parametrize(("finished", "cut"), PAIRS)
async def test_finished_words_end_the_turn_far_more_likely_than_words_cut_mid_clause(llm, finished, cut):
    complete = await llm.end_of_turn_probability(CONVERSATION, finished)
    paused = await llm.end_of_turn_probability(CONVERSATION, cut)
    assert 0 <= paused < 1e-3 < 1e-2 < complete <= 1  # apart by orders of magnitude, not a borderline margin


async def test_whisper_s_period_on_cut_off_words_changes_nothing(llm):
    bare = await llm.end_of_turn_probability(CONVERSATION, "Turn off the lights in the")
    period = await llm.end_of_turn_probability(CONVERSATION, "Turn off the lights in the.")
    # the same prompt (bfloat16 sums differ a little once its prefix is cached)
    assert period < 1e-3 and math.log10(period) == pytest.approx(math.log10(bare), abs=0.3)


async def test_no_words_no_verdict_and_no_request_left_behind(llm):
    assert await llm.end_of_turn_probability(CONVERSATION, " . ") is None
    await llm.end_of_turn_probability(CONVERSATION, "What time is it?")
    assert llm.engine.engine.stats()["kv_blocks_used"] == 0


async def test_a_follow_up_is_answered_with_its_exchange_and_a_question_of_its_own_without(llm):
    """A request weighing the words alone (``ReplyRequest.alone``), what ``history_relevance_nats`` uses: an elliptical follow-up gains nats a token from the
    exchange it follows; a question that stands alone gains about nothing (probe: +2.2 against +0.6). Both prompts
    start at once; the one chosen goes on under the reply's request id, the other is aborted at its first token."""
    exchange = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
    ]
    aborted_before = llm.engine.engine.stats()["requests_aborted_total"]

    async def weigh(words: str, request_id: str) -> tuple[float, str]:
        said = {"role": "user", "content": words}
        gains: list[float | None] = []
        alone = StandAlone([*CONVERSATION, said], min_gain_nats=1.4, on_weighed=gains.append)
        answered_by = None
        request = ReplyRequest([*CONVERSATION, *exchange, said], request_id, SHORT, alone=alone)
        async for _ in llm.stream(request):
            answered_by = answered_by or llm._engine_id(request_id)
        [gain] = gains
        assert gain is not None
        return gain, answered_by

    follow_up, follow_up_by = await weigh("And what about Spain?", "follow-up")
    own, own_by = await weigh("How many legs does a spider have?", "own")
    assert follow_up > own + 0.8  # 2.2, 0.6
    assert (follow_up_by, own_by) == ("follow-up", "own-alone")
    assert llm._engine_ids == {} and llm.engine.engine.stats()["kv_blocks_used"] == 0
    assert llm.engine.engine.stats()["requests_aborted_total"] == aborted_before + 2


async def test_the_warm_up_scores_the_words_as_the_weighed_reply_does(llm):
    """``warm(score_words=True)`` returns the words' mean log-probability a token, which the prefix warm-up weighs the
    words heard so far with (``PrefixWarmup.heard_gain``): the gain of the two prompts is a weighing request's."""
    exchange = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
    ]
    said = {"role": "user", "content": "And what about Spain?"}
    related, alone = [*CONVERSATION, *exchange, said], [*CONVERSATION, said]
    warmed = await llm.warm(related, score_words=True) - await llm.warm(alone, score_words=True)
    gains: list[float | None] = []
    async for _ in llm.stream(ReplyRequest(related, "weighed", SHORT, alone=StandAlone(alone, 1.4, gains.append))):
        pass
    assert gains[0] is not None and abs(warmed - gains[0]) < 0.1  # the same scores (bfloat16 sums may differ)
    assert warmed > 1.0  # a follow-up: 2.2 nats a token
    assert await llm.warm(related) is None  # not asked to score
    assert llm.engine.engine.stats()["kv_blocks_used"] == 0


async def _read_by_reply(llm, messages: list[dict], request_id: str) -> tuple[float | None, str]:
    """The verdict a reply to ``messages`` reads from its own prefill, and the reply's text."""
    verdict = TurnEndVerdict()
    position = llm.turn_end_position(messages)
    assert position is not None
    verdict.take(position)
    request = ReplyRequest(messages, request_id, SHORT, turn_end=verdict)
    text = "".join([delta async for delta in llm.stream(request)])
    return await verdict.wait(), text


@pytest.mark.parametrize(("finished", "cut"), PAIRS[:3])
async def test_a_reply_reads_the_verdict_from_its_own_prefill_as_the_verdict_asked_apart(llm, finished, cut):
    """One prefill for both (``TurnEndVerdict``): the reply's prompt up to the user's last word is the verdict's,
    so the distribution there gives the same P; and the reply is written (its greedy tokens may differ from a plain
    ``stream``'s: bfloat16 sums differ a little where the prefix cache served other positions)."""
    for words in (finished, cut, finished.rstrip(".?")):
        messages = [*CONVERSATION, {"role": "user", "content": words}]
        apart = await llm.end_of_turn_probability(CONVERSATION, words)
        read, text = await _read_by_reply(llm, messages, f"read-{words}")
        # the same P up to bfloat16 sums (batched or cached differently): well within what the endpoint's rule sees
        assert math.log10(read) == pytest.approx(math.log10(apart), abs=0.3), (words, read, apart)
        assert text.strip()
    assert llm.engine.engine.stats()["kv_blocks_used"] == 0


async def test_a_reply_whose_prompt_does_not_continue_the_verdict_s_reads_none(llm):
    assert llm.turn_end_position([*CONVERSATION, {"role": "user", "content": " ?"}]) is None  # no words
    assert llm.turn_end_position([*CONVERSATION, {"role": "assistant", "content": "Hi."}]) is None  # not the user's
    verdict = TurnEndVerdict()  # (not taken): the reply is written as without it, the verdict None
    messages = [*CONVERSATION, {"role": "user", "content": "What time is it?"}]
    text = "".join([delta async for delta in llm.stream(ReplyRequest(messages, "untaken", SHORT, turn_end=verdict))])
    assert text and await verdict.wait() is None
