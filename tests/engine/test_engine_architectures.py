"""Other Llama-family layouts (Qwen2 qkv bias, Mistral, Llama-3 rope scaling, untied lm_head) on tiny random models.

Each tiny model is built with transformers, saved as safetensors next to the bundled
tokenizer, served by our engine, and checked against transformers' greedy generate.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # spread logits so greedy has no near-ties
)


def _build(kind: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=49152, tie_word_embeddings=False, **TINY))
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(vocab_size=49152, sliding_window=None, **TINY))
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, rope_parameters=rope, tie_word_embeddings=True, **TINY))


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3_rope"])
def test_tiny_model_matches_transformers(kind, tmp_path, model_path):
    torch.manual_seed(0)
    hf = _build(kind).eval()
    if kind == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, tmp_path / name)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", block_size=8))
    prompts = [[1, 400, 500, 600, 700], list(range(1000, 1090))]
    ours = eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None
            )
        assert o == ref[0, len(p) :].tolist()
