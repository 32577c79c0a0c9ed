"""Prompt log-probabilities (``SamplingParams.prompt_logprobs_from``) against transformers' own logits.

The voice turn decides what history the model sees from how much likelier the user's words are after the last
exchange (``app.voice.history``): these figures must be the model's, whatever was cached, chunked or batched.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def hf_logprobs(model_path):
    """The log-probability of each token of a prompt given those before it, from transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True).eval()

    def ref(prompt: list[int]) -> list[float]:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        return [logits[i - 1, prompt[i]].item() for i in range(1, len(prompt))]

    return ref


def first_outputs(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Each request's output that brought its first token (the prompt's scores come with it, once), all requests
    in the engine at once."""
    ids = [engine.add_request(None, p, q) for p, q in zip(prompts, params, strict=True)]
    found: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            if out.token_ids_delta and out.request_id not in found:
                found[out.request_id] = out
            else:
                assert out.prompt_logprobs is None and out.prompt_top_logprobs is None, "they come once"
    return [found[i] for i in ids]


def scored(
    engine: LLMEngine, prompts: list[list[int]], first: int | list[int], to: int | None = None
) -> list[tuple[float, ...]]:
    """Each prompt's log-probabilities from ``first`` on (to ``to``), all requests in the engine at once."""
    firsts = first if isinstance(first, list) else [first] * len(prompts)
    params = [SamplingParams(max_tokens=2, prompt_logprobs_from=f, prompt_logprobs_to=to) for f in firsts]
    return [out.prompt_logprobs for out in first_outputs(engine, prompts, params)]


def close(found, expected) -> None:
    assert len(found) == len(expected)
    assert max(abs(a - b) for a, b in zip(found, expected, strict=True)) < 2e-3, (found, expected)


def test_prompt_logprobs_equal_transformers_alone_batched_and_chunked(make_engine, prompts, hf_logprobs):
    chosen = [p for p in prompts if len(p) >= 12][:3]
    expected = [hf_logprobs(p) for p in chosen]
    for engine in (make_engine(), make_engine(max_num_batched_tokens=16, enable_prefix_caching=False)):
        # the whole prompt but its first token, and its last 5 tokens only
        for found, want in zip(scored(engine, chosen, 1), expected, strict=True):
            close(found, want)
        tails = scored(engine, chosen, [len(p) - 5 for p in chosen])
        for found, want in zip(tails, expected, strict=True):
            close(found, want[-5:])


def test_a_cached_prefix_still_gives_the_scored_tokens(make_engine, prompts, hf_logprobs):
    """The prefix cache serves the tokens before the scored ones, and the scored ones only once their scores are
    kept (``engine.prompt_scores``): a prompt scored again is served whole, with the same scores."""
    engine = make_engine(block_size=4)
    prompt = max(prompts, key=len)
    first = len(prompt) - 6
    expected = hf_logprobs(prompt)[first - 1 :]
    engine.add_request(None, prompt, SamplingParams(max_tokens=1))  # the whole prompt is in the cache now
    while engine.has_unfinished():
        engine.step()
    before = engine.scheduler.kv.prefix_hit_tokens
    (found,) = scored(engine, [prompt], first)
    close(found, expected)
    hit = engine.scheduler.kv.prefix_hit_tokens - before
    assert 0 < hit <= first - 1  # served from the cache up to the token before the first scored one
    before = engine.scheduler.kv.prefix_hit_tokens
    (again,) = scored(engine, [prompt], first)
    assert again == found and engine.prompt_scores.hits_total == len(found)
    assert engine.scheduler.kv.prefix_hit_tokens - before > first  # the scored tokens too, this time


def test_scores_kept_serve_a_longer_prompt_up_to_where_it_differs(make_engine, prompts, hf_logprobs):
    """What a voice turn does: the words heard so far are scored while the user speaks, the reply's prompt adds
    the rest; each score is the model's after exactly its own prefix."""
    engine = make_engine(block_size=4)
    prompt = max(prompts, key=len)
    first, said = len(prompt) - 8, len(prompt) - 4
    scored(engine, [prompt[:said]], first)  # the words so far
    (found,) = scored(engine, [prompt], first)
    close(found, hf_logprobs(prompt)[first - 1 :])
    assert engine.prompt_scores.hits_total == said - first  # the shorter prompt's scores, all of them


def test_prompt_logprobs_to_ends_the_scored_tokens(make_engine, prompts, hf_logprobs):
    engine = make_engine()
    prompt = max(prompts, key=len)
    first, to = len(prompt) - 8, len(prompt) - 3
    (found,) = scored(engine, [prompt], first, to)
    close(found, hf_logprobs(prompt)[first - 1 : to - 1])
    with pytest.raises(ValueError, match="prompt_logprobs_to"):
        SamplingParams(prompt_logprobs_from=4, prompt_logprobs_to=4)
    with pytest.raises(ValueError, match="prompt_logprobs_to"):
        SamplingParams(prompt_logprobs_to=4)


def test_no_prompt_logprobs_unless_asked(engine, prompts):
    rid = engine.add_request(None, prompts[0], SamplingParams(max_tokens=2))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs and all(o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_from_must_be_a_position_with_a_token_before_it():
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        SamplingParams(prompt_logprobs_from=0)


@pytest.fixture(scope="module")
def hf_distributions(model_path):
    """Each position's next-token log-probabilities over the vocabulary, from transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True).eval()

    def ref(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return ref


def test_prompt_top_logprobs_and_named_tokens_equal_transformers(make_engine, prompts, hf_distributions):
    """What a voice reply reads at the user's last word (the end-of-turn verdict): the likeliest tokens there and a
    named token's log-probability whatever its rank, from the reply's own prefill, batched beside a request that
    asks for none, with a prefix that was cached, and chunked."""
    prompt = max(prompts, key=len)
    at = len(prompt) - 3  # the position whose next token (prompt[at]) is scored
    expected = hf_distributions(prompt)[at - 1]
    rare = int(expected.argsort()[len(expected) // 2])  # a token of middling rank, far outside any top 20
    params = SamplingParams(
        max_tokens=2,
        prompt_logprobs_from=at,
        prompt_logprobs_to=at + 1,
        prompt_top_logprobs=5,
        prompt_logprobs_token_ids=(rare, int(prompt[at])),
    )
    for engine in (make_engine(block_size=4), make_engine(max_num_batched_tokens=8, enable_prefix_caching=False)):
        engine.generate([prompt[: at + 1]], SamplingParams(max_tokens=1))  # its start is in the prefix cache now
        found, plain = first_outputs(engine, [prompt, prompts[0]], [params, SamplingParams(max_tokens=2)])
        assert plain.prompt_top_logprobs is None and plain.prompt_logprobs is None
        (position,) = found.prompt_top_logprobs
        assert position.token_id == prompt[at] and abs(position.logprob - expected[prompt[at]].item()) < 2e-3
        want_top = expected.topk(5)
        assert [t for t, _ in position.top] == want_top.indices.tolist()
        assert max(abs(lp - w) for (_, lp), w in zip(position.top, want_top.values.tolist(), strict=True)) < 2e-3
        assert [t for t, _ in position.named] == [rare, prompt[at]]
        assert abs(position.named[0][1] - expected[rare].item()) < 5e-3
        assert position.named[1][1] == position.logprob


def test_prompt_distributions_need_scored_positions_and_known_tokens(engine, prompts):
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        SamplingParams(prompt_top_logprobs=3)
    with pytest.raises(ValueError, match="prompt_top_logprobs"):
        SamplingParams(prompt_logprobs_from=2, prompt_top_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs_token_ids"):
        SamplingParams(prompt_logprobs_from=2, prompt_logprobs_token_ids=(-1,))
    vocab = engine.runner.model.args.vocab_size
    rid = engine.add_request(
        None, prompts[0], SamplingParams(prompt_logprobs_from=2, prompt_logprobs_token_ids=(vocab,))
    )
    (out,) = [o for o in engine.step() if o.request_id == rid]
    assert out.finish_reason == "error" and "prompt_logprobs_token_ids" in out.error
