"""A GGUF as a Hugging Face folder: config.json, generation_config.json, the tokenizer with its chat
template, and the index of the GGUF's tensors (``engine.gguf.tensors``), which the engine dequantizes
from the GGUF itself as it loads.

On request (``float32_weights``) every tensor is also written dequantized to float32 safetensors, for
what reads the folder without Parley's loader (transformers, vLLM, a LoRA merge). Float32 because it holds
every GGUF value exactly (a quantized weight is an fp16 scale times a small integer, up to 18 significant
bits; bfloat16 keeps 8), at 4 bytes a parameter (a 135M model 0.54 GB, a 1B model 5 GB).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from engine.gguf.archs import end_of_turn_ids, family_of, hf_config
from engine.gguf.reader import GGUFError, GGUFFile, open_gguf
from engine.gguf.tensors import index_gguf, write_float32_weights

log = logging.getLogger(__name__)

# general.sampling.* (llama.cpp writes them from the model's generation_config.json) -> generation_config keys
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def convert_gguf(path: Path, out: Path, *, float32_weights: bool = False) -> None:
    """Write the HF folder for the GGUF at ``path`` into the existing, empty directory ``out`` (with the float32
    safetensors when ``float32_weights``)."""
    start = time.perf_counter()
    log.info("reading %s (%.0f MB) once: its header, tokenizer and tensor table", path.name, path.stat().st_size / 1e6)
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
    index_gguf(gguf, config, names, out)
    if float32_weights:
        stage = time.perf_counter()
        nbytes = write_float32_weights(out)
        log.info(
            "%s: %.0f MB of float32 weights written in %.1f s", path.name, nbytes / 1e6, time.perf_counter() - stage
        )
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
