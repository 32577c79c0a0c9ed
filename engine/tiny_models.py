"""Tiny random-weight models of every supported family, built in place (nothing downloaded).

What ``parley doctor`` and the family tests compare the engine's forward with transformers' on.
Each config reaches every layer pattern its family has (sliding and full layers, NoPE layers,
Gemma 3's two RoPE bases), with small windows that prompts outgrow, noise on the norm weights
(Gemma's start at zero, so an untouched norm would hide a wrong offset), non-trivial Granite
multipliers and a longrope short/long switch. Dimensions are multiples of 64 so int4 applies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

VOCAB = 512
# Phi-3's pre-training length in the tiny config: an engine whose max_model_len exceeds it runs the long RoPE factors
PHI3_ORIGINAL_LEN = 8
# ids a tiny Gemma 3 vision-language checkpoint reserves for images (prompts stay below them)
_GEMMA3_IMAGE_IDS = {"boi_token_index": 509, "eoi_token_index": 510, "image_token_index": 511}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,  # peaked logits: greedy ties between near-equal logits would make exactness luck
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _llama3():
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**_COMMON, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=True)


def _qwen3():
    from transformers import Qwen3Config

    # head_dim 32 is not hidden / heads: the projections are wider than the model
    return Qwen3Config(**(_COMMON | {"head_dim": 32}), num_hidden_layers=2, tie_word_embeddings=False)


def _gemma2():
    from transformers import Gemma2Config

    # caps low enough to bite on a tiny model's scores and logits (the real ones are 50 and 30)
    return Gemma2Config(
        **_COMMON,
        num_hidden_layers=4,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
    )


def _gemma3_text_config():
    from transformers import Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    return Gemma3TextConfig(
        **_COMMON, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24, rope_parameters=rope
    )


def _gemma3():
    return _gemma3_text_config()


def _gemma3_vlm():
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    text = _gemma3_text_config()
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **_GEMMA3_IMAGE_IDS)


def _phi3():
    from transformers import Phi3Config

    half_rot = 4  # partial rotary: 8 of 16 channels, 4 frequencies
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": _COMMON["max_position_embeddings"] / PHI3_ORIGINAL_LEN,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.3, 2.1, 3.5][:half_rot],
        "long_factor": [1.2, 2.5, 4.0, 9.0][:half_rot],
    }
    # head_dim must be hidden / heads here (Phi-3's config checks the factors' length against it)
    return Phi3Config(
        **_COMMON,
        num_hidden_layers=2,
        rope_parameters=rope,
        original_max_position_embeddings=PHI3_ORIGINAL_LEN,
        sliding_window=16,
        tie_word_embeddings=False,
    )


def _smollm3():
    from transformers import SmolLM3Config

    return SmolLM3Config(**_COMMON, num_hidden_layers=4, tie_word_embeddings=True)  # layer 4 has no RoPE


def _granite():
    from transformers import GraniteConfig

    return GraniteConfig(
        **_COMMON,
        num_hidden_layers=2,
        embedding_multiplier=6.0,
        attention_multiplier=0.09,
        residual_multiplier=0.4,
        logits_scaling=0.5,
        tie_word_embeddings=True,
    )


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=16)


# family -> its tiny config (gemma3_vlm: the text part of a Gemma3ForConditionalGeneration checkpoint)
FAMILY_CONFIGS: dict[str, Callable[[], object]] = {
    "llama3": _llama3,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_vlm": _gemma3_vlm,
    "phi3": _phi3,
    "smollm3": _smollm3,
    "granite": _granite,
    "olmo2": _olmo2,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# transformers' attention for the reference: Gemma 2's soft-capping runs only in its eager attention
REFERENCE_ATTENTION = {"gemma2": "eager"}


def build_family_model(root: Path, family: str, seed: int = 0) -> Path:
    """A tiny random-weight model of ``family`` with a byte-level tokenizer, saved in ``root / family``."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    path = root / family
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    config = FAMILY_CONFIGS[family]()
    if family == "gemma3_vlm":
        model = Gemma3ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=REFERENCE_ATTENTION.get(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # spread the norm weights (Gemma's start at zero)
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return path


def load_reference(path: Path, family: str, dtype=None, device: str = "cpu"):
    """transformers' model of a tiny family folder, in eval mode (the reference the engine must match)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    cls = Gemma3ForConditionalGeneration if family == "gemma3_vlm" else AutoModelForCausalLM
    model = cls.from_pretrained(
        str(path),
        dtype=dtype or torch.float32,
        attn_implementation=REFERENCE_ATTENTION.get(family),
        local_files_only=True,
    )
    return model.to(device).eval()


# transformers' cached generate for the tiny Phi-3: before 5.2x (seen on 5.17) a sequence that crosses the
# pre-training length keeps the keys it cached with the short factors, so the reference disagrees with the same
# version's full forward; recomputing every step (no cache) gives the full forward's tokens in every version
REFERENCE_GENERATE = {"phi3": {"use_cache": False}}


def reference_generate(model, prompt: list[int], new: int, family: str | None = None) -> list[int]:
    """transformers' greedy ``new`` tokens after ``prompt`` (the engine's reference; no eos stops it)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            **REFERENCE_GENERATE.get(family or "", {}),
        )
    return out[0, len(prompt) :].tolist()


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (token id = byte value, no merges) with a plain chat template, saved in ``path``.

    Any text round-trips through ids 0..255, inside every tiny vocabulary, so a tiny model also
    serves chats and runs ``parley bench engine --model <folder>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
