"""Grammar-constrained decoding: each format's call grammar, the sampler's mask step, and the engine with a grammar
request beside plain ones (the bundled model, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from tool_models import EOS, family_tokenizer, schema_errors

import engine.sampling as sampling_mod
from engine.request_state import lazy_trigger
from engine.sampling import SamplerRow, SamplingParams, make_generator, sample
from engine.structured_output.formats import HERMES, LLAMA3, MISTRAL, PLAIN_JSON
from engine.structured_output.grammar import (
    GrammarCompiler,
    LazyGrammar,
    grammar_bias,
    lazy_call_grammar,
    opener_ids,
    schema_grammar,
    tool_call_grammar,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("get_time", {"type": "object", "properties": {}})]
GOOD = '{"city": "Paris", "unit": "celsius"}'
# (family, format, a call as the model writes it: {args} and {name} filled in)
CALLS = [
    ("hermes", HERMES, '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'),
    ("llama3", LLAMA3, '{{"name": "{name}", "parameters": {args}}}'),
    ("mistral", MISTRAL, '[TOOL_CALLS] [{{"name": "{name}", "arguments": {args}}}]'),
    (None, PLAIN_JSON, '{{"name": "{name}", "arguments": {args}}}'),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("families")
    return {None: tokenizer} | {f: family_tokenizer(root, f) for f in ("hermes", "llama3", "mistral")}


def _accepts(compiler: GrammarCompiler, grammar: str, ids: list[int]) -> bool:
    state = compiler.state(grammar)
    return all(state.accept(t) is None for t in ids) and state.matcher.is_accepting()


@pytest.mark.parametrize(("family", "fmt", "call"), CALLS)
def test_a_call_grammar_takes_exactly_the_formats_calls_of_the_tools(tokenizers, family, fmt, call):
    tok = tokenizers[family]
    compiler = GrammarCompiler(tok, len(tok), [EOS])
    markers = {m: tok.convert_tokens_to_ids(m) for m in fmt.markers if m in tok.get_vocab()}
    grammar = tool_call_grammar(fmt, TOOLS, parallel=False, marker_ids=markers)

    def ids(name: str, args: str) -> list[int]:
        return tok(call.format(name=name, args=args), add_special_tokens=False)["input_ids"]

    assert _accepts(compiler, grammar, ids("get_weather", GOOD))
    assert _accepts(compiler, grammar, ids("get_time", "{}"))
    assert not _accepts(compiler, grammar, ids("get_weather", '{"city": "Paris", "unit": "kelvin"}'))
    assert not _accepts(compiler, grammar, ids("get_weather", '{"city": "Paris"}'))
    assert not _accepts(compiler, grammar, ids("get_news", "{}"))
    assert not _accepts(compiler, grammar, ids("get_weather", '{"city": "Paris",  "unit": "celsius"}'))  # spacing


def test_parallel_calls_are_allowed_only_when_asked(tokenizers):
    tok = tokenizers["hermes"]
    compiler = GrammarCompiler(tok, len(tok), [EOS])
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    two = tok(f"{one}\n{one}", add_special_tokens=False)["input_ids"]
    markers = {"<tool_call>": 3, "</tool_call>": 4}
    assert _accepts(compiler, tool_call_grammar(HERMES, TOOLS, True, markers), two)
    assert not _accepts(compiler, tool_call_grammar(HERMES, TOOLS, False, markers), two)


def _rows(tokenizer, n: int, grammar_rows: dict[int, str], compiler: GrammarCompiler) -> list[SamplerRow]:
    rows = []
    for i in range(n):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, grammar=grammar_rows.get(i))
        state = compiler.state(params.grammar) if params.grammar else None
        rows.append(SamplerRow(params, make_generator(params, "cpu", i), [5, 6], [], (EOS,), grammar=state))
    return rows


def test_a_lazy_grammar_keeps_text_free_and_a_bare_call_well_formed(tokenizers):
    """The default brain writes Hermes calls bare: a reply that opens with "{" is held to one call (a declared tool
    within its schema, or another name with flat, short arguments, which the caller says it has not got)."""
    tok = tokenizers["hermes"]
    compiler = GrammarCompiler(tok, len(tok), [EOS])
    lazy = lazy_call_grammar(HERMES, TOOLS, opener_ids(tok))
    assert tok.convert_tokens_to_ids("{") in lazy.openers and lazy.triggers == ()
    assert all(tok.decode([t]).startswith("{") for t in lazy.openers)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    assert _accepts(compiler, lazy.grammar, ids(f'{{"name": "get_weather", "arguments": {GOOD}}}'))
    assert _accepts(compiler, lazy.grammar, ids('{"name": "play_music", "arguments": {"song": "Yesterday"}}'))
    # what a 0.5B model wrote for get_time (no arguments): its own schema again, nested until its token cap
    assert not _accepts(compiler, lazy.grammar, ids('{"name": "get_time", "arguments": {"type": "object", "p": {}}}'))
    assert not _accepts(compiler, lazy.grammar, ids('{"name": "get_time", "arguments": {}}\n{"name": "get_time"'))
    state = compiler.state(lazy.grammar)
    for t in ids('{"name": "get_time", "arguments": {}}'):
        assert state.accept(t) is None
    allowed = torch.isfinite(grammar_bias([state], len(tok))[0]).nonzero().flatten().tolist()
    assert allowed == [EOS]  # one call, then the reply ends (its results come in the next round)


def test_the_engine_starts_a_lazy_grammar_only_at_its_trigger():
    lazy = LazyGrammar("unused", triggers=(7,), openers=(3,))
    row = SamplerRow(SamplingParams(lazy_grammar=lazy), output_token_ids=[])
    assert lazy_trigger(row, 3) and lazy_trigger(row, 7)
    assert not lazy_trigger(row, 5)
    later = SamplerRow(SamplingParams(lazy_grammar=lazy), output_token_ids=[5])
    assert lazy_trigger(later, 7) and not lazy_trigger(later, 3)  # "{" opens only a reply
    assert not lazy_trigger(SamplerRow(SamplingParams(), output_token_ids=[]), 3)


def test_the_mask_constrains_only_its_own_rows(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [EOS])
    vocab = len(tokenizer)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 4
    digits = schema_grammar({"type": "integer"})
    alone, _ = sample(logits, _rows(tokenizer, 4, {}, compiler))
    mixed, errors = sample(logits, _rows(tokenizer, 4, {1: digits, 2: digits}, compiler))
    assert errors == [None] * 4
    assert [mixed[0], mixed[3]] == [alone[0], alone[3]]  # rows without a grammar: the same tokens
    for t in (mixed[1], mixed[2]):
        assert set(tokenizer.decode([t])) <= set("-0123456789"), tokenizer.decode([t])


def test_rows_without_a_grammar_never_compute_a_mask(tokenizer, monkeypatch):
    def boom(*_):
        raise AssertionError("a mask was computed")

    monkeypatch.setattr(sampling_mod, "grammar_bias", boom)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [EOS])
    logits = torch.randn(3, len(tokenizer))
    tokens, errors = sample(logits, _rows(tokenizer, 3, {}, compiler))
    assert errors == [None] * 3 and tokens[1] == int(logits[1].argmax())


NUMBERS = {
    "type": "object",
    "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
        "label": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["home", "work"]}, "maxItems": 2},
    },
    "required": ["minutes", "label", "tags"],
    "additionalProperties": False,
}


def test_plain_requests_keep_their_greedy_tokens_beside_a_grammar_request(engine, prompts, hf_reference):
    plain = SamplingParams(max_tokens=12)
    forced = SamplingParams(max_tokens=60, grammar=schema_grammar(NUMBERS))
    ids = [engine.add_request(None, p, plain) for p in prompts[:3]]
    json_id = engine.add_request(None, prompts[3], forced)
    out: dict[str, list[int]] = {i: [] for i in [*ids, json_id]}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids_delta)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for rid, prompt in zip(ids, prompts[:3], strict=True):
        assert out[rid] == hf_reference(prompt, 12)
    assert reasons[json_id] == "stop", reasons
    value = json.loads(engine.tokenizer.decode(out[json_id], skip_special_tokens=True))
    assert schema_errors(value, NUMBERS) == []


def test_an_invalid_grammar_fails_its_request_only(engine, prompts):
    bad = schema_grammar({"type": "strin"})
    engine.add_request("bad-grammar", prompts[0], SamplingParams(max_tokens=4, grammar=bad))
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.error_type == "invalid_request" and "strin" in out.error
    with pytest.raises(ValueError, match="strin"):
        engine.check_grammar(bad)


def test_the_grammar_cost_benchmark_reports_both_ratios(engine):
    from engine.benchmarks.grammar import decode_grammar_cost, report_lines, sampler_grammar_cost

    r = sampler_grammar_cost(engine.tokenizer, len(engine.tokenizer), engine.eos_token_ids, batch_sizes=(1, 2), reps=2)
    r |= decode_grammar_cost(engine, reps=1, max_tokens=24)
    for key in ("grammar_sampler_ratio_all_bs1", "grammar_sampler_ratio_one_bs2", "grammar_decode_ratio"):
        assert r[key] > 0, key
    assert r["grammar_decode_tokens"] > 1
    text = "\n".join(report_lines(r))
    assert "every row with one" in text and "per decoded token" in text
