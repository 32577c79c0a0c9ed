"""Correctness oracle: fp32 greedy tokens equal transformers generate(do_sample=False), whatever the batch."""

from __future__ import annotations

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

N = 16  # new tokens per request (modest: HF reference generation on 2 cores is the slow part)


def run(engine: LLMEngine, prompts, n=N, add_at: dict[int, int] | None = None) -> dict[str, list[int]]:
    """Run prompts to completion; ``add_at`` maps prompt index -> step at which to add it (mid-flight)."""
    add_at = add_at or {}
    out: dict[str, list[int]] = {}
    pending = {i: add_at.get(i, 0) for i in range(len(prompts))}
    step = 0
    while pending or engine.has_unfinished():
        for i, at in list(pending.items()):
            if at <= step:
                engine.add_request(f"p{i}", prompts[i], SamplingParams(max_tokens=n))
                out[f"p{i}"] = []
                del pending[i]
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.token_ids_delta)
        step += 1
        assert step < 5000
    return out


def check(out, prompts, hf_reference, n=N):
    mismatches = [i for i, p in enumerate(prompts) if out[f"p{i}"] != hf_reference(p, n)]
    assert not mismatches, f"prompts {mismatches} differ from transformers"


def test_alone(engine, prompts, hf_reference):
    for i, p in enumerate([prompts[0], prompts[5], prompts[-1]]):
        out = run(engine, [p])
        assert out["p0"] == hf_reference(p, N), f"prompt {i}"
    assert engine.kv.num_used_blocks == 0


def test_concurrent_batch(engine, prompts, hf_reference):
    assert len(prompts) >= 8
    out = run(engine, prompts)
    check(out, prompts, hf_reference)
    assert engine.kv.num_used_blocks == 0


def test_requests_added_mid_flight(make_engine, prompts, hf_reference):
    eng = make_engine(enable_prefix_caching=False)
    add_at = {i: (i * 3) % 11 for i in range(len(prompts))}
    out = run(eng, prompts, add_at=add_at)
    check(out, prompts, hf_reference)


def test_chunked_prefill(make_engine, prompts, hf_reference):
    eng = make_engine(max_num_batched_tokens=24, enable_prefix_caching=False)
    out = run(eng, prompts)
    check(out, prompts, hf_reference)
    assert max(len(p) for p in prompts) > 24 * 3  # the long prompts really were chunked


def test_preemption_with_tiny_kv_pool(make_engine, prompts, hf_reference):
    # 40 blocks x 4 tokens for 13 requests that need 160 in all (3-104 prompt tokens + 16 new):
    # admission keeps one block of headroom per running request, decodes outgrow it
    eng = make_engine(num_blocks=40, block_size=4, enable_prefix_caching=False)
    out = run(eng, prompts)
    print("preemptions:", eng.scheduler.num_preemptions)
    assert eng.scheduler.num_preemptions > 0
    check(out, prompts, hf_reference)
    assert eng.kv.num_used_blocks == 0


def test_prefix_cache_hits(make_engine, prompts, hf_reference, tokenizer):
    eng = make_engine(block_size=16)
    story = prompts[5]
    # same long prefix, different endings; the first run fills the cache
    variants = [story, story[:-2] + tokenizer(" Later that day,")["input_ids"], story + prompts[3]]
    first = run(eng, [variants[0]])
    assert first["p0"] == hf_reference(variants[0], N)
    outs = run(eng, variants)
    check(outs, variants, hf_reference)
    cached = eng.stats()["prefix_cache_hit_rate"]
    assert cached > 0.5
    # the identical prompt hits its full blocks; its last 2 tokens are in a block the earlier runs
    # filled with their own outputs: shared by hash, never taken over (only a freed partial block is), but the
    # start it shares is copied into a block of its own
    eng.add_request("again", story, SamplingParams(max_tokens=N))
    outs = eng.step()  # the uncached last token fits one step: it prefills and gives the first token
    assert [o.request_id for o in outs] == ["again"], outs
    assert outs[0].num_cached_tokens == len(story) - 1
    tokens = list(outs[0].token_ids_delta)
    while eng.has_unfinished():
        tokens += [t for out in eng.step() for t in out.token_ids_delta]
    assert tokens == hf_reference(story, N)
    outs = run(eng, [variants[2]])  # and the block copied from still serves the prompts that continue it
    check(outs, [variants[2]], hf_reference)


def test_a_prompt_continuing_a_finished_one_computes_only_its_new_tokens(make_engine, prompts, hf_reference):
    """The voice loop warms the history, then the turn's prompt continues it: same tokens as without a cache."""
    eng = make_engine(block_size=16)
    history = prompts[5][:37]  # two full blocks and a tail of 5
    # a tail taken over, in whole or in part; a full block parted from mid-way, its start copied (the words heard
    # so far, then the final transcript: "... about it" / "... about dogs")
    cases = (("turn", history + prompts[3], 37), ("other", history[:-2] + prompts[1], 35))
    for rid, prompt, cached in (*cases, ("parted", history[:20] + prompts[1], 20)):
        run(eng, [history], n=1)  # the warm-up: its last 5 tokens stay as a tail
        eng.add_request(rid, prompt, SamplingParams(max_tokens=N))
        first = eng.step()
        assert first[0].num_cached_tokens == cached
        tokens = list(first[0].token_ids_delta)
        while eng.has_unfinished():
            tokens += [t for out in eng.step() for t in out.token_ids_delta]
        assert tokens == hf_reference(prompt, N)
    run(eng, [history], n=1)
    eng.add_request("once", history[:20] + prompts[2], SamplingParams(max_tokens=1))  # done in its one step
    (out,) = eng.step()
    assert out.finished and out.num_cached_tokens == 20
    assert eng.stats()["kv_blocks_used"] == 0  # the block it copied from is not held past that step


@pytest.mark.parametrize("block_size", [1, 7])
def test_odd_block_sizes(make_engine, prompts, hf_reference, block_size):
    eng = make_engine(block_size=block_size, num_blocks=4096 // block_size)
    sel = [prompts[0], prompts[5], prompts[-1]]
    out = run(eng, sel, add_at={2: 2})
    check(out, sel, hf_reference)
