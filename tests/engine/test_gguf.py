"""Parley's GGUF loader (engine/gguf/, engine/weights.py), offline on tiny random-weight models.

Each test model is written to a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it
(its metadata keys, gguf-py's own HF -> GGUF tensor names, q/k rows permuted for the Llama family,
Gemma norms stored as w + 1, weights quantized with ``gguf.quants.quantize``), loaded back, and
compared with the same dequantized weights in the original HF layout: the weights exactly, the
logits through transformers (which also checks the config rebuilt from the metadata: sliding
windows, soft-caps, RoPE scaling, multipliers).
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

import engine.gguf
from engine.gguf import FAMILIES, GGUFError, convert_gguf
from engine.gguf.index import INDEX_FILE, has_float32_weights
from engine.gguf.tensors import GGUFTensors
from engine.weights import cache_dir, resolve_model

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is, of course. " * 20
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with ChatML specials and a chat template, as a model's own tokenizer would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, initial_alphabet=alphabet)
    )
    return TokenizersBackend(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str, vocab_size: int):
    """A small config per GGUF architecture that reaches every layer pattern llama.cpp assumes."""
    import transformers as tf

    common = SMALL | IDS | {"vocab_size": vocab_size, "num_hidden_layers": 2}
    if arch == "llama":  # Llama 3.1 RoPE scaling: llama.cpp stores it only as the rope_freqs tensor
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return tf.LlamaConfig(**common, rope_parameters=rope, max_position_embeddings=131072, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if arch == "gemma2":  # llama.cpp scales attention by head_dim: the config must say so to round-trip
        common |= {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}
        return tf.Gemma2Config(**common, attn_implementation="eager")
    if arch == "gemma3":  # 5 sliding layers to 1 full, linear RoPE scaling on the full ones, its own local base
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
        rope["sliding_attention"] = {"rope_type": "default", "rope_theta": 10000.0}
        common |= {"num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}
        return tf.Gemma3TextConfig(**common, rope_parameters=rope, attn_implementation="eager")
    if arch == "phi3":  # fused qkv / gate_up, partial rotary, longrope past 16 positions
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        rope |= {"long_factor": [1.0, 1.5, 2.5, 4.0], "short_factor": [1.0, 1.1, 1.2, 1.3]}
        return tf.Phi3Config(
            **common, rope_parameters=rope, original_max_position_embeddings=16, max_position_embeddings=64
        )
    if arch == "smollm3":  # every 4th layer without RoPE
        return tf.SmolLM3Config(**common | {"num_hidden_layers": 4})
    if arch == "granite":
        mult = {
            "attention_multiplier": 0.2,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        }
        return tf.GraniteConfig(**common, **mult)
    if arch == "olmo2":
        return tf.Olmo2Config(**common)
    raise AssertionError(arch)


def tiny_model(arch: str, vocab_size: int, config=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or tiny_config(arch, vocab_size)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's start at 0: an untouched norm would hide a bug
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


# --- a GGUF writer as llama.cpp's converter does it ------------------------------------------------
def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(data: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """How llama.cpp stores a tensor: 1-D ones float32, matrices in the file's type."""
    if data.ndim == 1:
        return data.astype(np.float32), Q.F32
    return gguf.quants.quantize(data.astype(np.float32), qtype), qtype


def write_metadata(w: gguf.GGUFWriter, arch: str, cfg, tokenizer) -> None:
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch != "phi3" and arch != "granite":  # Phi3MiniModel writes no head_dim, GraniteModel drops it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "smollm3", "granite"):
        w.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    # the vocabulary as _set_vocab_gpt2 writes it
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)


def llama3_rope_freqs(cfg) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors``: the Llama 3 RoPE scaling as per-frequency factors."""
    import math

    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, tokenizer, path: Path, arch: str, qtype: Q) -> dict[str, torch.Tensor]:
    """Write ``model`` as llama.cpp would; returns the weights a loader must give back (dequantized, HF layout)."""
    cfg = model.config
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers
    )
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, cfg, tokenizer)
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        layout = data
        if arch in ("llama", "smollm3", "granite") and ".q_proj." in hf_name:
            layout = permute(data, cfg.num_attention_heads)
        if arch in ("llama", "smollm3", "granite") and ".k_proj." in hf_name:
            layout = permute(data, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            layout = data + 1
        raw, raw_type = stored(layout, qtype)
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
        # quantization works row by row, and the permutation moves whole rows: dequantizing the HF layout
        # gives the same values as un-permuting the dequantized file
        expected[hf_name] = torch.from_numpy(
            gguf.quants.dequantize(stored(data, qtype)[0], raw_type).reshape(data.shape)
        )
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    if cfg.rope_parameters.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(cfg.rope_parameters["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(cfg.rope_parameters["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def reference_logits(arch: str, vocab_size: int, expected: dict, ids: torch.Tensor) -> torch.Tensor:
    """The original architecture and config, with the dequantized weights."""
    model = tiny_model(arch, vocab_size)
    state = dict(expected)
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(ids).logits


def loaded_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def assert_same_weights(folder: Path, expected: dict[str, torch.Tensor], arch: str) -> None:
    """The float32 safetensors and the engine's in-place reading of the GGUF both give the expected weights."""
    in_place = GGUFTensors(folder)
    for loaded in (load_file(str(folder / "model.safetensors")), {name: in_place.pop(name) for name in in_place}):
        assert sorted(loaded) == sorted(expected)
        for name, want in expected.items():
            assert loaded[name].dtype == torch.float32
            if arch.startswith("gemma") and name.endswith("norm.weight"):  # w + 1 - 1 in float32: within an ulp of 1
                torch.testing.assert_close(loaded[name], want, atol=2e-7, rtol=0, msg=name)
            else:
                assert torch.equal(loaded[name], want), name


def convert(path: Path, out: Path) -> Path:
    out.mkdir()
    convert_gguf(path, out, float32_weights=True)
    return out


CASES = [(arch, Q.Q8_0) for arch in FAMILIES] + [
    (arch, qtype) for arch in ("llama", "qwen2", "gemma3") for qtype in (Q.Q4_0, Q.F16)
]


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_loads_to_the_same_weights_and_logits(tmp_path, tokenizer, arch, qtype):
    vocab_size = len(tokenizer)
    model = tiny_model(arch, vocab_size)
    expected = write_gguf(model, tokenizer, tmp_path / "m.gguf", arch, qtype)
    folder = convert(tmp_path / "m.gguf", tmp_path / "hf")

    assert_same_weights(folder, expected, arch)
    ids = torch.tensor([tokenizer(TEXT[:120])["input_ids"][:24]])
    assert ids.shape[1] == 24  # longer than the sliding windows (8) and Phi-3's original context (16)
    torch.testing.assert_close(
        loaded_logits(folder, ids), reference_logits(arch, vocab_size, expected, ids), atol=1e-4, rtol=1e-4
    )


def test_rebuilt_config_keeps_what_the_forward_needs(tmp_path, tokenizer):
    """The fields whose loss the logits might not show at 24 tokens."""
    import json

    got = {}
    for arch in ("llama", "gemma3", "phi3", "granite"):
        model = tiny_model(arch, len(tokenizer))
        write_gguf(model, tokenizer, tmp_path / f"{arch}.gguf", arch, Q.F16)
        got[arch] = json.loads((convert(tmp_path / f"{arch}.gguf", tmp_path / arch) / "config.json").read_text())
    assert got["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert got["llama"]["rope_parameters"]["original_max_position_embeddings"] == 8192
    assert got["llama"]["rope_parameters"]["factor"] == 8.0
    assert got["llama"]["max_position_embeddings"] == 131072
    assert got["gemma3"]["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert got["gemma3"]["rope_parameters"]["full_attention"]["factor"] == 8.0
    assert got["gemma3"]["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert got["phi3"]["rope_parameters"]["long_factor"] == [1.0, 1.5, 2.5, 4.0]
    assert got["phi3"]["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert got["granite"]["logits_scaling"] == 4.0 and got["granite"]["embedding_multiplier"] == 3.0
    assert got["llama"]["rms_norm_eps"] == 1e-6  # the float32 metadata read back as the config's decimal


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to K-quants) with sane fp16 super-block scales.

    Offsets of d (and dmin) in each block, from ggml-common.h's block_q2_K ... block_q6_K.
    """
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scales = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for offset in scales:
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_blocks_dequantize_as_gguf_py_reads_them(tmp_path, tokenizer, qtype):
    """K-quant tensors come back as gguf-py's dequantizer reads the raw blocks, renamed and un-permuted."""
    from transformers import LlamaConfig

    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = LlamaConfig(**IDS, **sizes, vocab_size=len(tokenizer), num_hidden_layers=1)
    model = tiny_model("llama", len(tokenizer), cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    write_metadata(writer, "llama", cfg, tokenizer)
    rng = np.random.default_rng(0)
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if tensor.ndim == 1:  # norms stay float32
            writer.add_tensor(names.get_name(hf_name, (".weight",)), tensor.numpy())
            expected[hf_name] = tensor
            continue
        raw = random_k_blocks(qtype, *tensor.shape, rng)
        writer.add_tensor(names.get_name(hf_name, (".weight",)), raw, raw_shape=raw.shape, raw_dtype=qtype)
        values = gguf.quants.dequantize(raw, qtype)  # the file's layout: q/k rows as llama.cpp permuted them
        assert values.shape == tuple(tensor.shape) and np.isfinite(values).all()
        heads = {"q_proj": 4, "k_proj": 2}.get(hf_name.split(".")[-2])
        if heads:  # transformers' LlamaTensorProcessor._reverse_permute_weights, written out
            values = values.reshape(heads, values.shape[0] // heads // 2, 2, -1).swapaxes(2, 1).reshape(values.shape)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_weights(convert(tmp_path / "k.gguf", tmp_path / "hf"), expected, "llama")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_legacy_blocks_dequantize_with_torch_as_gguf_py_does(qtype):
    """engine/gguf/dequant.py gives gguf-py's float32 values to the bit, every byte pattern of the values and
    high bits, scales and mins of every magnitude and sign."""
    from engine.gguf.dequant import dequantize_blocks

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(4096, type_size), dtype=np.uint8)
    scales = (rng.standard_normal((4096, 2)) * np.logspace(-6, 3, 4096)[:, None]).astype(np.float16)
    scales[:4] = [[0, 0], [-0.0, 1], [65504, -65504], [6e-8, -6e-8]]  # zero, sign, largest, subnormal
    raw[:, :2] = scales[:, :1].view(np.uint8)
    if qtype in (Q.Q4_1, Q.Q5_1):
        raw[:, 2:4] = scales[:, 1:].view(np.uint8)
    want = gguf.quants.dequantize(raw, qtype).reshape(-1)
    got = dequantize_blocks(raw.reshape(-1), qtype).numpy()
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_chat_template_and_tokens_match_the_original_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    write_gguf(tiny_model("qwen2", len(tokenizer)), tokenizer, tmp_path / "m.gguf", "qwen2", Q.F16)
    loaded = AutoTokenizer.from_pretrained(str(convert(tmp_path / "m.gguf", tmp_path / "hf")))

    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "3"}],
    ]
    for chat in chats:
        want = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want
        assert loaded(want)["input_ids"] == tokenizer(want)["input_ids"]
    for text in (TEXT[:200], "  spaces, tabs\tand newlines\n", "émoji ✓ 東京"):
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.eos_token == "<|im_end|>"


def test_cache_is_keyed_by_content_and_reused(tmp_path, tokenizer, monkeypatch):
    """The second start finds the folder without converting, under any file name; a new file converts again."""
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = engine.gguf.convert_gguf
    monkeypatch.setattr(
        engine.gguf, "convert_gguf", lambda path, out, **kw: calls.append(path) or real(path, out, **kw)
    )
    write_gguf(tiny_model("llama", len(tokenizer)), tokenizer, tmp_path / "m.gguf", "llama", Q.Q8_0)

    start = time.perf_counter()
    first = resolve_model(tmp_path / "m.gguf")
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = resolve_model(str(tmp_path / "m.gguf"))
    second_s = time.perf_counter() - start
    assert second == first and first.parent == cache_dir() / "models" and (first / "config.json").is_file()
    assert len(calls) == 1
    assert second_s < first_s / 5, (first_s, second_s)

    (tmp_path / "blob").write_bytes((tmp_path / "m.gguf").read_bytes())  # an Ollama blob: no .gguf suffix
    assert resolve_model(tmp_path / "blob") == first and len(calls) == 1

    write_gguf(tiny_model("qwen2", len(tokenizer)), tokenizer, tmp_path / "m.gguf", "qwen2", Q.Q8_0)
    replaced = resolve_model(tmp_path / "m.gguf")
    assert replaced != first and len(calls) == 2
    assert sorted(p.name for p in cache_dir().joinpath("models").iterdir()) == sorted([first.name, replaced.name])


# --- clear errors ---------------------------------------------------------------------------------
@pytest.fixture
def good_gguf(tmp_path, tokenizer) -> Path:
    write_gguf(tiny_model("llama", len(tokenizer)), tokenizer, tmp_path / "good.gguf", "llama", Q.Q8_0)
    return tmp_path / "good.gguf"


def test_not_a_gguf(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        convert(tmp_path / "model.safetensors", tmp_path / "hf")


def test_truncated_file_names_the_tensor_past_the_end(tmp_path, good_gguf):
    data = good_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFError, match=r"truncated: tensor '[\w.]+' ends at byte \d+, past the end of the file"):
        convert(tmp_path / "cut.gguf", tmp_path / "hf")


def test_damaged_header(tmp_path, good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[24:32] = (2**62).to_bytes(8, "little")  # the first metadata key's length
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="damaged GGUF header"):
        convert(tmp_path / "bad.gguf", tmp_path / "hf")


def test_unsupported_architecture_names_the_supported_ones(tmp_path, tokenizer, monkeypatch):
    writer = gguf.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(
        GGUFError, match="architecture 'bloom' is not supported; supported GGUF architectures: llama, qwen2"
    ):
        resolve_model(tmp_path / "bloom.gguf")
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-written left behind


def test_quant_type_gguf_py_cannot_dequantize(tmp_path, tokenizer):
    model = tiny_model("llama", len(tokenizer))
    writer = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    write_metadata(writer, "llama", model.config, tokenizer)
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    writer.add_tensor(
        "token_embd.weight", np.zeros((len(tokenizer), 64 // block * type_size), np.uint8), raw_dtype=Q.Q8_1
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match="tensor 'token_embd.weight' is stored as Q8_1, which gguf-py cannot dequantize"
    ):
        convert(tmp_path / "q81.gguf", tmp_path / "hf")


@pytest.mark.slow
def test_bundled_gguf_equals_transformers_own_gguf_loader(model_path):
    """A real llama.cpp file: the weights equal what transformers' GGUF loader dequantizes from it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.weights import bundled_gguf_path

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    theirs = load_gguf_checkpoint(str(bundled_gguf_path()), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(model_path / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 272
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].float()), name


def test_engine_serve_stops_on_a_bad_gguf_with_its_reason(tmp_path, capsys, monkeypatch):
    import engine.cli

    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "x.gguf").write_bytes(b"<html>a download page, not a model</html>")
    assert engine.cli.serve(engine.cli.build_parser().parse_args(["serve", "--model", str(tmp_path / "x.gguf")])) == 2
    assert "x.gguf is not a GGUF file: it starts with b'<htm'" in capsys.readouterr().err


# --- the engine reads the GGUF in place -------------------------------------------------------------
@pytest.mark.parametrize(("arch", "qtype"), [("llama", Q.Q8_0), ("qwen2", Q.Q4_0), ("gemma3", Q.F16)])
def test_the_engine_loads_a_gguf_without_float32_weights(tmp_path, tokenizer, monkeypatch, arch, qtype):
    """A GGUF's folder holds no weights: the engine dequantizes them from the GGUF as it loads and computes the
    same logits as from the float32 safetensors; those are written only when asked for, once."""
    from engine.model import LlamaModel
    from engine.model_runner import perplexity
    from engine.model_traits import _folder_traits

    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model(arch, len(tokenizer))
    write_gguf(model, tokenizer, tmp_path / "m.gguf", arch, qtype)
    folder = resolve_model(tmp_path / "m.gguf")
    assert (folder / INDEX_FILE).is_file() and not list(folder.glob("*.safetensors"))
    assert _folder_traits(folder).parameters == sum(p.numel() for p in model.parameters())
    ids = tokenizer(TEXT[:120])["input_ids"][:24]
    in_place = LlamaModel(folder, torch.float32, "cpu", 64)

    assert resolve_model(tmp_path / "m.gguf", float32_weights=True) == folder and has_float32_weights(folder)
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(tmp_path / "m.gguf", float32_weights=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # once
    from_float32 = LlamaModel(folder, torch.float32, "cpu", 64)
    assert perplexity(in_place, ids) == perplexity(from_float32, ids)  # every weight equal (checked above)


def test_a_moved_gguf_is_followed_and_a_missing_one_named(tmp_path, tokenizer, monkeypatch):
    """The folder is found by content: the same file at a new path is read from there; a folder whose GGUF is
    gone says so instead of failing inside numpy."""
    from engine.model import LlamaModel

    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(tiny_model("llama", len(tokenizer)), tokenizer, tmp_path / "m.gguf", "llama", Q.Q8_0)
    folder = resolve_model(tmp_path / "m.gguf")
    (tmp_path / "m.gguf").rename(tmp_path / "moved.gguf")
    with pytest.raises(FileNotFoundError, match="m.gguf, which is gone or was replaced"):
        LlamaModel(folder, torch.float32, "cpu", 64)
    assert resolve_model(tmp_path / "moved.gguf") == folder
    assert GGUFTensors(folder).file == (tmp_path / "moved.gguf").resolve()
    LlamaModel(folder, torch.float32, "cpu", 64)
