"""What ``parley doctor`` measures with: random-weight models built in place (nothing downloaded), an engine
sized for the speed test, decode tokens/s (the engine's and transformers'), and the report of self-tests.
Shared by the doctor's sections (``engine.doctor``, ``engine.doctor_int8``)."""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

log = logging.getLogger(__name__)

SIZES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab, tie embeddings)
    "tiny": (64, 2, 4, 2, 128, 512, False),
    "135m": (576, 30, 9, 3, 1536, 49152, True),  # SmolLM2-135M's shape
    "1b": (2048, 16, 32, 8, 8192, 128256, True),  # Llama 3.2 1B's shape
    "8b": (4096, 32, 32, 8, 14336, 128256, False),  # Llama 3.1 8B's shape (16 GB in bf16: GPU machines only)
}

BATCH_SIZES = (1, 8, 32)


def build_model(root: Path, size: str, dtype: str = "float32", seed: int = 0, device: str = "cpu") -> Path:
    """A random-weight Llama of ``size`` with a byte-level tokenizer (engine/tiny_models.py), saved in ``root``
    (``device``: where its weights are drawn; a GPU draws an 8B model's in seconds, a CPU in minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tiny_models import save_byte_tokenizer

    hidden, layers, heads, kv, inter, vocab, tie = SIZES[size]
    path = root / f"random-{size}-{dtype}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        # peaked logits: greedy ties between near-equal logits would make token-exactness luck
        initializer_range=0.1 if size == "tiny" else 0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).to("cpu")
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    del model
    save_byte_tokenizer(path)
    return path


def speed_engine(
    path: Path, device: str, precision: str, new_tokens: int, cuda_graphs: bool, int8_method: str | None = None
):
    """An engine for the speed test: room for the largest batch of 8-token prompts plus ``new_tokens`` each
    (``int8_method``: the int8 scheme, else ``auto``'s)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="bfloat16",
            quantization="int8" if precision == "int8" else None,
            int8_method=int8_method or "auto",
            device=device,
            max_num_seqs=max(BATCH_SIZES),
            max_num_batched_tokens=max(512, 8 * max(BATCH_SIZES)),
            num_blocks=max(BATCH_SIZES) * (-(-(8 + new_tokens) // 16)) + 4,
            cuda_graphs=cuda_graphs,
        )
    )


def decode_speed(eng, device: str, batch: int, new_tokens: int) -> float:
    """Engine decode tokens/s: ``batch`` requests of 8-token prompts generating ``new_tokens`` each (after a
    warm-up run that also captures the CUDA graphs this run meets); the prefill step is not counted."""
    from engine.sampling import SamplingParams

    prompts = [[1 + (i * 7 + j) % 200 for j in range(8)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eng.generate(prompts, params)  # warm-up
    eng.reset_prefix_cache()
    _sync(device)
    ids = {eng.add_request(None, p, params) for p in prompts}
    first = True
    n = 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        if first:  # the prefill step: not decode
            _sync(device)
            t0 = time.perf_counter()
            first = False
            continue
        n += sum(len(o.token_ids_delta) for o in outs if o.request_id in ids)
    _sync(device)
    return n / max(time.perf_counter() - t0, 1e-9)


def hf_decode_speed(model, device: str, batch: int, new_tokens: int) -> float:
    """transformers ``generate`` tokens/s at ``batch`` (greedy, 8-token prompts), prefill time subtracted."""
    import torch

    ids = torch.tensor([[1 + (i * 7 + j) % 200 for j in range(8)] for i in range(batch)], device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        return time.perf_counter() - t

    run(2)  # warm-up
    one = run(1)
    full = run(new_tokens)
    return batch * (new_tokens - 1) / max(full - one, 1e-9)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class Report:
    def __init__(self) -> None:
        self.data: dict = {"self_tests": []}

    def line(self, text: str) -> None:
        print(text, flush=True)

    def test(self, name: str, device: str, fn) -> object:
        """Run one self-test; a crash is a failed test with its reason, never the end of the run."""
        started = time.perf_counter()
        try:
            ok, detail, value = fn()
        except Exception as e:
            ok, detail, value = False, f"{type(e).__name__}: {e}", None
            log.debug("%s", traceback.format_exc())
        secs = time.perf_counter() - started
        self.data["self_tests"].append({"name": name, "device": device, "ok": ok, "detail": detail, "seconds": secs})
        self.line(f"  [{'PASS' if ok else 'FAIL'}] {device} {name}: {detail} ({secs:.1f} s)")
        return value
