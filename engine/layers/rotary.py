"""Rotary position embedding: the cos/sin tables (as transformers computes them) and their application."""

from __future__ import annotations

import torch


def rope_tables(cfg, head_dim: int, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, head_dim] exactly as transformers computes them (float32, then cast)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    else:  # dynamic/longrope change with sequence length; not supported by a static table
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype).to(device), (emb.sin() * scaling).to(dtype).to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated (half-split layout); ``cos``/``sin`` [T, 1, D], the tables at each position."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
