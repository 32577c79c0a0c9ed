"""Compute only: owns the model and the KV cache tensor, turns a SchedulerOutput into logits.

Why separate: the scheduler never touches tensors and the runner never decides policy,
so each side is testable alone and a GPU runner (CUDA graphs, flash-attn) can replace
this one without changing the loop.
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.model import AttentionMetadata, LlamaModel
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        # Sharing an already loaded model lets tests build engines with different limits cheaply.
        self.model = model or LlamaModel(model_path, dtype, self.device)
        a = self.model.args
        limit = a.max_position_embeddings
        if a.sliding_window:
            limit = min(limit, a.sliding_window)  # full attention is exact up to the window
        self.block_size = config.block_size
        bs = self.block_size
        elem = torch.empty((), dtype=dtype).element_size()
        bytes_per_block = a.num_layers * 2 * a.num_kv_heads * bs * a.head_dim * elem
        self.num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // bytes_per_block)
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.kv_cache = torch.zeros(
            a.num_layers, 2, a.num_kv_heads, self.num_blocks, bs, a.head_dim, dtype=dtype, device=self.device
        )
        self.quant_info: dict | None = None
        if config.quantization:
            from engine.quant import quantize_model

            self.quant_info = quantize_model(self.model, self.device, config.quantization)
        # bf16 on CPU: the remaining dense linears (all of them, or lm_head next to int8 layers)
        # get their weights reordered for oneDNN once instead of on every call.
        self.num_packed_linears = self.model.pack_linears()
        self.fused_kernels = config.fused_kernels and self.model.use_fused_kernels()
        log.info(
            "model %s dtype=%s quant=%s device=%s, KV cache %d blocks x %d tokens (%.0f MiB)",
            a.architecture,
            config.dtype,
            config.quantization,
            self.device,
            self.num_blocks,
            bs,
            self.kv_cache.numel() * elem / 2**20,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Run one step; returns the ids of requests that sample and their logits rows."""
        bs = self.block_size
        dev = self.device
        decodes = [c for c in sched.chunks if c.num_tokens == 1]
        prefills = [c for c in sched.chunks if c.num_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        ctx_lens: list[int] = []
        for c in decodes:
            p = c.start
            ids.append(c.token_ids[0])
            pos.append(p)
            slots.append(c.block_ids[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
            if c.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(c.request_id)
        B = len(decodes)
        decode_tables = decode_mask = decode_flat = None
        decode_ctx_len = None
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev) if B else None
        if B == 1:  # one request: its own blocks, cut to its length; no mask
            nb = -(-ctx_lens[0] // bs)
            decode_flat = torch.tensor(decodes[0].block_ids[:nb], dtype=torch.long, device=dev)
            decode_tables = decode_flat.view(1, nb)
            decode_ctx_len = ctx_lens[0]
        elif B:
            max_blocks = max(-(-n // bs) for n in ctx_lens)
            table: list[int] = []
            for c in decodes:
                row = c.block_ids[:max_blocks]
                table += row
                table += [0] * (max_blocks - len(row))
            decode_flat = torch.tensor(table, dtype=torch.long, device=dev)
            decode_tables = decode_flat.view(B, max_blocks)
            L = max_blocks * bs
            decode_mask = (torch.arange(L, device=dev)[None, :] < lens[:, None]).view(B, 1, 1, L)
        pre_meta = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        for c in prefills:
            n = c.num_tokens
            start_row = len(ids)
            ids.extend(c.token_ids)
            p = torch.arange(c.start, c.start + n, dtype=torch.long)
            blocks = torch.tensor(c.block_ids, dtype=torch.long)
            pos_parts.append(p)
            slot_parts.append(blocks[p // bs] * bs + p % bs)
            if c.start == 0:
                pre_meta.append((start_row, start_row + n, None, None))
            else:
                ctx = c.start + n
                nb = -(-ctx // bs)
                k_pos = torch.arange(nb * bs)
                mask = k_pos[None, :] <= p[:, None]  # causal, offset by the cached context
                pre_meta.append((start_row, start_row + n, blocks[:nb].to(dev), mask.to(dev)))
            if c.sample:
                sample_rows.append(start_row + n - 1)
                sample_ids.append(c.request_id)
        positions = torch.tensor(pos, dtype=torch.long)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        if pos_parts:
            positions = torch.cat([positions, *pos_parts])
            slot_mapping = torch.cat([slot_mapping, *slot_parts])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decodes=B,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=pre_meta,
            sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            decode_flat_blocks=decode_flat,
            decode_ctx_len=decode_ctx_len,
            decode_ctx_lens=lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        if not sample_rows:
            meta.sample_indices = meta.sample_indices[:0]
        logits = self.model.forward(input_ids, positions.to(dev), meta, self.kv_cache)
        return sample_ids, logits
