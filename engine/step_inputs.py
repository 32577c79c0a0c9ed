"""One step's model inputs: token ids, positions and the attention metadata, built from the scheduled chunks.

Why a module of its own: the eager runner (``engine.model_runner``), the CUDA graph runner and the
activation profile (``engine.cuda``) all lay out a step's inputs, and this is the one place they
are built (``AttentionMetadata`` included), so imports run one way: model_runner -> cuda -> step_inputs.
Decode rows (one token per request) come first in a step: one batched attention call serves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.layers.attention import AttentionMetadata
from engine.scheduler import ScheduledChunk

# A prefill chunk of up to this many rows is attended row by row by the fused paged kernel (each row a decode over
# the chunk's block table, up to its own position) instead of SDPA over the gathered blocks. Per layer, 14 heads
# over 2 KV heads, 64 wide, ~1000 cached tokens, 2 threads: 8 rows 0.45 ms against SDPA's 0.62, 16 rows 0.89
# against 0.88, 32 rows 1.8 against 1.35; over a short context SDPA's fixed cost per call dominates. A voice
# turn's chunks are 7-12 rows (app/bench/results/engine_cpu.md, 2026-12-07).
PAGED_PREFILL_MAX_ROWS = 16


@dataclass
class ModelInputs:
    """One step's packed tokens: decodes first, then prefill chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_request_ids: list[str]  # the request of each logits row (not used with all_logits)
    # after the sampling rows: (request id, position) of each row that scores a prompt token (``ScheduledChunk.scores``)
    score_rows: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class DecodeRows:
    """A step's single-token decodes as host lists, one row per request, then any padding rows."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # the KV slot each row writes
    ctx_lens: list[int]  # how many cached tokens each row attends to
    block_table: list[int]  # flat [rows * num_blocks]


def decode_blocks(decodes: Sequence[ScheduledChunk], block_size: int) -> int:
    """Blocks of KV cache the longest of ``decodes`` attends over (0 when there are none)."""
    return max((-(-(c.start + 1) // block_size) for c in decodes), default=0)


def decode_rows(
    decodes: Sequence[ScheduledChunk], block_size: int, num_blocks: int, pad_block: int = 0, rows: int | None = None
) -> DecodeRows:
    """The rows of ``decodes``, block-table rows ``num_blocks`` wide padded with ``pad_block``; ``rows``
    pads the batch (the CUDA graph buckets) with rows that touch only ``pad_block``'s first slot."""
    bs = block_size
    out = DecodeRows([], [], [], [], [])
    for c in decodes:
        p = c.start
        out.token_ids.append(c.token_ids[0])
        out.positions.append(p)
        out.slots.append(c.block_ids[p // bs] * bs + p % bs)
        out.ctx_lens.append(p + 1)
        row = c.block_ids[:num_blocks]
        out.block_table += row + [pad_block] * (num_blocks - len(row))
    pad = (len(decodes) if rows is None else rows) - len(decodes)
    out.token_ids += [0] * pad
    out.positions += [0] * pad
    out.slots += [pad_block * bs] * pad  # padded rows write into the pad block only
    out.ctx_lens += [1] * pad  # and attend to its first slot only
    out.block_table += [pad_block] * (num_blocks * pad)
    return out


def decode_attention_mask(ctx_lens: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[B, 1, 1, num_blocks * block_size] bool: the cached positions each decode row attends to."""
    L = num_blocks * block_size
    return (torch.arange(L, device=ctx_lens.device)[None, :] < ctx_lens[:, None]).view(len(ctx_lens), 1, 1, L)


def decode_metadata(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    sample_indices: torch.Tensor,
    block_size: int,
) -> AttentionMetadata:
    """Metadata of a decode-only step on given tensors (the CUDA graph runner's static buffers)."""
    B, nb = block_tables.shape
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=B,
        decode_block_tables=block_tables,
        decode_mask=decode_attention_mask(ctx_lens, nb, block_size),
        prefills=[],
        sample_indices=sample_indices,
        decode_flat_blocks=block_tables.view(-1),
        decode_ctx_len=None,
        decode_ctx_lens=ctx_lens,
    )


def prepare_inputs(
    chunks: Sequence[ScheduledChunk], block_size: int, device: str | torch.device, all_logits: bool = False
) -> ModelInputs:
    """Token ids, positions and attention metadata of one step's chunks.

    Logits rows are the last token of each sampling chunk, or every token with ``all_logits``
    (scoring a text, as ``perplexity`` does); then those of the positions a chunk scores (``score_rows``).
    """
    bs = block_size
    dev = device
    decodes = [c for c in chunks if c.num_tokens == 1]
    prefills = [c for c in chunks if c.num_tokens > 1]
    B = len(decodes)
    nb = decode_blocks(decodes, bs)
    rows = decode_rows(decodes, bs, nb)
    ids, pos, slots = rows.token_ids, rows.positions, rows.slots
    sample_rows = [i for i, c in enumerate(decodes) if c.sample or all_logits]
    sample_ids = [decodes[i].request_id for i in sample_rows]
    score_rows: list[int] = []
    score_ids: list[tuple[str, int]] = []
    for i, c in enumerate(decodes):
        if c.scores[0] <= c.start < c.scores[1]:
            score_rows.append(i)
            score_ids.append((c.request_id, c.start))
    decode_tables = decode_mask = decode_flat = None
    decode_ctx_len = None
    lens = torch.tensor(rows.ctx_lens, dtype=torch.long, device=dev) if B else None
    if B:
        decode_flat = torch.tensor(rows.block_table, dtype=torch.long, device=dev)
        decode_tables = decode_flat.view(B, nb)
        if B == 1:  # one request: its own blocks, cut to its length; no mask
            decode_ctx_len = rows.ctx_lens[0]
        else:
            decode_mask = decode_attention_mask(lens, nb, bs)
    pre_meta = []
    prefill_rows: list[tuple[torch.Tensor, torch.Tensor] | None] = []
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
        if n <= PAGED_PREFILL_MAX_ROWS and torch.device(dev).type == "cpu":
            ctx_blocks = -(-(c.start + n) // bs)
            prefill_rows.append((blocks[:ctx_blocks].expand(n, ctx_blocks).contiguous(), p + 1))
        else:
            prefill_rows.append(None)
        if c.start == 0:
            pre_meta.append((start_row, start_row + n, None, None))
        else:
            ctx = c.start + n
            ctx_blocks = -(-ctx // bs)
            k_pos = torch.arange(ctx_blocks * bs)
            mask = k_pos[None, :] <= p[:, None]  # causal, offset by the cached context
            pre_meta.append((start_row, start_row + n, blocks[:ctx_blocks].to(dev), mask.to(dev)))
        if all_logits:
            sample_rows.extend(range(start_row, start_row + n))
        elif c.sample:
            sample_rows.append(start_row + n - 1)
            sample_ids.append(c.request_id)
        for position in range(*c.scores):
            score_rows.append(start_row + position - c.start)
            score_ids.append((c.request_id, position))
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
        sample_indices=torch.tensor(sample_rows + score_rows, dtype=torch.long, device=dev),
        decode_flat_blocks=decode_flat,
        decode_ctx_len=decode_ctx_len,
        decode_ctx_lens=lens,
        prefill_rows=prefill_rows if any(r is not None for r in prefill_rows) else [],
    )
    input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
    return ModelInputs(input_ids, positions.to(dev), meta, sample_ids, score_ids)
