"""Rotary position embedding: the cos/sin tables (as transformers computes them) and their application.

A model has one table per distinct RoPE parameter set (Gemma 3: one for its sliding layers, with
``rope_local_base_freq``, one for its full layers); each layer names the table it uses, or none
(SmolLM3's NoPE layers). Partial rotary (Phi-3/4-mini) rotates the first ``dim`` channels of a
head and passes the rest through.

Longrope (Phi-3/4) has short factors for sequences within the pre-training length and long
ones beyond it. transformers switches when a sequence first grows past that length, and then
recomputes its whole cache with the long factors; a paged cache shared between requests and
computed in chunks cannot, and keys rotated with two factor sets do not attend correctly. So,
as vLLM does, the set is fixed by the engine's ``max_model_len``: long when it exceeds the
pre-training length, short otherwise (same tokens as transformers for every sequence when
``max_model_len`` is at most the pre-training length, and for every sequence longer than it
otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# computed by transformers' own functions (their inverse frequencies and attention factor)
_LIBRARY_TYPES = ("linear", "llama3", "yarn", "longrope")


@dataclass
class Rope:
    """cos/sin [max_len, dim] of one RoPE parameter set."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def dim(self) -> int:
        """Rotated channels per head (less than head_dim with partial rotary)."""
        return self.cos.shape[-1]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, dim] at each packed token's position, ready for ``apply_rotary``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rope_parameter_sets(cfg) -> dict[str | None, dict]:
    """The config's RoPE parameters by layer type (key None: one set for every layer)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    nested = {k: dict(v) for k, v in params.items() if k in layer_types and isinstance(v, dict)}
    if nested:
        return nested
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    return {None: params}


def build_rope(cfg, layer_type: str | None, head_dim: int, max_len: int, dtype: torch.dtype, device) -> Rope:
    """The tables of one parameter set, exactly as transformers computes them (float32, then cast)."""
    sets = rope_parameter_sets(cfg)
    params = sets[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    dim = int(head_dim * partial)
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    elif rope_type in _LIBRARY_TYPES:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # longrope: the long factors when sequences may outgrow the pre-training length (module docstring)
        seq_len = max_len if rope_type == "longrope" else None
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len, layer_type=layer_type)
    else:  # dynamic NTK rescales with the sequence length: no static table
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return Rope((emb.cos() * scaling).to(dtype).to(device), (emb.sin() * scaling).to(dtype).to(device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated (half-split layout); ``cos``/``sin`` [T, 1, dim], the tables at each position.

    With ``dim < D`` (partial rotary) the first ``dim`` channels rotate and the rest pass through.
    """
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
