"""Dense linears: plain ``F.linear``, or bf16 weights pre-reordered for oneDNN on the CPU.

A linear is any callable ``x [M, in] -> [M, out]``; the quantized ones live in
``engine/quant.py``. Each kind reports the bytes it holds (``linear_nbytes``), which is
how the engine accounts weight memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]


class DenseLinear:
    """y = x W^T (+ b); weights kept as one contiguous tensor (fused QKV / gate_up)."""

    __slots__ = ("weight", "bias")
    kernel = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def onednn_packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """bf16 weights can be pre-reordered for oneDNN on this CPU (AVX512-BF16/AMX, or at least AVX512)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """bf16 linear whose weight is reordered for oneDNN once, at load.

    Why: ``F.linear`` on a bf16 CPU tensor reorders (re-lays out) the whole weight on every
    call; for decode-sized inputs that costs as much as the product itself. Same math (oneDNN
    bf16 with fp32 accumulation), different blocking.
    """

    __slots__ = ("packed", "bias", "_nbytes")
    kernel = "onednn-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias
        self._nbytes = weight.numel() * weight.element_size()
        if bias is not None:
            self._nbytes += bias.numel() * bias.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def nbytes(self) -> int:
        return self._nbytes


def tensor_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def linear_nbytes(lin) -> int:
    """Bytes a linear holds: its own ``nbytes()`` (packed, quantized) or its weight and bias."""
    if hasattr(lin, "nbytes"):
        return lin.nbytes()
    return tensor_nbytes(lin.weight, lin.bias)
