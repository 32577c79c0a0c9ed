"""The workload record shared by the benchmark, and the transformers baselines it is compared with.

(a) ``generate`` one request at a time, (b) ``generate`` on padded static batches sorted
by prompt length, (c) transformers' own continuous batching (``init_continuous_batching``)
when the installed version has it. Every system gets the same requests, all arriving at
t=0, greedy, with fixed output lengths (EOS ignored); TTFT is measured from t=0, so it
includes time spent queued behind other requests, as a server's users would see it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.metrics import percentile

log = logging.getLogger(__name__)


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else 1000 * seconds


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class RunResult:
    """One system's run of the workload. ``output_tokens`` counts requested tokens only (not padding waste)."""

    name: str
    wall_s: float
    output_tokens: int
    ttfts_s: list[float]
    computed_tokens: int | None = None  # tokens actually generated, when more than requested (static batches)
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_p50_ms(self) -> float:
        return _ms(percentile(self.ttfts_s, 50))

    @property
    def ttft_p95_ms(self) -> float:
        return _ms(percentile(self.ttfts_s, 95))


def load_hf_model(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.eval()
    # Fixed output lengths: never stop at EOS (the engine runs with ignore_eos=True).
    model.generation_config.eos_token_id = None
    return model


class _FirstTokenClock:
    """A stopping criterion that never stops; it records when the first new token of a call exists."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.t is None:
            self.t = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, pad_id: int):
    from transformers import GenerationConfig, StoppingCriteriaList

    clock = _FirstTokenClock()
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=pad_id
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen_config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return out, clock.t


def hf_sequential(model, reqs: list[BenchRequest], pad_id: int) -> RunResult:
    """(a) One ``generate`` call per request, in arrival order."""
    t0 = time.perf_counter()
    ttfts = []
    produced = 0
    for r in reqs:
        ids = torch.tensor([r.prompt])
        out, t_first = _hf_generate(model, ids, torch.ones_like(ids), r.max_tokens, pad_id)
        produced += out.shape[1] - ids.shape[1]
        ttfts.append((t_first or time.perf_counter()) - t0)
    wall = time.perf_counter() - t0
    requested = sum(r.max_tokens for r in reqs)
    if produced != requested:
        log.warning("HF sequential produced %d tokens, %d requested", produced, requested)
    return RunResult("hf_sequential", wall, requested, ttfts)


def hf_static(model, reqs: list[BenchRequest], pad_id: int, batch_size: int) -> RunResult:
    """(b) Requests sorted by prompt length, left-padded static batches; a batch runs to its longest output."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    t0 = time.perf_counter()
    ttfts = [0.0] * len(reqs)
    computed = 0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(reqs[i].prompt) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = reqs[i].prompt
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n = max(reqs[i].max_tokens for i in idx)
        out, t_first = _hf_generate(model, ids, mask, n, pad_id)
        computed += (out.shape[1] - width) * len(idx)
        for i in idx:
            ttfts[i] = (t_first or time.perf_counter()) - t0
    wall = time.perf_counter() - t0
    return RunResult(
        "hf_static",
        wall,
        sum(r.max_tokens for r in reqs),
        ttfts,
        computed_tokens=computed,
        note=f"batches of {batch_size} sorted by prompt length",
    )


def hf_continuous_available(model) -> str | None:
    """None when transformers' continuous batching can be tried, else why not."""
    if not hasattr(model, "init_continuous_batching"):
        import transformers

        return f"transformers {transformers.__version__} has no init_continuous_batching"
    return None


def hf_continuous(
    model,
    reqs: list[BenchRequest],
    pad_id: int,
    kv_cache_bytes: int,
    max_batch_tokens: int | None,
    timeout_s: float = 600,
) -> RunResult:
    """(c) transformers' ContinuousBatchingManager: all requests queued at t=0, per-request output lengths.

    Its KV cache gets the same memory as our engine's (left alone, on a CPU it sizes the cache
    from free RAM: many GiB of zeros, and attention masks that span the whole cache) and, unless
    ``max_batch_tokens`` is None, the same per-step token budget. A short warm-up request runs
    first on the same manager, as every other system also gets a warm-up before the clock starts.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1, pad_token_id=pad_id
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt) for r in reqs),
        max_generated_length=max(r.max_tokens for r in reqs),
        num_requests=len(reqs),
    )
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    page = 256
    bytes_per_block = cfg.num_hidden_layers * 2 * kv_heads * head_dim * page * model.dtype.itemsize
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=max(1, kv_cache_bytes // bytes_per_block), max_batch_tokens=max_batch_tokens
    )
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    manager.start()
    try:
        manager.add_request(reqs[0].prompt[:16], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        _collect(manager, {"warmup"}, timeout_s)
        t0 = time.perf_counter()
        ids = {}
        for i, r in enumerate(reqs):
            rid = f"bench-{i}"
            ids[rid] = i
            manager.add_request(
                r.prompt, request_id=rid, max_new_tokens=r.max_tokens, record_timestamps=True, eos_token_id=-1
            )
        results = _collect(manager, set(ids), timeout_s)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
    ttfts = []
    produced = 0
    for rid, res in results.items():
        if res.error:
            raise RuntimeError(f"request {rid} failed: {res.error}")
        produced += len(res.generated_tokens)
        first = res.timestamps[0] if res.timestamps else res.lifespan[1]
        ttfts.append(first - t0)
    requested = sum(r.max_tokens for r in reqs)
    if produced != requested:
        log.warning("HF continuous batching produced %d tokens, %d requested", produced, requested)
    budget = max_batch_tokens or "default"
    note = f"ContinuousBatchingManager, sdpa, {kv_cache_bytes >> 20} MiB KV, max_batch_tokens={budget}"
    return RunResult("hf_continuous", wall, produced, ttfts, note=note)


def _collect(manager, wanted: set[str], timeout_s: float) -> dict:
    results = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching finished {len(results)} of {len(wanted)} requests in time")
        res = manager.get_result(timeout=1)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
            continue
        if res.request_id in wanted and res.is_finished():
            results[res.request_id] = res
    return results
