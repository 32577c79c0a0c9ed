"""INT8 linears meant to beat bf16 on the GPU: weight-only (``int8_method="weight_only"``) and W8A8
(``int8_method="w8a8"``).

Both hold the same per-channel int8 rows and float32 scales as the CPU's int8 (``quantize_per_channel``; so
``engine.quant_cache`` keeps them between starts), and both are captured in the decode CUDA graphs (no
data-dependent shapes, unlike bitsandbytes' LLM.int8).

* weight-only (w8a16): activations stay 16-bit; the product is ``engine.triton_int8``'s kernel, which reads
  each int8 weight once. Decode at small batch is bound by reading the weights, so half the bytes of bf16
  should be up to twice the speed there.
* W8A8: above ``W8A8_MIN_ROWS`` rows (prefill, large decode batches, where the product is bound by compute)
  the activations are quantized per token (absmax / 127, dynamic: no calibration) and multiplied on the
  int8 tensor cores by ``torch._int_mm`` (cuBLASLt), the int32 result scaled by the row's and the channel's
  scales. Below it, the weight-only kernel: cuBLASLt's int8 GEMM takes more than 16 rows, and a decode step is
  bound by memory anyway. What vLLM's W8A8 INT8 does, with its scales' granularity.

The output projection (lm_head) stays 16-bit on CUDA (its logits choose every token; bitsandbytes' recipe
too); an untied input embedding is stored as int8 rows (``QuantMethod.quantize_embedding``): a lookup reads
a few rows, so it costs nothing in speed and a large vocabulary's matrix in memory.

Correctness runs on the CPU in CI: ``torch._int_mm`` is the same op there, and the Triton kernel runs in
Triton's interpreter (``engine.triton_int8``). Only a GPU measures speed (``parley doctor --gpu``).
"""

from __future__ import annotations

import torch

from engine.int8_rows import quantize_per_channel
from engine.layers.linear import tensor_nbytes

W8A8_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows


def triton_runs_on(device_type: str) -> bool:
    """The weight-only kernel runs here: Triton compiled for CUDA, or interpreted on the CPU (tests)."""
    from engine import triton_int8

    if not triton_int8.available():
        return False
    return triton_int8.interpreting() == (device_type == "cpu") and device_type in ("cpu", "cuda")


class Int8WeightOnlyLinear:
    """y = x @ (q * scale).T (+ bias), x 16-bit, by the Triton kernel (``engine.triton_int8``)."""

    kernel = "weight-only-triton"
    per_channel_rows = True  # holds quantize_per_channel's (q, scale): engine.quant_cache keeps them

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        *,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.qweight, scale = quantized if quantized is not None else quantize_per_channel(weight)
        self.scale = scale.float().contiguous()
        self.bias = bias
        self.act_dtype = act_dtype

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        from engine.triton_int8 import w8a16_linear

        return w8a16_linear(x, self.qweight, self.scale, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_only(x)

    def nbytes(self) -> int:
        return tensor_nbytes(self.qweight, self.scale, self.bias)


class Int8DynamicLinear(Int8WeightOnlyLinear):
    """W8A8: per-token int8 activations x per-channel int8 weights on the int8 tensor cores (``torch._int_mm``)
    from ``W8A8_MIN_ROWS`` rows; the weight-only kernel below that."""

    kernel = "w8a8-int-mm"

    def __init__(self, weight, bias, act_dtype, *, quantized=None) -> None:
        super().__init__(weight, bias, act_dtype, quantized=quantized)
        n, k = self.qweight.shape
        # cuBLASLt's int8 GEMM wants both sizes multiples of 8; a layer that is not stays weight-only
        self.int_mm = n % 8 == 0 and k % 8 == 0
        self.qweight_t = self.qweight.t()  # [K, N] column-major: the layout cuBLASLt takes, no copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < W8A8_MIN_ROWS or not self.int_mm:
            return self.weight_only(x)
        return self.w8a8(x)

    def w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token quantization, the int8 GEMM, the scaling: three kernels (the first and last Triton's, one
        pass each, instead of ten-odd torch ops over fp32 copies of x and of the int32 result)."""
        from engine.triton_int8 import quantize_rows, scale_int32

        xq, x_scale = quantize_rows(x)
        acc = torch._int_mm(xq, self.qweight_t)
        return scale_int32(acc, x_scale, self.scale, self.bias, x.dtype)


class TorchaoLinear:
    """torchao's own INT8 scheme on one of our linears (an ``nn.Linear`` quantized by ``torchao.quantization.quantize_``):
    what the issue asks our kernels to be measured against. torchao quantizes from the float weight itself."""

    kernel = "torchao"
    config_name = ""  # the torchao config class

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        import torchao.quantization as ao

        out_f, in_f = weight.shape
        lin = torch.nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=act_dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
        ao.quantize_(lin, getattr(ao, self.config_name)())
        self.module = lin.requires_grad_(False)
        self.act_dtype = act_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(self.act_dtype))

    def nbytes(self) -> int:
        w = self.module.weight
        names = w.__tensor_flatten__()[0] if hasattr(w, "__tensor_flatten__") else []
        parts = [getattr(w, n) for n in names] or [w]
        return tensor_nbytes(*parts, self.module.bias)


class TorchaoWeightOnlyLinear(TorchaoLinear):
    kernel = "torchao-weight-only"
    config_name = "Int8WeightOnlyConfig"


class TorchaoDynamicLinear(TorchaoLinear):
    kernel = "torchao-w8a8"
    config_name = "Int8DynamicActivationInt8WeightConfig"


def torchao_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None
