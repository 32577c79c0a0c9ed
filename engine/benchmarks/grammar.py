"""The cost of a grammar per generated token: decoding under a JSON-schema grammar against plain greedy decoding.

Why: a request with a grammar (a forced tool call, a ``response_format``) pays each step for its
token mask (llguidance), the mask's -inf over a float32 copy of its logits row, and advancing
its matcher; a row without one must pay nothing. Two ratios, in one run: the sampler step alone
on random logits (every row with a grammar, one row with one, against plain greedy rows), and
whole decode steps of the engine (a request whose reply is a tool call's JSON, against a plain
greedy request of as many tokens). ``parley bench engine`` prints it as its ``grammar`` section;
``python -m engine.benchmarks.grammar`` runs it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.sampling import SamplerRow, SamplingParams, sample
from engine.structured_output.grammar import GrammarCompiler, schema_grammar

# a tool call's arguments, as a voice assistant's timer or weather tool would take them
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "details": {"type": "array", "items": {"enum": ["wind", "rain", "uv", "humidity"]}, "maxItems": 4},
    },
    "required": ["city", "unit", "days", "details"],
    "additionalProperties": False,
}
QUESTION = "What will the weather be like in Paris for the next three days? I care about wind and rain."


def sampler_grammar_cost(
    tokenizer,
    vocab: int,
    eos_token_ids: tuple[int, ...],
    batch_sizes: tuple[int, ...] = (1, 8),
    reps: int = 30,
    seed: int = 0,
) -> dict:
    """Median ms of a sampler step (greedy rows) with a grammar on every row, on one row, and on none.

    The grammar rows follow their masks: each sampled token advances the row's matcher, and a
    row whose grammar is done starts again. Keys: ``grammar_sampler_ms_{plain,one,all}_bs<b>``,
    ``grammar_sampler_ratio_{one,all}_bs<b>`` (against plain).
    """
    eos = eos_token_ids[0]  # the engine's (config and generation_config): a tokenizer may name none
    compiler = GrammarCompiler(tokenizer, vocab, eos_token_ids)
    grammar = schema_grammar(SCHEMA)
    compiler.matcher(grammar)  # the tokenizer and this grammar are built once, before any timing
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"grammar_sampler_vocab": vocab, "grammar_sampler_reps": reps}
    for b in batch_sizes:
        cases = {"plain": 0, "one": 1, "all": b} if b > 1 else {"plain": 0, "all": 1}
        rows = {
            c: [SamplerRow(SamplingParams(grammar=grammar if i < n else None), None, (), [], (eos,)) for i in range(b)]
            for c, n in cases.items()
        }
        for case_rows in rows.values():
            for row in case_rows:
                row.grammar = compiler.state(grammar) if row.params.grammar else None
        times: dict[str, list[float]] = {c: [] for c in cases}
        for rep in range(reps + 1):  # the first round warms up
            logits = torch.randn(b, vocab, generator=gen) * 4
            for c in cases:
                t = time.perf_counter()
                tokens, _ = sample(logits, rows[c])
                for row, token in zip(rows[c], tokens, strict=True):
                    if row.grammar is not None and (row.grammar.accept(token) or row.grammar.matcher.is_stopped()):
                        row.grammar = compiler.state(grammar)
                if rep:
                    times[c].append(time.perf_counter() - t)
        for c in cases:
            out[f"grammar_sampler_ms_{c}_bs{b}"] = statistics.median(times[c]) * 1e3
        for c in cases:
            if c != "plain":
                out[f"grammar_sampler_ratio_{c}_bs{b}"] = (
                    out[f"grammar_sampler_ms_{c}_bs{b}"] / out[f"grammar_sampler_ms_plain_bs{b}"]
                )
    out["grammar_sampler_batch_sizes"] = list(batch_sizes)
    return out


def _decode_ms_per_token(engine, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    """ms per token after the first (the decode steps alone), and the number of tokens."""
    rid = engine.add_request(None, prompt, params)
    stamps: list[float] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.token_ids_delta:
                stamps += [time.perf_counter()] * len(o.token_ids_delta)
    return (stamps[-1] - stamps[0]) * 1e3 / max(1, len(stamps) - 1), len(stamps)


def decode_grammar_cost(engine, reps: int = 3, max_tokens: int = 96) -> dict:
    """Decode ms per token of a greedy request under ``SCHEMA``'s grammar against a plain greedy one of as
    many tokens (EOS ignored), interleaved ``reps`` times; the medians and their ratio."""
    prompt = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    grammar = schema_grammar(SCHEMA)
    t = time.perf_counter()
    engine.grammars.tokenizer()
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.check_grammar(grammar)
    compile_ms = (time.perf_counter() - t) * 1e3
    forced = SamplingParams(max_tokens=max_tokens, grammar=grammar)
    _, n = _decode_ms_per_token(engine, prompt, forced)  # warm, and the length the plain request matches
    plain = SamplingParams(max_tokens=n, ignore_eos=True)
    with_grammar, without = [], []
    for _ in range(reps):
        with_grammar.append(_decode_ms_per_token(engine, prompt, forced)[0])
        without.append(_decode_ms_per_token(engine, prompt, plain)[0])
    ms_json, ms_plain = statistics.median(with_grammar), statistics.median(without)
    return {
        "grammar_tokenizer_build_s": build_s,
        "grammar_compile_ms": compile_ms,
        "grammar_decode_tokens": n,
        "grammar_decode_reps": reps,
        "grammar_decode_ms_per_token_plain": ms_plain,
        "grammar_decode_ms_per_token_json": ms_json,
        "grammar_decode_ratio": ms_json / ms_plain,
    }


def report_lines(r: dict) -> list[str]:
    """The section's lines: the sampler step and the decode step, with and without a grammar."""
    lines = []
    if "grammar_sampler_batch_sizes" in r:
        lines.append(
            f"grammar cost per sampler step (greedy, vocab {r['grammar_sampler_vocab']}, median of "
            f"{r['grammar_sampler_reps']}; ms, x plain):"
        )
        for b in r["grammar_sampler_batch_sizes"]:
            row = f"  bs{b}: plain {r[f'grammar_sampler_ms_plain_bs{b}']:.3f}"
            for c, what in (("one", "one row with a grammar"), ("all", "every row with one")):
                if f"grammar_sampler_ms_{c}_bs{b}" in r:
                    row += f"; {what} {r[f'grammar_sampler_ms_{c}_bs{b}']:.3f} ({r[f'grammar_sampler_ratio_{c}_bs{b}']:.2f}x)"
            lines.append(row)
    else:
        lines.append(f"grammar cost per sampler step: n/a ({r.get('grammar_error', 'not run')})")
    if "grammar_decode_ratio" in r:
        lines.append(
            f"grammar cost per decoded token (a {r['grammar_decode_tokens']}-token JSON tool call, greedy, median of "
            f"{r['grammar_decode_reps']}): {r['grammar_decode_ms_per_token_json']:.2f} ms against "
            f"{r['grammar_decode_ms_per_token_plain']:.2f} plain = {r['grammar_decode_ratio']:.3f}x; "
            f"once: vocabulary {r['grammar_tokenizer_build_s']:.2f} s, this schema {r['grammar_compile_ms']:.1f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.benchmarks.grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled", help="model directory or .gguf (default: the bundled model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30, help="sampler steps per case (the decode runs 3 times)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", num_threads=args.threads)
    engine = LLMEngine(config)
    r = sampler_grammar_cost(
        engine.tokenizer, engine.runner.model.args.vocab_size, engine.eos_token_ids, reps=args.reps
    )
    r.update(decode_grammar_cost(engine))
    print("\n".join(report_lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
