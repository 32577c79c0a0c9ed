"""Our own Llama-family model (Llama, SmolLM2, Mistral, Qwen2): the decoder layers, and the weight loading.

Why not transformers' model: its per-op Python overhead dominates decode on a small CPU
model, and it knows nothing of a paged KV cache. Here a step is one flat batch of tokens
(decodes of running requests and prefill chunks of new ones) with per-token positions;
each layer runs a handful of fused ops (QKV and gate/up are single matmuls, rotary on q
and k together), writes K/V into the paged cache through a slot mapping, then attends
over the blocks (``engine/layers/attention.py``).

The builder chooses every linear as it loads the weights: quantized when the engine asks
for it (``engine/quant.py``), bf16 pre-packed for oneDNN where that applies, else dense.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionMetadata, attention, fused_decode_attention, write_kv
from engine.layers.linear import (
    DenseLinear,
    Linear,
    PackedLinear,
    linear_nbytes,
    onednn_packing_available,
    tensor_nbytes,
)
from engine.layers.rotary import apply_rotary, rope_tables
from engine.quant import QuantMethod, quant_summary

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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


@dataclass
class DecoderLayer:
    """One transformer block's weights: pre-norm attention (fused QKV) and a SwiGLU MLP (fused gate/up)."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """Weights plus a forward over packed tokens; holds no per-request state.

    ``quant``: store the layer linears (and, for int8 on the CPU, the embedding / lm_head)
    quantized, built that way as the weights load. ``pack_linears``: pre-pack the 16-bit
    dense linears for oneDNN where the CPU supports it (the engine asks for it; a plain
    model keeps ``F.linear`` everywhere).
    """

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype,
        device: str,
        max_model_len: int | None = None,
        *,
        quant: QuantMethod | None = None,
        pack_linears: bool = False,
    ) -> None:
        from transformers import AutoConfig

        path = Path(path)
        self.config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.args = args = ModelArgs.from_config(self.config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_len = max_model_len or args.max_position_embeddings
        self.sliding_window = args.sliding_window
        self.quant = quant
        self.quant_info: dict | None = None  # what quantization did (method, kernel, bytes), when quantized
        self.num_packed_linears = 0
        self._pack = pack_linears and onednn_packing_available(dtype, self.device)
        # the fused CPU kernels (engine/fused.py), set by use_fused_kernels() for 16-bit CPU models
        self.fused = None
        self._build(_load_state_dict(path))
        self.cos, self.sin = rope_tables(self.config, args.head_dim, self.max_len, dtype, self.device)

    def _build(self, sd: dict[str, torch.Tensor]) -> None:
        a = self.args
        quant = self.quant
        float_linear_bytes = 0

        def take(name: str) -> torch.Tensor:
            return sd.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in sd else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            nonlocal float_linear_bytes
            float_linear_bytes += tensor_nbytes(weight, bias)
            if quant is not None:
                return quant.linear(weight, bias, self.dtype)
            return self._dense(weight, bias)

        embed = take("model.embed_tokens.weight")
        lm_head = sd.pop("lm_head.weight", None)
        tied = a.tie_word_embeddings or lm_head is None
        if not tied:
            lm_head = lm_head.to(device=self.device, dtype=self.dtype).contiguous()
        if quant is not None and quant.quantize_vocab:
            # int8 rows only: no 16-bit copy of the vocabulary matrix remains
            emb = quant.vocab(embed, self.dtype)
            self.embed = self.lm_head = None
            self.embed_lookup: Callable[[torch.Tensor], torch.Tensor] = emb.lookup
            self.lm_head_linear: Linear = emb if tied else quant.vocab(lm_head, self.dtype)
        else:
            self.embed = embed
            self.lm_head = embed if tied else lm_head
            self.embed_lookup = self._dense_lookup
            # a packed copy where packing applies (the plain tensor stays for the tied embedding lookup)
            self.lm_head_linear = self._dense(self.lm_head)
        del embed, lm_head
        self.norm = take("model.norm.weight")
        self.layers: list[DecoderLayer] = []
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_bias = torch.cat(biases).contiguous() if all(b is not None for b in biases) else None
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]).contiguous()
            self.layers.append(
                DecoderLayer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(qkv, qkv_bias),
                    o=linear(take(p + "self_attn.o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(gate_up),
                    down=linear(take(p + "mlp.down_proj.weight")),
                )
            )
        if sd:
            log.debug("unused weights: %s", sorted(sd)[:10])
        if quant is not None:
            self.quant_info = quant_summary(
                quant, float_linear_bytes, self.linear_weight_bytes(), self.weight_bytes(), self.dtype
            )

    def _dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        if self._pack:
            self.num_packed_linears += 1
            return PackedLinear(weight, bias)
        return DenseLinear(weight, bias)

    @property
    def linear_kernel(self) -> str:
        """The kernel the layer linears run: dense, onednn-packed, int8pack, ao, bitsandbytes or int4pack."""
        return getattr(self.layers[0].qkv, "kernel", "dense") if self.layers else "dense"

    def graph_safe(self) -> bool:
        """Every linear can be captured in a CUDA graph (bitsandbytes LLM.int8 cannot: see engine/quant.py)."""
        linears = [self.lm_head_linear] + [
            getattr(layer, n) for layer in self.layers for n in ("qkv", "o", "gate_up", "down")
        ]
        return all(getattr(lin, "graph_safe", True) for lin in linears)

    def use_fused_kernels(self) -> bool:
        """Switch the forward to the fused CPU kernels where they apply (16-bit, CPU); returns whether it did.

        fp32 keeps the ATen ops: its tokens must equal transformers' bit for bit.
        """
        if self.device.type != "cpu" or self.dtype == torch.float32:
            return False
        from engine.fused import fused_kernels

        self.fused = fused_kernels()
        if self.fused is not None:
            for linear in [self.lm_head_linear] + [
                getattr(layer, n) for layer in self.layers for n in ("qkv", "o", "gate_up", "down")
            ]:
                if hasattr(linear, "use_fused_kernels"):  # int8 weights: the int8 x int8 kernel (Int8Dot)
                    linear.use_fused_kernels(self.fused)
        return self.fused is not None

    def _dense_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def pack_linears(self) -> int:
        """Pre-reorder every remaining 16-bit dense linear (and lm_head) for oneDNN; returns how many.

        For a model built without ``pack_linears`` and then handed to an engine (tests share
        one loaded model). A no-op where packing does not apply (fp32 keeps ``F.linear``: its
        results must equal transformers' bit for bit, which the oracle tests check).
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
            self.lm_head_linear = PackedLinear(self.lm_head)
            n += 1
        self.num_packed_linears += n
        return n

    # --- memory accounting -----------------------------------------------------------
    def linear_weight_bytes(self) -> int:
        """Bytes held by the transformer-layer linear weights (what quantization shrinks)."""
        total = 0
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                total += linear_nbytes(lin)
        return total

    def weight_bytes(self) -> int:
        """All weight bytes (embeddings counted once when tied; quantized and packed copies counted)."""
        total = self.linear_weight_bytes()
        plain = {id(t): t for t in (self.embed, self.lm_head) if t is not None}
        total += tensor_nbytes(*plain.values())
        if not isinstance(self.lm_head_linear, DenseLinear):
            total += linear_nbytes(self.lm_head_linear)  # a packed or quantized copy of lm_head
        total += tensor_nbytes(self.norm)
        for layer in self.layers:
            total += tensor_nbytes(layer.input_norm, layer.post_norm)
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
        hidden = a.hidden_size
        for li, layer in enumerate(self.layers):
            x = F.rms_norm(h, (hidden,), layer.input_norm, eps)
            qkv = layer.qkv(x)
            qk = apply_rotary(qkv[:, : (H + KV) * D].view(T, H + KV, D), cos, sin)
            q = qk[:, :H]
            k = qk[:, H:]
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            cache = kv_cache[li]
            write_kv(cache, k, v, meta.slot_mapping)
            h = h + layer.o(attention(q, k, v, cache, meta))
            x = F.rms_norm(h, (hidden,), layer.post_norm, eps)
            g, u = layer.gate_up(x).chunk(2, dim=-1)
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
            decoded = fused_decode_attention(fk, qkv, cache, meta, H, D)
            if meta.num_decodes == T:
                attn = decoded.view(T, H * D)
            else:
                q = qkv[:, : H * D].view(T, H, D)
                k = qkv[:, H * D : (H + KV) * D].view(T, KV, D)
                v = qkv[:, (H + KV) * D :].view(T, KV, D)
                attn = attention(q, k, v, cache, meta, decoded=decoded)
            delta = layer.o(attn)
            h, x = fk.add_rms_norm(h, delta, layer.post_norm, eps)
            delta = layer.down(fk.silu_mul(layer.gate_up(x).contiguous()))
        idx = meta.sample_indices
        return fk.add_rms_norm(h.index_select(0, idx), delta.index_select(0, idx), self.norm, eps)[1]


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
