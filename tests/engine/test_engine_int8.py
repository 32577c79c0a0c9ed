"""INT8 weights: memory drops to ~1/4 of fp32, perplexity within 3%, greedy answers mostly unchanged."""

from __future__ import annotations

import pytest
import torch
from engine_prompts import STORY

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import perplexity
from engine.quant import Int8PackLinear
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def int8_engine():
    return LLMEngine(EngineConfig(dtype="bfloat16", quantization="int8", device="cpu"))


def test_int8_weights_replace_float_weights(int8_engine, fp32_model):
    info = int8_engine.runner.quant_info
    assert info["kernel"] == "int8pack"
    layer = int8_engine.runner.model.layers[0]
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(lin, Int8PackLinear) and lin.qweight.dtype == torch.int8
    ratio = int8_engine.runner.model.linear_weight_bytes() / fp32_model.linear_weight_bytes()
    assert ratio <= 0.35, ratio
    assert info["linear_ratio_vs_fp32"] == pytest.approx(ratio, rel=1e-6)


def test_int8_perplexity_close_to_fp32(int8_engine, fp32_model, tokenizer):
    ids = tokenizer(STORY + " The children never forgot the keeper, and every summer they came back to visit him.")[
        "input_ids"
    ]
    p32 = perplexity(fp32_model, ids)
    p8 = perplexity(int8_engine.runner.model, ids)
    assert p8 / p32 < 1.03, (p8, p32)


def test_int8_greedy_answers_mostly_agree(int8_engine, engine, prompts):
    sel = prompts[:9]
    params = SamplingParams(max_tokens=6)
    ref = engine.generate(sel, params)
    got = int8_engine.generate(sel, params)
    agree = sum(a[:4] == b[:4] for a, b in zip(ref, got, strict=True))
    assert agree >= 6, (agree, ref, got)


def test_int8_prefill_path_matches_small_batch_path(int8_engine):
    # > INT8PACK_MAX_M rows take the dequantize-to-bf16 path; both must compute the same product
    lin = int8_engine.runner.model.layers[3].gate_up
    x = torch.randn(40, lin.qweight.shape[1], dtype=torch.bfloat16)
    big = lin(x)
    small = torch.cat([lin(x[i : i + 8]) for i in range(0, 40, 8)])
    assert torch.allclose(big.float(), small.float(), rtol=0.05, atol=0.05)
