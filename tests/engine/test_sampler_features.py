"""The sampler's vLLM features against references computed by hand on small logits (no model loaded)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine import sampling
from engine.openai_api.protocol import ChatCompletionRequest, CompletionRequest, choice_params, sampling_defaults
from engine.sampling import (
    SamplerRow,
    SamplingParams,
    make_generator,
    process_logits,
    sample,
    token_logprobs,
    warp_logits,
)
from engine.weights import generation_defaults

NEG_INF = float("-inf")


def row(prompt=(), output=(), stops=(), seed=None, breakers=(), **kw) -> SamplerRow:
    params = SamplingParams(seed=seed, **kw)
    generator = make_generator(params, "cpu", 0)
    return SamplerRow(params, generator, list(prompt), list(output), tuple(stops), frozenset(breakers))


def processed(logits: list[list[float]], rows: list[SamplerRow]) -> list[list[float]]:
    return process_logits(torch.tensor(logits), rows).tolist()


# ------------------------------------------------------------------ each parameter by hand
def test_repetition_penalty_covers_prompt_and_output_tokens():
    # token 0 in the prompt (positive: divided), 1 in the output (negative: multiplied), 2 and 3 unseen
    got = processed([[2.0, -1.0, 0.5, 3.0]], [row(prompt=[0], output=[1, 1], repetition_penalty=2.0)])
    assert got == [[1.0, -2.0, 0.5, 3.0]]


def test_frequency_and_presence_penalties_cover_output_tokens_only():
    # output: token 1 twice, token 2 once; token 3 only in the prompt
    r = row(prompt=[3], output=[1, 2, 1], frequency_penalty=0.5, presence_penalty=0.25)
    got = processed([[2.0, -1.0, 0.5, 3.0]], [r])
    assert got == [[2.0, -1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25, 3.0]]


def test_repetition_penalty_comes_before_frequency_and_presence():
    r = row(prompt=[0], output=[1], repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    got = processed([[4.0, 3.0, -1.0]], [r])
    assert got == [[2.0, 3.0 / 2 - 1.0 - 0.5, -1.0]]


def test_negative_penalties_reward_repeats():
    got = processed([[0.0, 0.0]], [row(output=[1], presence_penalty=-1.0)])
    assert got == [[0.0, 1.0]]


def test_logit_bias_adds_to_the_given_ids():
    got = processed([[0.0, 1.0, 2.0]], [row(logit_bias={0: 5.0, 2: -100.0})])
    assert got == [[5.0, 1.0, -98.0]]
    tokens, _ = sample(torch.tensor([[0.0, 1.0, 2.0]]), [row(logit_bias={0: 5.0})])
    assert tokens == [0]  # greedy follows the bias


def test_min_tokens_holds_back_stop_tokens_until_reached():
    logits = [[1.0, 5.0, 2.0, 4.0]]  # 1 and 3 are the stop tokens
    early = row(output=[0], stops=[1, 3], min_tokens=2)
    assert processed(logits, [early]) == [[1.0, NEG_INF, 2.0, NEG_INF]]
    assert sample(torch.tensor(logits), [early])[0] == [2]
    reached = row(output=[0, 2], stops=[1, 3], min_tokens=2)
    assert processed(logits, [reached]) == logits
    assert sample(torch.tensor(logits), [reached])[0] == [1]


def test_min_p_is_relative_to_the_top_token_after_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]])
    # temperature 1: threshold 0.5 * 0.5 = 0.25 keeps tokens 0 and 1
    y = warp_logits(logits.clone(), [row(temperature=1.0, min_p=0.5)])
    assert torch.isinf(y[0, 2:]).all() and torch.isfinite(y[0, :2]).all()
    # temperature 2 flattens them (p ~ sqrt(p): .379 .293 .208 .120): the threshold .19 keeps three
    y = warp_logits(logits.clone(), [row(temperature=2.0, min_p=0.5)])
    assert torch.isfinite(y[0, :3]).all() and torch.isinf(y[0, 3])
    assert torch.allclose(y[0, :3], logits[0, :3] / 2)


def test_top_k_and_top_p_with_different_values_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    rows = [
        row(temperature=1.0, top_k=2),
        row(temperature=1.0, top_p=0.5),  # p(token 0) = 0.64 >= 0.5 already
        row(temperature=1.0, top_k=3, top_p=0.9),  # top 3 renormalized: .665 .245 .090 -> keeps 2
        row(temperature=1.0),
    ]
    y = warp_logits(logits.clone(), rows)
    kept = torch.isfinite(y).sum(dim=-1).tolist()
    assert kept == [2, 1, 2, 5]


def test_logprobs_come_from_the_raw_logits():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([[math.log(p) for p in probs]] * 2)
    rows = [
        row(logprobs=2, temperature=0.5, repetition_penalty=1.5, prompt=[3], logit_bias={0: 3.0}),
        row(logprobs=0),
    ]
    found = token_logprobs(logits, rows, [0, 2])
    assert found[0].token_id == 0 and found[0].logprob == pytest.approx(math.log(0.1), abs=1e-6)
    assert [t for t, _ in found[0].top] == [3, 2]
    assert [v for _, v in found[0].top] == pytest.approx([math.log(0.4), math.log(0.3)], abs=1e-6)
    assert found[1].token_id == 2 and found[1].logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert found[1].top == ()
    assert token_logprobs(logits, [row(), row()], [0, 1]) == [None, None]


def _dry(prompt, output=(), breakers=(), **kw) -> list[float]:
    return processed([[0.0] * 12], [row(prompt=prompt, output=output, breakers=breakers, **kw)])[0]


def test_dry_penalizes_the_token_that_would_continue_a_repeat():
    # context 1 2 3 9 1 2 3: the end "1 2 3" (length 3) occurred before, followed by 9
    # -> 9 loses multiplier * base ** (3 - allowed_length) = 1.0 * 2 ** 1
    got = _dry([1, 2, 3, 9], [1, 2, 3], dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    assert got == [0.0] * 9 + [-2.0] + [0.0] * 2
    # shorter than allowed_length: nothing
    assert _dry([1, 2, 3, 9], [1, 2, 3], dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=4) == [0.0] * 12


def test_dry_takes_each_tokens_longest_repeat():
    # context 5 1 2 7 6 1 2 8 6 1 2: "1 2" was followed by 7 (repeat of length 2: before it 5 != 6)
    # and "6 1 2" by 8 (length 3: before it 7 != 8)
    got = _dry([5, 1, 2, 7, 6, 1, 2, 8, 6, 1, 2], dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    expected = [0.0] * 12
    expected[7], expected[8] = -0.8 * 1.75**0, -0.8 * 1.75**1
    assert got == pytest.approx(expected)


def test_dry_does_not_match_across_sequence_breakers():
    kw = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    assert _dry([1, 2, 3, 9, 1, 2, 3], breakers={2}, **kw) == [0.0] * 12  # the repeat stops at 2: length 1
    assert _dry([1, 2, 3, 9, 1, 2, 3], breakers={9}, **kw) == [0.0] * 12  # a breaker is never penalized
    assert _dry([1, 2, 3, 9, 1, 2, 3], breakers={3}, **kw) == [0.0] * 12  # the context ends with a breaker


def test_dry_never_penalizes_a_stop_token():
    # a chat's earlier reply ended "1 2 3" then EOS (9): this reply may end the same way
    kw = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    assert processed([[0.0] * 12], [row([1, 2, 3, 9], [1, 2, 3], stops=(9,), **kw)])[0] == [0.0] * 12
    assert _dry([1, 2, 3, 9], [1, 2, 3], **kw)[9] == -2.0  # not a stop token of this row: penalized


def test_dry_reads_its_context_as_if_before_the_prompt():
    kw = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    # "1 2 3 9" only in dry_context (an earlier reply the prompt leaves out): the output "1 2 3" would repeat it
    got = _dry([5], [1, 2, 3], dry_context=[[1, 2, 3, 9]], **kw)
    assert got == [0.0] * 9 + [-2.0] + [0.0] * 2
    assert _dry([5], [1, 2, 3], **kw) == [0.0] * 12  # without it: nothing to repeat
    # each sequence apart, and apart from the prompt: no repeat runs across their ends ("1 2 3 9" is not one)
    assert _dry([3, 9], [1, 2, 3], dry_context=[[1], [2]], **kw) == [0.0] * 12
    assert _dry([3, 9], [1, 2, 3], dry_context=[[1, 2]], **kw) == [0.0] * 12
    # a repeat of a whole sequence has no token after it to penalize (nor the last id, -1's index)
    assert _dry([5], [1, 2], dry_context=[[1, 2]], **kw) == [0.0] * 12


def test_dry_context_is_bounded_and_refused_outside_the_vocabulary():
    with pytest.raises(ValueError):
        SamplingParams(dry_context=[[1, -2]])
    with pytest.raises(ValueError):
        SamplingParams(dry_context=[[1] * (sampling.MAX_DRY_CONTEXT_TOKENS + 1)])
    assert SamplingParams(dry_context=[[1, 2], (3,)]).dry_context == ((1, 2), (3,))  # stored hashable


def test_dry_is_off_by_default():
    assert row(prompt=[1, 2, 1, 2], output=[1]).plain_greedy
    assert not row(prompt=[1, 2, 1, 2], output=[1], dry_multiplier=0.5).plain_greedy


# ------------------------------------------------------------------ the batch
def _mixed_rows() -> list[SamplerRow]:
    return [
        row(),
        row(temperature=0.8, seed=1, top_p=0.9),
        row(prompt=[3, 4], output=[5, 5, 7], repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        row(temperature=1.2, seed=2, top_k=5, min_p=0.05, output=[1, 2], presence_penalty=0.7),
        row(logit_bias={9: 4.0, 11: -2.0}, output=[0], stops=[9], min_tokens=3),
        row(temperature=0.7, seed=3, repetition_penalty=1.8, prompt=list(range(20))),
        row(temperature=1.0, seed=4),
        row(prompt=[1, 2, 3, 9, 1, 2], output=[3], dry_multiplier=2.0, breakers={30}),
    ]


def test_rows_in_a_batch_equal_the_same_rows_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=gen) * 3
    batched, errors = sample(logits, _mixed_rows())
    assert errors == [None] * 8
    alone = [sample(logits[i : i + 1], [r])[0][0] for i, r in enumerate(_mixed_rows())]
    assert batched == alone
    # and the processed logits too (greedy and sampled rows alike)
    rows = _mixed_rows()
    whole = process_logits(logits.clone(), rows)
    for i, r in enumerate(_mixed_rows()):
        assert torch.equal(whole[i : i + 1], process_logits(logits[i : i + 1].clone(), [r]))


def test_seeded_row_draws_the_same_whatever_its_neighbours():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=gen)
    mine = dict(temperature=1.0, seed=77, min_p=0.01)
    first = sample(logits[2:3], [row(**mine)])[0][0]
    crowd = [row(temperature=1.0, seed=s) for s in (5, 6, 7)]
    crowd.insert(2, row(**mine))
    assert sample(logits, crowd)[0][2] == first


def test_greedy_without_features_is_the_raw_argmax_and_skips_processing(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a plain greedy batch must not process its logits")

    monkeypatch.setattr(sampling, "process_logits", fail)
    logits = torch.randn(5, 300).to(torch.bfloat16)
    tokens, _ = sample(logits, [row() for _ in range(5)])
    assert tokens == logits.float().argmax(-1).tolist()


def test_a_feature_no_row_uses_is_skipped(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("sorted although no row uses top_p")

    monkeypatch.setattr(torch, "sort", fail)
    logits = torch.randn(3, 50)
    sample(logits, [row(temperature=1.0, seed=1), row(temperature=1.0, top_k=4, seed=2), row(min_p=0.1)])


def test_greedy_rows_beside_processed_rows_keep_the_raw_argmax():
    logits = torch.randn(3, 40)
    tokens, _ = sample(logits, [row(), row(repetition_penalty=2.0, output=[0, 1, 2]), row()])
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()


def test_draw_follows_the_distribution_and_never_picks_a_token_without_mass():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2), 9.0]])
    r = row(temperature=1.0, seed=123, stops=[3], min_tokens=1)  # token 3 (most likely) held back: no mass
    counts = [0, 0, 0, 0]
    for _ in range(3000):
        token, error = sample(logits, [r])
        assert error == [None]
        counts[token[0]] += 1
    assert counts[3] == 0
    assert [c / 3000 for c in counts[:3]] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


def test_non_finite_rows_are_errors_and_the_others_still_sample():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 2.0, 1.0]])
    tokens, errors = sample(logits, [row(repetition_penalty=1.5, output=[2]), row(presence_penalty=2.0, output=[1])])
    assert errors[0] is not None and errors[1] is None
    assert tokens[1] == 2  # 2.0 - 2.0 = 0 < 1.0


@pytest.mark.parametrize(
    "kw",
    [
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 2.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {i: 1.0 for i in range(301)}},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"logprobs": 21},
        {"logprobs": -1},
        {"stop_token_ids": (-3,)},
        {"dry_multiplier": 5.5},
        {"dry_base": 1.0},
        {"dry_allowed_length": 0},
        {"dry_sequence_breakers": ("",)},
    ],
)
def test_sampling_params_refuse_out_of_range_features(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_logit_bias_is_stored_hashable():
    p = SamplingParams(logit_bias={5: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (5, 1.0))
    hash(p)


# ------------------------------------------------------------------ generation_config defaults
def test_generation_defaults_read_only_the_sampling_keys(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2, "do_sample": True, "min_p": None})
    )
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | kw)


def test_defaults_apply_to_unset_fields_and_requests_override_them():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    p = _chat(max_tokens=5).to_sampling_params(10, 100, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    p = _chat(max_tokens=5, temperature=0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0).to_sampling_params(
        10, 100, defaults
    )
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    p = _chat(max_tokens=5).to_sampling_params(10, 100)  # no file: OpenAI's neutral values
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_unusable_generation_config_values_are_left_out():
    found = {"temperature": 1e-9, "top_p": 0.8, "top_k": -1, "repetition_penalty": 0.0}
    assert sampling_defaults(found) == {"top_p": 0.8, "top_k": -1}


def test_request_fields_reach_the_sampling_params():
    req = _chat(
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"7": 3, "11": -1.5},
        min_tokens=4,
        logprobs=True,
        top_logprobs=3,
        stop_token_ids=[2],
    )
    p = req.to_sampling_params(10, 100)
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens, p.logprobs) == (0.5, -0.5, 4, 3)
    assert p.logit_bias == ((7, 3.0), (11, -1.5)) and p.stop_token_ids == (2,)
    assert _chat(logprobs=True).to_sampling_params(1, 100).logprobs == 0
    assert _chat().to_sampling_params(1, 100).logprobs is None
    text = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 2}).to_sampling_params(1, 100)
    assert text.logprobs == 2


def test_choices_shift_a_given_seed():
    p = SamplingParams(temperature=1.0, seed=2**63 - 1)
    assert [choice_params(p, i).seed for i in range(3)] == [2**63 - 1, 0, 1]
    unseeded = SamplingParams(temperature=1.0)
    assert choice_params(unseeded, 2) is unseeded


def test_sampler_cost_benchmark_reports_every_case():
    from engine.benchmarks.sampler import CASES, report_lines, sampler_cost

    r = sampler_cost(vocab=500, batch_sizes=(1, 2), reps=2, prompt_tokens=20, output_tokens=10)
    for case in CASES:
        assert r[f"sampler_ms_{case}_bs2"] > 0
    assert "sampler_ms_one_row_everything_bs1" not in r  # one row of one is every row
    assert r["sampler_vs_greedy_greedy_bs1"] == 1.0 and r["sampler_vs_temperature_temperature_bs2"] == 1.0
    lines = report_lines(r)
    assert len(lines) == 2 + len(CASES) and "x greedy" in lines[1]


def _top_k_top_p_by_sorting(y: torch.Tensor, k: list[int], p: list[float]) -> torch.Tensor:
    """The plain way: a threshold at each row's k-th largest, then a sort of the whole row for top-p."""
    sorted_logits, order = torch.sort(y, dim=-1, descending=True)
    kth = sorted_logits.gather(1, torch.tensor(k).unsqueeze(1) - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([pj if pj < 1.0 else math.inf for pj in p]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p, NEG_INF)
    return torch.full_like(y, NEG_INF).scatter(1, order, sorted_logits)


@pytest.mark.parametrize("tied", [False, True])
def test_top_k_top_p_on_candidates_equals_sorting_whole_rows(tied):
    # the fast path looks for each cut among the largest logits only; it must keep exactly what sorting keeps,
    # ties with the k-th included (bf16 logits tie often) and top-p masses the candidates do not reach
    gen = torch.Generator().manual_seed(3)
    vocab = 2000
    logits = torch.randn(9, vocab, generator=gen) * 3
    if tied:
        logits = logits.round()  # many equal values, at the k-th too
    logits[5] = torch.randn(vocab, generator=gen) * 0.01  # nearly flat: top_p 0.95 needs most of the row
    logits[8, 5:] = NEG_INF  # min_p / min_tokens left fewer tokens than top_k asks for
    settings = [(50, 1.0), (0, 0.9), (300, 0.8), (3, 0.5), (0, 0.3), (0, 0.95), (1000, 0.99), (7, 1.0), (50, 0.9)]
    rows = [row(temperature=1.0, top_k=k, top_p=p) for k, p in settings]
    fast = logits.clone()
    sampling._apply_top_k_top_p(fast, rows)
    reference = _top_k_top_p_by_sorting(logits, [k or vocab for k, _ in settings], [p for _, p in settings])
    kept = torch.isfinite(fast)
    assert torch.equal(fast[kept], logits[kept])
    if not tied:
        assert torch.equal(kept, torch.isfinite(reference))
        return
    # with ties the top-p cut may fall among equal logits, and which of them a sort puts first is arbitrary:
    # the same number of tokens with the same values is kept; top-k alone (threshold) keeps the same tokens
    assert torch.equal(kept.sum(dim=-1), torch.isfinite(reference).sum(dim=-1))
    for i in range(len(settings)):
        assert torch.equal(fast[i][kept[i]].sort().values, reference[i][torch.isfinite(reference[i])].sort().values)
    for i in (0, 7):
        assert torch.equal(kept[i], torch.isfinite(reference[i]))
