"""Sampling, stop conditions, non-finite logits and incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling import SamplerRow, SamplingParams, make_generator, sample


def collect(engine, prompt, params, rid="r"):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def tokens(outs):
    return [t for o in outs for t in o.token_ids_delta]


def test_seeded_sampling_is_deterministic_whatever_the_batch(engine, prompts):
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    alone = tokens(collect(engine, prompts[1], p))
    # same request in a crowd: other (unseeded) sampled requests must not disturb its stream
    for i in range(4):
        engine.add_request(f"other{i}", prompts[i + 2], SamplingParams(max_tokens=6, temperature=1.0))
    crowd = tokens(collect(engine, prompts[1], p, rid="again"))
    assert alone == crowd
    other_seed = tokens(collect(engine, prompts[1], SamplingParams(max_tokens=8, temperature=0.9, seed=99)))
    assert other_seed != alone


def test_top_k_1_equals_greedy(engine, prompts):
    greedy = tokens(collect(engine, prompts[0], SamplingParams(max_tokens=10)))
    topk1 = tokens(collect(engine, prompts[0], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3)))
    assert greedy == topk1


def test_sampler_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    seen_k, seen_p = set(), set()
    for s in range(200):
        pk = SamplingParams(temperature=1.0, top_k=2, seed=s)
        seen_k.add(sample(logits, [SamplerRow(pk, make_generator(pk, "cpu", 0))])[0][0])
        pp = SamplingParams(temperature=1.0, top_p=0.5, seed=s)
        seen_p.add(sample(logits, [SamplerRow(pp, make_generator(pp, "cpu", 0))])[0][0])
    assert seen_k == {0, 1}
    assert seen_p == {0}  # p(token 0) = 0.64 >= 0.5 already


def test_stop_string_is_trimmed(engine, tokenizer):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = "".join(o.text_delta for o in collect(engine, prompt, SamplingParams(max_tokens=12)))
    assert " 8" in full, full  # the model continues counting
    outs = collect(engine, prompt, SamplingParams(max_tokens=12, stop=(" 8",)), rid="s")
    text = "".join(o.text_delta for o in outs)
    assert text == full[: full.index(" 8")]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert engine.kv.num_used_blocks == 0


def test_stop_token_ids(engine, tokenizer):
    prompt = "Count: 1, 2, 3, 4, 5,"
    toks = tokens(collect(engine, prompt, SamplingParams(max_tokens=8)))
    stop_id = toks[3]
    outs = collect(engine, prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop_id,)), rid="s")
    assert tokens(outs) == toks[: toks.index(stop_id) + 1]
    assert outs[-1].finish_reason == "stop"


def test_max_tokens_and_length_reason(engine, prompts):
    outs = collect(engine, prompts[5], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(tokens(outs)) == 3 and outs[-1].finish_reason == "length"
    assert outs[0].num_prompt_tokens == len(prompts[5])


def test_rejected_request_reports_error(make_engine):
    eng = make_engine(num_blocks=4, block_size=16)
    outs = collect(eng, list(range(10, 60)), SamplingParams(max_tokens=20))
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "error"
    assert "KV blocks" in outs[0].error


def test_non_finite_logits_finish_with_error(engine, prompts, monkeypatch):
    real = engine.runner.execute

    def poisoned(sched):
        ids, logits = real(sched)
        if "bad" in ids:
            logits = logits.clone()
            logits[ids.index("bad"), 5] = float("nan")
        return ids, logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    engine.add_request("good", prompts[0], SamplingParams(max_tokens=4))
    outs = collect(engine, prompts[1], SamplingParams(max_tokens=4), rid="bad")
    assert len(outs) == 1 and outs[0].finish_reason == "error"
    assert outs[0].token_ids_delta == () and "non-finite" in outs[0].error
    assert engine.kv.num_used_blocks == 0


def test_detokenizer_never_splits_multibyte_characters(tokenizer):
    text = "Café ☕ and 🎉 naïve 日本語 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer)
    parts = [d.add([t], finished=False)[0] for t in ids]
    parts.append(d.add([], finished=True)[0])
    assert "".join(parts) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in parts)
    assert sum(1 for p in parts if p == "") > 0  # some tokens held back half a character


def test_detokenizer_holds_back_possible_stop_prefix(tokenizer):
    ids = tokenizer(" Hello User: bye", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, stop=("User:",))
    emitted, stopped = "", False
    for t in ids:
        delta, stopped = d.add([t], finished=False)
        emitted += delta
        assert "User" not in emitted
        if stopped:
            break
    assert stopped and emitted == " Hello "


@pytest.mark.parametrize(
    "kw",
    [{"temperature": 1e-40}, {"temperature": float("nan")}, {"temperature": -1.0}, {"seed": -1}, {"seed": 2**63}],
)
def test_sampling_params_refuse_values_the_sampler_cannot_use(kw):
    # 1e-40 overflowed the scaled logits; a seed outside 0..2**63-1 failed in torch's generator
    with pytest.raises(ValueError):
        SamplingParams(**kw)
    SamplingParams(temperature=1e-3, seed=2**63 - 1)
