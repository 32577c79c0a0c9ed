"""Shared fixtures for the engine tests: one loaded fp32 model and HF reference generations."""

from __future__ import annotations

import pytest
import torch
from engine_prompts import CHAT_QUESTIONS, TEXT_PROMPTS

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import LlamaModel
from engine.weights import resolve_model

# One thread: the suite shares 2 cores with other work, and OpenMP with 2 threads on a busy
# machine stalls at every barrier (measured up to 10x slower per step than 1 thread).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_path():
    return resolve_model(float32_weights=True)  # tests compare with transformers, which reads the folder


@pytest.fixture(scope="session")
def fp32_model(model_path) -> LlamaModel:
    return LlamaModel(model_path, torch.float32, "cpu")


@pytest.fixture(scope="session")
def make_engine(fp32_model):
    """Build an fp32 engine sharing the loaded model, with any limits."""

    def make(**kw) -> LLMEngine:
        kw.setdefault("dtype", "float32")
        kw.setdefault("device", "cpu")
        return LLMEngine(EngineConfig(**kw), model=fp32_model)

    return make


@pytest.fixture(scope="session")
def engine(make_engine) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Token-id prompts of different lengths (5 to ~130 tokens), text and chat."""
    out = [tokenizer(p)["input_ids"] for p in TEXT_PROMPTS]
    for q in CHAT_QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return [list(p) for p in out]


@pytest.fixture(scope="session")
def hf_reference(model_path):
    """Greedy tokens from transformers' own generate() (memoised per prompt and length)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True)
    hf.eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return ref
