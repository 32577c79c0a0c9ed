"""What the engine reports about itself: its counters and recent rate (``LLMEngine.stats``), and what
was loaded and how (``LLMEngine.model_info``).

Why apart from the loop: the loop only counts (a request finished, a step's tokens); gathering the
figures that the metrics endpoint and the start-up report read (``engine.metrics.EngineCollector``)
from the runner, the model and the counters is a job of its own.
"""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.model_runner import ModelRunner

RATE_WINDOW_S = 5.0  # the generation rate is over the tokens of the last this many seconds


class EngineCounters:
    """Totals since the engine started, and the tokens generated over the last ``RATE_WINDOW_S`` seconds."""

    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_aborted_total = 0
        self.requests_finished_total = 0
        self._rate: deque[tuple[float, int]] = deque()

    def generated(self, n: int, now: float) -> None:
        """A step gave ``n`` new tokens at ``now`` (``time.monotonic()``)."""
        self.generation_tokens_total += n
        if n:
            self._rate.append((now, n))

    def figures(self, now: float) -> dict:
        """The generation rate (tokens/s) at ``now`` and the totals, under their ``LLMEngine.stats`` names."""
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        tokens = sum(n for _, n in self._rate)
        span = now - self._rate[0][0] if self._rate else 0.0
        return {
            "generation_tokens_per_s": tokens / max(span, 1e-3) if len(self._rate) > 1 else 0.0,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "requests_aborted_total": self.requests_aborted_total,
            "requests_finished_total": self.requests_finished_total,
        }


def model_info(config: EngineConfig, runner: ModelRunner, kv_blocks_total: int) -> dict:
    """What was loaded and how: precision, kernels and memory (fixed once the engine is built)."""
    model = runner.model
    return {
        "architecture": model.args.architecture,
        "dtype": str(runner.dtype).removeprefix("torch."),  # of weights and activations (16-bit when quantized)
        "device": str(runner.device),
        "quantization": config.quantization,
        "int8_method": config.int8_method,
        "linear_kernel": model.linear_kernel,
        "quant_info": dict(model.quant_info) if model.quant_info else None,
        "fused_kernels": runner.fused_kernels,
        "cuda_graphs": runner.cuda_graphs_note,
        "packed_linears": runner.num_packed_linears,
        "weight_bytes": model.weight_bytes(),
        "linear_weight_bytes": model.linear_weight_bytes(),
        "kv_cache_bytes": runner.kv_cache_bytes,
        "kv_blocks_total": kv_blocks_total,
        "block_size": config.block_size,
        "max_model_len": runner.max_model_len,
    }
