"""Whether INT8 beats bf16 on this GPU: decided by figures measured on this card, never assumed.

``parley doctor --gpu`` measures decode tokens/s of bf16 and of each INT8 scheme (weight-only, W8A8,
LLM.int8) at batch 1, 8 and 32, and each scheme's perplexity ratio against fp32, and keeps them per card
(``record_path``). ``quantization="auto"`` on CUDA reads that record: INT8 with the scheme that won, where one
was at least as fast as bf16 at every batch and size measured and within ``MAX_PERPLEXITY_RATIO``; else bf16.
The start-up says which and why (``Int8Choice.why``). Without a record it is bf16: a kernel that has not been
measured on this card is not the default.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# int8_method values the doctor compares with bf16: ours, torchao's (where installed), LLM.int8
SCHEMES = ("weight_only", "w8a8", "torchao_weight_only", "torchao_w8a8", "bitsandbytes")
MAX_PERPLEXITY_RATIO = 1.01  # an INT8 scheme's perplexity over fp32's, at most (bf16's own is about 1.00)


@dataclass(frozen=True)
class Int8Choice:
    quantization: str | None  # "int8" or None (16-bit)
    int8_method: str  # the scheme where quantization is "int8", else "auto"
    why: str


def record_path(card: str) -> Path:
    """Where the doctor keeps this card's figures (``PARLEY_CACHE_DIR`` or ``~/.cache/parley``, then gpu/)."""
    from engine.weights import cache_dir

    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") or "gpu"
    return cache_dir() / "gpu" / f"{slug}.json"


def save_record(card: str, speeds: dict, perplexity: dict, versions: dict) -> Path:
    """Keep ``parley doctor --gpu``'s figures for ``card``: ``speeds[size][precision][batch]`` tokens/s (precision
    "bf16" or a scheme), ``perplexity[scheme]`` its ratio to fp32."""
    path = record_path(card)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "card": card,
        "measured": time.strftime("%Y-%m-%d"),
        "versions": versions,
        "speeds": speeds,
        "perplexity": perplexity,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_record(card: str) -> dict | None:
    path = record_path(card)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the INT8 figures in %s (%s)", path, e)
        return None


def _ratios(record: dict, scheme: str) -> list[tuple[str, str, float]] | None:
    """(size, batch, scheme's tokens/s over bf16's) for every figure of the record; None if one is missing."""
    out = []
    for size, by_precision in record.get("speeds", {}).items():
        base, mine = by_precision.get("bf16") or {}, by_precision.get(scheme) or {}
        for batch, tps in base.items():
            if not tps or not mine.get(batch):
                return None
            out.append((size, batch, mine[batch] / tps))
    return out or None


def choose(record: dict | None, card: str) -> Int8Choice:
    """INT8 with the scheme that was never slower than bf16 (the best geometric mean of its ratios), or bf16."""
    if record is None:
        return Int8Choice(None, "auto", f"bf16: no INT8 figures for {card} yet (`parley doctor --gpu` measures them)")
    when = f"parley doctor --gpu, {record.get('measured', '?')}"
    best: tuple[float, str, list] | None = None
    nearest: tuple[float, str, list] | None = None  # the scheme that came closest, for the bf16 line
    for scheme in SCHEMES:
        ratios = _ratios(record, scheme)
        if ratios is None:
            continue
        worst = min(r for _, _, r in ratios)
        ppl = record.get("perplexity", {}).get(scheme)
        mean = math.exp(sum(math.log(r) for _, _, r in ratios) / len(ratios))
        if worst >= 1.0 and ppl is not None and ppl <= MAX_PERPLEXITY_RATIO:
            if best is None or mean > best[0]:
                best = (mean, scheme, ratios)
        elif nearest is None or worst > nearest[0]:
            nearest = (worst, scheme, ratios)
    if best is not None:
        _, scheme, ratios = best
        figures = ", ".join(f"{size} batch {batch} {r:.2f}x" for size, batch, r in ratios)
        return Int8Choice("int8", scheme, f"int8 ({scheme}): at least as fast as bf16 on {card}: {figures} ({when})")
    if nearest is None:
        return Int8Choice(None, "auto", f"bf16: the INT8 figures for {card} are incomplete ({when})")
    worst, scheme, ratios = nearest
    slowest = min(ratios, key=lambda t: t[2])
    return Int8Choice(
        None,
        "auto",
        f"bf16: no INT8 scheme was as fast as bf16 everywhere on {card} (nearest: {scheme}, "
        f"{slowest[0]} batch {slowest[1]} {worst:.2f}x, or its perplexity over {MAX_PERPLEXITY_RATIO}; {when})",
    )


@functools.cache
def cuda_choice() -> Int8Choice:
    """This process's GPU's choice (the first CUDA device), logged once."""
    import torch

    card = torch.cuda.get_device_name(0)
    choice = choose(load_record(card), card)
    log.info("llm_quantization=auto on CUDA: %s", choice.why)
    return choice
