"""INT8 weights for the transformer-layer linears (``quantization="int8"``); lm_head stays 16-bit.

Why: decode on a small CPU is bound by reading weights, so int8 weights (1/4 of fp32,
1/2 of bf16) read faster. Candidates measured on this 2-core CPU (SmolLM2-135M layer
shapes, one layer's four linears, 1 thread, microseconds; see the engine notes):

    M (tokens)        1     4     8     64
    bf16 linear     276   347   388   1349
    int8pack (W8)   115   218   465   3179   torch._weight_int8pack_mm, per-channel scales
    ao dynamic      161   200   203    898   torch.ao quantized linear (activations quantized too)
    dequant->bf16   ~1000 ...        2384   int8 -> bf16 on the fly, then a bf16 matmul

``torch._weight_int8pack_mm`` is weight-only (activations stay bf16, so answers stay
close to bf16) and the fastest at batch 1, where a voice turn decodes; it scales
linearly with M, so above ``INT8PACK_MAX_M`` tokens (prefill) the same int8 weights are
dequantized to bf16 per call and multiplied in bf16. ``torch.ao`` dynamic quantization
is faster at batch >= 8 but quantizes activations per tensor, which changed answers in
our measurements; it remains selectable (``PARLEY_INT8_KERNEL=ao``) for comparison.
On CUDA, bitsandbytes LLM.int8 (outlier threshold 6.0) is used when importable, else
the same weight-only int8pack path.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

INT8PACK_MAX_M = 32


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~= q * scale[:, None]."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8PackLinear:
    """Weight-only int8 with per-channel scales; activations stay in the model's 16-bit dtype."""

    kernel = "int8pack"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        self.qweight, scale = quantize_per_channel(weight)
        self.scale = scale.to(act_dtype).contiguous()
        self.scale_col = self.scale[:, None]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8PACK_MAX_M:
            y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)
            return y + self.bias if self.bias is not None else y
        w = self.qweight.to(x.dtype) * self.scale_col  # transient; freed right after the matmul
        return F.linear(x, w, self.bias)

    def nbytes(self) -> int:
        b = self.qweight.numel() + self.scale.numel() * self.scale.element_size()
        return b + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class AoDynamicLinear:
    """torch.ao dynamic int8 linear (fbgemm): per-channel int8 weights, activations quantized per call."""

    kernel = "ao"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        q, scale = quantize_per_channel(weight)
        zp = torch.zeros(scale.shape[0], dtype=torch.int64)
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zp, 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self._nbytes = q.numel() + scale.numel() * 4
        self.act_dtype = act_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
        return y if self.act_dtype == torch.float32 else y.to(self.act_dtype)

    def nbytes(self) -> int:
        return self._nbytes


class BnbLinear:
    """CUDA: bitsandbytes LLM.int8 (int8 matmul with fp16 outlier columns above threshold 6.0)."""

    kernel = "bitsandbytes"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        import bitsandbytes as bnb

        out_f, in_f = weight.shape
        lin = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=6.0)
        lin.weight = bnb.nn.Int8Params(weight.detach().to("cpu", torch.float16), requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias.detach().to("cpu", torch.float16), requires_grad=False)
        self.module = lin.to(weight.device)
        self.act_dtype = act_dtype
        self._nbytes = out_f * in_f + out_f * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(torch.float16)).to(self.act_dtype)

    def nbytes(self) -> int:
        return self._nbytes


def choose_kernel(device: str) -> type:
    forced = os.environ.get("PARLEY_INT8_KERNEL", "").strip().lower()
    if forced == "ao":
        return AoDynamicLinear
    if forced == "int8pack":
        return Int8PackLinear
    if device.startswith("cuda"):
        try:
            import bitsandbytes  # noqa: F401

            return BnbLinear
        except ImportError:
            log.info("bitsandbytes not installed; using weight-only int8pack on CUDA")
    return Int8PackLinear


def quantize_model(model, device: str) -> dict:
    """Replace every layer linear of ``model`` by an int8 one, freeing the float weights as it goes."""
    cls = choose_kernel(str(device))
    before = model.linear_weight_bytes()
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, cls(lin.weight, lin.bias, model.dtype))
            lin.weight = None  # drop our reference now so peak memory stays near the int8 size
    after = model.linear_weight_bytes()
    info = {
        "kernel": cls.kernel,
        "linear_bytes_float": before,
        "linear_bytes_int8": after,
        "linear_ratio_vs_fp32": after / (before * 4 / torch.empty((), dtype=model.dtype).element_size()),
        "total_weight_bytes": model.weight_bytes(),
    }
    log.info("int8 (%s): layer linears %.1f MiB -> %.1f MiB", cls.kernel, before / 2**20, after / 2**20)
    return info
