"""Paged attention: the per-step metadata every layer shares, and the attention backend over the KV cache.

The model runner builds one ``AttentionMetadata`` per step (``engine.step_inputs``,
the only place it is built); each layer writes its K/V into the paged cache through the
slot mapping, then attends: decodes in one batched SDPA call (query heads of a KV group
folded into the query length, so no K/V repeat), prefill chunks one call each with a
causal mask offset by the request's cached context. With the fused CPU kernels
(``engine/fused.py``) the decode rows use a paged decode kernel instead.

A layer's own attention settings (``AttentionSpec``: the score scale, Gemma 2's soft-cap) go
with each call; a sliding-window layer gets the step's metadata narrowed to its window
(``AttentionMetadata.windowed``): every block stays in the cache, keys before the window are
masked out.

The KV cache of one layer is [2, num_kv_heads, num_blocks, block_size, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
    decode_ctx_start: int = 0  # with decode_ctx_len: the first cached position attended (a sliding window)
    # per prefill chunk, aligned with ``prefills``: (block table repeated per row [n, nb], each row's context
    # length [n]) where the chunk is short enough for the paged kernel row by row (``attention``'s ``paged``),
    # else None; empty where the step has none (a GPU, a long prefill)
    prefill_rows: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)

    def windowed(self, window: int) -> AttentionMetadata:
        """The same step with each query seeing only its last ``window`` keys (itself included), as
        transformers' sliding-window mask does; the masks are derived on the device (graph-safe)."""
        prefills = []
        for start, end, block_ids, mask in self.prefills:
            n = end - start
            if mask is None:  # no cached context: the keys are the chunk's own tokens
                if n > window:
                    i = torch.arange(n, device=self.slot_mapping.device)
                    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            else:  # each row sees keys 0..p, its position p
                last = mask.sum(-1, keepdim=True) - 1
                mask = mask & (torch.arange(mask.shape[-1], device=mask.device)[None, :] > last - window)
            prefills.append((start, end, block_ids, mask))
        decode_mask = self.decode_mask
        if self.num_decodes and self.decode_ctx_len is None:  # several decodes: their mask, narrowed
            L = decode_mask.shape[-1]
            lens = self.decode_ctx_lens if self.decode_ctx_lens is not None else decode_mask.sum(-1).view(-1)
            first = (lens - window).view(-1, 1, 1, 1)
            decode_mask = decode_mask & (torch.arange(L, device=decode_mask.device) >= first)
        start = max(0, self.decode_ctx_len - window) if self.decode_ctx_len is not None else 0
        # the paged rows see every key before them: a window is the masks' alone
        return replace(self, prefills=prefills, decode_mask=decode_mask, decode_ctx_start=start, prefill_rows=[])


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention settings: the score scale (None: head_dim ** -0.5) and Gemma 2's soft-cap."""

    scale: float | None = None
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the mask


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
    spec: AttentionSpec = AttentionSpec(),
    paged: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention output [T, H * D] of a packed step; the step's K/V are already in ``cache``.

    ``decoded``: the decode rows' attention when already computed (by the fused kernel). ``paged``: the
    fused paged kernel for the rows start..end of a chunk given its ``meta.prefill_rows`` (table, lengths).
    """
    T, H, D = q.shape
    B = meta.num_decodes
    if B == T:  # decode-only step: one batched call, no copies of q/out
        return decode_attention(q, cache, meta, spec).reshape(T, H * D)
    out = q.new_empty(T, H * D)
    if B:
        out[:B] = (decoded if decoded is not None else decode_attention(q[:B], cache, meta, spec)).reshape(B, H * D)
    for i, (start, end, block_ids, mask) in enumerate(meta.prefills):
        n = end - start
        rows = meta.prefill_rows[i] if paged is not None and meta.prefill_rows else None
        if rows is not None:
            out[start:end] = paged(start, end, *rows).reshape(n, H * D)
            continue
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if block_ids is None:  # no cached context: attend within the chunk only (causal, or the given mask)
            kp = k[start:end].transpose(0, 1).unsqueeze(0)
            vp = v[start:end].transpose(0, 1).unsqueeze(0)
            o = _attend(qp, kp, vp, mask, spec)
        else:
            kv = cache[:, :, block_ids].flatten(2, 3)  # [2, KV, L, D]
            o = _attend(qp, kv[0].unsqueeze(0), kv[1].unsqueeze(0), mask, spec, causal=False)
        out[start:end] = o[0].transpose(0, 1).reshape(n, H * D)
    return out


def decode_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec = AttentionSpec()
) -> torch.Tensor:
    """Attention [B, H, D] of the step's ``B`` single-token decodes over their cached context."""
    B, H, D = q.shape
    KV = cache.shape[1]
    qd = q.reshape(B, KV, H // KV, D)  # query heads of one KV head become query rows
    flat = meta.decode_flat_blocks
    if flat is None:  # metadata built by hand (tests): advanced indexing
        kv = cache[:, :, meta.decode_block_tables].flatten(3, 4).transpose(1, 2)  # [2, B, KV, L, D]
        return _attend(qd, kv[0], kv[1], meta.decode_mask, spec, causal=False)
    # index_select is a plain row copy, faster than aten::index's generic gather
    kv = cache.index_select(2, flat)  # [2, KV, B * nb, bs, D]
    L = kv.shape[2] // B * kv.shape[3]
    kv = kv.view(2, KV, B, L, D).transpose(1, 2)  # [2, B, KV, L, D]
    if meta.decode_ctx_len is not None:  # one request: cut to its length (and window), no mask needed
        s, n = meta.decode_ctx_start, meta.decode_ctx_len
        return _attend(qd, kv[0, :, :, s:n], kv[1, :, :, s:n], None, spec, causal=False)
    return _attend(qd, kv[0], kv[1], meta.decode_mask, spec, causal=False)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    spec: AttentionSpec,
    causal: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over [..., heads, n|L, D]; ``mask`` (bool, True = attend) or, without one
    and ``causal``, the causal mask. K/V may have fewer heads than q (grouped-query attention)."""
    gqa = q.shape[-3] != k.shape[-3]
    causal = causal and mask is None
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=spec.scale, enable_gqa=gqa
        )
    # SDPA has no soft-cap: the scores are formed here, in the order transformers' eager attention uses
    if gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        n, L = scores.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def fused_decode_attention(
    fk, qkv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, head_dim: int
) -> torch.Tensor | None:
    """The decode rows' attention by the fused paged kernel (``fk``: engine/fused.py), None without decodes."""
    if not meta.num_decodes:
        return None
    return fk.paged_decode_attention(
        qkv, cache, meta.decode_block_tables, meta.decode_ctx_lens, num_heads, head_dim, head_dim**-0.5
    )


def paged_rows(
    fk, qkv: torch.Tensor, cache: torch.Tensor, num_heads: int, head_dim: int
) -> Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``attention``'s ``paged``: rows start..end of ``qkv`` by the fused paged kernel, each as a decode over
    the chunk's block table up to its own position (``AttentionMetadata.prefill_rows``)."""

    def attend(start: int, end: int, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return fk.paged_decode_attention(qkv[start:end], cache, tables, lens, num_heads, head_dim, head_dim**-0.5)

    return attend
