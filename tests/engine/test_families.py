"""Every supported family on a tiny random-weight model (``engine/tiny_models.py``), against transformers.

Greedy tokens in fp32 equal transformers' ``generate(do_sample=False)`` through continuous
batching of requests of different lengths, chunked prefill, a shared prefix from the prefix
cache and preemption by a tiny KV pool; logits equal transformers' (soft-caps and Granite's
logits divisor change no greedy token); int8 and int4 stay within a perplexity ratio of fp32.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda import eager_capture
from engine.llm_engine import LLMEngine
from engine.model import SUPPORTED_ARCHITECTURES, LlamaModel
from engine.model_runner import perplexity
from engine.model_weights import open_checkpoint
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.step_inputs import prepare_inputs
from engine.tiny_models import (
    FAMILY_CONFIGS,
    PHI3_ORIGINAL_LEN,
    build_family_model,
    load_reference,
    reference_generate,
)

# random-weight models, but a minute and a half of CPU in all: `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.models

FAMILIES = list(FAMILY_CONFIGS)
NEW = 12  # tokens generated per request
BLOCK = 8
# int8 / int4 perplexity over fp32's on the model's own greedy text, at most (and its inverse at least);
# measured on these tiny models: int8 within 1.5 %, int4 within 11.5 % (random weights quantize worse
# than trained ones)
PPL_RATIO = {"int8": 1.02, "int4": 1.15}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(40, 0)  # five full blocks two requests share
PROMPTS = [SHARED + _ids(7, 1), _ids(9, 2), _ids(23, 3), _ids(70, 4), SHARED + _ids(13, 5), _ids(47, 6)]


@pytest.fixture(scope="module")
def family_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return functools.cache(lambda family: build_family_model(root, family))


@pytest.fixture(scope="module")
def reference(family_path):
    """transformers' greedy tokens (memoised per family and prompt)."""

    @functools.cache
    def model(family: str):
        return load_reference(family_path(family), family)

    @functools.cache
    def tokens(family: str, prompt: tuple[int, ...], new: int = NEW) -> list[int]:
        return reference_generate(model(family), list(prompt), new, family)

    tokens.model = model
    return tokens


def _engine(path, **kw) -> LLMEngine:
    kw = {"dtype": "float32", "device": "cpu", "block_size": BLOCK} | kw
    return LLMEngine(EngineConfig(model=str(path), **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family, family_path, reference):
    # 20 blocks of 8 for 6 requests needing 4 to 11 blocks each: decodes outgrow the pool and preempt;
    # 32 tokens a step chunk the long prompts, so windowed layers also attend over cached context
    eng = _engine(family_path(family), num_blocks=20, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    assert eng.generate([PROMPTS[0]], params) == [reference(family, tuple(PROMPTS[0]))]
    got = eng.generate(PROMPTS[::-1], params)[::-1]  # the shared prefix's second user goes first: a cache hit
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == reference(family, tuple(prompt)), f"{family}, prompt of {len(prompt)}"
    assert eng.scheduler.num_preemptions > 0 and eng.stats()["prefix_cache_hit_rate"] > 0
    assert eng.kv.num_used_blocks == 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3"])
def test_graph_decode_path_equals_transformers(family, family_path, reference):
    """The CUDA graph runner's static decode inputs (eager stand-in on the CPU) with sliding windows,
    soft-caps and partial rotary: padded rows and windowed masks built inside the captured forward."""
    eng = _engine(family_path(family), num_blocks=64, max_num_seqs=4)
    eng.runner.enable_graphs(capture=eager_capture)
    got = eng.generate(PROMPTS[1:4], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert got == [reference(family, tuple(p)) for p in PROMPTS[1:4]]
    assert eng.runner.graphs.replays > 0


def _all_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position, on a private KV buffer (as ``perplexity`` computes them)."""
    a = model.args
    nb = -(-len(ids) // BLOCK)
    inputs = prepare_inputs([ScheduledChunk("x", ids, 0, list(range(nb)), sample=True)], BLOCK, "cpu", all_logits=True)
    cache = torch.zeros(a.num_layers, 2, a.num_kv_heads, nb, BLOCK, a.head_dim, dtype=model.dtype)
    with torch.inference_mode():
        return model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, family_path, reference):
    ids = PROMPTS[3]
    model = LlamaModel(family_path(family), torch.float32, "cpu")
    with torch.inference_mode():
        ref = reference.model(family)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), ref, rtol=1e-4, atol=1e-4)


def test_gemma3_text_weights_load_from_either_multimodal_layout(family_path, tmp_path):
    """transformers saves a Gemma3ForConditionalGeneration's text part as ``language_model.model.*`` and
    loads it as ``model.language_model.*``: both are read, and the vision tower is not."""
    from safetensors.torch import load_file, save_file

    src = family_path("gemma3_vlm")
    sd = load_file(str(src / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in sd) and any(k.startswith("vision_tower.") for k in sd)
    renamed = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in sd.items()}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    ids = PROMPTS[2]
    want = _all_logits(LlamaModel(src, torch.float32, "cpu"), ids)  # transformers' logits: the test above
    torch.testing.assert_close(_all_logits(LlamaModel(tmp_path, torch.float32, "cpu"), ids), want, rtol=0, atol=0)
    assert not any(k.startswith(("vision_tower.", "multi_modal")) for k in open_checkpoint(tmp_path)[0])


def test_phi3_short_factors_when_max_model_len_fits_the_pretraining_length(family_path, reference):
    """Within the pre-training length transformers rotates with the short factors; an engine whose
    max_model_len fits in it does too (beyond it, the main test: the long factors)."""
    prompt = _ids(3, 7)
    new = PHI3_ORIGINAL_LEN - len(prompt)
    eng = _engine(family_path("phi3"), max_model_len=PHI3_ORIGINAL_LEN)
    assert eng.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True)) == [
        reference("phi3", tuple(prompt), new)
    ]
    long = _engine(family_path("phi3"))  # max_model_len 512: long factors, not transformers' here
    assert long.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True)) != [
        reference("phi3", tuple(prompt), new)
    ]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_perplexity_close_to_fp32(family, quantization, family_path, reference):
    path = family_path(family)
    # the fp32 model's own greedy text (low perplexity, so a broken layer shows; random text is near uniform)
    ids = [t for p in PROMPTS[1:4] for t in p[:8] + reference(family, tuple(p[:8]), 24)]
    fp32 = perplexity(LlamaModel(path, torch.float32, "cpu"), ids, BLOCK)
    eng = _engine(path, dtype="bfloat16", quantization=quantization, num_blocks=16)
    kernels = {getattr(layer, n).kernel for layer in eng.model.layers for n in ("qkv", "o", "gate_up", "down")}
    assert kernels == {"int8pack" if quantization == "int8" else "int4pack"}
    if quantization == "int8":  # the vocabulary matrix too, tied (Gemma) or not (Qwen3)
        assert eng.model.embed is None and eng.model.lm_head_linear.kernel == "int8-rows"
    ratio = eng.perplexity(ids) / fp32
    assert 1 / PPL_RATIO[quantization] < ratio < PPL_RATIO[quantization], f"{family} {quantization}: {ratio:.4f}"


def test_fused_kernels_only_for_llama_shaped_families(family_path):
    """The fused CPU kernels are Llama's forward: every other family keeps the ATen ops (the bundled
    SmolLM2, a Llama, keeps its fast path)."""
    shaped = {}
    for family in FAMILIES:
        model = LlamaModel(family_path(family), torch.bfloat16, "cpu")
        shaped[family] = model._llama_shaped()
        if not shaped[family]:
            assert not model.use_fused_kernels() and model.fused is None
    assert shaped == {f: f == "llama3" for f in FAMILIES}


def test_a_window_no_sequence_outgrows_is_full_attention(family_path, reference):
    """Mistral's window of 16 in a 16-token context: a Llama (fused kernels and all), same tokens."""
    prompt = _ids(5, 8)
    eng = _engine(family_path("mistral"), max_model_len=16)
    assert eng.model.family.window is None and eng.model._llama_shaped()
    got = eng.generate([prompt], SamplingParams(max_tokens=11, ignore_eos=True))
    assert got == [reference("mistral", tuple(prompt), 11)]


def test_unsupported_architecture_is_refused_with_the_supported_ones(family_path, tmp_path):
    src = family_path("llama3")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((src / "config.json").read_text()) | {"architectures": ["Lfm2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture Lfm2ForCausalLM; supported: .*Gemma3ForCausalLM"):
        LlamaModel(tmp_path, torch.float32, "cpu")
    assert {"Qwen3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


def test_bench_engine_quick_runs_on_a_tiny_qwen3_folder(tmp_path):
    """`parley bench engine --quick --model <folder>`: every section runs on a family other than the bundled one."""
    from engine.benchmarks.throughput import main as bench_engine
    from engine.tiny_models import build_family_model

    folder = build_family_model(tmp_path, "qwen3")
    out = tmp_path / "bench.json"
    assert bench_engine(["--quick", "--model", str(folder), "--skip-hf", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["engine_steps"] > 0 and "grammar_error" not in figures
    assert figures["grammar_sampler_ratio_all_bs1"] > 0
    assert 0.9 < figures["int8_perplexity_ratio"] < 1.1
