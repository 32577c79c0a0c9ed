"""``parley engine merge-lora``: a PEFT adapter merged offline gives the logits of base + adapter applied on
the fly, and the merged folder loads in transformers and in the engine; bad inputs get clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.cli import main as engine_main
from engine.lora import LoraError, merge_lora
from engine.model import LlamaModel
from engine.scheduler import ScheduledChunk
from engine.step_inputs import prepare_inputs

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
R, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_adapter(path, base_sd: dict, targets=TARGETS, r=R, alpha=ALPHA, extra_config=None, seed=1) -> dict:
    """A PEFT-format adapter (as peft's save_pretrained writes it) with random A and B; returns the factors."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors, factors = {}, {}
    for key, w in base_sd.items():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or w.dim() != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        A = torch.randn(r, w.shape[1], generator=g) * 0.1
        B = torch.randn(w.shape[0], r, generator=g) * 0.1  # peft starts B at 0; a trained one is not
        tensors[f"base_model.model.{module}.lora_A.weight"] = A
        tensors[f"base_model.model.{module}.lora_B.weight"] = B
        factors[module] = (A, B)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
    } | (extra_config or {})
    (path / "adapter_config.json").write_text(json.dumps(config))
    return factors


def base_state(base) -> dict:
    from safetensors.torch import load_file

    return load_file(str(base / "model.safetensors"))


def on_the_fly_logits(base, factors, scale, ids) -> torch.Tensor:
    """transformers' base model with x @ A^T @ B^T * scale added to each target linear's output (LoRA unmerged)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    hooks = []
    for name, module in model.named_modules():
        if name in factors:
            A, B = factors[name]
            hooks.append(module.register_forward_hook(lambda m, i, o, A=A, B=B: o + scale * (i[0] @ A.t() @ B.t())))
    assert len(hooks) == len(factors)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_merged_logits_equal_base_plus_adapter_on_the_fly(tiny_base, tmp_path):
    from transformers import AutoModelForCausalLM

    factors = write_adapter(tmp_path / "adapter", base_state(tiny_base))
    assert len(factors) == 2 * len(TARGETS)
    out = merge_lora(tiny_base, tmp_path / "adapter", tmp_path / "merged")
    ids = [3, 17, 42, 99, 5, 64, 7, 120, 1, 2, 33, 8]
    expected = on_the_fly_logits(tiny_base, factors, ALPHA / R, ids)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(torch.tensor([ids])).logits[0] - expected).abs().max() > 1e-2  # the adapter does something

    # the engine loads the merged folder and computes the same logits with its own forward
    model = LlamaModel(out, torch.float32, "cpu")
    chunk = ScheduledChunk("x", ids, 0, [0], sample=True)
    inputs = prepare_inputs([chunk], 16, "cpu", all_logits=True)
    cache = torch.zeros(2, 2, 2, 1, 16, 16)
    engine_logits = model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, cache)
    torch.testing.assert_close(engine_logits, expected, rtol=1e-4, atol=1e-4)
    assert json.loads((out / "parley_merged_lora.json").read_text())["modules"]


def test_rslora_and_rank_pattern_scales(tiny_base, tmp_path):
    sd = base_state(tiny_base)
    factors = write_adapter(tmp_path / "a", sd, targets=["q_proj"], extra_config={"use_rslora": True})
    out = merge_lora(tiny_base, tmp_path / "a", tmp_path / "m")
    merged = base_state(out)
    key = "model.layers.0.self_attn.q_proj"
    A, B = factors[key]
    torch.testing.assert_close(merged[key + ".weight"], sd[key + ".weight"] + ALPHA / R**0.5 * (B @ A))
    factors = write_adapter(tmp_path / "b", sd, targets=["v_proj"], extra_config={"alpha_pattern": {"v_proj": 2.0}})
    merged = base_state(merge_lora(tiny_base, tmp_path / "b", tmp_path / "m2"))
    key = "model.layers.1.self_attn.v_proj"
    A, B = factors[key]
    torch.testing.assert_close(merged[key + ".weight"], sd[key + ".weight"] + 2.0 / R * (B @ A))


def test_clear_errors(tiny_base, tmp_path):
    sd = base_state(tiny_base)
    write_adapter(tmp_path / "ok", sd)
    with pytest.raises(FileNotFoundError, match="adapter's weights"):
        (tmp_path / "noweights").mkdir()
        shutil.copy(tmp_path / "ok" / "adapter_config.json", tmp_path / "noweights")
        merge_lora(tiny_base, tmp_path / "noweights", tmp_path / "o1")
    with pytest.raises(FileNotFoundError, match="adapter's config"):
        merge_lora(tiny_base, tmp_path / "missing", tmp_path / "o2")
    with pytest.raises(FileNotFoundError, match="config.json"):
        merge_lora(tmp_path / "nobase", tmp_path / "ok", tmp_path / "o3")

    bad = tmp_path / "unknown"
    write_adapter(bad, sd, targets=["q_proj"])
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": ["q_proj", "query_key_value"]}))
    with pytest.raises(LoraError, match=r"unknown target modules \['query_key_value'\]"):
        merge_lora(tiny_base, bad, tmp_path / "o4")

    # an adapter trained on another base: its factors do not fit these layers
    other = {k: torch.zeros(v.shape[0] * 2, v.shape[1]) if v.dim() == 2 else v for k, v in sd.items()}
    write_adapter(tmp_path / "other", other, targets=["q_proj"])
    with pytest.raises(LoraError, match="mismatched base: model.layers.0.self_attn.q_proj is 64x64"):
        merge_lora(tiny_base, tmp_path / "other", tmp_path / "o5")

    deeper = dict(sd) | {"model.layers.7.self_attn.q_proj.weight": torch.zeros(64, 64)}
    write_adapter(tmp_path / "deeper", deeper, targets=["q_proj"])
    with pytest.raises(LoraError, match="mismatched base: the adapter has LoRA weights for model.layers.7"):
        merge_lora(tiny_base, tmp_path / "deeper", tmp_path / "o6")

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError):
        merge_lora(tiny_base, tmp_path / "ok", tmp_path / "full")
    assert not (tmp_path / "o4").exists() and not (tmp_path / "o5").exists()  # nothing half written


def test_cli(tiny_base, tmp_path, capsys):
    write_adapter(tmp_path / "a", base_state(tiny_base))
    args = ["merge-lora", "--base", str(tiny_base), "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")]
    assert engine_main(args) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "config.json").is_file()
    capsys.readouterr()
    bad = ["merge-lora", "--base", str(tiny_base), "--adapter", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
    assert engine_main(bad) == 2
    assert "missing the adapter's config" in capsys.readouterr().err
