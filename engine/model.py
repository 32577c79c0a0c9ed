"""Our own Llama-family forward (Llama, SmolLM2, Mistral, Qwen2) over the packed tokens of a step.

Why not transformers' model: its per-op Python overhead dominates decode on a small CPU
model, and it knows nothing of a paged KV cache. Here a step is one flat batch of tokens
(decodes of running requests and prefill chunks of new ones) with per-token positions;
each layer runs a handful of fused ops (QKV and gate/up are single matmuls, rotary on q
and k together), writes K/V into the paged cache through a slot mapping, then reads K/V
back from the blocks for attention: decodes in one batched SDPA call (query heads of a
KV group folded into the query length, so no K/V repeat), prefill chunks one call each
with a causal mask offset by the request's cached context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ModelArgs:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, cfg) -> ModelArgs:
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg.num_attention_heads
        eos = cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        sw = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            sliding_window=sw,
        )


def rope_tables(cfg, head_dim: int, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, head_dim] exactly as transformers computes them (float32, then cast)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    else:  # dynamic/longrope change with sequence length; not supported by a static table
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype).to(device), (emb.sin() * scaling).to(dtype).to(device)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class DenseLinear:
    """y = x W^T (+ b); weights kept as one contiguous tensor (fused QKV / gate_up)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def onednn_packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """bf16 weights can be pre-reordered for oneDNN on this CPU (AVX512-BF16/AMX, or at least AVX512)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """bf16 linear whose weight is reordered for oneDNN once, at load.

    Why: ``F.linear`` on a bf16 CPU tensor reorders (re-lays out) the whole weight on every
    call; for decode-sized inputs that costs as much as the product itself. Measured on this
    CPU, 1 thread: a SmolLM2 layer's gate_up at 1 token 145 -> 70 us, lm_head at 8 tokens
    17 -> 5 ms. Same math (oneDNN bf16 with fp32 accumulation), different blocking.
    """

    __slots__ = ("packed", "bias", "_nbytes")
    kernel = "onednn-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias
        self._nbytes = weight.numel() * weight.element_size()
        if bias is not None:
            self._nbytes += bias.numel() * bias.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def nbytes(self) -> int:
        return self._nbytes


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


class LlamaModel:
    """Weights plus a forward over packed tokens; holds no per-request state."""

    def __init__(self, path: str | Path, dtype: torch.dtype, device: str, max_model_len: int | None = None) -> None:
        from transformers import AutoConfig

        path = Path(path)
        self.config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.args = args = ModelArgs.from_config(self.config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_len = max_model_len or args.max_position_embeddings
        self.sliding_window = args.sliding_window
        state = _load_state_dict(path)
        self._build(state)
        self.cos, self.sin = rope_tables(self.config, args.head_dim, self.max_len, dtype, self.device)

    def _build(self, sd: dict[str, torch.Tensor]) -> None:
        a = self.args

        def take(name: str) -> torch.Tensor:
            return sd.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in sd else None

        self.embed = take("model.embed_tokens.weight")
        lm_head = sd.pop("lm_head.weight", None)
        if a.tie_word_embeddings or lm_head is None:
            self.lm_head = self.embed
        else:
            self.lm_head = lm_head.to(device=self.device, dtype=self.dtype).contiguous()
        self.lm_head_linear: Linear = DenseLinear(self.lm_head)
        # the fused CPU kernels (engine/fused.py), set by use_fused_kernels() for 16-bit CPU models
        self.fused = None
        # replaced by quantization when the embedding is stored quantized (then self.embed is None)
        self.embed_lookup: Callable[[torch.Tensor], torch.Tensor] = self._dense_lookup
        self.norm = take("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_bias = torch.cat(biases).contiguous() if all(b is not None for b in biases) else None
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]).contiguous()
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=DenseLinear(qkv, qkv_bias),
                    o=DenseLinear(take(p + "self_attn.o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=DenseLinear(gate_up),
                    down=DenseLinear(take(p + "mlp.down_proj.weight")),
                )
            )
        if sd:
            log.debug("unused weights: %s", sorted(sd)[:10])

    def use_fused_kernels(self) -> bool:
        """Switch the forward to the fused CPU kernels where they apply (16-bit, CPU); returns whether it did.

        fp32 keeps the ATen ops: its tokens must equal transformers' bit for bit.
        """
        if self.device.type != "cpu" or self.dtype == torch.float32:
            return False
        from engine.fused import fused_kernels

        self.fused = fused_kernels()
        return self.fused is not None

    def _dense_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def pack_linears(self) -> int:
        """Pre-reorder every remaining 16-bit dense linear (and lm_head) for oneDNN; returns how many.

        Called by the runner after any quantization (int8 layers keep their own kernel). A
        no-op where packing does not apply (fp32 keeps ``F.linear``: its results must equal
        transformers' bit for bit, which the oracle tests check).
        """
        if not onednn_packing_available(self.dtype, self.device):
            return 0
        n = 0
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(layer, name)
                if isinstance(lin, DenseLinear):
                    setattr(layer, name, PackedLinear(lin.weight, lin.bias))
                    n += 1
        if isinstance(self.lm_head_linear, DenseLinear) and self.lm_head is not None:
            # A packed copy (the plain tensor stays for the tied embedding lookup).
            self.lm_head_linear = PackedLinear(self.lm_head)
            n += 1
        return n

    # --- memory accounting -----------------------------------------------------------
    def linear_weight_bytes(self) -> int:
        """Bytes held by the transformer-layer linear weights (what quantization shrinks)."""
        total = 0
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                total += _linear_bytes(lin)
        return total

    def weight_bytes(self) -> int:
        """All weight bytes (embeddings counted once when tied; quantized and packed copies counted)."""
        total = self.linear_weight_bytes()
        plain = {id(t): t for t in (self.embed, self.lm_head) if t is not None}
        total += sum(t.numel() * t.element_size() for t in plain.values())
        if not isinstance(self.lm_head_linear, DenseLinear):
            total += _linear_bytes(self.lm_head_linear)  # a packed or quantized copy of lm_head
        total += self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * layer.input_norm.element_size()
        return total

    # --- forward -----------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [S, vocab] for ``meta.sample_indices``; K/V of every token written to ``kv_cache``.

        ``kv_cache`` is [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].
        """
        return self.lm_head_linear(self.hidden_states(input_ids, positions, meta, kv_cache))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed hidden states [S, hidden] of the sampled rows (everything before lm_head)."""
        if self.fused is not None:
            return self._hidden_states_fused(input_ids, positions, meta, kv_cache)
        a = self.args
        eps = a.rms_norm_eps
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        T = input_ids.shape[0]
        h = self.embed_lookup(input_ids)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = D // 2
        hidden = a.hidden_size
        for li, layer in enumerate(self.layers):
            x = F.rms_norm(h, (hidden,), layer.input_norm, eps)
            qkv = layer.qkv(x)
            qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
            rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rot * sin
            q = qk[:, :H]
            k = qk[:, H:]
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            cache = kv_cache[li]
            flat = cache.view(2, KV, -1, D)
            flat.index_copy_(2, meta.slot_mapping, torch.stack((k, v)).transpose(1, 2))
            attn = self._attention(q, k, v, cache, meta)
            h = h + layer.o(attn)
            x = F.rms_norm(h, (hidden,), layer.post_norm, eps)
            gu = layer.gate_up(x)
            g, u = gu.chunk(2, dim=-1)
            h = h + layer.down(F.silu(g) * u)
        h = h.index_select(0, meta.sample_indices)
        return F.rms_norm(h, (hidden,), self.norm, eps)

    def _hidden_states_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """The same forward in ~9 calls per layer: fused norm+residual, rotary+KV write, paged decode attention."""
        fk = self.fused
        a = self.args
        eps = a.rms_norm_eps
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        T = input_ids.shape[0]
        h = self.embed_lookup(input_ids)
        delta = None
        for li, layer in enumerate(self.layers):
            h, x = fk.add_rms_norm(h, delta, layer.input_norm, eps)
            qkv = layer.qkv(x).contiguous()
            cache = kv_cache[li]
            fk.rotary_kv_write(qkv, self.cos, self.sin, positions, cache, meta.slot_mapping, H, KV, D)
            decoded = self._fused_decode(qkv, cache, meta)
            if meta.num_decodes == T:
                attn = decoded.view(T, H * D)
            else:
                q = qkv[:, : H * D].view(T, H, D)
                k = qkv[:, H * D : (H + KV) * D].view(T, KV, D)
                v = qkv[:, (H + KV) * D :].view(T, KV, D)
                attn = self._attention(q, k, v, cache, meta, decoded=decoded)
            delta = layer.o(attn)
            h, x = fk.add_rms_norm(h, delta, layer.post_norm, eps)
            delta = layer.down(fk.silu_mul(layer.gate_up(x).contiguous()))
        idx = meta.sample_indices
        return fk.add_rms_norm(h.index_select(0, idx), delta.index_select(0, idx), self.norm, eps)[1]

    def _fused_decode(self, qkv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        if not meta.num_decodes:
            return None
        a = self.args
        return self.fused.paged_decode_attention(
            qkv, cache, meta.decode_block_tables, meta.decode_ctx_lens, a.num_heads, a.head_dim, a.head_dim**-0.5
        )

    def _attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,
        cache: torch.Tensor,  # [2, KV, num_blocks, block_size, D]
        meta: AttentionMetadata,
        decoded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``decoded``: the decode rows' attention when already computed (by the fused kernel)."""
        T, H, D = q.shape
        KV = k.shape[1]
        G = H // KV
        B = meta.num_decodes
        if B == T:  # decode-only step: one batched call, no copies of q/out
            return self._decode(q, cache, meta).reshape(T, H * D)
        out = q.new_empty(T, H * D)
        if B:
            out[:B] = (decoded if decoded is not None else self._decode(q[:B], cache, meta)).reshape(B, H * D)
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

    @staticmethod
    def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, H, D = q.shape
        KV = cache.shape[1]
        qd = q.reshape(B, KV, H // KV, D)  # query heads of one KV head become query rows
        flat = meta.decode_flat_blocks
        if flat is None:  # metadata built by hand (older callers): advanced indexing
            kv = cache[:, :, meta.decode_block_tables].flatten(3, 4).transpose(1, 2)  # [2, B, KV, L, D]
            return F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=meta.decode_mask)
        # index_select is a plain row copy (aten::index is a generic gather, ~2x slower here)
        kv = cache.index_select(2, flat)  # [2, KV, B * nb, bs, D]
        L = kv.shape[2] // B * kv.shape[3]
        kv = kv.view(2, KV, B, L, D).transpose(1, 2)  # [2, B, KV, L, D]
        if meta.decode_ctx_len is not None:  # one request: cut to its length, no mask needed
            n = meta.decode_ctx_len
            return F.scaled_dot_product_attention(qd, kv[0, :, :, :n], kv[1, :, :, :n])
        return F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=meta.decode_mask)


def _linear_bytes(lin) -> int:
    if hasattr(lin, "nbytes"):
        return lin.nbytes()
    total = lin.weight.numel() * lin.weight.element_size()
    if lin.bias is not None:
        total += lin.bias.numel() * lin.bias.element_size()
    return total


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(str(path / name)))
    return sd


@torch.inference_mode()
def perplexity(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> float:
    """Perplexity of ``token_ids`` under ``model`` in one prefill (for quantization checks and benchmarks)."""
    a = model.args
    T = len(token_ids)
    nb = -(-T // block_size)
    cache = torch.zeros(
        a.num_layers, 2, a.num_kv_heads, nb, block_size, a.head_dim, dtype=model.dtype, device=model.device
    )
    idx = torch.arange(T, device=model.device)
    meta = AttentionMetadata(
        slot_mapping=idx,
        num_decodes=0,
        decode_block_tables=None,
        decode_mask=None,
        prefills=[(0, T, None, None)],
        sample_indices=idx[:-1],
    )
    ids = torch.tensor(token_ids, device=model.device)
    logits = model.forward(ids, idx, meta, cache).float()
    nll = F.cross_entropy(logits, ids[1:])
    return float(torch.exp(nll))
