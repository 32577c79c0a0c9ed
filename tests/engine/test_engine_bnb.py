"""INT8 as the GPU runs it: bitsandbytes LLM.int8 (threshold 6.0, lm_head 16-bit), through the whole engine.

bitsandbytes >= 0.46 runs ``Linear8bitLt`` on the CPU, so this is the very module the CUDA path
uses (only its CUDA kernels differ). Perplexity on the bench text stays within 3 % of fp32, and
greedy chat replies agree with fp32's (identical, or parting only after the first tokens, but for
at most one near tie).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from engine_prompts import CHAT_QUESTIONS

import engine.quant as quant
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import perplexity
from engine.quant import BnbLinear, Int8PackLinear, get_quant_method, int8_linear_class
from engine.sampling import SamplingParams

# found, not imported: the import takes seconds, which the one model-free test below does not need
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="the test extra installs bitsandbytes (the GPU's int8)"
)

BENCH_TEXT = Path(__file__).resolve().parents[2] / "engine" / "benchmarks" / "data.txt"
QUESTIONS = [*CHAT_QUESTIONS, "What is the capital of France?", "Name three colors.", "What is 2 plus 2?"]


@pytest.fixture(scope="module")
def bnb_engine():
    return LLMEngine(EngineConfig(dtype="bfloat16", quantization="int8", int8_method="bitsandbytes", device="cpu"))


@pytest.mark.models
def test_bitsandbytes_layers_and_16bit_lm_head(bnb_engine):
    model = bnb_engine.model
    for lin in (model.layers[0].qkv, model.layers[0].o, model.layers[0].gate_up, model.layers[-1].down):
        assert isinstance(lin, BnbLinear)
        assert lin.module.weight.dtype == torch.int8 and lin.module.state.threshold == 6.0
    assert model.embed is not None and model.lm_head_linear.__class__.__name__ != "Int8Embedding"
    assert not model.graph_safe()  # outlier columns are found per call: no CUDA graph capture
    info = bnb_engine.model_info()
    assert info["linear_kernel"] == "bitsandbytes" and info["quant_info"]["kernel"] == "bitsandbytes"
    line = bnb_engine.describe()
    assert "bitsandbytes LLM.int8 (threshold 6.0, lm_head 16-bit)" in line


def test_bitsandbytes_perplexity_within_3_percent_of_fp32(bnb_engine, fp32_model):
    ids = bnb_engine.tokenize(BENCH_TEXT.read_text())[:512]
    p32 = perplexity(fp32_model, ids)
    pq = bnb_engine.perplexity(ids)
    assert pq / p32 <= 1.03, (pq, p32)


def test_bitsandbytes_greedy_replies_agree_with_fp32(bnb_engine, engine):
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16)
    ref = engine.generate(prompts, params)
    got = bnb_engine.generate(prompts, params)

    def agreed(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    prefixes = [agreed(a, b) for a, b in zip(ref, got, strict=True)]
    # At most one reply parts from fp32's in its first words: greedy decoding follows a near tie either
    # way. On a Xeon with AMX, "Name three colors." opens "1. Red" in fp32 and "The most obvious color"
    # in int8 with bf16 activations, with bitsandbytes and int8pack alike; a broken kernel parts everywhere.
    assert sorted(prefixes)[1] >= 6, prefixes
    assert sum(p >= min(12, len(r)) for p, r in zip(prefixes, ref, strict=True)) >= 4, prefixes


def test_int8_method_choice(monkeypatch, caplog):
    import engine.int8_choice as int8_choice

    # a card without the doctor's figures, where Triton does not compile (else W8A8: tests/engine/test_int8_gpu.py)
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: int8_choice.Int8Choice(None, "auto", "no figures"))
    monkeypatch.setattr("engine.int8_gpu.triton_runs_on", lambda dev: False)
    monkeypatch.setattr(quant, "_bitsandbytes_importable", lambda: True)
    assert int8_linear_class("auto", "cpu") is Int8PackLinear
    assert int8_linear_class("auto", "cuda") is BnbLinear
    assert int8_linear_class("bitsandbytes", "cpu") is BnbLinear
    assert int8_linear_class("int8pack", "cuda") is Int8PackLinear
    assert get_quant_method("int8", "cpu", "bitsandbytes").quantize_vocab is False  # lm_head stays 16-bit
    assert get_quant_method("int8", "cpu", "auto").quantize_vocab is True
    monkeypatch.setattr(quant, "_bitsandbytes_importable", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.quant"):
        assert int8_linear_class("auto", "cuda") is Int8PackLinear
    assert "bitsandbytes is not installed" in caplog.text  # not silent
    with pytest.raises(ValueError, match="gpu"):
        int8_linear_class("bitsandbytes", "cpu")
