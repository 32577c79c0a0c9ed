"""``parley doctor --gpu``'s INT8 comparison: bf16 against each INT8 scheme, on random-weight 1B and 8B shapes.

Per shape (built in place, nothing downloaded) and precision: decode tokens/s at batch 1, 8 and 32 with CUDA
graphs (LLM.int8 cannot be captured and runs eagerly), and the weights' bytes. Per scheme, on the perplexity
source (the bundled model and the bench text where installed): perplexity over fp32's and greedy agreement with
fp32's continuations (``int8_quality``). The figures are kept for this card (``engine.int8_choice``), where
``quantization="auto"`` reads them at the next start, and the doctor prints the choice they make.

The issue's bars (8B: INT8 decode >= 1.4x bf16 at batch 1 and >= 1.0x at 32, weights <= 0.55x bf16's; 1B:
never slower at batch 8 and 32; perplexity ratio <= 1.01) are printed beside the figures, not asserted: a
slower kernel is a finding, not a broken machine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from pathlib import Path

from engine.int8_choice import SCHEMES

INT8_SIZES = ("1b", "8b")
BARS = {  # (size, batch): INT8 tokens/s over bf16's at least
    ("8b", "1"): 1.4,
    ("8b", "32"): 1.0,
    ("1b", "8"): 1.0,
    ("1b", "32"): 1.0,
}
MAX_WEIGHT_RATIO_8B = 0.55


def greedy_agreement(reference: list[list[int]], got: list[list[int]]) -> float:
    """The mean share of each greedy continuation that matches the reference's before they first part."""
    shares = []
    for ref, out in zip(reference, got, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
        shares.append(same / max(1, len(ref)))
    return sum(shares) / max(1, len(shares))


def agreement_prompts(ids: list[int], n: int = 6, length: int = 24) -> list[list[int]]:
    """``n`` windows of the perplexity text as prompts (spread over it)."""
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step : i * step + length] for i in range(n) if len(ids[i * step : i * step + length]) == length]


def int8_quality(path: Path, ids: list[int], device: str, schemes, fp32_ppl: float, new_tokens: int = 32) -> dict:
    """Per scheme: perplexity on ``ids`` over fp32's, and greedy agreement with fp32 on prompts taken from them."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    prompts = agreement_prompts(ids)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    fp32 = LLMEngine(EngineConfig(model=str(path), dtype="float32", device=device, num_blocks=64))
    reference = fp32.generate(prompts, params)
    del fp32
    out = {}
    for scheme in schemes:
        config = EngineConfig(
            model=str(path), dtype="bfloat16", quantization="int8", int8_method=scheme, device=device, num_blocks=64
        )
        with tempfile.TemporaryDirectory(prefix="parley-doctor-") as tmp, scratch_cache(Path(tmp)):
            eng = LLMEngine(config)
        out[scheme] = {
            "kernel": eng.linear_kernel,
            "perplexity_ratio": eng.perplexity(ids) / fp32_ppl,
            "greedy_agreement": greedy_agreement(reference, eng.generate(prompts, params)),
        }
        del eng
        _free(device)
    return out


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


@contextlib.contextmanager
def scratch_cache(root: Path):
    """``PARLEY_CACHE_DIR`` in the doctor's own folder while it loads random-weight models: the int8 matrices
    the engine keeps between starts (7.5 GB for the 8B shape) are of a checkpoint drawn anew each run."""
    before = os.environ.get("PARLEY_CACHE_DIR")
    os.environ["PARLEY_CACHE_DIR"] = str(root / "cache")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PARLEY_CACHE_DIR", None)
        else:
            os.environ["PARLEY_CACHE_DIR"] = before


def int8_speeds(rep, root: Path, device: str, sizes, schemes, new_tokens: int) -> tuple[dict, dict]:
    """tokens/s ``speeds[size][precision][batch]`` and weight bytes ``memory[size][precision]``."""
    from engine.doctor_measure import BATCH_SIZES, build_model, decode_speed, speed_engine

    speeds: dict = {}
    memory: dict = {}
    for size in sizes:
        started = time.perf_counter()
        path = build_model(root, size, dtype="bfloat16", device=device)
        rep.line(f"  built a random-weight {size} model in {time.perf_counter() - started:.0f} s")
        for precision in ("bf16", *schemes):
            holder: dict = {}

            def load(precision=precision, holder=holder, path=path, size=size):
                method = None if precision == "bf16" else precision
                with scratch_cache(root):
                    holder["engine"] = eng = speed_engine(
                        path, device, "int8" if method else "bf16", new_tokens, True, method
                    )
                memory.setdefault(size, {})[precision] = eng.model.weight_bytes()
                return True, eng.describe(), None

            rep.test(f"{size} {precision} load", device, load)
            if "engine" not in holder:
                continue
            for batch in BATCH_SIZES:

                def measure(batch=batch, holder=holder):
                    tps = decode_speed(holder["engine"], device, batch, new_tokens)
                    return tps > 0, f"{tps:.1f} tok/s", tps

                tps = rep.test(f"{size} {precision} decode batch {batch}", device, measure)
                if tps:
                    speeds.setdefault(size, {}).setdefault(precision, {})[str(batch)] = tps
            holder.clear()
            _free(device)
        with contextlib.suppress(OSError):
            for f in path.iterdir():  # an 8B checkpoint is 16 GB of disk
                f.unlink()
    return speeds, memory


def table(speeds: dict, memory: dict, quality: dict) -> list[str]:
    """The figures as the README's table: per size and precision, tokens/s (ratio to bf16), weights."""
    lines = ["| shape | precision | batch 1 | batch 8 | batch 32 | weights | ppl / fp32 | greedy agreement |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for size, by_precision in speeds.items():
        base = by_precision.get("bf16", {})
        base_mem = memory.get(size, {}).get("bf16")
        for precision, tps in by_precision.items():
            cells = []
            for batch in ("1", "8", "32"):
                v = tps.get(batch)
                ratio = f" ({v / base[batch]:.2f}x)" if v and base.get(batch) and precision != "bf16" else ""
                cells.append(f"{v:.0f}{ratio}" if v else "-")
            mem = memory.get(size, {}).get(precision)
            mem_cell = "-" if not mem else f"{mem / 2**30:.2f} GiB" + (f" ({mem / base_mem:.2f}x)" if base_mem else "")
            q = quality.get(precision, {})
            ppl = f"{q['perplexity_ratio']:.4f}" if "perplexity_ratio" in q else "-"
            agree = f"{q['greedy_agreement']:.2f}" if "greedy_agreement" in q else "-"
            lines.append(f"| {size} | {precision} | {' | '.join(cells)} | {mem_cell} | {ppl} | {agree} |")
    return lines


def bars(speeds: dict, memory: dict, quality: dict) -> list[str]:
    """Each scheme against the issue's bars, one line each: met or not, with the figure."""
    out = []
    for scheme in SCHEMES:
        checks = []
        for (size, batch), bar in BARS.items():
            base = speeds.get(size, {}).get("bf16", {}).get(batch)
            mine = speeds.get(size, {}).get(scheme, {}).get(batch)
            if base and mine:
                checks.append((f"{size} batch {batch} {mine / base:.2f}x (>= {bar})", mine / base >= bar))
        base_mem, mem = memory.get("8b", {}).get("bf16"), memory.get("8b", {}).get(scheme)
        if base_mem and mem and (speeds.get("8b") or {}).get(scheme):
            checks.append((f"8b weights {mem / base_mem:.2f}x (<= {MAX_WEIGHT_RATIO_8B})", mem / base_mem <= 0.55))
        ppl = quality.get(scheme, {}).get("perplexity_ratio")
        if ppl is not None:
            checks.append((f"perplexity {ppl:.4f} (<= 1.01)", ppl <= 1.01))
        if checks:
            met = all(ok for _, ok in checks)
            out.append(f"{scheme}: {'meets' if met else 'misses'} the bars: " + "; ".join(c for c, _ in checks))
    return out


def run_section(
    rep, root: Path, args, env: dict, perplexity_source: tuple[Path, list[int]], fp32_ppl, device: str = "cuda"
) -> dict:
    """The whole comparison on CUDA; keeps the record for this card and prints the choice it makes. (``device``
    "cpu" runs it in Triton's interpreter: the tests, on a tiny shape.)"""
    import torch

    from engine.int8_choice import choose, save_record
    from engine.int8_gpu import torchao_importable, triton_runs_on

    asked = getattr(args, "int8_schemes", None) or SCHEMES
    schemes = [s for s in SCHEMES if s in asked and (s != "bitsandbytes" or env.get("bitsandbytes_version"))]
    if not torchao_importable():
        rep.line(f"  [SKIP] {device} torchao's schemes: torchao is not installed (the gpu extra installs it)")
        schemes = [s for s in schemes if not s.startswith("torchao")]
    if not triton_runs_on(device):
        rep.line(f"  [SKIP] {device} weight_only / w8a8: Triton is not installed (it comes with torch's CUDA wheels)")
        schemes = [s for s in schemes if s not in ("weight_only", "w8a8")]
    rep.line(f"INT8 on {device} against bf16 ({', '.join(schemes) or 'no scheme'}; CUDA graphs where they capture):")
    quality: dict = {}
    if fp32_ppl:

        def measure_quality():
            q = int8_quality(*perplexity_source, device, schemes, fp32_ppl, args.new_tokens)
            detail = ", ".join(
                f"{s} ppl {r['perplexity_ratio']:.4f} agree {r['greedy_agreement']:.2f}" for s, r in q.items()
            )
            return all(r["perplexity_ratio"] <= args.max_ppl_ratio for r in q.values()), detail, q

        quality = rep.test("INT8 schemes' perplexity and greedy agreement vs fp32", device, measure_quality) or {}
    speeds, memory = int8_speeds(rep, root, device, args.int8_sizes, schemes, args.new_tokens)
    for line in table(speeds, memory, quality) + bars(speeds, memory, quality):
        rep.line("  " + line)
    card = torch.cuda.get_device_name(0)
    perplexity = {s: q["perplexity_ratio"] for s, q in quality.items()}
    versions = {
        "torch": env.get("torch_version"),
        "cuda": env.get("torch_cuda_version"),
        "driver": env.get("cuda_driver"),
    }
    path = save_record(card, speeds, perplexity, versions)
    choice = choose({"speeds": speeds, "perplexity": perplexity, "measured": time.strftime("%Y-%m-%d")}, card)
    rep.line(f"  kept in {path}; llm_quantization=auto will start as: {choice.why}")
    return {
        "speeds": speeds,
        "weight_bytes": memory,
        "quality": quality,
        "choice": choice.__dict__,
        "record": str(path),
    }
