"""Compute only: owns the model and the KV cache tensor, turns a SchedulerOutput into logits.

Why separate: the scheduler never touches tensors and the runner never decides policy,
so each side is testable alone and a GPU runner (CUDA graphs, flash-attn) can replace
this one without changing the loop. A step's input tensors and attention metadata are built
in ``engine.step_inputs`` (the engine's steps and ``perplexity`` both use it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.cuda import DecodeGraphRunner, gpu_kv_cache_bytes
from engine.model import LlamaModel
from engine.quant import get_quant_method
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.step_inputs import prepare_inputs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


@torch.inference_mode()
def perplexity(model: LlamaModel, token_ids: Sequence[int], block_size: int = 16) -> float:
    """Perplexity of ``token_ids`` under ``model`` in one prefill, on a private KV buffer
    (for quantization checks and benchmarks; no engine cache or prefix block is touched)."""
    T = len(token_ids)
    if T < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    a = model.args
    nb = -(-T // block_size)
    chunk = ScheduledChunk("perplexity", [int(t) for t in token_ids], 0, list(range(nb)), sample=True)
    inputs = prepare_inputs([chunk], block_size, model.device, all_logits=True)
    cache = torch.zeros(
        a.num_layers, 2, a.num_kv_heads, nb, block_size, a.head_dim, dtype=model.dtype, device=model.device
    )
    logits = model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, cache)[:-1].float()
    nll = F.cross_entropy(logits, inputs.input_ids[1:])
    return float(torch.exp(nll))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, model: LlamaModel | None = None) -> None:
        self.config = config
        self.device = config.resolved_device()
        dtype = _DTYPES[config.dtype]
        if config.quantization and dtype == torch.float32:
            # The quantized kernels take 16-bit activations (int8pack with fp32 input is ~15x slower on CPU).
            dtype = torch.bfloat16
        self.dtype = dtype
        if model is not None and (model.dtype != dtype or config.quantization):
            raise ValueError("a shared model must have the configured dtype and no quantization")
        if model is None:
            # The builder applies the quantization method and the oneDNN packing as it loads the layers.
            quant = get_quant_method(config.quantization, self.device, config.int8_method)
            self.model = LlamaModel(
                model_path, dtype, self.device, config.max_model_len, quant=quant, pack_linears=True
            )
        else:
            # Sharing an already loaded model lets tests build engines with different limits cheaply.
            self.model = model
            model.pack_linears()  # bf16 on an oneDNN CPU: packed once, for every engine sharing it
        a = self.model.args
        limit = a.max_position_embeddings  # sliding-window layers mask their keys: any length is exact
        self.block_size = config.block_size
        bs = self.block_size
        elem = torch.empty((), dtype=dtype).element_size()
        bytes_per_block = a.num_layers * 2 * a.num_kv_heads * bs * a.head_dim * elem
        self.max_model_len = min(config.max_model_len or limit, limit)
        if config.num_blocks:
            self.num_blocks = config.num_blocks
        elif config.kv_cache_bytes:
            self.num_blocks = max(1, config.kv_cache_bytes // bytes_per_block)
        elif torch.device(self.device).type == "cuda":  # vLLM's gpu_memory_utilization (engine/cuda.py)
            self.num_blocks = max(
                1, gpu_kv_cache_bytes(self.model, config, bytes_per_block, self.max_model_len) // bytes_per_block
            )
        else:
            self.num_blocks = max(1, DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_block)
        # one block more than the KV manager hands out: the scratch block padded CUDA-graph rows write to
        self.scratch_block = self.num_blocks
        self.kv_cache = torch.zeros(
            a.num_layers, 2, a.num_kv_heads, self.num_blocks + 1, bs, a.head_dim, dtype=dtype, device=self.device
        )
        self.bytes_per_block = bytes_per_block
        self.quant_info: dict | None = self.model.quant_info
        self.num_packed_linears = self.model.num_packed_linears
        self.fused_kernels = config.fused_kernels and self.model.use_fused_kernels()
        # CPU threads per step: prefill_threads for a step with prompt tokens, num_threads for decode.
        # On the 2-core development VM, a voice turn's first token took 130 ms with 2 threads
        # against 250 ms with 1, while decoding on 2 threads slowed the Piper synthesis beside it
        # from 180 to 390 ms (`parley bench voice`, per-stage trace); so the app prefills on every
        # core and decodes on one, except a reply's first tokens (prefill_threads_first_tokens), which
        # are written while the rest of the app waits for them.
        self._prefill_threads = config.prefill_threads if torch.device(self.device).type == "cpu" else None
        self._decode_threads = config.num_threads or torch.get_num_threads()
        self._first_tokens = config.prefill_threads_first_tokens  # decode steps that count as urgent
        self._cores_lent = 0  # cores another model is running on meanwhile (lend_core)
        self._lending = threading.Lock()
        self.graphs: DecodeGraphRunner | None = None  # on CUDA: decode steps as CUDA graphs
        self.cuda_graphs_note = "off (CPU)"
        if torch.device(self.device).type == "cuda":
            if not config.cuda_graphs:
                self.cuda_graphs_note = "off (cuda_graphs=False)"
            elif not self.model.graph_safe():
                self.cuda_graphs_note = f"off ({self.model.linear_kernel} linears cannot be captured)"
            else:
                self.enable_graphs()
        log.info("%s", self.describe())

    def enable_graphs(self, capture=None) -> None:
        """Run decode-only steps through ``engine.cuda.DecodeGraphRunner`` (``capture``: how graphs are
        captured, ``torch.cuda.graph`` by default; the CPU tests pass ``engine.cuda.eager_capture``)."""
        self.graphs = DecodeGraphRunner(
            self.model,
            self.kv_cache,
            self.block_size,
            self.config.max_num_seqs,
            self.max_model_len,
            self.scratch_block,
            capture=capture,
        )
        self.cuda_graphs_note = f"on (batch buckets {','.join(map(str, self.graphs.buckets))}, captured lazily)"

    def describe(self) -> str:
        """The start-up line: model, precision, the linear kernel in use, CUDA graphs, the KV pool."""
        a = self.model.args
        kernel = self.model.linear_kernel
        if kernel == "bitsandbytes":
            kernel = "bitsandbytes LLM.int8 (threshold 6.0, lm_head 16-bit)"
        return (
            f"engine: {a.architecture} on {self.device}, {str(self.dtype).removeprefix('torch.')} activations, "
            f"quantization {self.config.quantization or 'none'}, linears {kernel}, "
            f"fused CPU kernels {'on' if self.fused_kernels else 'off'}, CUDA graphs {self.cuda_graphs_note}, "
            f"KV cache {self.num_blocks} blocks x {self.block_size} tokens ({self.kv_cache_bytes / 2**20:.0f} MiB)"
        )

    @property
    def first_tokens(self) -> int:
        """How many first output tokens of a lone request decode on the prefill threads."""
        return self._first_tokens

    @first_tokens.setter
    def first_tokens(self, n: int) -> None:
        self._first_tokens = max(0, int(n))  # read once per step, on the stepping thread

    def lend_core(self) -> None:
        """Another model runs on one core until ``return_core``: steps keep off it (any thread may call)."""
        with self._lending:
            self._cores_lent += 1

    def return_core(self) -> None:
        with self._lending:
            self._cores_lent = max(0, self._cores_lent - 1)

    @property
    def cores_lent(self) -> int:
        return self._cores_lent

    def _use_threads(self, sched: SchedulerOutput) -> None:
        """Set torch's CPU threads for this step (on the stepping thread: OpenMP settings are per thread)."""
        # A reply's first tokens are urgent only while the request is alone: beside other requests
        # (other users' replies, whose speech is being synthesized) extra threads slow everyone. Requests added
        # together as one group are one reply's (its prompt and its words alone): with them it still is alone
        # (the second step of a weighed voice turn had taken 105 ms on one thread instead of ~55 on two).
        alone = len({chunk.group or chunk.request_id for chunk in sched.chunks}) == 1
        urgent = any(chunk.num_tokens > 1 or (alone and chunk.generated < self._first_tokens) for chunk in sched.chunks)
        threads = self._prefill_threads if urgent else self._decode_threads
        # A step split over every core waits for its slowest thread, and a thread sharing a core
        # with another model is slow: on the 2-core Xeon, 6 first tokens beside a Smart Turn call
        # took 115 ms on 2 threads, 117 on 1, and 93 stepping on 1 only while the call ran (72 alone).
        threads = min(threads, max(1, self._prefill_threads - self._cores_lent))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the blocks the KV manager hands out (the scratch block not counted)."""
        return self.num_blocks * self.bytes_per_block

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None, list[tuple[str, int]]]:
        """Run one step; returns the ids of requests that sample, the logits rows (theirs, then those scoring
        prompt tokens), and the (request id, position) of each scoring row."""
        if self._prefill_threads is not None:
            self._use_threads(sched)
        for copy in sched.copies:  # a new request's start, from a cached block it parts from mid-way
            self.kv_cache[:, :, :, copy.dst, : copy.num_tokens] = self.kv_cache[:, :, :, copy.src, : copy.num_tokens]
        if self.graphs is not None:
            out = self.graphs.run(sched.chunks)  # (decode-only steps: they score nothing)
            if out is not None:
                return (*out, [])
        inputs = prepare_inputs(sched.chunks, self.block_size, self.device)
        logits = self.model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_cache)
        return inputs.sample_request_ids, logits, inputs.score_rows

    def perplexity(self, token_ids: Sequence[int]) -> float:
        return perplexity(self.model, token_ids, self.block_size)
