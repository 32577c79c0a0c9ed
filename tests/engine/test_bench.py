"""``parley bench engine``: the workload is fixed and well-formed, and a quick run writes every figure.

No timing assertions: the machine is shared and noisy; only types and sanity are checked.
"""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.throughput import DATA_PATH, history_turns, main, make_workload
from engine.metrics import percentile

REQUIRED_KEYS = {
    "engine_tokens_per_s": float,
    "hf_sequential_tokens_per_s": float,
    "hf_static_tokens_per_s": float,
    "hf_continuous_tokens_per_s": (float, type(None)),
    "engine_ttft_ms_p50": float,
    "engine_ttft_ms_p95": float,
    "prefix_cached_ttft_ratio": float,
    "int8_decode_speedup_bs1": (float, type(None)),
    "int8_decode_speedup_bs8": (float, type(None)),
    "int8_weight_memory_ratio": (float, type(None)),
    "int8_perplexity_ratio": (float, type(None)),
    "int8_prefill_speedup_burst4x24": (float, type(None)),
    "int8_prefill_speedup_long1x384": (float, type(None)),
    "grammar_decode_ratio": float,
    "quick": bool,
}


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    return list(tokenizer(DATA_PATH.read_text(), add_special_tokens=False)["input_ids"])


def test_workload_is_seeded_and_has_exact_lengths(tokenizer, text_ids):
    a = make_workload(tokenizer, text_ids, 32, (20, 500), (16, 128), seed=0)
    b = make_workload(tokenizer, text_ids, 32, (20, 500), (16, 128), seed=0)
    assert a == b
    assert a != make_workload(tokenizer, text_ids, 32, (20, 500), (16, 128), seed=1)
    assert all(20 <= len(r.prompt) <= 500 and 16 <= r.max_tokens <= 128 for r in a)
    assert len(text_ids) >= 500  # prompts are cut from the shipped text
    # Every prompt is a chat prompt that ends with the assistant cue.
    ends = {tuple(r.prompt[-3:]) for r in a}
    assert len(ends) == 1


def test_second_turn_prompt_starts_with_the_history(tokenizer, text_ids):
    history, turn2 = history_turns(tokenizer, text_ids, 0, 300)
    assert abs(len(history) - 300) <= 8
    assert turn2[: len(history)] == history and len(turn2) > len(history)


def test_percentile():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0
    assert percentile([], 50) is None


@pytest.mark.slow
@pytest.mark.models
def test_quick_bench_writes_all_figures(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "(d) parley engine" in printed and "targets:" in printed
    r = json.loads(out.read_text())
    for key, types in REQUIRED_KEYS.items():
        assert key in r, key
        assert isinstance(r[key], types), (key, r[key])
    assert r["quick"] is True
    for key in ("engine_tokens_per_s", "hf_sequential_tokens_per_s", "hf_static_tokens_per_s"):
        assert r[key] > 0
    assert 0 < r["engine_ttft_ms_p50"] <= r["engine_ttft_ms_p95"]
    assert r["prefix_cached_ttft_ratio"] > 0
    assert r["prefix_cached_tokens"] > 0  # the second turn really hit the cache
    if r["hf_continuous_tokens_per_s"] is None:
        assert r.get("hf_continuous_error")  # a reason is given when (c) is unavailable
    if r["int8_available"]:
        assert r["int8_weight_memory_ratio"] < 1
        assert 0.5 < r["int8_perplexity_ratio"] < 2
    else:
        assert r.get("int8_error")
    # Our forward in fp32 agrees with transformers on the perplexity of the shipped text.
    assert r["fp32_perplexity"] == pytest.approx(r["hf_fp32_perplexity"], rel=1e-3)
