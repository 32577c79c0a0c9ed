"""Merge a PEFT LoRA adapter into a model's weights, offline: ``parley engine merge-lora``.

Why offline: the engine serves one set of weights with its own fused linears (QKV and
gate/up concatenated, then quantized or packed); merging once (``W + scale * B @ A`` per
target module, what PEFT's ``merge_and_unload`` computes) gives a plain Hugging Face model
directory that the engine, transformers and any other server load, at no cost per token.

Input: a base model directory (``config.json`` + safetensors, as the engine loads) and a
PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``). The
scale is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); per-module
``rank_pattern`` / ``alpha_pattern`` are honoured; target modules are matched by name as
PEFT matches them (a list of module-name suffixes, or one regular expression). Refused
with a clear error: a missing file, a target module the base does not have, a LoRA
weight whose shape does not fit the base's (a different base model), DoRA, trained
LoRA biases, ``fan_in_fan_out`` layers, and a target that is a tied embedding.

The merged weights keep the base's dtype (the sum is computed in fp32) and its shard
layout; the other files of the base (tokenizer, generation config) are copied. The output
is written to a temporary folder next to ``--out`` and renamed into place.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraError(ValueError):
    """The adapter cannot be merged into this base (the message says why)."""


def _weight_files(base: Path) -> list[str]:
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in base.glob("*.safetensors"))


def _module_of(key: str) -> tuple[str, str] | None:
    """``base_model.model.X.lora_A[.default].weight`` -> (X, "A"); None for a key that is not a LoRA factor."""
    m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
    return (m.group(1), m.group(2)) if m else None


def _targets(config: dict, modules: list[str]) -> set[str]:
    """The base's linear modules the adapter config targets (PEFT's matching); LoraError for a target none matches."""
    target = config.get("target_modules")
    if not target:
        raise LoraError(f"{ADAPTER_CONFIG} names no target_modules")
    if isinstance(target, str):
        hit = {m for m in modules if re.fullmatch(target, m)}
        if not hit:
            raise LoraError(f"target_modules regex {target!r} matches no linear module of the base")
        return hit
    hit: set[str] = set()
    unknown = []
    for t in target:
        found = {m for m in modules if m == t or m.endswith("." + t)}
        if not found:
            unknown.append(t)
        hit |= found
    if unknown:
        names = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise LoraError(f"unknown target modules {unknown}: the base's linear modules are named {names}")
    return hit


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def merge_lora(base: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """Write ``base`` with ``adapter`` merged into ``out`` (which must not exist yet); returns ``out``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from engine.weights import resolve_model

    base = resolve_model(base, float32_weights=True) if str(base) == "bundled" else Path(base)
    adapter, out = Path(adapter), Path(out)
    for path, what in (
        (base / "config.json", "the base model's config.json"),
        (adapter / ADAPTER_CONFIG, "the adapter's config"),
        (adapter / ADAPTER_WEIGHTS, "the adapter's weights"),
    ):
        if not path.is_file():
            hint = (
                " (a .bin adapter: save it again with safe_serialization=True)" if path.name == ADAPTER_WEIGHTS else ""
            )
            raise FileNotFoundError(f"missing {what}: {path}{hint}")
    files = _weight_files(base)
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {base}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")

    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA").upper() != "LORA":
        raise LoraError(f"not a LoRA adapter: peft_type {config.get('peft_type')!r}")
    if config.get("use_dora"):
        raise LoraError("DoRA adapters are not supported (merge them with peft's merge_and_unload)")
    if config.get("fan_in_fan_out"):
        raise LoraError("fan_in_fan_out adapters (GPT-2 style Conv1D layers) do not fit a Llama-family model")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapters with trained biases (bias={config['bias']!r}) are not supported")
    r0, alpha0 = int(config["r"]), float(config.get("lora_alpha", config["r"]))

    # where every base weight lives, and the shapes of the linear ones
    owner: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(base / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                owner[key] = name
                shapes[key] = tuple(f.get_slice(key).get_shape())
    linears = sorted(k.removesuffix(".weight") for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2)
    targets = _targets(config, [m for m in linears if "embed" not in m])

    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter / ADAPTER_WEIGHTS)).items():
        parsed = _module_of(key)
        if parsed is None:
            raise LoraError(f"{ADAPTER_WEIGHTS} holds {key!r}, which is not a LoRA factor (modules_to_save?)")
        factors.setdefault(parsed[0], {})[parsed[1]] = tensor
    if not factors:
        raise LoraError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    base_cfg = json.loads((base / "config.json").read_text())
    deltas: dict[str, torch.Tensor] = {}
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{module}: lora_A and lora_B must both be present")
        weight = module + ".weight"
        if weight not in shapes:
            raise LoraError(f"mismatched base: the adapter has LoRA weights for {module}, which the base does not have")
        if module not in targets:
            raise LoraError(f"{module} has LoRA weights but is not among the target_modules of {ADAPTER_CONFIG}")
        if module == "lm_head" and base_cfg.get("tie_word_embeddings"):
            raise LoraError("lm_head is tied to the embedding in this base: merging into it would change both")
        A, B = ab["A"].float(), ab["B"].float()
        out_f, in_f = shapes[weight]
        if A.shape[1] != in_f or B.shape[0] != out_f or A.shape[0] != B.shape[1]:
            raise LoraError(
                f"mismatched base: {module} is {out_f}x{in_f} in the base, the adapter's factors are "
                f"B {tuple(B.shape)} x A {tuple(A.shape)}"
            )
        r = int(_pattern_value(config.get("rank_pattern"), module, r0))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha0))
        if A.shape[0] != r:
            raise LoraError(f"{module}: rank {A.shape[0]} in the weights, {r} in {ADAPTER_CONFIG}")
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        deltas[weight] = scale * (B @ A)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for item in base.iterdir():
            if item.is_file() and item.suffix not in (".safetensors", ".bin", ".pt", ".pth", ".gguf"):
                shutil.copy2(item, tmp / item.name)
        for name in files:
            sd = load_file(str(base / name))
            for key in [k for k in sd if k in deltas]:
                w = sd[key]
                sd[key] = (w.float() + deltas[key]).to(w.dtype).contiguous()
            save_file(sd, str(tmp / name), metadata={"format": "pt"})
        (tmp / "parley_merged_lora.json").write_text(
            json.dumps({"base": str(base), "adapter": str(adapter), "modules": sorted(deltas)}, indent=1) + "\n"
        )
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("merged %d LoRA modules of %s into %s -> %s", len(deltas), adapter, base, out)
    return out
