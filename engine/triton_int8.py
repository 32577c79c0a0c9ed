"""A Triton kernel for weight-only int8 products: y = x @ (q * scale).T (+ bias), q int8 [N, K], x 16-bit.

Why a kernel of our own: decode at small batch is bound by reading the weights, and an int8 weight is half
the bytes of a bf16 one only if nothing reads a 16-bit copy. ``q.to(bf16) * scale`` then ``F.linear`` (what
torch does unfused) writes and reads a 16-bit copy every call: 5 bytes a weight instead of bf16's 2. Here each
tile of int8 weights is loaded once, widened in registers and fed to ``tl.dot`` with fp32 accumulation; the
per-channel scale and the bias are applied once per output tile. bitsandbytes' LLM.int8 and torch's int8pack
were 10-20x slower than bf16 on an H200 (issue 54; ``parley doctor --gpu`` measures all of them).

The block sizes are chosen by ``triton.autotune`` per (row class, N, K) on the GPU, at the first call of each
shape: the engine's CUDA-graph warm-up runs it outside capture (``engine.cuda.cuda_graph_capture``).

On the CPU the same kernel runs in Triton's interpreter (``InterpretedFunction``: numpy, one program at a
time, slow), which is how CI tests its indexing, masks and scaling without a GPU. The interpreter has no
bfloat16 (its values come out as garbage), so a bf16 input is computed there in float32 and cast back: the
kernel's code is the same, its rounding is float32's.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # No GPU: Triton can only interpret, and it must know before it is imported (triton.language's own
    # functions are jitted then). Imported lazily (``engine.quant``), so only where the int8 kernel is asked for.
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:  # optional: the kernel is defined either way and compiled only where it runs
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

log = logging.getLogger(__name__)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): decode-sized rows first (BLOCK_M 16 is tl.dot's least),
# narrow N tiles so a [N=2048] product still spreads over a hundred-odd SMs; then prefill-sized tiles.
CONFIGS = (
    (16, 32, 128, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3),
    (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
)
INTERPRETED_CONFIG = (32, 64, 64)  # the interpreter's cost is per program: few, large tiles (edges still masked)
K_SLICE_MIN = 512  # a split-K slice's least length (a multiple of every BLOCK_K above)  # small tiles: the interpreter's cost grows with the tile, not the grid


def available() -> bool:
    """Triton is importable (bundled with torch's CUDA wheels; the ``test`` extra installs it for the CPU)."""
    return triton is not None


def interpreting() -> bool:
    """Triton runs kernels in its interpreter in this process (the CPU: tests)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def row_class(m: int) -> int:
    """The autotuner's key for M: powers of two up to 256, so a prefill's varying lengths tune a few times."""
    return min(256, 1 << max(0, (m - 1).bit_length()))


def _w8a16(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    M_CLASS,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < k_end), other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < k_end), other=0
        )
        if IEEE:  # float32 input: full-precision products, not TF32's 10-bit mantissa
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    rm = rm.to(tl.int64)  # M x N outputs may pass 2**31 in a long prefill
    if SPLIT_K > 1:  # a float32 partial sum per slice of K; the caller adds them and scales
        tl.store(y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)
    else:
        acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _quantize_rows(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_M`` rows per program: each row's absmax, then the row as int8 (x / scale, halves away from zero)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rm.to(tl.int64)
    peak = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, axis=1), 1e-10) / 127.0
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        y = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y / scale[:, None]
        y = tl.minimum(tl.maximum(tl.where(y >= 0, y + 0.5, y - 0.5), -127.0), 127.0)
        tl.store(q_ptr + rows[:, None] * stride_qm + rk[None, :], y.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rm, scale, mask=rm < M)


def _scale_int32(
    acc_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    stride_am,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """W8A8's epilogue in one pass: int32 products x the row's and the channel's scales (+ bias), in y's dtype."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    rows = rm.to(tl.int64)
    acc = tl.load(acc_ptr + rows[:, None] * stride_am + rn[None, :], mask=mask, other=0).to(tl.float32)
    acc = acc * tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
    acc = acc * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k(m: int, n: int, k: int, sms: int | None) -> int:
    """Slices of K for a decode-sized product, so that enough programs stream weights at once: at most 16 rows
    there are only N / 64 or so output tiles, fewer than twice the SMs for most layers of a 1B-8B model (a
    [4096 x 14336] down projection: 64 tiles on 132 SMs). Powers of two up to 8, each slice at least
    ``K_SLICE_MIN`` long; 1 for prefill-sized products (enough tiles) and where the SM count is unknown."""
    if sms is None or m > 16:
        return 1
    tiles = max(1, -(-n // 64))
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and k // (split * 2) >= K_SLICE_MIN:
        split *= 2
    return split


@functools.cache
def _kernels():
    """The jitted kernel, its autotuned launcher (GPU) and its interpreted twin (CPU); built on first use."""
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in CONFIGS
    ]
    # an interpreted function where TRITON_INTERPRET is set. M and M_CLASS vary with every prefill: not specialized
    # on (each specialization is a compile of its own, seconds on first use)
    kernel = triton.jit(_w8a16, do_not_specialize=["M", "M_CLASS"])
    if interpreting():
        return kernel, kernel
    tuned = triton.autotune(
        configs=configs,
        key=["M_CLASS", "N", "K", "SPLIT_K"],
        prune_configs_by={"early_config_prune": _fitting_configs},
        cache_results=True,  # the choice kept on disk (Triton's cache): a restart does not benchmark again
    )(kernel)
    return tuned, kernel


@functools.cache
def _w8a8_kernels():
    """W8A8's two small kernels around ``torch._int_mm``: per-token quantization and the scaling epilogue."""
    return triton.jit(_quantize_rows), triton.jit(_scale_int32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M]) in one kernel (``engine.int8_rows.quantize_rows``'s math;
    halves are rounded away from zero, not to even)."""
    _check(x)
    quantize, _ = _w8a8_kernels()
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        xin = x.float() if x.device.type == "cpu" and x.dtype == torch.bfloat16 else x
        # a few rows of 512 per program on the GPU; the interpreter, whose cost is per program, takes 32 at once
        bm, bk = (32, 128) if x.device.type == "cpu" else (4, 512)
        quantize[(triton.cdiv(M, bm),)](xin, q, scale, M, K, xin.stride(0), q.stride(0), BLOCK_M=bm, BLOCK_K=bk)
    return q, scale


def scale_int32(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """int32 [M, N] * x_scale [M, None] * w_scale [None, N] (+ bias) -> dtype, in one kernel."""
    _check(acc)
    _, epilogue = _w8a8_kernels()
    M, N = acc.shape
    out_dtype = torch.float32 if acc.device.type == "cpu" and dtype == torch.bfloat16 else dtype
    y = torch.empty((M, N), dtype=out_dtype, device=acc.device)
    if M:
        grid = (triton.cdiv(M, 32), triton.cdiv(N, 128))
        b = bias if bias is not None else w_scale
        epilogue[grid](acc, x_scale, w_scale, b, y, M, N, acc.stride(0), y.stride(0), bias is not None, 32, 128)
    return y.to(dtype)


def _check(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the int8 kernels need Triton (bundled with torch's CUDA wheels)")
    if (x.device.type == "cpu") != interpreting():
        raise RuntimeError(
            f"the int8 kernels run on CUDA, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1 "
            f"before Triton is imported, as on a machine without a GPU); not on {x.device.type} here"
        )


def _fitting_configs(configs, named_args, **kwargs):
    """Tiles no taller than the rows' class (a decode step does not benchmark 128-row tiles)."""
    rows = max(16, named_args["M_CLASS"])
    return [c for c in configs if c.kwargs["BLOCK_M"] <= rows] or configs[:1]


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] (16-bit or float32) @ (qweight [N, K] int8 * scale [N] float32).T (+ bias [N]) -> [M, N] in x's dtype.

    CUDA: the compiled, autotuned kernel, K split in slices for decode-sized products (``split_k``; ``split``
    overrides it). CPU: the same kernel interpreted (tests; slow)."""
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"w8a16_linear: x {tuple(x.shape)} does not fit a weight of {tuple(qweight.shape)}")
    _check(x)
    tuned, interpreted = _kernels()
    cdiv = triton.cdiv
    M, K = x.shape
    N = qweight.shape[0]
    x = x.contiguous()
    dtype = x.dtype
    on_cpu = x.device.type == "cpu"
    if on_cpu and dtype == torch.bfloat16:
        x = x.float()  # the interpreter's numpy has no bfloat16
    if M == 0:
        return torch.empty((0, N), dtype=dtype, device=x.device)
    if split is None:
        split = split_k(M, N, K, None if on_cpu else _sm_count(x.device))
    slice_len = -(-K // split)
    slice_len = -(-slice_len // 256) * 256  # whole blocks of every BLOCK_K
    split = -(-K // slice_len)
    if split > 1:
        out = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    args = (x, qweight, scale, bias if bias is not None else scale, out, M, N, K, row_class(M), slice_len)
    strides = (x.stride(0), qweight.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0)
    flags = {"HAS_BIAS": bias is not None, "IEEE": x.dtype == torch.float32, "SPLIT_K": split}
    if on_cpu:
        bm, bn, bk = INTERPRETED_CONFIG
        interpreted[(cdiv(M, bm), cdiv(N, bn), split)](*args, *strides, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    else:

        def grid(meta):
            return (cdiv(M, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"]), split)

        tuned[grid](*args, *strides, **flags)
    if split > 1:
        y = out.sum(0).mul_(scale)
        if bias is not None:
            y += bias
        out = y
    return out.to(dtype)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
