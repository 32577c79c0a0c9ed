"""Quantized weights kept between starts (``engine.quant_cache``): a second start of the same checkpoint reads
the int8 rows back instead of its float weights and builds the very same model; a changed checkpoint, another
dtype or a damaged file is quantized again. Model-free (a tiny random Llama built in place)."""

from __future__ import annotations

import os

import pytest
import torch

import engine.model_weights
import engine.quant_cache
from engine.model import LlamaModel
from engine.quant import get_quant_method, quantize_per_channel
from engine.quant_cache import FILE_NAME, QuantCache
from engine.tiny_models import build_family_model


def _reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula before the in-place version (abs, amax, round on copies)."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def test_per_channel_quantization_is_the_same_as_the_plain_formula():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    w[3] = -w[3].abs()  # a row of negatives only: its largest magnitude is its minimum
    w[5] = w[5].abs()
    w[7] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = quantize_per_channel(w.to(dtype))
        ref_q, ref_scale = _reference_quantize(w.to(dtype))
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(engine.quant_cache, "MIN_CHECKPOINT_BYTES", 0)  # the tiny model is kept too
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    return build_family_model(tmp_path, "llama3")


def _int8_model(path) -> LlamaModel:
    return LlamaModel(path, torch.bfloat16, "cpu", 64, quant=get_quant_method("int8", "cpu"))


def _perplexity(model: LlamaModel) -> float:
    from engine.model_runner import perplexity

    return perplexity(model, list(range(5, 40)))


def _matrices(model: LlamaModel) -> list[torch.Tensor]:
    linears = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    return [t for lin in [model.lm_head_linear, *linears] for t in (lin.qweight, lin.scale)]


def _cache_files(root) -> list:
    return sorted((root / "cache" / "quantized").glob(f"*/{FILE_NAME}"))


def test_a_second_start_reads_the_int8_rows_and_builds_the_same_model(tiny, tmp_path, monkeypatch):
    first = _int8_model(tiny)
    (kept,) = _cache_files(tmp_path)
    read: list[str] = []
    pop = engine.model_weights.CheckpointTensors.pop
    monkeypatch.setattr(
        engine.model_weights.CheckpointTensors, "pop", lambda self, name: read.append(name) or pop(self, name)
    )
    second = _int8_model(tiny)
    # the float weights of every quantized matrix stay unread: only norms (and no linear) come from the checkpoint
    assert read and all("norm" in name for name in read), read
    assert _cache_files(tmp_path) == [kept]
    for a, b in zip(_matrices(first), _matrices(second), strict=True):
        assert torch.equal(a, b)
    assert first.weight_bytes() == second.weight_bytes()
    assert first.quant_info == second.quant_info  # float bytes before quantization reported alike
    assert _perplexity(first) == _perplexity(second)


def test_a_changed_checkpoint_or_dtype_is_quantized_again(tiny, tmp_path):
    _int8_model(tiny)
    weights = next(tiny.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    _int8_model(tiny)
    LlamaModel(tiny, torch.float32, "cpu", 64, quant=get_quant_method("int8", "cpu"))
    assert len(_cache_files(tmp_path)) == 3


def test_a_damaged_cache_is_made_again(tiny, tmp_path):
    reference = _matrices(_int8_model(tiny))
    (kept,) = _cache_files(tmp_path)
    kept.write_bytes(b"not safetensors")
    again = _int8_model(tiny)
    for a, b in zip(reference, _matrices(again), strict=True):
        assert torch.equal(a, b)
    found = QuantCache(kept)
    assert found.found == len(reference) // 2  # written again, whole


def test_small_checkpoints_and_other_kernels_are_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    path = build_family_model(tmp_path, "llama3")
    _int8_model(path)  # under MIN_CHECKPOINT_BYTES
    monkeypatch.setattr(engine.quant_cache, "MIN_CHECKPOINT_BYTES", 0)
    LlamaModel(path, torch.bfloat16, "cpu", 64, quant=get_quant_method("int4", "cpu"))
    assert _cache_files(tmp_path) == []


def test_rows_read_off_a_cache_line_are_copied_onto_one(tmp_path):
    """safetensors reads tensors in place, 8-byte aligned at best; torch's AVX-512 int8pack kernel died on such
    rows (a segfault). What the cache hands out starts on a 64-byte line and holds the same numbers."""
    from safetensors.torch import load_file

    cache = QuantCache(tmp_path / FILE_NAME)
    made = {f"m{i}": (torch.randint(-127, 128, (i + 1, 40), dtype=torch.int8), torch.rand(i + 1)) for i in range(8)}
    for name, quantized in made.items():
        cache.put(name, quantized)
    cache.save()
    raw = load_file(str(tmp_path / FILE_NAME))
    assert any(t.data_ptr() % engine.quant_cache.ALIGNMENT for t in raw.values())  # the case this is about
    again = QuantCache(tmp_path / FILE_NAME)
    for name, (q, scale) in made.items():
        got_q, got_scale = again.get(name, torch.device("cpu"))
        assert got_q.data_ptr() % engine.quant_cache.ALIGNMENT == 0
        assert got_scale.data_ptr() % engine.quant_cache.ALIGNMENT == 0
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale)
