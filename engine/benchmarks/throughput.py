"""``parley bench engine``: our engine against transformers on one mixed workload, plus prefix caching and int8.

What it measures, in one run (all on the CPU, ``--threads`` torch threads, one dtype):

1. A fixed, seeded workload of chat requests (prompts cut from ``data.txt``, a few
   public-domain English passages, inside the model's chat template; greedy, fixed output
   lengths with EOS ignored), all arriving at t=0. Tokens/s (requested output tokens / wall
   time) and TTFT p50/p95 (from t=0, so queueing counts) for (a) HF ``generate`` one request
   at a time, (b) HF ``generate`` on padded static batches sorted by length, (c) transformers'
   continuous batching if it is there and works (else null, with the reason), (d) our engine.
2. Second-turn TTFT with a ~300-token shared history: cold (no prefix cache) vs prefix-cached
   (the history was computed by the previous turn).
3. fp32 vs bf16 vs int8 (and int4) in our engine: decode tokens/s at batch 1 and 8 (prefill excluded),
   weight memory, and perplexity of ``data.txt`` computed with the engine's own forward.
4. The sampler's cost per step with vLLM's sampling features (penalties, min_p, logit_bias,
   logprobs, ...) as a ratio to plain greedy and temperature sampling (``engine/benchmarks/sampler.py``).
5. A grammar's cost (forced tool calls, ``response_format``): the sampler step and the decode step with
   and without one, as ratios (``engine/benchmarks/grammar.py``).

``--json PATH`` writes every figure as one JSON object; ``--quick`` is a small smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from engine.benchmarks.baselines import (
    BenchRequest,
    RunResult,
    hf_continuous,
    hf_continuous_available,
    hf_sequential,
    hf_static,
    load_hf_model,
)
from engine.benchmarks.grammar import decode_grammar_cost, sampler_grammar_cost
from engine.benchmarks.grammar import report_lines as grammar_report_lines
from engine.benchmarks.sampler import report_lines as sampler_report_lines
from engine.benchmarks.sampler import sampler_cost

log = logging.getLogger(__name__)

DATA_PATH = Path(__file__).with_name("data.txt")
SYSTEM = "You are a helpful assistant."
_MARK = "\u2063PARLEY_BENCH\u2063"
QUESTIONS = [
    "Who is speaking in this passage?",
    "Summarize that in one sentence.",
    "What is the mood of the text?",
    "Which word in it is the most unusual?",
    "Where does the story take place?",
    "Give the passage a short title.",
    "What happens next?",
    "Is the narrator happy?",
]

TARGETS = {
    "engine_vs_hf_sequential": 3.0,
    "engine_vs_hf_static": 1.5,
    "engine_vs_hf_continuous": 1.5,
    "prefix_cached_ttft_ratio": 0.3,
    "int8_decode_speedup_bs1": 1.5,
    "int8_weight_memory_ratio": 0.35,
    "int8_perplexity_ratio": 0.03,  # |ratio - 1| at most this
}

KV_CACHE_BYTES = 512 * 1024 * 1024  # (d) and (c): the same KV cache memory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- workload --------------------------------------------------------------------------------


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before and after the user's text in a one-turn chat prompt (system + user + assistant cue)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _MARK}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    before, after = text.split(_MARK)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return enc(before), enc(after)


def make_workload(
    tokenizer,
    text_ids: list[int],
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> list[BenchRequest]:
    """``n`` chat prompts, each of a seeded-random length in ``prompt_range`` (exactly), and output lengths."""
    rng = random.Random(seed)
    head, tail = chat_frame(tokenizer)
    reqs = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        out = rng.randint(*output_range)
        k = max(1, length - len(head) - len(tail))
        off = rng.randrange(len(text_ids))
        body = [text_ids[(off + j) % len(text_ids)] for j in range(k)]
        reqs.append(BenchRequest(head + body + tail, out))
    return reqs


def _template(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def history_turns(tokenizer, text_ids: list[int], i: int, history_tokens: int) -> tuple[list[int], list[int]]:
    """A conversation of about ``history_tokens`` tokens and the next turn's prompt (which starts with it)."""
    n_asst = history_tokens // 5
    off = (i * 97) % len(text_ids)

    def excerpt(start: int, n: int) -> str:
        return _decode(tokenizer, [text_ids[(start + j) % len(text_ids)] for j in range(max(n, 1))])

    n_user = history_tokens - n_asst
    for _ in range(3):  # re-tokenizing decoded text shifts the count a little: adjust twice
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Read this passage:\n" + excerpt(off, n_user)},
            {"role": "assistant", "content": excerpt(off + n_user + 50, n_asst)},
        ]
        history = _template(tokenizer, messages, add_generation_prompt=False)
        n_user += history_tokens - len(history)
    turn2 = _template(tokenizer, messages + [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], True)
    if turn2[: len(history)] != history:
        raise RuntimeError("the chat template is not prefix-stable; cannot build a shared history")
    return history, turn2


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# --- our engine --------------------------------------------------------------------------------


def _engine(model_name: str, dtype: str, threads: int, shared_model=None, **kw):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    kw.setdefault("kv_cache_bytes", 64 * 1024 * 1024)
    config = EngineConfig(model=model_name, dtype=dtype, device="cpu", num_threads=threads, **kw)
    return LLMEngine(config, model=shared_model)


def _warm(eng, prompt: list[int]) -> None:
    from engine.sampling import SamplingParams

    eng.generate([prompt[:24], prompt[:40]], SamplingParams(max_tokens=4, ignore_eos=True))


def run_engine(eng, reqs: list[BenchRequest]) -> RunResult:
    """(d) Every request added at t=0, then the engine steps until all are done."""
    from engine.sampling import SamplingParams

    _warm(eng, reqs[0].prompt)
    stats0 = eng.stats()
    t0 = time.monotonic()
    for i, r in enumerate(reqs):
        eng.add_request(f"bench-{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    produced = 0
    steps = 0
    while eng.has_unfinished():
        steps += 1
        for o in eng.step():
            if o.finished and o.finish_reason == "error":
                raise RuntimeError(f"engine request {o.request_id} failed: {o.error}")
            produced += len(o.token_ids_delta)
            if o.token_ids_delta and o.request_id not in first:
                first[o.request_id] = (o.first_token_time or time.monotonic()) - t0
    wall = time.monotonic() - t0
    stats = eng.stats()
    requested = sum(r.max_tokens for r in reqs)
    if produced != requested:
        raise RuntimeError(f"engine produced {produced} tokens, {requested} requested")
    return RunResult(
        "engine",
        wall,
        produced,
        list(first.values()),
        note=f"max_num_seqs={eng.config.max_num_seqs}, max_num_batched_tokens={eng.config.step_tokens()}",
        extra={
            "engine_steps": steps,
            "engine_preemptions": stats["num_preemptions_total"] - stats0["num_preemptions_total"],
        },
    )


def _ttft(eng, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request on an idle engine, and its prefix-cache hit in tokens."""
    from engine.sampling import SamplingParams

    t0 = time.monotonic()
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    ttft, cached = None, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id != rid:
                continue
            if o.finish_reason == "error":
                raise RuntimeError(o.error)
            if ttft is None and o.token_ids_delta:
                ttft = (o.first_token_time or time.monotonic()) - t0
            cached = o.num_cached_tokens
    if ttft is None:
        raise RuntimeError("no token produced")
    return ttft, cached


def prefix_cache_ttft(model_name, dtype, threads, shared_model, tokenizer, text_ids, reps, history_tokens) -> dict:
    """Second-turn TTFT: cold (prefix caching off) vs cached (the previous turn computed the shared history)."""
    cold_eng = _engine(model_name, dtype, threads, shared_model, enable_prefix_caching=False)
    hot_eng = _engine(model_name, dtype, threads, shared_model, enable_prefix_caching=True)
    _warm(cold_eng, text_ids)
    _warm(hot_eng, text_ids)
    cold, hot, hits, hist_lens, turn_lens = [], [], [], [], []
    for i in range(reps):
        history, turn2 = history_turns(tokenizer, text_ids, i, history_tokens)
        cold.append(_ttft(cold_eng, turn2)[0])
        _ttft(hot_eng, history)  # the previous turn: its prompt and answer are now in the cache
        t, cached = _ttft(hot_eng, turn2)
        hot.append(t)
        hits.append(cached)
        hist_lens.append(len(history))
        turn_lens.append(len(turn2))
    cold_ms = 1000 * statistics.median(cold)
    hot_ms = 1000 * statistics.median(hot)
    return {
        "prefix_cold_ttft_ms": cold_ms,
        "prefix_cached_ttft_ms": hot_ms,
        "prefix_cached_ttft_ratio": hot_ms / cold_ms,
        "prefix_history_tokens": round(statistics.mean(hist_lens), 1),
        "prefix_turn_prompt_tokens": round(statistics.mean(turn_lens), 1),
        "prefix_cached_tokens": round(statistics.mean(hits), 1),
        "prefix_reps": reps,
    }


# --- precision: fp32 / bf16 / int8 -----------------------------------------------------------------


def decode_tokens_per_s(eng, prompts: list[list[int]], n_tokens: int) -> float:
    """Decode rate with ``len(prompts)`` requests in the batch; the prefill steps are not timed."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    ids = {eng.add_request(None, p, params) for p in prompts}
    started: set[str] = set()
    while len(started) < len(ids) and eng.has_unfinished():
        for o in eng.step():
            if o.token_ids_delta:
                started.add(o.request_id)
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.token_ids_delta)
    return n / max(time.perf_counter() - t0, 1e-9)


def prefill_tokens_per_s(eng, prompts: list[list[int]]) -> float:
    """Prompt tokens per second when ``prompts`` arrive together, timed to their first tokens.

    Several prompts at once is what the voice server sees when users finish speaking close
    together: their prefills share one step, whose row count decides which kernel runs.
    """
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        eng.add_request(None, p, params)
    while eng.has_unfinished():
        eng.step()
    return sum(map(len, prompts)) / max(time.perf_counter() - t0, 1e-9)


# the prefill shapes timed per precision: a burst of four short prompts (one 96-row step), and one long prompt
PREFILL_SHAPES = {"burst4x24": (4, 24), "long1x384": (1, 384)}


def engine_perplexity(eng, ids: list[int]) -> float:
    """Perplexity of ``ids`` with the engine's own model forward (quantized or not), one causal prefill
    on a private KV buffer (the engine's cache and prefix blocks are not touched)."""
    return eng.perplexity(ids)


@torch.inference_mode()
def hf_perplexity(path, ids: list[int]) -> float:
    """Reference perplexity from transformers in fp32 (checks the engine's forward)."""
    model = load_hf_model(path, torch.float32)
    x = torch.tensor([ids])
    loss = model(input_ids=x, labels=x).loss
    del model
    return math.exp(loss.item())


def precision_section(
    model_name, threads, shared_bf16, text_ids, ppl_ids, decode_tokens, batch_sizes, reps: int = 3
) -> dict:
    """Decode speed, weight memory and perplexity for fp32, bf16 and int8 engines.

    All three engines are loaded, then the decode measurements are interleaved (fp32, bf16,
    int8, fp32, ...) ``reps`` times and the best of each is kept: a burst of other work on the
    shared cores then hits every variant alike instead of one of them.
    """
    out: dict = {}
    prompts = [text_ids[37 * i : 37 * i + 32] for i in range(max(batch_sizes))]
    variants = [
        ("fp32", {"dtype": "float32"}, None),
        ("bf16", {"dtype": "bfloat16"}, shared_bf16),
        ("int8", {"dtype": "float32", "quantization": "int8"}, None),
        ("int4", {"dtype": "float32", "quantization": "int4"}, None),
    ]
    engines = {}
    for name, kw, shared in variants:
        try:
            eng = _engine(model_name, kw.pop("dtype"), threads, shared, enable_prefix_caching=False, **kw)
        except Exception as e:
            if name not in ("int8", "int4"):
                raise
            reason = f"{type(e).__name__}: {e}"
            print(f"{name}: not available ({reason})", flush=True)
            out[f"{name}_error"] = reason
            continue
        engines[name] = eng
        info = eng.model_info()
        out[f"{name}_activation_dtype"] = info["dtype"]
        out[f"{name}_linear_kernel"] = info["linear_kernel"]
        out[f"{name}_weight_bytes"] = info["weight_bytes"]
        out[f"{name}_linear_weight_bytes"] = info["linear_weight_bytes"]
        decode_tokens_per_s(eng, prompts[:2], 4)  # warm-up
    for _ in range(reps):
        for b in batch_sizes:
            for name, eng in engines.items():
                key = f"{name}_decode_tokens_per_s_bs{b}"
                out[key] = max(out.get(key, 0.0), decode_tokens_per_s(eng, prompts[:b], decode_tokens))
        for shape, (count, length) in PREFILL_SHAPES.items():
            prompts = [text_ids[53 * i : 53 * i + length] for i in range(count)]
            for name, eng in engines.items():
                key = f"{name}_prefill_tokens_per_s_{shape}"
                out[key] = max(out.get(key, 0.0), prefill_tokens_per_s(eng, prompts))
    for name, eng in engines.items():
        try:
            out[f"{name}_perplexity"] = engine_perplexity(eng, ppl_ids)
        except Exception as e:
            out[f"{name}_perplexity_error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: perplexity failed ({e})", flush=True)
    out["decode_reps"] = reps
    engines.clear()
    gc.collect()
    out["int8_available"] = "int8_weight_bytes" in out

    def ratio(a: str, b: str) -> float | None:
        return out[a] / out[b] if out.get(a) is not None and out.get(b) else None

    for b in batch_sizes:
        out[f"int8_decode_speedup_bs{b}"] = ratio(f"int8_decode_tokens_per_s_bs{b}", f"fp32_decode_tokens_per_s_bs{b}")
        out[f"int8_vs_bf16_decode_speedup_bs{b}"] = ratio(
            f"int8_decode_tokens_per_s_bs{b}", f"bf16_decode_tokens_per_s_bs{b}"
        )
        out[f"bf16_decode_speedup_bs{b}"] = ratio(f"bf16_decode_tokens_per_s_bs{b}", f"fp32_decode_tokens_per_s_bs{b}")
    out["int8_weight_memory_ratio"] = ratio("int8_weight_bytes", "fp32_weight_bytes")
    out["int8_linear_weight_memory_ratio"] = ratio("int8_linear_weight_bytes", "fp32_linear_weight_bytes")
    out["int8_vs_bf16_weight_memory_ratio"] = ratio("int8_weight_bytes", "bf16_weight_bytes")
    out["int8_perplexity_ratio"] = ratio("int8_perplexity", "fp32_perplexity")
    out["int4_weight_memory_ratio"] = ratio("int4_weight_bytes", "fp32_weight_bytes")
    out["int4_perplexity_ratio"] = ratio("int4_perplexity", "fp32_perplexity")
    for shape in PREFILL_SHAPES:
        for name in ("bf16", "int8", "int4"):
            out[f"{name}_prefill_speedup_{shape}"] = ratio(
                f"{name}_prefill_tokens_per_s_{shape}", f"fp32_prefill_tokens_per_s_{shape}"
            )
    for b in batch_sizes:
        out[f"int4_decode_speedup_bs{b}"] = ratio(f"int4_decode_tokens_per_s_bs{b}", f"fp32_decode_tokens_per_s_bs{b}")
    out["bf16_perplexity_ratio"] = ratio("bf16_perplexity", "fp32_perplexity")
    out["perplexity_tokens"] = len(ppl_ids)
    return out


# --- report ------------------------------------------------------------------------------------


def _fmt(x, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _target_lines(r: dict) -> list[str]:
    lines = []

    def check(label: str, value, target: float, higher: bool, why: str = "") -> None:
        if value is None:
            lines.append(f"  {label}: not measured{why}")
            return
        ok = value >= target if higher else value <= target
        if ok:
            lines.append(f"  {label}: {value:.2f} (target {'>=' if higher else '<='} {target}) met")
        else:
            miss = target / value if higher else value / target
            lines.append(
                f"  {label}: {value:.2f} (target {'>=' if higher else '<='} {target}) MISSED by {miss:.2f}x{why}"
            )

    check("engine / (a) HF sequential", r.get("engine_vs_hf_sequential"), TARGETS["engine_vs_hf_sequential"], True)
    check("engine / (b) HF static batches", r.get("engine_vs_hf_static"), TARGETS["engine_vs_hf_static"], True)
    why_c = f" ({r['hf_continuous_error']})" if r.get("hf_continuous_error") else ""
    check(
        "engine / (c) HF continuous", r.get("engine_vs_hf_continuous"), TARGETS["engine_vs_hf_continuous"], True, why_c
    )
    check("prefix-cached / cold TTFT", r.get("prefix_cached_ttft_ratio"), TARGETS["prefix_cached_ttft_ratio"], False)
    why_q = f" ({r['int8_error']})" if r.get("int8_error") else ""
    check("int8 / fp32 decode bs1", r.get("int8_decode_speedup_bs1"), TARGETS["int8_decode_speedup_bs1"], True, why_q)
    check(
        "int8 / fp32 weight memory",
        r.get("int8_weight_memory_ratio"),
        TARGETS["int8_weight_memory_ratio"],
        False,
        why_q,
    )
    ppl = r.get("int8_perplexity_ratio")
    if ppl is None:
        lines.append(f"  int8 / fp32 perplexity: not measured{why_q}")
    else:
        tol = TARGETS["int8_perplexity_ratio"]
        verdict = "met" if abs(ppl - 1) <= tol else f"MISSED ({100 * (ppl - 1):+.1f}%)"
        lines.append(f"  int8 / fp32 perplexity: {ppl:.4f} (target within {100 * tol:.0f}%) {verdict}")
    return lines


def report(r: dict, runs: dict[str, RunResult | None]) -> str:
    w = r["workload"]
    lines = [
        "",
        f"Parley engine benchmark ({r['model']}, {r['dtype']}, {r['threads']} threads"
        + (", QUICK)" if r["quick"] else ")"),
        f"workload: {w['num_requests']} chat requests arriving at t=0, "
        f"prompts {w['prompt_min']}-{w['prompt_max']} tokens "
        f"(mean {w['prompt_mean']:.0f}), outputs {w['output_min']}-{w['output_max']} tokens "
        f"(mean {w['output_mean']:.0f}, EOS ignored), {w['output_tokens']} output tokens in all; greedy",
        "",
        f"{'system':<44}{'tok/s':>9}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'wall s':>9}{'engine x':>10}",
    ]
    labels = {
        "hf_sequential": "(a) HF generate, one request at a time",
        "hf_static": f"(b) HF generate, static batches of {r.get('static_batch_size')}",
        "hf_continuous": "(c) HF continuous batching",
        "engine": "(d) parley engine",
    }
    for key, label in labels.items():
        run = runs.get(key)
        if run is None:
            reason = r.get(f"{key}_error", "not run")
            lines.append(f"{label:<44}{'n/a':>9}   ({reason})")
            continue
        ratio = r.get(f"engine_vs_{key}") if key != "engine" else 1.0
        lines.append(
            f"{label:<44}{run.tokens_per_s:>9.1f}{run.ttft_p50_ms:>13.0f}{run.ttft_p95_ms:>13.0f}"
            f"{run.wall_s:>9.1f}{_fmt(ratio, '.2f'):>10}"
        )
    st = runs.get("hf_static")
    if st is not None and st.computed_tokens:
        lines.append(
            f"    (b) computed {st.computed_tokens} tokens for {st.output_tokens} requested (padding to batch max)"
        )
    eng = runs.get("engine")
    if eng is not None:
        lines.append(
            f"    (d) {eng.note}, {eng.extra.get('engine_steps')} steps, "
            f"{eng.extra.get('engine_preemptions')} preemptions"
        )
    lines.append("")
    if r.get("prefix_cached_ttft_ratio") is not None:
        lines.append(
            f"second-turn TTFT, {r['prefix_history_tokens']:.0f}-token shared history "
            f"({r['prefix_turn_prompt_tokens']:.0f}-token "
            f"prompt, median of {r['prefix_reps']}): cold {r['prefix_cold_ttft_ms']:.0f} ms, prefix-cached "
            f"{r['prefix_cached_ttft_ms']:.0f} ms ({r['prefix_cached_tokens']:.0f} tokens from cache), ratio "
            f"{r['prefix_cached_ttft_ratio']:.2f}"
        )
    else:
        lines.append(f"second-turn TTFT: n/a ({r.get('prefix_error', 'not run')})")
    lines.append("")
    bss = r.get("decode_batch_sizes", [1, 8])
    head = f"{'precision':<11}{'activations':<13}" + "".join(f"{'decode bs' + str(b) + ' tok/s':>20}" for b in bss)
    head += "".join(f"{'prefill ' + shape + ' tok/s':>26}" for shape in PREFILL_SHAPES)
    lines.append(head + f"{'weights MB':>12}{'linear MB':>11}{'perplexity':>12}")
    for name in ("fp32", "bf16", "int8", "int4"):
        if f"{name}_weight_bytes" not in r:
            lines.append(f"{name:<11}not available ({r.get(f'{name}_error') or r.get('precision_error') or 'not run'})")
            continue
        row = f"{name:<11}{r[f'{name}_activation_dtype']:<13}"
        row += "".join(f"{_fmt(r.get(f'{name}_decode_tokens_per_s_bs{b}')):>20}" for b in bss)
        row += "".join(f"{_fmt(r.get(f'{name}_prefill_tokens_per_s_{shape}'), '.0f'):>26}" for shape in PREFILL_SHAPES)
        row += f"{r[f'{name}_weight_bytes'] / 2**20:>12.1f}{r[f'{name}_linear_weight_bytes'] / 2**20:>11.1f}"
        row += f"{_fmt(r.get(f'{name}_perplexity'), '.3f'):>12}"
        lines.append(row)
    if r.get("decode_reps"):
        lines.append(
            f"(decode: {r.get('decode_tokens')} tokens per request after a 32-token prompt, prefill not timed, "
            f"best of {r['decode_reps']} interleaved runs; prefill: prompt tokens to the first token, "
            "burst4x24 = four 24-token prompts arriving together, long1x384 = one 384-token prompt, no prefix cache)"
        )
    if r.get("hf_fp32_perplexity") is not None:
        lines.append(
            f"(transformers fp32 perplexity of the same {r.get('perplexity_tokens')} tokens: "
            f"{r['hf_fp32_perplexity']:.3f})"
        )

    def speedups(key: str) -> str:
        return ", ".join(f"bs{b} {_fmt(r.get(f'{key}_bs{b}'), '.2f')}x" for b in bss)

    def prefill_speedups(name: str) -> str:
        return "; prefill " + ", ".join(
            f"{shape} {_fmt(r.get(f'{name}_prefill_speedup_{shape}'), '.2f')}x" for shape in PREFILL_SHAPES
        )

    if r.get("int8_available"):
        lines.append(
            "int8 vs fp32: decode "
            + speedups("int8_decode_speedup")
            + prefill_speedups("int8")
            + f"; weights {_fmt(r.get('int8_weight_memory_ratio'), '.3f')}x (linear layers "
            f"{_fmt(r.get('int8_linear_weight_memory_ratio'), '.3f')}x); "
            f"perplexity {_fmt(r.get('int8_perplexity_ratio'), '.4f')}x"
        )
        lines.append(
            "int8 vs bf16: decode "
            + speedups("int8_vs_bf16_decode_speedup")
            + f"; weights {_fmt(r.get('int8_vs_bf16_weight_memory_ratio'), '.3f')}x"
        )
    if r.get("int4_weight_bytes"):
        lines.append(
            "int4 vs fp32 (layer linears in 4-bit groups of 32, as GGUF Q4_1): decode "
            + speedups("int4_decode_speedup")
            + prefill_speedups("int4")
            + f"; weights {_fmt(r.get('int4_weight_memory_ratio'), '.3f')}x; "
            f"perplexity {_fmt(r.get('int4_perplexity_ratio'), '.4f')}x"
        )
    lines += ["", *sampler_report_lines(r)]
    lines += ["", *grammar_report_lines(r)]
    lines += ["", "targets:", *_target_lines(r), "", f"total bench time {r['bench_wall_s']:.0f} s"]
    other = r.get("other_cpu_cores")
    if other is not None:
        lines[-1] += f"; other processes kept {other:.2f} cores busy on average"
        if other > 0.25:
            lines.append(
                "WARNING: other processes were using the CPU; with 2 torch threads on 2 shared cores the "
                "figures can be many times off (see other_cpu_cores_by_section). Rerun on an idle machine."
            )
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parley bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run (well under a minute)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as one JSON object")
    p.add_argument("--model", default="bundled")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="dtype of (a)-(d) and section 2; auto: bfloat16 where the CPU computes it (oneDNN), else float32",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--requests", type=int, default=None, help="number of requests (default 32, quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine: cap on running requests")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="engine: token budget of a step (default: the engine's)",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines (a)-(c)")
    p.add_argument(
        "--hf-cb-default-budget",
        action="store_true",
        help="(c) with transformers' default max_batch_tokens instead of the engine's step budget",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    t_start = time.monotonic()
    cpu0 = _cpu_snapshot()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from engine.layers.linear import onednn_packing_available
    from engine.weights import resolve_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    if args.dtype == "auto":
        # as the app picks it: where bf16 is emulated it is far slower than fp32, and a comparison
        # in it would measure the emulation, not the engine
        args.dtype = "bfloat16" if onednn_packing_available(torch.bfloat16, "cpu") else "float32"
    quick = args.quick
    n_req = args.requests or (4 if quick else 32)
    prompt_range = (20, 96) if quick else (20, 500)
    output_range = (4, 12) if quick else (16, 128)
    prefix_reps = 2 if quick else 5
    decode_tokens = 8 if quick else 64
    batch_sizes = [1, 8]

    path = resolve_model(args.model, float32_weights=True)  # transformers, the baseline, reads the folder
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text_ids = list(tokenizer(DATA_PATH.read_text(), add_special_tokens=False)["input_ids"])
    ppl_ids = text_ids[: 128 if quick else 1024]
    reqs = make_workload(tokenizer, text_ids, n_req, prompt_range, output_range, args.seed)
    # masked out, so any id pads; a tokenizer with neither pad nor EOS (the tiny test models') pads with 0
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    plens = [len(r.prompt) for r in reqs]
    olens = [r.max_tokens for r in reqs]
    r: dict = {
        "quick": quick,
        "model": str(args.model),
        "dtype": args.dtype,
        "threads": args.threads,
        "static_batch_size": args.static_batch_size,
        "decode_batch_sizes": batch_sizes,
        "workload": {
            "num_requests": n_req,
            "seed": args.seed,
            "prompt_min": min(plens),
            "prompt_max": max(plens),
            "prompt_mean": statistics.mean(plens),
            "output_min": min(olens),
            "output_max": max(olens),
            "output_mean": statistics.mean(olens),
            "prompt_tokens": sum(plens),
            "output_tokens": sum(olens),
        },
    }
    runs: dict[str, RunResult | None] = {}
    failed = False

    def section(name: str, fn) -> None:
        nonlocal failed
        t = time.monotonic()
        snap = _cpu_snapshot()
        print(f"[bench] {name} ...", flush=True)
        try:
            fn()
        except Exception as e:
            failed = True
            r[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"[bench] {name} failed: {e}", flush=True)
            traceback.print_exc()
        other = _other_cores(snap, _cpu_snapshot())
        r.setdefault("other_cpu_cores_by_section", {})[name] = other
        busy = f" (other processes kept {other:.2f} cores busy)" if other is not None else ""
        print(f"[bench] {name} done in {time.monotonic() - t:.1f} s{busy}", flush=True)

    shared = {}

    def engine_run() -> None:
        eng = _engine(
            args.model,
            args.dtype,
            args.threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=KV_CACHE_BYTES,
        )
        shared["model"] = eng.model
        runs["engine"] = run_engine(eng, reqs)
        r.update(runs["engine"].extra)
        del eng
        gc.collect()

    def prefix_run() -> None:
        r.update(
            prefix_cache_ttft(
                args.model, args.dtype, args.threads, shared.get("model"), tokenizer, text_ids, prefix_reps, 300
            )
        )

    def precision_run() -> None:
        bf16 = shared.get("model") if args.dtype == "bfloat16" else None
        r.update(
            precision_section(
                args.model, args.threads, bf16, text_ids, ppl_ids, decode_tokens, batch_sizes, 1 if quick else 3
            )
        )
        r["decode_tokens"] = decode_tokens
        r["hf_fp32_perplexity"] = hf_perplexity(path, ppl_ids)

    hf = {}

    def hf_a() -> None:
        hf["model"] = load_hf_model(path, _DTYPES[args.dtype])
        _hf_warm(hf["model"], reqs, pad_id)
        runs["hf_sequential"] = hf_sequential(hf["model"], reqs, pad_id)

    def hf_b() -> None:
        runs["hf_static"] = hf_static(hf["model"], reqs, pad_id, args.static_batch_size)

    def hf_c() -> None:
        reason = hf_continuous_available(hf["model"])
        if reason is not None:
            r["hf_continuous_error"] = reason
            print(f"[bench] (c) unavailable: {reason}", flush=True)
            return
        try:
            from engine.config import EngineConfig

            # the same step budget as the engine's (``_engine`` builds it on the CPU)
            steps = EngineConfig(device="cpu", max_num_batched_tokens=args.max_num_batched_tokens).step_tokens()
            budget = None if args.hf_cb_default_budget else steps
            runs["hf_continuous"] = hf_continuous(hf["model"], reqs, pad_id, KV_CACHE_BYTES, budget)
        except Exception as e:  # a baseline that does not work here is reported, not fatal
            r["hf_continuous_error"] = f"{type(e).__name__}: {e}"
            print(f"[bench] (c) failed, reported as null: {r['hf_continuous_error']}", flush=True)

    def sampler_run() -> None:
        dtype = _DTYPES[args.dtype]  # the logits come in the model's dtype
        r.update(sampler_cost(len(tokenizer), tuple(batch_sizes), dtype, reps=5 if quick else 30, seed=args.seed))

    section("engine", engine_run)
    section("prefix", prefix_run)
    section("precision", precision_run)

    def grammar_run() -> None:
        eng = _engine(args.model, args.dtype, args.threads, shared.get("model"))
        reps = 5 if quick else 30
        r.update(
            sampler_grammar_cost(
                eng.tokenizer, eng.runner.model.args.vocab_size, eng.eos_token_ids, tuple(batch_sizes), reps
            )
        )
        r.update(decode_grammar_cost(eng, reps=1 if quick else 3, max_tokens=32 if quick else 96))

    section("sampler", sampler_run)
    section("grammar", grammar_run)
    shared.clear()
    gc.collect()
    if not args.skip_hf:
        section("hf_sequential", hf_a)
        if "model" in hf:
            section("hf_static", hf_b)
            section("hf_continuous", hf_c)
        hf.clear()
        gc.collect()

    for key, run in runs.items():
        r[f"{key}_tokens_per_s"] = run.tokens_per_s
        r[f"{key}_ttft_ms_p50"] = run.ttft_p50_ms
        r[f"{key}_ttft_ms_p95"] = run.ttft_p95_ms
        r[f"{key}_wall_s"] = run.wall_s
    for key in ("hf_sequential", "hf_static", "hf_continuous"):
        r.setdefault(f"{key}_tokens_per_s", None)
        d, b = r.get("engine_tokens_per_s"), r.get(f"{key}_tokens_per_s")
        r[f"engine_vs_{key}"] = d / b if d is not None and b else None
    if runs.get("hf_static") is not None:
        r["hf_static_computed_tokens"] = runs["hf_static"].computed_tokens
    for key in ("engine_tokens_per_s", "engine_ttft_ms_p50", "engine_ttft_ms_p95", "prefix_cached_ttft_ratio"):
        r.setdefault(key, None)
    for key in (
        "int8_decode_speedup_bs1",
        "int8_decode_speedup_bs8",
        "int8_weight_memory_ratio",
        "int8_perplexity_ratio",
    ):
        r.setdefault(key, None)
    r["bench_wall_s"] = time.monotonic() - t_start
    r["other_cpu_cores"] = _other_cores(cpu0, _cpu_snapshot())
    r["targets"] = TARGETS
    print(report(r, runs), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=_json_default) + "\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(monotonic s, CPU-seconds busy on the whole machine, CPU-seconds of this process), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system


def _other_cores(a, b) -> float | None:
    """Average number of cores that other processes kept busy between two snapshots."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


def _hf_warm(model, reqs: list[BenchRequest], pad_id: int) -> None:
    hf_sequential(model, [BenchRequest(reqs[0].prompt[:24], 4)], pad_id)
    hf_static(model, [BenchRequest(reqs[0].prompt[:24], 4), BenchRequest(reqs[0].prompt[:40], 4)], pad_id, 2)


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
