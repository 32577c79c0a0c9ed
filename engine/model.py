"""Our own decoder forward for every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM3,
Granite, OLMo 2).

Why not transformers' model: its per-op Python overhead dominates decode on a small CPU
model, and it knows nothing of a paged KV cache. Here a step is one flat batch of tokens
(decodes of running requests and prefill chunks of new ones) with per-token positions;
each layer runs a handful of fused ops (QKV and gate/up are single matmuls, rotary on q
and k together), writes K/V into the paged cache through a slot mapping, then attends
over the blocks (``engine/layers/attention.py``). What differs between families (norms,
scales, activation, sliding or NoPE layers) is a ``Family`` description (``engine/families.py``)
that the one forward follows.

The weights are read and every linear's kind chosen as they load (quantized, packed or dense) in
``engine/model_weights.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.families import ACTIVATIONS, SUPPORTED_ARCHITECTURES, Family, describe, text_config
from engine.layers.attention import AttentionMetadata, attention, fused_decode_attention, paged_rows, write_kv
from engine.layers.linear import (
    DenseLinear,
    Linear,
    PackedLinear,
    linear_nbytes,
    onednn_packing_available,
    tensor_nbytes,
)
from engine.layers.rotary import apply_rotary, build_rope
from engine.model_weights import DecoderLayer, build_weights, open_checkpoint
from engine.quant import QuantMethod, every_core, quant_summary
from engine.quant_cache import QuantCache

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderLayer", "LlamaModel", "ModelArgs"]


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

    @classmethod
    def from_config(cls, cfg) -> ModelArgs:
        """The shapes of the language model (a multimodal checkpoint's text part)."""
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        text = text_config(cfg)
        heads = text.num_attention_heads
        eos = getattr(cfg, "eos_token_id", None)
        eos = text.eos_token_id if eos is None else eos
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size,
            rms_norm_eps=text.rms_norm_eps,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


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
        family = describe(self.config)  # refuses an unsupported architecture
        self.args = args = ModelArgs.from_config(self.config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_len = max_model_len or args.max_position_embeddings
        self.family: Family = family.windowed_up_to(self.max_len)
        self.quant = quant
        self.quant_info: dict | None = None  # what quantization did (method, kernel, bytes), when quantized
        pack = pack_linears and onednn_packing_available(dtype, self.device)
        # the fused CPU kernels (engine/fused.py), set by use_fused_kernels() for 16-bit CPU models
        self.fused = None
        text = text_config(self.config)
        sets = {plan.rope_set for plan in self.family.layers if plan.rope}
        self.ropes = {key: build_rope(text, key, args.head_dim, self.max_len, dtype, self.device) for key in sets}
        scale = self.family.embed_scale
        # Gemma's scale is a tensor in the model's dtype (sqrt(3072) is 55.5 in bf16)
        self.embed_scale = float(torch.tensor(scale).to(dtype)) if self.family.embed_scale_rounded else scale
        self._activation = ACTIVATIONS[self.family.activation]
        tensors, files = open_checkpoint(path)
        with every_core():  # quantizing is a one-off burst of elementwise work
            w = build_weights(
                tensors,
                self.family,
                dtype,
                self.device,
                rms_norm_eps=args.rms_norm_eps,
                tie_word_embeddings=args.tie_word_embeddings,
                quant=quant,
                pack=pack,
                # only the per-channel int8 matrices are kept: another method never reads the kept file
                cache=QuantCache.for_checkpoint(path, files, dtype) if quant and quant.per_channel_int8 else None,
            )
        self.embed, self.lm_head, self.norm, self.layers = w.embed, w.lm_head, w.norm, w.layers
        self.embed_lookup: Callable[[torch.Tensor], torch.Tensor] = (
            self._dense_lookup if w.vocab is None else w.vocab.lookup
        )
        self.lm_head_linear: Linear = w.lm_head_linear
        self.vocab = w.vocab
        self.num_packed_linears = w.num_packed_linears
        if quant is not None:
            self.quant_info = quant_summary(
                quant, w.float_linear_bytes, self.linear_weight_bytes(), self.weight_bytes(), self.dtype
            )

    @property
    def linear_kernel(self) -> str:
        """The kernel the layer linears run: dense, onednn-packed, int8pack, ao, bitsandbytes, int4pack, or on the
        GPU weight-only-triton, w8a8-int-mm, torchao-weight-only, torchao-w8a8."""
        return getattr(self.layers[0].qkv, "kernel", "dense") if self.layers else "dense"

    def graph_safe(self) -> bool:
        """Every linear can be captured in a CUDA graph (bitsandbytes LLM.int8 cannot: see engine/quant.py)."""
        linears = [self.lm_head_linear] + [
            getattr(layer, n) for layer in self.layers for n in ("qkv", "o", "gate_up", "down")
        ]
        return all(getattr(lin, "graph_safe", True) for lin in linears)

    def use_fused_kernels(self) -> bool:
        """Switch the forward to the fused CPU kernels where they apply (16-bit, CPU); returns whether it did.

        fp32 keeps the ATen ops: its tokens must equal transformers' bit for bit. The kernels are
        Llama's forward: a family that differs from it (other norms, scales, windows, partial
        rotary or longrope) keeps the ATen ops too.
        """
        if self.device.type != "cpu" or self.dtype == torch.float32 or not self._llama_shaped():
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

    def _llama_shaped(self) -> bool:
        rope = self.ropes.get(None)
        return self.family.llama_shaped and rope is not None and rope.dim == self.args.head_dim

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
        if self.vocab is not None and self.vocab is not self.lm_head_linear:
            total += self.vocab.nbytes()  # an int8 input embedding beside a 16-bit lm_head
        total += self.norm.nbytes()
        for layer in self.layers:
            total += sum(n.nbytes() for n in layer.norms())
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
        logits = self.lm_head_linear(self.hidden_states(input_ids, positions, meta, kv_cache))
        f = self.family
        if f.final_softcap is not None:
            logits = torch.tanh(logits / f.final_softcap) * f.final_softcap
        if f.logits_divisor != 1.0:
            logits = logits / f.logits_divisor
        return logits

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
        f = self.family
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        T = input_ids.shape[0]
        h = self.embed_lookup(input_ids)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        tables = {key: rope.at(positions) for key, rope in self.ropes.items()}  # cos/sin, once a step
        window_meta = meta.windowed(f.window) if f.window is not None else meta
        act = self._activation
        scale = f.residual_scale
        for li, layer in enumerate(self.layers):
            x = layer.attn_norm(h) if layer.attn_norm is not None else h
            qkv = layer.qkv(x)
            cos_sin = tables[layer.plan.rope_set] if layer.plan.rope else None
            if layer.q_norm is None:  # q and k rotate together, no copies
                qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
                if cos_sin is not None:
                    qk = apply_rotary(qk, *cos_sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q, k = self._normed_qk(layer, qkv, T)
                if cos_sin is not None:
                    q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            cache = kv_cache[li]
            write_kv(cache, k, v, meta.slot_mapping)
            out = layer.o(attention(q, k, v, cache, window_meta if layer.plan.sliding else meta, spec=layer.spec))
            if layer.attn_out_norm is not None:
                out = layer.attn_out_norm(out)
            h = h + (out * scale if scale != 1.0 else out)
            x = layer.mlp_norm(h) if layer.mlp_norm is not None else h
            g, u = layer.gate_up(x).chunk(2, dim=-1)
            out = layer.down(act(g) * u)
            if layer.mlp_out_norm is not None:
                out = layer.mlp_out_norm(out)
            h = h + (out * scale if scale != 1.0 else out)
        return self.norm(h.index_select(0, meta.sample_indices))

    def _normed_qk(self, layer: DecoderLayer, qkv: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KV, D] after the family's q/k norm (per head, or over the whole projection)."""
        a = self.args
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        q, k = qkv[:, : H * D], qkv[:, H * D : (H + KV) * D]
        if self.family.qk_norm == "width":
            return layer.q_norm(q).view(T, H, D), layer.k_norm(k).view(T, KV, D)
        return layer.q_norm(q.view(T, H, D)), layer.k_norm(k.view(T, KV, D))

    def _hidden_states_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """The same forward in ~9 calls per layer: fused norm+residual, rotary+KV write, paged decode attention."""
        fk = self.fused
        a = self.args
        eps = a.rms_norm_eps
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        T = input_ids.shape[0]
        rope = self.ropes[None]
        h = self.embed_lookup(input_ids)
        delta = None
        for li, layer in enumerate(self.layers):
            h, x = fk.add_rms_norm(h, delta, layer.attn_norm.weight, eps)
            qkv = layer.qkv(x).contiguous()
            cache = kv_cache[li]
            fk.rotary_kv_write(qkv, rope.cos, rope.sin, positions, cache, meta.slot_mapping, H, KV, D)
            decoded = fused_decode_attention(fk, qkv, cache, meta, H, D)
            if meta.num_decodes == T:
                attn = decoded.view(T, H * D)
            else:
                q = qkv[:, : H * D].view(T, H, D)
                k = qkv[:, H * D : (H + KV) * D].view(T, KV, D)
                v = qkv[:, (H + KV) * D :].view(T, KV, D)
                attn = attention(q, k, v, cache, meta, decoded=decoded, paged=paged_rows(fk, qkv, cache, H, D))
            delta = layer.o(attn)
            h, x = fk.add_rms_norm(h, delta, layer.mlp_norm.weight, eps)
            delta = layer.down(fk.silu_mul(layer.gate_up(x).contiguous()))
        idx = meta.sample_indices
        return fk.add_rms_norm(h.index_select(0, idx), delta.index_select(0, idx), self.norm.weight, eps)[1]
