"""The model families the engine's forward runs, each described by how it differs from Llama's decoder.

Why a description and not a class per family: every family here is a pre-norm decoder with
rotary attention and a gated MLP; they differ in a few switches (which norms, which scales,
which activation, which layers slide or skip RoPE, fused or split projections). ``Family``
names those switches, one builder per architecture reads them off the transformers config,
and one forward (``engine/model.py``) follows them. transformers' modeling files are the
reference for each switch.

Hybrid recurrent models (Qwen3.5, Gemma 4, LFM2, Granite 4) are not decoders of this shape
and are refused with the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does differently from the others."""

    sliding: bool  # attends to the last ``Family.window`` positions only
    rope: bool = True  # rotates q and k (SmolLM3's NoPE layers do not)
    rope_set: str | None = None  # its RoPE parameter set: a layer type (Gemma 3), or None for the model's one


@dataclass(frozen=True)
class Family:
    """The switches of one architecture, with the values its config gives them.

    Norm names are the checkpoint's per-layer weight names; None: the family has no norm there.
    """

    name: str
    layers: tuple[LayerPlan, ...]
    window: int | None = None  # the sliding layers' window
    # RMSNorm rounding (engine/layers/norm.py): Gemma's 1 + w, Gemma's and OLMo 2's float32 scaling
    norm_offset: float = 0.0
    norm_upcast: bool = False
    attn_norm: str | None = "input_layernorm"  # before attention
    attn_out_norm: str | None = None  # on attention's output, before the residual add (Gemma, OLMo 2)
    mlp_norm: str | None = "post_attention_layernorm"  # before the MLP
    mlp_out_norm: str | None = None  # on the MLP's output (Gemma, OLMo 2)
    qk_norm: Literal["head", "width"] | None = None  # per head (Qwen3, Gemma 3) or over the projection (OLMo 2)
    qkv_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # Phi-3: one fused qkv_proj
    gate_up_names: tuple[str, ...] = ("gate_proj", "up_proj")  # Phi-3: one fused gate_up_proj
    activation: str = "silu"
    embed_scale: float = 1.0
    embed_scale_rounded: bool = False  # Gemma: the scale is a tensor in the model's dtype
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    residual_scale: float = 1.0  # Granite: each block's output is scaled before the residual add
    logits_divisor: float = 1.0  # Granite's logits_scaling

    def windowed_up_to(self, max_len: int) -> Family:
        """This family for sequences of at most ``max_len`` tokens: a window none of them outgrows is full
        attention (Phi-4-mini's 262144 in a 131072 context, Mistral's 4096 in a 4096 one)."""
        if self.window is not None and self.window < max_len and any(p.sliding for p in self.layers):
            return self
        return replace(self, window=None, layers=tuple(replace(p, sliding=False) for p in self.layers))

    @property
    def llama_shaped(self) -> bool:
        """The forward is Llama's, so the fused CPU kernels (engine/fused.py) can run it."""
        # fused or split projections load into the same fused linears: they do not count
        plain = Family(self.name, self.layers, self.window, qkv_names=self.qkv_names, gate_up_names=self.gate_up_names)
        return self == plain and all(p.rope and not p.sliding and p.rope_set is None for p in self.layers)


def _layers(cfg, window: int | None, no_rope: list[int] | None = None) -> tuple[LayerPlan, ...]:
    """Per layer: sliding by ``layer_types`` (every layer when the config has a window and no types), RoPE."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if window is None:
        sliding = [False] * n
    elif types:
        sliding = [t == "sliding_attention" for t in types]
    else:  # Mistral, Phi-3: one window for every layer
        sliding = [True] * n
    from engine.layers.rotary import rope_parameter_sets

    sets = rope_parameter_sets(cfg)
    return tuple(
        LayerPlan(
            sliding=sliding[i],
            rope=not no_rope or bool(no_rope[i]),
            rope_set=types[i] if None not in sets else None,
        )
        for i in range(n)
    )


def _window(cfg) -> int | None:
    return getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None


def _llama(cfg) -> dict:
    return {}


def _qwen3(cfg) -> dict:
    return {"qk_norm": "head"}


def _gemma(cfg) -> dict:
    """Gemma 2 and 3: scaled embeddings, four (1 + w) norms per layer, their own attention scale."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("bidirectional Gemma (an embedding model) is not a causal LM")
    return {
        "norm_offset": 1.0,
        "norm_upcast": True,
        "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
        "embed_scale": cfg.hidden_size**0.5,
        "embed_scale_rounded": True,
        "attn_scale": cfg.query_pre_attn_scalar**-0.5,
        "final_softcap": cfg.final_logit_softcapping,
    }


def _gemma2(cfg) -> dict:
    return _gemma(cfg) | {"attn_softcap": cfg.attn_logit_softcapping}


def _gemma3(cfg) -> dict:
    # transformers' Gemma 3 attention does not soft-cap even where the config names a cap
    return _gemma(cfg) | {"qk_norm": "head"}


def _phi3(cfg) -> dict:
    return {"qkv_names": ("qkv_proj",), "gate_up_names": ("gate_up_proj",)}


def _granite(cfg) -> dict:
    return {
        "embed_scale": cfg.embedding_multiplier,
        "attn_scale": cfg.attention_multiplier,
        "residual_scale": cfg.residual_multiplier,
        "logits_divisor": cfg.logits_scaling,
    }


def _olmo2(cfg) -> dict:
    return {
        "norm_upcast": True,
        "attn_norm": None,
        "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": None,
        "mlp_out_norm": "post_feedforward_layernorm",
        "qk_norm": "width",
    }


# architecture -> (family name, its switches from the config)
_ARCHITECTURES: dict[str, tuple[str, Callable[[object], dict]]] = {
    "LlamaForCausalLM": ("llama", _llama),
    "MistralForCausalLM": ("mistral", _llama),
    "Qwen2ForCausalLM": ("qwen2", _llama),
    "Qwen3ForCausalLM": ("qwen3", _qwen3),
    "Gemma2ForCausalLM": ("gemma2", _gemma2),
    "Gemma3ForCausalLM": ("gemma3", _gemma3),
    "Gemma3ForConditionalGeneration": ("gemma3", _gemma3),  # its text part
    "Phi3ForCausalLM": ("phi3", _phi3),
    "SmolLM3ForCausalLM": ("smollm3", _llama),
    "GraniteForCausalLM": ("granite", _granite),
    "Olmo2ForCausalLM": ("olmo2", _olmo2),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def architecture_of(cfg) -> str:
    return (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]


def text_config(cfg):
    """The language model's config (a multimodal checkpoint's ``text_config``; else the config itself)."""
    return getattr(cfg, "text_config", None) or cfg


def describe(cfg) -> Family:
    """The family of a transformers config; an unsupported architecture is refused with the supported ones."""
    arch = architecture_of(cfg)
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    name, switches = _ARCHITECTURES[arch]
    text = text_config(cfg)
    window = _window(text)
    family = Family(name, _layers(text, window, getattr(text, "no_rope_layers", None)), window, **switches(text))
    activation = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{arch}: activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
    return replace(family, activation=activation)
