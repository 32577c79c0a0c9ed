"""Symmetric int8 rows: per output channel for weights (``quantize_per_channel``, every int8 kernel's storage and
what ``engine.quant_cache`` keeps) and per token for activations (``quantize_rows``, W8A8's dynamic scales)."""

from __future__ import annotations

import torch

Quantized = tuple[torch.Tensor, torch.Tensor]  # ``quantize_per_channel``'s int8 rows and float32 scale per row


def quantize_per_channel(w: torch.Tensor) -> Quantized:
    """Symmetric per-output-channel int8: w ~= q * scale[:, None] (scale float32).

    The largest magnitude of a row is max(its max, -its min) and the rounding is done in place: no copy of the
    matrix for ``abs`` or ``round`` (a load quantizes ~0.5 G weights of the default brain)."""
    w32 = w.float()
    low, high = torch.aminmax(w32, dim=1)
    scale = torch.maximum(high, low.neg()).clamp_min(1e-8) / 127.0
    q = w32 / scale[:, None]
    return q.round_().clamp_(-127, 127).to(torch.int8).contiguous(), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M]): symmetric per-token quantization, x ~ q * scale[:, None].

    An all-zero row gets a tiny scale and zeros (no division by zero)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=1e-10) / 127.0
    q = torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
