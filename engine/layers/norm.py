"""RMSNorm in the two roundings the families use.

Llama's: normalize, cast back to the model's dtype, then scale by the weight (``F.rms_norm``).
Gemma's and OLMo 2's: normalize and scale in float32, then cast; Gemma stores its weight as
an offset from one (``1 + w``). The two differ only in 16-bit models (in float32 they are the
same), but there they change tokens, so each family keeps its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm:
    """x / rms(x) * weight over the last ``weight.numel()`` channels."""

    __slots__ = ("weight", "eps", "upcast", "shape")

    def __init__(
        self, weight: torch.Tensor, eps: float, dtype: torch.dtype, *, offset: float = 0.0, upcast: bool = False
    ) -> None:
        if offset and not upcast:
            raise ValueError("an offset weight (Gemma's 1 + w) is applied in float32: pass upcast=True")
        # upcast: the weight as transformers applies it, 1 + w or w in float32
        self.weight = (offset + weight.float()).contiguous() if upcast else weight.to(dtype).contiguous()
        self.eps = eps
        self.upcast = upcast
        self.shape = (weight.numel(),)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return F.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.shape, self.weight, self.eps)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
