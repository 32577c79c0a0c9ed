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
        ids, logits, scored = real(sched)
        if "bad" in ids:
            logits = logits.clone()
            logits[ids.index("bad"), 5] = float("nan")
        return ids, logits, scored

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


# ------------------------------------------------------------------ vLLM's sampling features, end to end
@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True).eval()


def test_repetition_penalty_and_min_tokens_match_transformers(engine, prompts, hf_model):
    # transformers' greedy generate with the same processors is the reference: RepetitionPenaltyLogitsProcessor
    # (prompt + output, positive logits divided) and MinNewTokensLengthLogitsProcessor (EOS held back)
    prompt = prompts[-1]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.3,
            min_new_tokens=20,
            eos_token_id=list(engine.eos_token_ids),
        )[0, len(prompt) :].tolist()
    got = tokens(collect(engine, prompt, SamplingParams(max_tokens=24, repetition_penalty=1.3, min_tokens=20)))
    assert got == ref
    assert not set(got[:20]) & set(engine.eos_token_ids)


def test_penalized_requests_in_a_crowd_equal_them_alone(engine, prompts):
    mine = [
        SamplingParams(max_tokens=10, repetition_penalty=1.5, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5, presence_penalty=1.0, min_p=0.05, logit_bias={13: 2.0}),
    ]
    alone = [tokens(collect(engine, prompts[i], p, rid=f"alone{i}")) for i, p in enumerate(mine)]
    others = [
        SamplingParams(max_tokens=8, temperature=1.0, top_k=20),
        SamplingParams(max_tokens=8, frequency_penalty=-1.0),
        SamplingParams(max_tokens=8, logprobs=3),
    ]
    for j, p in enumerate(others):
        engine.add_request(f"other{j}", prompts[j + 3], p)
    for i, p in enumerate(mine):
        engine.add_request(f"crowd{i}", prompts[i], p)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids_delta)
    assert [got[f"crowd{i}"] for i in range(2)] == alone


def test_logprobs_come_with_every_token(engine, prompts):
    outs = collect(engine, prompts[0], SamplingParams(max_tokens=6, logprobs=4, ignore_eos=True))
    entries = [e for o in outs for e in o.logprobs]
    assert [e.token_id for e in entries] == tokens(outs)
    for e in entries:
        assert len(e.top) == 4 and e.top[0] == (e.token_id, pytest.approx(e.logprob))  # greedy: the top token
        assert e.logprob <= 0 and [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
    assert all(o.logprobs is None for o in collect(engine, prompts[0], SamplingParams(max_tokens=2), rid="plain"))


def test_same_prompt_requests_share_the_prefix_cache(make_engine, prompts):
    eng = make_engine(block_size=16)
    prompt = prompts[-1]
    assert len(prompt) > 32
    params = SamplingParams(max_tokens=2, temperature=1.0)
    for i in range(3):  # the API's n choices are added like this, all at once
        eng.add_request(f"choice{i}", prompt, params)
    cached: dict[str, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            cached[o.request_id] = o.num_cached_tokens
    assert cached["choice0"] == 0
    assert cached["choice1"] >= (len(prompt) - 1) // 16 * 16 and cached["choice2"] >= cached["choice1"]


def test_token_ids_outside_the_vocabulary_are_refused(engine, prompts):
    vocab = engine.runner.model.args.vocab_size
    for p in (
        SamplingParams(stop_token_ids=(vocab,)),
        SamplingParams(logit_bias={vocab + 5: 1.0}),
        SamplingParams(dry_multiplier=0.8, dry_context=[[1, vocab]]),
    ):
        outs = collect(engine, prompts[0], p)
        assert outs[-1].finish_reason == "error" and "outside the vocabulary" in outs[-1].error


def test_dry_sequence_breakers_are_the_tokens_holding_them(engine, tokenizer):
    breakers = engine.state_builder.dry_breakers(("\n", ":"))
    for text in ("\n", "\n\n", ":", " :"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] in breakers, text
    assert not {tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("hello", " the", ",")} & breakers
    assert engine.state_builder.dry_breakers(("\n", ":")) is breakers  # decoded once per set
