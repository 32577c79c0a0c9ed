"""Paged attention: the per-step metadata every layer shares, and the attention backend over the KV cache.

The model runner builds one ``AttentionMetadata`` per step (``engine.step_inputs``,
the only place it is built); each layer writes its K/V into the paged cache through the
slot mapping, then attends: decodes in one batched SDPA call (query heads of a KV group
folded into the query length, so no K/V repeat), prefill chunks one call each with a
causal mask offset by the request's cached context. With the fused CPU kernels
(``engine/fused.py``) the decode rows use a paged decode kernel instead.

The KV cache of one layer is [2, num_kv_heads, num_blocks, block_size, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by all layers (built once per step by the model runner)."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each token
    num_decodes: int  # the first num_decodes tokens are single-token requests
    decode_block_tables: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool
    # prefill chunks: (token_start, token_end, block ids [nb] or None when no cached context, mask [n, L] or None)
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    sample_indices: torch.Tensor  # [S] packed token rows whose logits are needed
    # decodes, precomputed once per step so no layer re-derives them: the block ids of all
    # decode requests flattened ([B * max_blocks], one index_select per layer gathers K/V)
    # and, when B == 1, the exact context length (then no mask at all)
    decode_flat_blocks: torch.Tensor | None = None
    decode_ctx_len: int | None = None
    decode_ctx_lens: torch.Tensor | None = None  # [B] context length of each decode (fused kernels)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V ([T, KV, D] each) at their slots of one layer's paged cache."""
    KV, D = cache.shape[1], cache.shape[-1]
    flat = cache.view(2, KV, -1, D)
    flat.index_copy_(2, slot_mapping, torch.stack((k, v)).transpose(1, 2))


def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,
    cache: torch.Tensor,  # [2, KV, num_blocks, block_size, D]
    meta: AttentionMetadata,
    decoded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [T, H * D] of a packed step; the step's K/V are already in ``cache``.

    ``decoded``: the decode rows' attention when already computed (by the fused kernel).
    """
    T, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    B = meta.num_decodes
    if B == T:  # decode-only step: one batched call, no copies of q/out
        return decode_attention(q, cache, meta).reshape(T, H * D)
    out = q.new_empty(T, H * D)
    if B:
        out[:B] = (decoded if decoded is not None else decode_attention(q[:B], cache, meta)).reshape(B, H * D)
    for start, end, block_ids, mask in meta.prefills:
        n = end - start
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if block_ids is None:  # no cached context: attend within the chunk only
            kp = k[start:end].transpose(0, 1).unsqueeze(0)
            vp = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=G > 1)
        else:
            kv = cache[:, :, block_ids].flatten(2, 3)  # [2, KV, L, D]
            o = F.scaled_dot_product_attention(
                qp, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=mask, enable_gqa=G > 1
            )
        out[start:end] = o[0].transpose(0, 1).reshape(n, H * D)
    return out


def decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention [B, H, D] of the step's ``B`` single-token decodes over their cached context."""
    B, H, D = q.shape
    KV = cache.shape[1]
    qd = q.reshape(B, KV, H // KV, D)  # query heads of one KV head become query rows
    flat = meta.decode_flat_blocks
    if flat is None:  # metadata built by hand (tests): advanced indexing
        kv = cache[:, :, meta.decode_block_tables].flatten(3, 4).transpose(1, 2)  # [2, B, KV, L, D]
        return F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=meta.decode_mask)
    # index_select is a plain row copy, faster than aten::index's generic gather
    kv = cache.index_select(2, flat)  # [2, KV, B * nb, bs, D]
    L = kv.shape[2] // B * kv.shape[3]
    kv = kv.view(2, KV, B, L, D).transpose(1, 2)  # [2, B, KV, L, D]
    if meta.decode_ctx_len is not None:  # one request: cut to its length, no mask needed
        n = meta.decode_ctx_len
        return F.scaled_dot_product_attention(qd, kv[0, :, :, :n], kv[1, :, :, :n])
    return F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=meta.decode_mask)


def fused_decode_attention(
    fk, qkv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, head_dim: int
) -> torch.Tensor | None:
    """The decode rows' attention by the fused paged kernel (``fk``: engine/fused.py), None without decodes."""
    if not meta.num_decodes:
        return None
    return fk.paged_decode_attention(
        qkv, cache, meta.decode_block_tables, meta.decode_ctx_lens, num_heads, head_dim, head_dim**-0.5
    )
