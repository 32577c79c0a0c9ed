"""Engine settings in one typed record, so every part (scheduler, cache, runner) reads the same numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dtype = Literal["float32", "bfloat16", "float16"]
Int8Method = Literal[
    "auto", "int8pack", "ao", "bitsandbytes", "weight_only", "w8a8", "torchao_weight_only", "torchao_w8a8"
]
INT8_METHODS = ("auto", "int8pack", "ao", "bitsandbytes", "weight_only", "w8a8", "torchao_weight_only", "torchao_w8a8")
CPU_STEP_TOKENS = 128  # ``EngineConfig.step_tokens`` where the CPU emulates bfloat16
CPU_BF16_STEP_TOKENS = 256  # ... and where it computes bfloat16 (AVX512-BF16, AMX)
CUDA_STEP_TOKENS = 512


def resolve_dtype(setting: str, device: str) -> str:
    """``auto``: bfloat16 where the hardware computes it (CUDA, CPUs with AVX512-BF16/AMX), else float32.

    Where the CPU only emulates bfloat16 (oneDNN without native support) it is several times slower
    than float32 at the first token (app/bench/results/engine_cpu.md).
    """
    if setting != "auto":
        return setting
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_computes_bf16() else "float32"


def cpu_computes_bf16() -> bool:
    """oneDNN computes bfloat16 on this CPU (AVX512-BF16, AMX) instead of emulating it."""
    import torch

    from engine.layers.linear import onednn_packing_available

    return onednn_packing_available(torch.bfloat16, "cpu")


def resolve_quantization(setting: str, device: str) -> str | None:
    """``auto``: int8 weights on the CPU (with bf16 activations where the CPU has them); on CUDA int8 where this
    card's figures (``parley doctor --gpu``) show an INT8 scheme at least as fast as bf16, else none
    (``engine.int8_choice``, which says why); ``none``: None.

    A voice reply waits for its first spoken piece, so decode speed counts more than prefill speed,
    and int8 decodes faster than 16-bit on every CPU measured, at about float32's perplexity
    (app/bench/results/engine_cpu.md; ``parley doctor`` checks it).
    """
    if setting == "auto":
        if device.startswith("cuda"):
            from engine.int8_choice import cuda_choice

            return cuda_choice().quantization
        return "int8"
    return None if setting == "none" else setting


@dataclass
class EngineConfig:
    """What model to serve, in what precision, and how much memory and batching to allow.

    ``kv_cache_bytes`` sizes the paged KV pool from a memory budget; ``num_blocks``
    overrides it (tests use a tiny pool to force preemption). ``max_model_len``
    defaults to the model's context length (capped by the pool size).

    ``int8_method`` picks the int8 kernel (``quantization="int8"`` only): ``auto`` is, on CUDA, the
    scheme this card's doctor figures chose, else ``w8a8`` where Triton is installed, else bitsandbytes;
    on the CPU weight-only ``int8pack`` (``torch._weight_int8pack_mm``). ``weight_only`` (a Triton
    kernel reading int8 weights) and ``w8a8`` (per-token int8 activations on the int8 tensor cores,
    ``torch._int_mm``) are the GPU's fast schemes (engine/int8_gpu.py), ``torchao_weight_only`` and
    ``torchao_w8a8`` torchao's, which they are measured against; ``bitsandbytes`` forces
    LLM.int8 on either device (bitsandbytes >= 0.46 runs it on the CPU too: what the CPU
    tests check the GPU path with); ``int8pack`` forces that one; ``ao`` is torch.ao
    dynamic int8 (CPU, activations quantized too). See engine/quant.py.

    CUDA only (see engine/cuda.py): ``cuda_graphs`` captures decode steps as CUDA graphs
    per batch-size bucket (eager for the rest, and wherever capture fails);
    ``gpu_memory_fraction`` (vLLM's ``gpu_memory_utilization``) sizes the KV pool from the
    GPU's free memory when neither ``num_blocks`` nor ``kv_cache_bytes`` is set. On the
    CPU ``kv_cache_bytes`` defaults to 512 MiB.
    """

    model: str = "bundled"
    dtype: Dtype = "float32"
    quantization: Literal["int8", "int4"] | None = None
    int8_method: Int8Method = "auto"
    device: Literal["cpu", "cuda", "auto"] = "auto"
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # tokens of one step; None: ``step_tokens`` (by device)
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: 512 MiB on the CPU, from gpu_memory_fraction on CUDA
    num_blocks: int | None = None
    gpu_memory_fraction: float = 0.9
    cuda_graphs: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    # CPU threads for steps that prefill a prompt (None: num_threads). A prompt is compute-bound
    # and uses every core well; decoding one token per sequence is not, and in the voice app it
    # shares the cores with speech recognition and synthesis (see ModelRunner.execute).
    prefill_threads: int | None = None
    # Decode steps also run on prefill_threads while a request in them has generated fewer than
    # this many tokens: its first words come sooner (a voice reply's first spoken piece is written
    # while speech recognition and synthesis are idle). 0: only prompt steps do.
    prefill_threads_first_tokens: int = 0
    seed: int = 0
    # 16-bit CPU models run the fused C++ kernels of engine/fused.py (built on first use)
    fused_kernels: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', not {self.quantization!r}")
        if self.int8_method not in INT8_METHODS:
            raise ValueError(f"int8_method must be one of {', '.join(INT8_METHODS)}, not {self.int8_method!r}")
        if self.int8_method != "auto" and self.quantization != "int8":
            raise ValueError(f"int8_method={self.int8_method!r} applies only to quantization='int8'")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, not {self.device!r}")
        budget = self.max_num_batched_tokens
        if self.max_num_seqs < 1 or (budget is not None and budget < 1) or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if (self.num_threads is not None and self.num_threads < 1) or (
            self.prefill_threads is not None and self.prefill_threads < 1
        ):
            raise ValueError("num_threads and prefill_threads must be positive")
        if self.prefill_threads_first_tokens < 0:
            raise ValueError("prefill_threads_first_tokens must be 0 or more")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], not {self.gpu_memory_fraction}")

    def step_tokens(self) -> int:
        """The most tokens one step computes (``max_num_batched_tokens``, or the device's default).

        On a CPU that emulates bfloat16, 128: a prompt is prefilled in chunks the int8 x int8 kernel takes (it beats
        the dense float32 product there), and a step of one user's long prompt holds the others' replies for ~1 s
        instead of ~4. The default brain (int8, 2 AVX2 cores, the two alternated in one process): a 500-token
        prefill 4.37 s against 5.10 at 512, eight chat requests at once 15.5 against 14.4 tok/s with the median
        first token at 3.9 against 4.6 s; SmolLM2 the same within noise (1.71 against 1.62 s, 43 against 42 tok/s).
        Where the CPU computes bfloat16, 256: a chunk over 32 rows is a dense bfloat16 product there
        (``engine.quant.INT8PACK_MAX_M``), whose weights are dequantized once a step, so wider steps pay; a step of
        256 rows is ~0.55 s. The default brain on a 2-core AVX512-BF16 EPYC (in one process, alternated, 2 each):
        a 500-token prefill 1.27-1.43 s at 128, 1.15-1.21 at 256, 1.12-1.16 at 512; eight requests of 64-384
        tokens with 64-token replies 68-77 tok/s (first token p50 2.9 s) at 128, 78-80 (2.6 s) at 256, 80-81
        (2.7 s) at 512. On CUDA 512: a GPU wants wide steps."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.resolved_device() == "cuda":
            return CUDA_STEP_TOKENS
        return CPU_BF16_STEP_TOKENS if cpu_computes_bf16() else CPU_STEP_TOKENS

    def resolved_device(self) -> str:
        """``auto`` means CUDA when a GPU is visible, else CPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
