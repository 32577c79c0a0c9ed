"""Weight-only quantization: ``quantization="int8"`` (the memory setting) and ``"int4"`` (the speed setting).

int8: per-channel int8 for the transformer-layer linears and for the tied embedding /
lm_head (looked up and multiplied straight from its int8 rows), so no 16-bit copy of
the 49k-row vocabulary matrix remains: weight memory about a quarter of fp32.

int4: asymmetric 4-bit per group of 32 input channels for the layer linears, the layout
of GGUF Q4_1 (what llama.cpp runs the bundled SmolLM2 in; re-quantizing its dequantized
weights recovers the same grid), with ``torch._weight_int4pack_mm_for_cpu``; lm_head stays
16-bit (packed for oneDNN), as llama.cpp keeps it at 8 bits.

Why: decode on a small CPU is bound by reading weights, so int8 weights (1/4 of fp32,
1/2 of bf16) read faster; ``parley bench engine`` reports the decode rates (app/bench/results/engine_cpu.md).

``torch._weight_int8pack_mm`` is weight-only (activations stay bf16, so answers stay
close to bf16) and the fastest kernel at batch 1, where a voice turn decodes; its cost grows
linearly with M, so above a number of rows (prefill) the same int8 weights are dequantized
per call and multiplied densely. Where the CPU computes bf16 (oneDNN on AVX512 and up) or on
CUDA, that product is bf16 and starts above ``INT8PACK_MAX_M`` rows. Elsewhere a bf16 matmul
is emulated element by element, the slowest path of all, so there the product is fp32 (cast
back to bf16) and int8pack keeps up to ``INT8PACK_MAX_M_EMULATED`` rows (``prefill_path``).

Where the fused CPU kernels are built on a CPU with AVX2 and FMA, ``Int8Dot`` (int8 x int8 dot
products, activations quantized per block of 32) takes the steps int8pack would: it is faster.

``torch.ao`` dynamic quantization is faster at batch >= 8 but quantizes activations per
tensor, which changed answers; it remains selectable (``EngineConfig(int8_method="ao")``)
for comparison.

On CUDA, int8 is bitsandbytes LLM.int8 (``bnb.nn.Linear8bitLt``, ``has_fp16_weights=False``,
outlier threshold 6.0, as ``load_in_8bit`` sets it up; embedding and ``lm_head`` stay 16-bit):
``int8_method="auto"`` (the default) picks it on CUDA and int8pack on the CPU;
``"bitsandbytes"`` forces it on either device. bitsandbytes >= 0.46 runs the very same
module on the CPU (its CPU backend: under 1 % relative error per layer, and much slower
than fp32 there), so the CPU tests run the GPU's int8 path through the whole engine. The
``gpu`` extra installs it; on CUDA without it, ``auto`` falls back to int8pack with a
warning (int8pack's CUDA kernel is a simple loop, far from cuBLAS).

The model builder (``engine/model.py``) applies the method while it builds the layers
(``get_quant_method`` picks it from the config); nothing patches a built model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import INT8_METHODS
from engine.int8_rows import Quantized, quantize_per_channel
from engine.layers.linear import onednn_packing_available

log = logging.getLogger(__name__)

INT8PACK_MAX_M = 32  # rows through int8pack where the dense product is bf16 at full speed
INT8PACK_MAX_M_EMULATED = 192  # ... and where bf16 is emulated, so the dense product is fp32
INT4_GROUP = 32
INT4PACK_MAX_M = 64  # int4 matmul cost grows with M; above this, dequantize once per call (prefill)
INT4PACK_MAX_M_EMULATED = 192  # where bf16 is emulated the dense product is fp32: int4pack is as fast up to here
INT4_TILE_N = 64  # output rows per tile of the CPU int4 pack layout


@contextlib.contextmanager
def every_core() -> Iterator[None]:
    """torch's CPU threads on every core this process may use while open (a model quantized as it loads: the
    engine's own thread count is for its steps, beside the other models); the count is set back after."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(before, cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Int8PackLinear:
    """Weight-only int8 with per-channel scales; activations stay in the model's 16-bit dtype."""

    kernel = "int8pack"
    per_channel_rows = True  # holds quantize_per_channel's (q, scale): engine.quant_cache keeps them

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        *,
        quantized: Quantized | None = None,
    ) -> None:
        """``quantized``: ``quantize_per_channel``'s (q, scale) of ``weight``, made before (a start reading them
        from ``engine.quant_cache``); ``weight`` is then not needed."""
        self.qweight, scale = quantized if quantized is not None else quantize_per_channel(weight)
        self.scale = scale.to(act_dtype).contiguous()
        self.max_rows, self.dense_dtype = prefill_path(
            act_dtype, self.qweight.device, INT8PACK_MAX_M, INT8PACK_MAX_M_EMULATED
        )
        self.scale_col = (self.scale if self.dense_dtype == act_dtype else scale.to(self.dense_dtype))[:, None]
        self.bias = bias
        self.dense_bias = None if bias is None else bias.to(self.dense_dtype)
        self.dot: Int8Dot | None = None  # set by use_fused_kernels
        self.dequantize: DenseWeight | None = None  # ... and this

    def use_fused_kernels(self, fused) -> bool:
        self.dot = Int8Dot.build(fused, self.qweight, self.scale)
        self.dequantize = DenseWeight.build(fused, self.qweight, self.scale_col)
        return self.dot is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            y = self.dot.product(x) if self.dot else None  # the fused kernel, where built, instead of int8pack
            if y is None:
                y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)
            return y + self.bias if self.bias is not None else y
        if self.dequantize is not None:
            w = self.dequantize.weight(self.dense_dtype)  # in a buffer the next call overwrites
        else:
            w = self.qweight.to(self.dense_dtype) * self.scale_col  # transient; freed right after the matmul
        return F.linear(x.to(self.dense_dtype), w, self.dense_bias).to(x.dtype)

    def nbytes(self) -> int:
        b = self.qweight.numel() + self.scale.numel() * self.scale.element_size()
        b += self.scale_col.numel() * self.scale_col.element_size() if self.dense_dtype != self.scale.dtype else 0
        return b + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class DenseWeight:
    """An int8 weight dequantized for a dense product (prefill), in one pass into a buffer of the thread's that the
    next call overwrites (the fused ``dequantize_rows_into``).

    Why: ``q.to(float32) * scale`` is two passes into fresh memory each call; with the page faults of a new
    17-35 MB tensor it took ~20% of a 500-token prefill of the default brain (0.84 of 3.8 s, torch's profiler).
    The buffer is as large as the largest weight dequantized (35 MB in fp32 for the default brain's gate/up),
    once per thread that runs prefills (the engine's step thread). The values are the same as ATen's."""

    _local = threading.local()

    def __init__(self, kernel, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self._kernel, self._qweight, self._scale = kernel, qweight, scale

    @classmethod
    def build(cls, fused, qweight: torch.Tensor, scale_col: torch.Tensor) -> DenseWeight | None:
        """For these weights, or None where the kernel is not there (not built, a GPU)."""
        if fused is None or not hasattr(fused, "dequantize_rows_into") or qweight.device.type != "cpu":
            return None
        return cls(fused.dequantize_rows_into, qweight, scale_col.reshape(-1).float().contiguous())

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``, valid until this thread's next call."""
        out = self.buffer(self._qweight.numel(), dtype).view(self._qweight.shape)
        self._kernel(self._qweight, self._scale, out)
        return out

    @classmethod
    def buffer(cls, numel: int, dtype: torch.dtype) -> torch.Tensor:
        held = getattr(cls._local, "buffer", None)
        if held is None or held.dtype != dtype or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype)
            cls._local.buffer = held
        return held[:numel]


def prefill_path(
    act_dtype: torch.dtype, device: torch.device | str, packed_rows: int, packed_rows_emulated: int
) -> tuple[int, torch.dtype]:
    """(most rows for the packed kernel, dtype of the dense product above them) for a quantized linear.

    A dequantized weight is multiplied in 16 bits where that runs at full speed (CUDA, or oneDNN's
    bf16 on the CPU); where 16-bit matmuls are emulated, in fp32, and the packed kernel keeps more rows.
    """
    if torch.device(device).type == "cuda" or onednn_packing_available(act_dtype, device):
        return packed_rows, act_dtype
    return packed_rows_emulated, torch.float32


@functools.cache
def int4_pack_tile_rows() -> int:
    """Rows per tile of ``torch._convert_weight_to_int4pack_for_cpu``'s layout on this CPU (64 or 32).

    The layout follows the ISA torch's kernel dispatches to (AVX512: 64-row tiles; AVX2 and
    others: 32), so it is read off a packed probe once instead of assumed.
    """
    n, k = INT4_TILE_N, INT4_GROUP
    q = torch.arange(n * k, dtype=torch.int32).view(n, k) % 15
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for rows in (64, 32):
        t = packed.view(n // rows, k, rows // 2)
        unpacked = torch.cat((t & 15, t >> 4), -1).transpose(1, 2).reshape(n, k)
        if torch.equal(unpacked.to(torch.int32), q):
            return rows
    raise RuntimeError("unknown int4 pack layout of torch._convert_weight_to_int4pack_for_cpu")


class Int4PackLinear:
    """Weight-only int4, asymmetric per group of ``INT4_GROUP`` inputs (w = q * scale + lo, q in 0..15)."""

    kernel = "int4pack"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        n, k = weight.shape
        if weight.device.type != "cpu":
            raise ValueError("int4 weights run on the CPU kernel only; use quantization='int8' on CUDA")
        if k % INT4_GROUP or n % INT4_TILE_N:
            raise ValueError(f"int4 needs in_features % {INT4_GROUP} == 0 and out_features % {INT4_TILE_N} == 0")
        w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
        lo = w.amin(-1)
        scale = ((w.amax(-1) - lo) / 15).clamp_min(1e-8)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel computes (q - 8) * scale + zero, per [group, out] pair
        self.scales_zeros = torch.stack((scale.t(), (lo + 8 * scale).t()), -1).to(act_dtype).contiguous()
        self.shape = (n, k)
        self.bias = bias
        self.max_rows, self.dense_dtype = prefill_path(
            act_dtype, weight.device, INT4PACK_MAX_M, INT4PACK_MAX_M_EMULATED
        )

    def dequantize_tiles(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (16-bit, or ``dtype``) in the kernel's tile order: [n / B, k, B], tile t holding
        rows Bt..Bt+B-1.

        The CPU pack layout: per B-row tile, byte (t, k, j) holds row Bt+j in its low nibble
        and row Bt+j+B/2 in its high one; B is 64 where torch's kernel was built for AVX512
        and 32 elsewhere (``int4_pack_tile_rows`` finds out once). Unpacking tile-wise needs
        no transpose, so dequantization is three cheap passes (a row-major unpack was an order of
        magnitude slower).
        """
        n, k = self.shape
        B = int4_pack_tile_rows()
        tiles, groups = n // B, k // INT4_GROUP
        t = self.packed.view(tiles, k, B // 2)
        q = torch.cat((t & 15, t >> 4), -1).view(tiles, groups, INT4_GROUP, B)
        sz = self.scales_zeros.float().view(groups, tiles, 1, B, 2).transpose(0, 1)
        dtype = dtype or self.scales_zeros.dtype
        scale = sz[..., 0].to(dtype).contiguous()
        offset = (sz[..., 1] - 8 * sz[..., 0]).to(dtype).contiguous()  # the kernel's (q - 8) * s + zero
        return torch.addcmul(offset, q.to(dtype), scale).view(tiles, k, B)

    def dequantize(self) -> torch.Tensor:
        """The 16-bit weight [n, k] (row-major, as ``F.linear`` takes it)."""
        n, k = self.shape
        return self.dequantize_tiles().transpose(1, 2).reshape(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scales_zeros)
        else:  # prefill: one batched matmul over the dequantized tiles ([tiles, M, 64] -> [M, n])
            tiles = self.dequantize_tiles(self.dense_dtype)
            y = torch.matmul(x.to(self.dense_dtype), tiles).to(x.dtype)
            y = y.transpose(0, 1).reshape(x.shape[0], self.shape[0])
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        b = self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()
        return b + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class Int8Embedding:
    """The tied embedding / lm_head as per-row int8 weights; activations stay 16-bit.

    As lm_head: ``_weight_int8pack_mm``, the layers' kernel (as fast as the packed bf16 head
    at one row, without a second 16-bit copy of the matrix). Quantizing the activations too
    (``torch._int_mm`` per token, fbgemm per tensor) was faster at 8+ rows but lost perplexity
    (app/bench/results/engine_cpu.md).
    Lookups gather and dequantize only the rows asked for.
    """

    kernel = "int8-rows"

    def __init__(
        self,
        weight: torch.Tensor | None,
        act_dtype: torch.dtype,
        *,
        quantized: Quantized | None = None,
    ) -> None:
        self.qweight, scale = quantized if quantized is not None else quantize_per_channel(weight)
        self.scale = scale.to(act_dtype).contiguous()
        self.act_dtype = act_dtype
        self.dot: Int8Dot | None = None  # set by use_fused_kernels

    def use_fused_kernels(self, fused) -> bool:
        self.dot = Int8Dot.build(fused, self.qweight, self.scale)
        return self.dot is not None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.act_dtype) * self.scale[ids, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dot.product(x) if self.dot else None
        return y if y is not None else torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()


class Int8Dot:
    """x times int8 weights as int8 x int8 dot products (the fused ``int8_linear`` kernel, AVX2 and FMA).

    The activations are quantized to int8 per block of 32 inputs (a scale per block, as
    llama.cpp's Q8_0), so a row costs 32-wide integer multiply-adds instead of widening every
    weight to 16 or 32 bits: decode reads each weight once and does little else with it.
    Where it is built it takes every step int8pack would (``max_rows``): it was faster than
    int8pack at every row count on an AVX2 CPU, at the same perplexity (app/bench/results/engine_cpu.md).
    Greedy continuations differ from int8pack's a little more often than int8pack's from bf16's.
    Not compared on an AVX512 CPU, where int8pack has its own AVX512 path. Per-token
    quantization of the activations (one scale per row) loses perplexity (see
    ``Int8Embedding``); per block of 32 it costs ~0.5% on average (the bundled model), and the tests
    bound the change at 3%, the scatter of their 94-token measurement across CPUs (``test_engine_fused``).
    """

    def __init__(self, kernel, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self._kernel, self._qweight, self._scale = kernel, qweight, scale  # the same tensors as int8pack's

    @classmethod
    def build(cls, fused, qweight: torch.Tensor, scale: torch.Tensor) -> Int8Dot | None:
        """The kernel for these weights, or None where it does not apply (not built, no AVX2, a GPU, odd width)."""
        if fused is None or not getattr(fused, "has_int8_linear", lambda: False)():
            return None
        if qweight.device.type != "cpu" or qweight.shape[1] % 32:
            return None
        return cls(fused.int8_linear, qweight, scale)

    def product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ (qweight * scale).T in x's dtype, or None for a tensor the kernel does not take."""
        if x.device.type != "cpu" or x.dim() != 2 or x.dtype != self._scale.dtype:
            return None
        return self._kernel(x.contiguous(), self._qweight, self._scale)


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


BNB_THRESHOLD = 6.0


class BnbLinear:
    """bitsandbytes LLM.int8: an int8 matmul, with the input columns holding an outlier above
    ``BNB_THRESHOLD`` (6.0) multiplied in fp16. CUDA, and the CPU with bitsandbytes >= 0.46.

    The weight is quantized (per row, int8 + scale ``SCB``) when the module is moved to its
    device, as ``load_in_8bit`` does. Activations go in as fp16, LLM.int8's dtype. Not safe to
    capture in a CUDA graph: the outlier columns are found per call (a data-dependent size).
    """

    kernel = "bitsandbytes"
    graph_safe = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        import bitsandbytes as bnb

        out_f, in_f = weight.shape
        lin = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=BNB_THRESHOLD)
        lin.weight = bnb.nn.Int8Params(weight.detach().to("cpu", torch.float16), requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias.detach().to("cpu", torch.float16), requires_grad=False)
        self.module = lin.to(weight.device)  # quantizes the weight (Int8Params.to)
        if self.module.weight.dtype != torch.int8:
            raise RuntimeError(f"bitsandbytes {bnb.__version__} did not quantize the weight on {weight.device}")
        self.act_dtype = act_dtype
        self._nbytes = out_f * in_f + out_f * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(torch.float16)).to(self.act_dtype)

    def nbytes(self) -> int:
        return self._nbytes


def _bitsandbytes_importable() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes version, or None (found without importing it: the import is slow)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitsandbytes")
    except PackageNotFoundError:
        return None


def int8_linear_class(int8_method: str, device: str | torch.device) -> type:
    """The int8 layer-linear kernel for ``EngineConfig.int8_method`` on ``device``.

    ``auto`` on CUDA: the scheme this card's doctor figures chose (``engine.int8_choice``), else W8A8 with the
    weight-only kernel for decode where Triton is installed (engine/int8_gpu.py), else bitsandbytes LLM.int8
    (int8pack, with a warning, when that is missing too); int8pack on the CPU. ``bitsandbytes`` forces LLM.int8
    on either device; ``weight_only`` and ``w8a8`` run on CUDA, and on the CPU only in Triton's interpreter
    (the tests). An explicit method the device cannot run is an error, not a silent fallback.
    """
    dev = torch.device(device).type
    if int8_method in ("weight_only", "w8a8"):
        from engine.int8_gpu import Int8DynamicLinear, Int8WeightOnlyLinear, triton_runs_on

        if not triton_runs_on(dev):
            raise ValueError(
                f"int8_method={int8_method!r} needs Triton on CUDA (bundled with torch's CUDA wheels), or on the CPU "
                "Triton's interpreter (tests only: TRITON_INTERPRET=1)"
            )
        return Int8WeightOnlyLinear if int8_method == "weight_only" else Int8DynamicLinear
    if int8_method in ("torchao_weight_only", "torchao_w8a8"):
        from engine.int8_gpu import TorchaoDynamicLinear, TorchaoWeightOnlyLinear, torchao_importable

        if not torchao_importable():
            raise ValueError(f"int8_method={int8_method!r} needs torchao (pip install -e '.[gpu]')")
        return TorchaoWeightOnlyLinear if int8_method == "torchao_weight_only" else TorchaoDynamicLinear
    if int8_method == "auto" and dev == "cuda":
        from engine.int8_choice import cuda_choice
        from engine.int8_gpu import triton_runs_on

        chosen = cuda_choice().int8_method
        if chosen != "auto":
            return int8_linear_class(chosen, device)
        if triton_runs_on(dev):
            return int8_linear_class("w8a8", device)
    if int8_method == "int8pack":
        return Int8PackLinear
    if int8_method == "ao":
        if dev != "cpu":
            raise ValueError("int8_method='ao' (torch.ao dynamic int8, fbgemm) runs on the CPU only")
        return AoDynamicLinear
    if int8_method == "bitsandbytes":
        if dev not in ("cuda", "cpu"):
            raise ValueError(f"int8_method='bitsandbytes' runs on CUDA or the CPU, not {dev}")
        if not _bitsandbytes_importable():
            raise ValueError("int8_method='bitsandbytes' needs the bitsandbytes package (pip install -e '.[gpu]')")
        return BnbLinear
    if int8_method == "auto":
        if dev == "cuda":
            if _bitsandbytes_importable():
                return BnbLinear
            log.warning(
                "bitsandbytes is not installed: int8 on CUDA falls back to int8pack (torch._weight_int8pack_mm, "
                "much slower than LLM.int8 there); install the gpu extra: pip install -e '.[gpu]'"
            )
        return Int8PackLinear
    raise ValueError(f"int8_method must be one of {', '.join(INT8_METHODS)}, not {int8_method!r}")


@dataclass(frozen=True)
class QuantMethod:
    """How the model builder stores weights: the layer-linear kernel, and whether the vocabulary matrices
    (embedding, lm_head) become int8 rows.

    int8 on the CPU also stores the embedding / lm_head as int8 rows; int4 and CUDA keep
    lm_head 16-bit (bitsandbytes' recipe, and llama.cpp's 8-bit output layer is no smaller
    than our packed bf16 one is slower). The GPU's own schemes store an untied input embedding as int8
    rows (``quantize_embedding``: a lookup reads a few rows), lm_head 16-bit.
    """

    name: str  # "int8" or "int4"
    linear_cls: type
    quantize_vocab: bool
    quantize_embedding: bool = False  # an untied embedding only (lm_head stays 16-bit)

    @property
    def kernel(self) -> str:
        return self.linear_cls.kernel

    @property
    def per_channel_int8(self) -> bool:
        """The layer linears hold ``quantize_per_channel``'s int8 rows and scales: what ``engine.quant_cache``
        keeps between starts (with the int8 vocabulary, which is always that)."""
        return getattr(self.linear_cls, "per_channel_rows", False)

    def linear(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        quantized: Quantized | None = None,
    ):
        """A layer linear of ``weight``, or of its (q, scale) made before (``per_channel_int8`` methods)."""
        if quantized is not None:
            return self.linear_cls(weight, bias, act_dtype, quantized=quantized)
        return self.linear_cls(weight, bias, act_dtype)

    def vocab(
        self,
        weight: torch.Tensor | None,
        act_dtype: torch.dtype,
        quantized: Quantized | None = None,
    ) -> Int8Embedding:
        return Int8Embedding(weight, act_dtype, quantized=quantized)


def get_quant_method(
    quantization: str | None, device: str | torch.device, int8_method: str = "auto"
) -> QuantMethod | None:
    """The method for ``EngineConfig.quantization`` / ``int8_method`` on ``device`` (None: 16-bit weights)."""
    if quantization is None:
        return None
    if quantization == "int4":
        method = QuantMethod("int4", Int4PackLinear, quantize_vocab=False)
    elif quantization == "int8":
        cls = int8_linear_class(int8_method, device)
        # LLM.int8 keeps the embedding and lm_head 16-bit (load_in_8bit's recipe), on either device
        from engine.int8_gpu import Int8WeightOnlyLinear, TorchaoLinear

        gpu_scheme = issubclass(cls, (Int8WeightOnlyLinear, TorchaoLinear))
        vocab = torch.device(device).type == "cpu" and cls is not BnbLinear and not gpu_scheme
        method = QuantMethod("int8", cls, quantize_vocab=vocab, quantize_embedding=gpu_scheme)
    else:
        raise ValueError(f"unknown quantization {quantization!r}")
    log.info("%s weights: layer linears run the %s kernel (int8_method=%s)", method.name, method.kernel, int8_method)
    return method


def quant_summary(
    method: QuantMethod, linear_bytes_float: int, linear_bytes: int, total_bytes: int, dtype: torch.dtype
) -> dict:
    """What quantization did to the weights (logged once at INFO; the model keeps it as ``quant_info``)."""
    fp32_bytes = linear_bytes_float * 4 / torch.empty((), dtype=dtype).element_size()
    info = {
        "method": method.name,
        "kernel": method.kernel,
        "linear_bytes_float": linear_bytes_float,
        "linear_bytes_quantized": linear_bytes,
        "linear_ratio_vs_fp32": linear_bytes / fp32_bytes,
        "total_weight_bytes": total_bytes,
    }
    log.info(
        "%s (%s): layer linears %.1f MiB -> %.1f MiB, all weights %.1f MiB",
        method.name,
        method.kernel,
        linear_bytes_float / 2**20,
        linear_bytes / 2**20,
        total_bytes / 2**20,
    )
    return info
