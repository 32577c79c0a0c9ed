"""What llama.cpp's converter (``convert_hf_to_gguf.py``) did to each architecture, undone.

For each GGUF ``general.architecture`` Parley loads: the Hugging Face class and config it came
from, the HF name of every GGUF tensor (``gguf/tensor_mapping.py`` read backwards), and the two
layout changes the converter makes:

- Llama-family models (``llama``, which Mistral also is, ``smollm3``, ``granite``: the converter's
  ``LlamaModel`` and its subclasses) have the rows of q_proj and k_proj permuted for llama.cpp's
  rotary layout (``LlamaModel.permute``); undone here with its inverse.
- Gemma 2/3 store every RMSNorm weight as w + 1 (their norms compute x * (1 + w)); 1 is
  subtracted here. Qwen2/3, Phi-3 and OLMo 2 are stored as they are.

What the file does not state is what llama.cpp itself assumes: Gemma 3 layers are 5 sliding to 1
full, SmolLM3 has no RoPE on every 4th layer, Gemma 2/3 27B scale attention by hidden / heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.gguf.reader import GGUFError, GGUFFile

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors llama.cpp computes from the config (RoPE frequency factors): read back into the config, not weights
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# end-of-turn tokens llama.cpp stops at besides eos (llama-vocab.cpp), which a GGUF's eos id often omits
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<end_of_utterance>")


@dataclass(frozen=True)
class Family:
    """One GGUF architecture: its HF class and config, its tensor names, and the layout changes to undo."""

    hf_architecture: str
    model_type: str
    block_names: dict[str, str] = field(default_factory=dict)  # differences from BLOCK_NAMES
    permuted_qk: bool = False
    norm_offset: float = 0.0
    extra_config: Callable[[GGUFFile, dict], dict] = lambda gguf, cfg: {}

    def hf_name(self, gguf: GGUFFile, name: str) -> str | None:
        """The HF state-dict name of a GGUF tensor (None: it goes into the config)."""
        if name in CONFIG_TENSORS:
            return None
        stem, _, suffix = name.rpartition(".")
        if stem in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[stem]}.{suffix}"
        parts = stem.split(".", 2)
        names = BLOCK_NAMES | self.block_names
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
        raise GGUFError(f"{gguf.path.name}: tensor {name!r} is not part of a {gguf.arch} model as Parley knows it")

    def restore(self, hf_name: str, weight: np.ndarray, config: dict) -> np.ndarray:
        """Undo the converter's layout changes on one tensor."""
        if self.permuted_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute(weight, config["num_attention_heads"])
        if self.permuted_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute(weight, config["num_key_value_heads"])
        if self.norm_offset and hf_name.endswith("norm.weight"):
            return weight - np.float32(self.norm_offset)
        return weight


def unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's ``LlamaModel.permute`` (rows of each head from interleaved to half-split)."""
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# --- the config -----------------------------------------------------------------------------------
def hf_config(gguf: GGUFFile, family: Family) -> dict:
    """The HF config.json fields for this file, from its metadata (and its RoPE factor tensors)."""
    key = _arch_key(gguf)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    config = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _one_per_model(gguf, "attention.head_count_kv", key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "rope_parameters": rope_parameters(gguf, head_dim),
        # llama.cpp drops the rows of an embedding padded past the tokenizer (Gemma 3): its rows are the vocabulary
        "vocab_size": gguf.shape("token_embd.weight")[0],
        # the converter writes output.weight only when lm_head is not the embedding
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": gguf.get("tokenizer.ggml.padding_token_id", None),
    }
    # biases, where the family has them optional (Qwen2's are always there and its config has no switch)
    for switch, tensor in (("attention_bias", "blk.0.attn_q.bias"), ("mlp_bias", "blk.0.ffn_up.bias")):
        if tensor in gguf.tensors:
            config[switch] = True
    return config | family.extra_config(gguf, config)


def end_of_turn_ids(gguf: GGUFFile) -> list[int]:
    """eos, eot and eom ids, and the end-of-turn tokens llama.cpp also stops at, in the order found."""
    ids = [gguf.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    tokens = gguf.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = {text: i for i, text in enumerate(tokens.contents()) if text in END_OF_TURN_TOKENS}
        ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return list(dict.fromkeys(i for i in ids if i is not None))


def rope_parameters(gguf: GGUFFile, head_dim: int) -> dict:
    """``rope_parameters`` (of the full-attention layers) from ``rope.*`` metadata and the RoPE factor tensors."""
    key = _arch_key(gguf)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    scaling = key("rope.scaling.type", "none")
    if "rope_freqs.weight" in gguf.tensors:
        params |= llama3_rope(gguf.dequantized("rope_freqs.weight"), params["rope_theta"], rotary, gguf)
    elif "rope_factors_long.weight" in gguf.tensors:
        params |= {
            "rope_type": "longrope",
            "long_factor": gguf.dequantized("rope_factors_long.weight").tolist(),
            "short_factor": gguf.dequantized("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
    elif scaling == "linear":
        params |= {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling == "yarn":
        params |= {
            "rope_type": "yarn",
            "factor": key("rope.scaling.factor"),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
        optional = {
            "beta_fast": "yarn_beta_fast",
            "beta_slow": "yarn_beta_slow",
            "attention_factor": "yarn_attn_factor",
        }
        params |= {hf: v for hf, k in optional.items() if (v := key(f"rope.scaling.{k}", None)) is not None}
    elif scaling != "none":
        raise GGUFError(f"{gguf.path.name}: RoPE scaling {scaling!r} is not supported")
    return params


def llama3_rope(factors: np.ndarray, theta: float, dim: int, gguf: GGUFFile) -> dict:
    """Llama 3.x RoPE scaling, which llama.cpp stores only as per-frequency factors (``rope_freqs``).

    Every Llama 3.x uses low/high frequency factors 1 and 4; the factor is the largest divisor and the
    original context length the one that reproduces the stored factors.
    """
    factor = float(factors.max())
    for original in (8192, 4096, 16384, 32768, 2048, 65536, 131072):
        if np.allclose(_llama3_factors(theta, dim, factor, 1.0, 4.0, original), factors, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": original,
            }
    raise GGUFError(f"{gguf.path.name}: its rope_freqs match no Llama 3 RoPE scaling (low/high frequency factors 1/4)")


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The factors llama.cpp's converter writes for Llama 3 scaling (``LlamaModel.generate_extra_tensors``)."""
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _arch_key(gguf: GGUFFile) -> Callable[..., Any]:
    arch = gguf.arch
    return lambda name, *default: gguf.get(f"{arch}.{name}", *default)


def _one_per_model(gguf: GGUFFile, name: str, value: Any) -> Any:
    """A per-layer list that is one value throughout (some files store head counts per layer)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{gguf.path.name}: {gguf.arch}.{name} differs between layers ({value[:8]}...)")
        return value[0]
    return value


# --- per-family config ----------------------------------------------------------------------------
def _gemma_attention_scalar(gguf: GGUFFile, config: dict, layers_of_27b: int) -> int:
    """llama.cpp scales Gemma 2/3 attention by head_dim, except the 27B models' hidden / heads."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(gguf: GGUFFile, config: dict) -> dict:
    key = _arch_key(gguf)
    return {
        "sliding_window": key("attention.sliding_window"),
        "attn_logit_softcapping": key("attn_logit_softcapping", None),
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "query_pre_attn_scalar": _gemma_attention_scalar(gguf, config, 46),
    }


def _gemma3(gguf: GGUFFile, config: dict) -> dict:
    key = _arch_key(gguf)
    local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10000.0)}
    return {
        "sliding_window": key("attention.sliding_window", None),
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "query_pre_attn_scalar": _gemma_attention_scalar(gguf, config, 62),
        "rope_parameters": {"full_attention": config["rope_parameters"], "sliding_attention": local},
    }


def _phi3(gguf: GGUFFile, config: dict) -> dict:
    key = _arch_key(gguf)
    return {
        "original_max_position_embeddings": key(
            "rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
        "sliding_window": key("attention.sliding_window", 0) or None,  # 0: none (Phi-4)
    }


def _granite(gguf: GGUFFile, config: dict) -> dict:
    key = _arch_key(gguf)
    return {
        "attention_multiplier": key("attention.scale", 1.0),
        "embedding_multiplier": key("embedding_scale", 1.0),
        "residual_multiplier": key("residual_scale", 1.0),
        "logits_scaling": key("logit_scale", 1.0),
    }


def _olmo2(gguf: GGUFFile, config: dict) -> dict:
    if _arch_key(gguf)("attention.sliding_window", None) is not None:
        raise GGUFError(f"{gguf.path.name}: OLMo 3 (an olmo2 GGUF with sliding-window layers) is not supported")
    return {}


GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2"),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3"),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", GEMMA_NORMS, norm_offset=1.0, extra_config=_gemma2),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", GEMMA_NORMS, norm_offset=1.0, extra_config=_gemma3),
    "phi3": Family(
        "Phi3ForCausalLM", "phi3", {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}, extra_config=_phi3
    ),
    "smollm3": Family("SmolLM3ForCausalLM", "smollm3", permuted_qk=True),
    "granite": Family("GraniteForCausalLM", "granite", permuted_qk=True, extra_config=_granite),
    "olmo2": Family(
        "Olmo2ForCausalLM",
        "olmo2",
        {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        extra_config=_olmo2,
    ),
}


def family_of(gguf: GGUFFile) -> Family:
    arch = gguf.arch
    if arch not in FAMILIES:
        raise GGUFError(
            f"{gguf.path.name}: architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(FAMILIES)} (Mistral GGUFs are 'llama')"
        )
    return FAMILIES[arch]
