"""The engine on CUDA, in plain torch: the KV pool sized from free GPU memory, and decode steps as CUDA graphs.

Why: on a GPU a small model's decode step is a few hundred tiny kernels whose launch cost,
not the math, sets the speed; replaying a captured CUDA graph launches them all at once.
And the KV pool should take what the GPU has, not a fixed 512 MiB.

**KV pool** (``kv_cache_bytes_for_gpu``): vLLM's ``gpu_memory_utilization`` notion. The
engine may use ``gpu_memory_fraction`` of the GPU's *total* memory; what is already used
(by this process's weights and by anything else on the GPU) and the activation peak of
the largest step (measured by one dummy forward of ``max_num_batched_tokens`` tokens)
come off that, and the rest is KV cache, capped at what ``max_num_seqs`` requests of
``max_model_len`` tokens can use twice over (the rest would only ever hold stale prefixes).
``EngineConfig.num_blocks`` or ``kv_cache_bytes`` overrides it.

**CUDA graphs** (``DecodeGraphRunner``): a step whose chunks are all single-token decodes
is padded to a batch-size bucket (1, 2, 4, 8, 16, 24, 32, ...: vLLM's) and a
context-length bucket (the longest request's blocks, rounded up to a power of two), and
replayed from a graph captured the first time that (batch, context) pair is seen. Padded
rows write their K/V into a scratch block the KV manager never hands out (the runner
allocates one block more than it manages) and attend to it only. Everything else
(prefills, mixed steps, batches above the largest bucket, a model whose linears cannot be
captured, e.g. bitsandbytes LLM.int8 whose outlier columns are found per call) runs
eagerly; so does a bucket whose capture failed (logged once). ``EngineConfig.cuda_graphs
= False`` turns graphs off.

What the CPU tests verify (tests/engine/test_engine_cuda_paths.py): the bucket choice,
the sizing arithmetic given a fake ``torch.cuda.mem_get_info`` and activation figure,
and the whole padded static-buffer decode path through the engine, token-exact against
transformers, with ``capture=eager_capture`` standing in for ``torch.cuda.graph``.
What only a GPU verifies (``parley doctor --gpu``): that ``torch.cuda.graph`` captures
these steps, that replays are token-exact and faster, and the activation profile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.scheduler import ScheduledChunk
from engine.step_inputs import decode_blocks, decode_metadata, decode_rows, prepare_inputs

log = logging.getLogger(__name__)

GRAPH_RESERVE_BYTES = 256 * 1024 * 1024  # CUDA graph pools, the sampler, allocator slack
MAX_GRAPHS = 96


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then multiples of 8 (vLLM's), up to ``max_num_seqs``."""
    out = [b for b in (1, 2, 4) if b < max_num_seqs]
    b = 8
    while b < max_num_seqs:
        out.append(b)
        b += 8
    out.append(max_num_seqs)
    return sorted(set(out))


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows, or None when ``n`` is above the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


def context_bucket(num_blocks: int, max_blocks: int) -> int:
    """Blocks of context a graph attends over: ``num_blocks`` rounded up to a power of two, at most ``max_blocks``."""
    nb = 1
    while nb < num_blocks:
        nb *= 2
    return min(nb, max(max_blocks, num_blocks))


def kv_cache_bytes_for_gpu(
    total: int,
    free: int,
    fraction: float,
    activation_bytes: int,
    max_useful_bytes: int | None = None,
    reserve_bytes: int = GRAPH_RESERVE_BYTES,
) -> int:
    """Bytes of KV cache the engine may allocate: ``fraction`` of the GPU's ``total`` memory, less what is
    already in use (``total - free``: weights, other processes), the activation peak and a reserve.

    Raises ValueError when nothing is left, with the figures.
    """
    gib = 2**30
    used = total - free
    budget = int(fraction * total) - used - activation_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_fraction={fraction} of {total / gib:.1f} GiB leaves no room for the KV cache: "
            f"{used / gib:.1f} GiB already in use, {activation_bytes / gib:.2f} GiB for activations, "
            f"{reserve_bytes / gib:.2f} GiB reserved; raise gpu_memory_fraction or set kv_cache_bytes"
        )
    if max_useful_bytes is not None:
        budget = min(budget, max_useful_bytes)
    return budget


@torch.inference_mode()
def profile_activation_bytes(model, num_tokens: int, block_size: int) -> int:
    """CUDA only: peak memory above the current allocation during one prefill of ``num_tokens`` tokens
    (a private KV buffer just big enough; freed again)."""
    dev = model.device
    a = model.args
    nb = -(-num_tokens // block_size)
    cache = torch.zeros(a.num_layers, 2, a.num_kv_heads, nb, block_size, a.head_dim, dtype=model.dtype, device=dev)
    chunk = ScheduledChunk("profile", [0] * num_tokens, 0, list(range(nb)), sample=True)
    inputs = prepare_inputs([chunk], block_size, dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, cache)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del cache, inputs
    torch.cuda.empty_cache()
    return int(peak)


def gpu_kv_cache_bytes(model, config, bytes_per_block: int, max_model_len: int) -> int:
    """CUDA only: the KV pool size for ``config`` (see ``kv_cache_bytes_for_gpu``), logged with its figures."""
    dev = model.device
    activation = profile_activation_bytes(model, config.step_tokens(), config.block_size)
    free, total = torch.cuda.mem_get_info(dev)
    per_seq = -(-max_model_len // config.block_size) * bytes_per_block
    useful = 2 * config.max_num_seqs * per_seq
    kv = kv_cache_bytes_for_gpu(total, free, config.gpu_memory_fraction, activation, useful)
    log.info(
        "KV cache from GPU memory: %.1f GiB free of %.1f, fraction %.2f, activations %.2f GiB -> %.2f GiB%s",
        free / 2**30,
        total / 2**30,
        config.gpu_memory_fraction,
        activation / 2**30,
        kv / 2**30,
        " (capped: max_num_seqs x max_model_len, twice)" if kv == useful else "",
    )
    return kv


# --- CUDA graphs -----------------------------------------------------------------------------


def cuda_graph_capture(pool=None) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """``torch.cuda.graph`` capture: warm up ``fn`` on a side stream, capture it, return the replay."""

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: lazy initialisation (cuBLAS handles, workspaces) must not happen in capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=capture.pool):
            out = fn()
        capture.pool = graph.pool()  # later graphs share one memory pool

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    capture.pool = pool
    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Stands in for ``torch.cuda.graph`` where there is none (the CPU tests): 'replaying' runs ``fn``
    again on the same static buffers, so everything but the capture itself is exercised."""
    return fn


class DecodeGraphRunner:
    """Decode-only steps on static, bucket-padded input buffers, one captured graph per (batch, context) bucket."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        scratch_block: int,
        capture: Callable | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.capture = capture or cuda_graph_capture()
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.failed: set[tuple[int, int]] = set()
        self.replays = 0
        self.eager_steps = 0
        dev = model.device
        B = self.buckets[-1]
        # the static inputs every graph reads (views of these are what a graph was captured on)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(B, dtype=torch.long, device=dev)
        self.block_table = torch.zeros(B * self.max_blocks, dtype=torch.long, device=dev)
        self.ctx_lens = torch.ones(B, dtype=torch.long, device=dev)
        self.sample_indices = torch.arange(B, dtype=torch.long, device=dev)

    def key(self, chunks: Sequence[ScheduledChunk]) -> tuple[int, int] | None:
        """The (batch, context blocks) bucket of a step, or None when the step must run eagerly."""
        if not chunks or any(c.num_tokens != 1 or not c.sample for c in chunks):
            return None
        b = pick_bucket(len(chunks), self.buckets)
        if b is None:
            return None
        key = (b, context_bucket(decode_blocks(chunks, self.block_size), self.max_blocks))
        if key in self.failed or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            return None
        return key

    def _fill(self, chunks: Sequence[ScheduledChunk], B: int, nb: int) -> None:
        """Copy one step's decodes into the static buffers, padded to ``B`` rows and ``nb`` blocks each."""
        rows = decode_rows(chunks, self.block_size, nb, pad_block=self.scratch_block, rows=B)
        host = torch.tensor([rows.token_ids, rows.positions, rows.slots, rows.ctx_lens], dtype=torch.long)
        self.input_ids[:B].copy_(host[0], non_blocking=True)
        self.positions[:B].copy_(host[1], non_blocking=True)
        self.slot_mapping[:B].copy_(host[2], non_blocking=True)
        self.ctx_lens[:B].copy_(host[3], non_blocking=True)
        self.block_table[: B * nb].copy_(torch.tensor(rows.block_table, dtype=torch.long), non_blocking=True)

    def _forward(self, B: int, nb: int) -> torch.Tensor:
        """The decode forward on the static buffers (what a graph captures); logits [B, vocab]."""
        tables = self.block_table[: B * nb].view(B, nb)
        meta = decode_metadata(
            self.slot_mapping[:B], tables, self.ctx_lens[:B], self.sample_indices[:B], self.block_size
        )
        return self.model.forward(self.input_ids[:B], self.positions[:B], meta, self.kv_cache)

    @torch.inference_mode()
    def run(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[str], torch.Tensor] | None:
        """Logits of a decode-only step from its bucket's graph (captured now if new); None: run it eagerly."""
        key = self.key(chunks)
        if key is None:
            self.eager_steps += 1
            return None
        B, nb = key
        self._fill(chunks, B, nb)
        replay = self.graphs.get(key)
        if replay is None:
            try:
                replay = self.capture(lambda: self._forward(B, nb))
            except Exception as e:  # capture is an optimisation: fall back to eager for this bucket
                log.warning("CUDA graph capture failed for batch %d x %d blocks (%s); eager there", B, nb, e)
                self.failed.add(key)
                self.eager_steps += 1
                return None
            self.graphs[key] = replay
            log.debug("captured a decode graph for batch %d x %d blocks (%d graphs)", B, nb, len(self.graphs))
            self._fill(chunks, B, nb)  # the warm-up inside capture may have run on these buffers: refill
        logits = replay()
        self.replays += 1
        return [c.request_id for c in chunks], logits[: len(chunks)]
