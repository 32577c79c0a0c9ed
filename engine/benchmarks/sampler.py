"""The sampler's cost per step: vLLM's sampling features against plain greedy and temperature sampling.

Why: each feature runs once over the rows that use it, and a feature no row uses must cost
nothing; this measures that on the same random logits in one run (``parley bench engine``
prints it as its ``sampler`` section; ``python -m engine.benchmarks.sampler`` runs it alone).
A step is what ``LLMEngine`` does with a batch of logits: ``sample`` and, when a row asks,
``token_logprobs``. Rows carry a prompt and an output so the penalties count real histories.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from engine.sampling import SamplerRow, SamplingParams, make_generator, sample, token_logprobs

_BIAS = {i * 97: 1.5 for i in range(10)}
# a chat's 16 earlier replies of 60 tokens that the prompt leaves out, for DRY to read (``dry_context``)
_EARLIER_REPLIES = tuple(tuple(random.Random(k).randrange(1000) for _ in range(60)) for k in range(16))
_EVERYTHING = dict(
    temperature=0.8,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    frequency_penalty=0.3,
    presence_penalty=0.3,
    logit_bias=_BIAS,
    min_tokens=1000,
    max_tokens=1000,
    logprobs=5,
    dry_multiplier=0.8,
)
# name -> (what it is, the params of every row); "one_row_everything" puts _EVERYTHING on row 0 only
CASES: dict[str, tuple[str, dict]] = {
    "greedy": ("plain greedy (baseline)", {}),
    "temperature": ("temperature 0.8 (baseline)", {"temperature": 0.8}),
    "top_k_top_p": ("temperature, top_k 50, top_p 0.9", {"temperature": 0.8, "top_k": 50, "top_p": 0.9}),
    "min_p": ("temperature, min_p 0.05", {"temperature": 0.8, "min_p": 0.05}),
    "penalties_greedy": (
        "greedy, repetition 1.1 + frequency 0.3 + presence 0.3",
        {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
    ),
    "bias_min_tokens": (
        "greedy, 10-id logit_bias, min_tokens",
        {"logit_bias": _BIAS, "min_tokens": 1000, "max_tokens": 1000},
    ),
    "logprobs_greedy": ("greedy, logprobs with top 5", {"logprobs": 5}),
    "dry_greedy": ("greedy, DRY 0.8", {"dry_multiplier": 0.8}),
    "dry_context_greedy": (
        "greedy, DRY 0.8 + 16 earlier replies (960 ids)",
        {"dry_multiplier": 0.8, "dry_context": _EARLIER_REPLIES},
    ),
    "everything": ("all of the above on every row", _EVERYTHING),
    "one_row_everything": ("all of the above on one row, the rest plain greedy", {}),
}


def _rows(name: str, batch: int, vocab: int, prompt_tokens: int, output_tokens: int, rng: random.Random):
    rows = []
    for i in range(batch):
        kw = _EVERYTHING if (name == "one_row_everything" and i == 0) else CASES[name][1]
        params = SamplingParams(seed=i, **kw)
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        output = [rng.randrange(vocab) for _ in range(output_tokens)]
        rows.append(SamplerRow(params, make_generator(params, "cpu", i), prompt, output, stop_token_ids=(0, 1)))
    return rows


def _step(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    tokens, _ = sample(logits, rows)
    if any(r.params.logprobs is not None for r in rows):
        token_logprobs(logits, rows, tokens)


def sampler_cost(
    vocab: int,
    batch_sizes: tuple[int, ...] = (1, 8),
    dtype: torch.dtype = torch.float32,
    prompt_tokens: int = 500,
    output_tokens: int = 256,
    reps: int = 30,
    seed: int = 0,
) -> dict:
    """Median ms per step of each case at each batch size, and its ratio to greedy and to temperature.

    Keys: ``sampler_ms_<case>_bs<b>``, ``sampler_vs_greedy_<case>_bs<b>``, ``sampler_vs_temperature_<case>_bs<b>``.
    The cases are timed interleaved (one step of each in turn), so a busy moment hits them all alike.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"sampler_vocab": vocab, "sampler_dtype": str(dtype).removeprefix("torch."), "sampler_reps": reps}
    out["sampler_prompt_tokens"], out["sampler_output_tokens"] = prompt_tokens, output_tokens
    for b in batch_sizes:
        logits = (torch.randn(b, vocab, generator=gen) * 4).to(dtype)
        cases = [c for c in CASES if b > 1 or c != "one_row_everything"]
        rows = {c: _rows(c, b, vocab, prompt_tokens, output_tokens, rng) for c in cases}
        times: dict[str, list[float]] = {c: [] for c in cases}
        for c in cases:  # warm: first calls allocate, and build each request's prompt mask once
            _step(logits, rows[c])
        for _ in range(reps):
            for c in cases:
                t = time.perf_counter()
                _step(logits, rows[c])
                times[c].append(time.perf_counter() - t)
        for c in cases:
            ms = statistics.median(times[c]) * 1e3
            out[f"sampler_ms_{c}_bs{b}"] = ms
        for c in cases:
            ms = out[f"sampler_ms_{c}_bs{b}"]
            out[f"sampler_vs_greedy_{c}_bs{b}"] = ms / out[f"sampler_ms_greedy_bs{b}"]
            out[f"sampler_vs_temperature_{c}_bs{b}"] = ms / out[f"sampler_ms_temperature_bs{b}"]
    out["sampler_batch_sizes"] = list(batch_sizes)
    return out


def report_lines(r: dict) -> list[str]:
    """The section's table: ms per step and the ratios, per case and batch size."""
    if "sampler_batch_sizes" not in r:
        return [f"sampler cost: n/a ({r.get('sampler_error', 'not run')})"]
    bss = r["sampler_batch_sizes"]
    lines = [
        f"sampler cost per step ({r['sampler_dtype']} logits, vocab {r['sampler_vocab']}, rows with a "
        f"{r['sampler_prompt_tokens']}-token prompt and {r['sampler_output_tokens']} output tokens, "
        f"median of {r['sampler_reps']}; x greedy / x temperature)",
        f"{'case':<54}" + "".join(f"{f'bs{b} ms':>10}{'x greedy':>10}{'x temp':>8}" for b in bss),
    ]
    for case, (what, _) in CASES.items():
        row = f"{what:<54}"
        for b in bss:
            ms = r.get(f"sampler_ms_{case}_bs{b}")
            if ms is None:
                row += f"{'-':>10}{'':>10}{'':>8}"
                continue
            row += f"{ms:>10.3f}{r[f'sampler_vs_greedy_{case}_bs{b}']:>10.2f}{r[f'sampler_vs_temperature_{case}_bs{b}']:>8.2f}"
        lines.append(row)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.benchmarks.sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152, help="logits width (SmolLM2's vocabulary by default)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = sampler_cost(args.vocab, tuple(args.batch_sizes), getattr(torch, args.dtype), reps=args.reps)
    print("\n".join(report_lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
