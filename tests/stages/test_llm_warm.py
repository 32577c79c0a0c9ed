"""Prefix warm-up between turns: the engine backend computes the next prompt's start ahead of time."""

from __future__ import annotations

import pytest

from app.stages.base import GenerationSettings, ReplyRequest
from app.stages.llm_engine import EngineChatLLM, Rendered
from engine.config import EngineConfig

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def llm():
    config = EngineConfig(dtype="bfloat16", device="cpu", num_threads=1)
    backend = EngineChatLLM(config)
    yield backend
    backend.close()


HISTORY = [
    {"role": "system", "content": "You are a helpful AI assistant named Parley. Keep your answers short."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris, a city known for its art and its food."},
]


async def test_warm_prefix_is_a_prefix_of_the_next_prompt_and_is_reused(llm):
    engine = llm.engine.engine
    warm_ids = llm.engine.apply_chat_template(HISTORY, add_generation_prompt=False)
    nxt = [*HISTORY, {"role": "user", "content": "And the capital of Spain?"}]
    next_ids = llm.engine.apply_chat_template(nxt)
    assert next_ids[: len(warm_ids)] == warm_ids  # the template only appends: the cache can match

    await llm.warm(HISTORY)
    assert llm.idle()  # the warm-up is done with: no request in the LLM
    hits_before = engine.kv.prefix_hit_tokens
    async for _ in llm.stream(ReplyRequest(nxt, "after-warm", GenerationSettings(max_tokens=3))):
        assert not llm.idle()  # (a reply streaming)
    assert llm.idle()
    full_blocks = len(warm_ids) // engine.config.block_size * engine.config.block_size
    assert engine.kv.prefix_hit_tokens - hits_before >= full_blocks
    assert engine.stats()["kv_blocks_used"] == 0  # neither request holds blocks afterwards


async def test_dry_reads_the_earlier_replies_the_prompt_leaves_out(llm):
    """A reply said before, not in the prompt (the policy left it out), is not said again word for word."""
    settings = GenerationSettings(max_tokens=16, temperature=0.0, dry_multiplier=0.8)
    question = [HISTORY[0], HISTORY[1]]

    async def reply(request_id: str, earlier_replies: tuple[str, ...] = ()) -> str:
        request = ReplyRequest(question, request_id, settings, earlier_replies=earlier_replies)
        return "".join([d async for d in llm.stream(request)])

    first = await reply("first")
    again = await reply("again")
    other = await reply("other", (first,))
    assert len(first.split()) >= 4 and again == first  # greedy: the same reply, but for DRY's context
    assert other != first
    assert llm.engine.engine.stats()["kv_blocks_used"] == 0
    # bounded, newest first: a Realtime client may put long assistant messages in the conversation
    from engine.sampling import MAX_DRY_CONTEXT_TOKENS

    def dry_context(earlier: tuple[str, ...], sampling: GenerationSettings = settings):
        return llm._params(
            ReplyRequest(question, "p", sampling, earlier_replies=earlier), Rendered([1]), None
        ).dry_context

    context = dry_context(("one two three", *["word " * 20000] * 12))
    assert sum(map(len, context)) == MAX_DRY_CONTEXT_TOKENS  # each long one cut to DRY_REPLY_CHARS
    assert 1 < len(context) < 12 and len(context[-1]) < 1000  # the oldest left out
    assert dry_context((first,), GenerationSettings()) == ()  # without DRY: nothing to read
