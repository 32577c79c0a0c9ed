"""The engine's ``auto`` precision policy (``engine.config``): what the hardware gets when nothing is set."""

from __future__ import annotations

import torch

from engine.config import resolve_dtype, resolve_quantization


def test_dtype_auto_follows_the_hardware(monkeypatch):
    assert resolve_dtype("float16", "cpu") == "float16"  # an explicit choice is kept
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", "cpu") == "float32"


def test_quantization_auto_is_int8_on_the_cpu(monkeypatch):
    import engine.int8_choice as int8_choice

    assert resolve_quantization("auto", "cpu") == "int8"  # whatever the dtype is: it decodes faster than bf16 there
    # on CUDA: bf16 unless the card's own figures show INT8 winning (tests/engine/test_int8_gpu.py)
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: int8_choice.Int8Choice(None, "auto", "no figures"))
    assert resolve_quantization("auto", "cuda") is None
    assert resolve_quantization("none", "cpu") is None  # an explicit choice is kept
    assert resolve_quantization("int4", "cpu") == "int4"
