"""A GGUF as a Hugging Face folder: config.json, generation_config.json, the tokenizer with its chat
template, and every tensor dequantized to float32 in safetensors shards.

Float32 because it holds every GGUF value exactly (a quantized weight is an fp16 scale times a small
integer, up to 18 significant bits; bfloat16 keeps 8): the engine then serves the precision asked
for (bf16, fp32, int8, int4) from the same values llama.cpp computes with, and fp32 serving sees no
extra rounding. The cost is disk: 4 bytes a parameter (a 135M model 0.54 GB, a 1B model 5 GB).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from pathlib import Path

from engine.gguf.archs import Family, end_of_turn_ids, family_of, hf_config
from engine.gguf.reader import GGUFError, GGUFFile, open_gguf

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30  # float32 bytes a shard: bounds the memory a conversion holds at once
# general.sampling.* (llama.cpp writes them from the model's generation_config.json) -> generation_config keys
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def convert_gguf(path: Path, out: Path) -> None:
    """Write the HF folder for the GGUF at ``path`` into the existing, empty directory ``out``."""
    start = time.perf_counter()
    log.info("converting %s (%.0f MB) to safetensors, once: reading its header", path.name, path.stat().st_size / 1e6)
    gguf = open_gguf(path)
    family = family_of(gguf)
    config = hf_config(gguf, family)
    names = {name: family.hf_name(gguf, name) for name in gguf.tensors}  # every name checked before any work
    types = Counter(t.tensor_type.name for t in gguf.tensors.values())
    log.info(
        "%s: %s, %d layers, %d tensors (%s); writing the config and tokenizer",
        path.name,
        gguf.arch,
        config["num_hidden_layers"],
        len(names),
        ", ".join(f"{n} {t}" for t, n in types.most_common()),
    )
    _write_config(gguf, config, out)
    stage = time.perf_counter()
    _write_tokenizer(path, out)
    log.info("%s: tokenizer and chat template written in %.1f s", path.name, time.perf_counter() - stage)
    stage = time.perf_counter()
    nbytes = _write_weights(gguf, family, config, names, out)
    log.info("%s: %.0f MB of float32 weights written in %.1f s", path.name, nbytes / 1e6, time.perf_counter() - stage)
    log.info("%s converted in %.1f s", path.name, time.perf_counter() - start)


def _write_config(gguf: GGUFFile, config: dict, out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    fields = dict(config, dtype="float32")
    try:
        hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, TypeError) as e:  # transformers validates (head counts, RoPE factors...)
        raise GGUFError(f"{gguf.path.name}: its metadata makes no valid {gguf.arch} config: {e}") from e
    hf.save_pretrained(out)
    eos = end_of_turn_ids(gguf)
    sampling = {
        hf_key: v for k, hf_key in SAMPLING_KEYS.items() if (v := gguf.get(f"general.sampling.{k}", None)) is not None
    }
    if sampling.get("temperature", 0) > 0:
        sampling["do_sample"] = True
    GenerationConfig(
        bos_token_id=config["bos_token_id"],
        eos_token_id=eos[0] if len(eos) == 1 else eos or None,
        pad_token_id=config["pad_token_id"],
        **sampling,
    ).save_pretrained(out)


def _write_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer transformers builds from the file's ``tokenizer.ggml.*`` metadata, with its chat template."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, vocab, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(arch, vocab)
    except (KeyError, ValueError) as e:
        raise GGUFError(f"{path.name}: cannot build its tokenizer ({type(e).__name__}: {e})") from e
    if "chat_template" not in tokenizer_config:
        log.warning("%s has no chat template (tokenizer.chat_template): chat requests will fail", path.name)
    TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(out)


def _write_weights(gguf: GGUFFile, family: Family, config: dict, names: dict[str, str | None], out: Path) -> int:
    """Dequantize, rename and restore every tensor, shard by shard; returns the float32 bytes written."""
    import torch
    from safetensors.torch import save_file

    weights = [(name, hf) for name, hf in names.items() if hf is not None]
    shards = _plan_shards([(w, 4 * math.prod(gguf.shape(w[0]))) for w in weights], SHARD_BYTES)
    weight_map: dict[str, str] = {}
    done = total_bytes = 0
    step = max(1, len(weights) // 10)
    for k, shard in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, hf in shard:
            tensors[hf] = torch.from_numpy(family.restore(hf, gguf.dequantized(name), config)).contiguous()
            total_bytes += tensors[hf].nbytes
            done += 1
            if done % step == 0 or done == len(weights):
                log.info("%s: dequantized %d/%d tensors", gguf.path.name, done, len(weights))
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total_bytes


def _plan_shards(items: list[tuple[object, int]], limit: int) -> list[list]:
    """Consecutive groups of items whose sizes add up to at most ``limit`` (an item larger than it goes alone)."""
    shards: list[list] = [[]]
    size = 0
    for item, nbytes in items:
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards
