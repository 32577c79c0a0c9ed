"""A checkpoint read into the layers ``engine.model.LlamaModel`` runs: the weight loading and the choice of
each linear's kind.

Why apart from the forward: loading knows the checkpoint (sharded safetensors, a multimodal checkpoint's
text part, a tied or separate lm_head, the family's weight names) and chooses every linear as it loads:
quantized when the engine asks for it (``engine/quant.py``), bf16 pre-packed for oneDNN where that
applies, else dense. The forward needs none of that, only the built ``DecoderLayer`` s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.families import Family, LayerPlan
from engine.gguf.index import has_float32_weights, has_index
from engine.layers.attention import AttentionSpec
from engine.layers.linear import DenseLinear, Linear, PackedLinear, tensor_nbytes
from engine.layers.norm import RMSNorm
from engine.quant import Int8Embedding, QuantMethod, quantize_per_channel
from engine.quant_cache import QuantCache

if TYPE_CHECKING:
    from engine.gguf.tensors import GGUFTensors

log = logging.getLogger(__name__)

# where the language model's weights live: a causal LM's, or a multimodal checkpoint's text part (new and old layouts)
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


@dataclass
class DecoderLayer:
    """One transformer block's weights (fused QKV, fused gate/up) and what its family does around them.

    A norm is None where the family has none there (OLMo 2 has no pre-norms, Llama no post-norms).
    """

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    attn_norm: RMSNorm | None
    attn_out_norm: RMSNorm | None
    mlp_norm: RMSNorm | None
    mlp_out_norm: RMSNorm | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    plan: LayerPlan  # sliding or not, which RoPE table (or none)
    spec: AttentionSpec

    def norms(self) -> list[RMSNorm]:
        return [
            n
            for n in (self.attn_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm, self.q_norm, self.k_norm)
            if n is not None
        ]


@dataclass
class ModelWeights:
    """What ``build_weights`` made of a checkpoint."""

    embed: torch.Tensor | None  # None when the vocabulary is quantized (``vocab``)
    lm_head: torch.Tensor | None  # the embedding itself when tied
    vocab: Int8Embedding | None  # the quantized embedding (int8 rows: its ``lookup`` embeds), or None
    lm_head_linear: Linear
    norm: RMSNorm
    layers: list[DecoderLayer]
    float_linear_bytes: int  # the layer linears' bytes before quantization
    num_packed_linears: int


def build_weights(
    sd: CheckpointTensors | GGUFTensors,
    family: Family,
    dtype: torch.dtype,
    device: torch.device,
    *,
    rms_norm_eps: float,
    tie_word_embeddings: bool,
    quant: QuantMethod | None,
    pack: bool,
    cache: QuantCache | None = None,
) -> ModelWeights:
    """The model's weights from the language model's tensors ``sd`` (each read as it is taken, so a
    16-bit tensor is freed once its quantized or packed linear is built).

    ``quant``: the layer linears (and, when it says so, the embedding / lm_head) quantized; ``pack``:
    the 16-bit dense linears pre-packed for oneDNN; ``cache``: per-channel int8 matrices quantized by an
    earlier start, read instead of their float weights, and those quantized now kept for the next.
    """
    f = family
    float_linear_bytes = 0
    num_packed = 0
    prefix = _text_prefix(sd)
    int8_rows_cached = cache is not None and quant is not None and quant.per_channel_int8

    def take(name: str) -> torch.Tensor:
        return sd.pop(name).to(device=device, dtype=dtype).contiguous()

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in sd else None

    def dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        nonlocal num_packed
        if pack:
            num_packed += 1
            return PackedLinear(weight, bias)
        return DenseLinear(weight, bias)

    def cached(key: str, names: list[str]):
        """``key``'s (q, scale) from the cache, its float weights ``names`` then left unread."""
        found = cache.get(key, device) if int8_rows_cached else None
        if found is not None:
            for name in names:
                sd.discard(name)
        return found

    def quantized(key: str, weight: torch.Tensor):
        made = quantize_per_channel(weight)
        cache.put(key, made)
        return made

    def linear(base: str, names: tuple[str, ...]) -> Linear:
        """One linear over the rows of ``base.<name>`` for each name (q/k/v or gate/up fused)."""
        nonlocal float_linear_bytes
        key = f"{base}|{','.join(names)}"
        found = cached(key, [f"{base}.{n}.weight" for n in names])
        biases = [maybe(f"{base}.{n}.bias") for n in names]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError(f"{base}: some of {', '.join(names)} have a bias and some not")
        bias = torch.cat(biases).contiguous() if biases[0] is not None else None
        if found is not None:
            float_linear_bytes += found[0].numel() * dtype.itemsize + tensor_nbytes(bias)
            return quant.linear(None, bias, dtype, found)
        weight = torch.cat([take(f"{base}.{n}.weight") for n in names]).contiguous()
        float_linear_bytes += tensor_nbytes(weight, bias)
        if int8_rows_cached:
            return quant.linear(None, bias, dtype, quantized(key, weight))
        if quant is not None:
            return quant.linear(weight, bias, dtype)
        return dense(weight, bias)

    def int8_rows(name: str) -> Int8Embedding:
        """A vocabulary matrix as int8 rows."""
        found = cached(name, [name])
        if found is not None:
            return quant.vocab(None, dtype, found)
        weight = take(name)
        return quant.vocab(None, dtype, quantized(name, weight)) if int8_rows_cached else quant.vocab(weight, dtype)

    def norm(name: str | None) -> RMSNorm | None:
        if name is None:
            return None
        return RMSNorm(take(name), rms_norm_eps, dtype, offset=f.norm_offset, upcast=f.norm_upcast)

    embed_name = prefix + "embed_tokens.weight"
    head_name = next((n for n in _LM_HEAD_NAMES if n in sd), None)
    tied = tie_word_embeddings or head_name is None
    if tied and head_name is not None:
        sd.discard(head_name)  # a tied checkpoint that stores the matrix twice: the embedding is used
    if quant is not None and quant.quantize_vocab:
        # int8 rows only: no 16-bit copy of the vocabulary matrix remains
        vocab = int8_rows(embed_name)
        lm_head_linear = vocab if tied else int8_rows(head_name)
        embed = lm_head = None
    elif quant is not None and quant.quantize_embedding and not tied:
        vocab = int8_rows(embed_name)  # looked up a few rows at a time; the output projection stays 16-bit
        embed = None
        lm_head = take(head_name)
        lm_head_linear = dense(lm_head)
    else:
        vocab = None
        embed = take(embed_name)
        lm_head = embed if tied else take(head_name)
        # a packed copy where packing applies (the plain tensor stays for the tied embedding lookup)
        lm_head_linear = dense(lm_head)
    final_norm = norm(prefix + "norm.weight")
    layers: list[DecoderLayer] = []
    for i, plan in enumerate(f.layers):
        p = f"{prefix}layers.{i}."
        layers.append(
            DecoderLayer(
                qkv=linear(p + "self_attn", f.qkv_names),
                o=linear(p + "self_attn", ("o_proj",)),
                gate_up=linear(p + "mlp", f.gate_up_names),
                down=linear(p + "mlp", ("down_proj",)),
                attn_norm=norm(f.attn_norm and p + f.attn_norm + ".weight"),
                attn_out_norm=norm(f.attn_out_norm and p + f.attn_out_norm + ".weight"),
                mlp_norm=norm(f.mlp_norm and p + f.mlp_norm + ".weight"),
                mlp_out_norm=norm(f.mlp_out_norm and p + f.mlp_out_norm + ".weight"),
                q_norm=norm(f.qk_norm and p + "self_attn.q_norm.weight"),
                k_norm=norm(f.qk_norm and p + "self_attn.k_norm.weight"),
                plan=plan,
                spec=AttentionSpec(f.attn_scale, f.attn_softcap),
            )
        )
    if sd:
        log.debug("unused weights: %s", sorted(sd)[:10])
    if int8_rows_cached:
        cache.save()
    return ModelWeights(
        embed=embed,
        lm_head=lm_head,
        vocab=vocab,
        lm_head_linear=lm_head_linear,
        norm=final_norm,
        layers=layers,
        float_linear_bytes=float_linear_bytes,
        num_packed_linears=num_packed,
    )


def _text_prefix(sd: CheckpointTensors | GGUFTensors) -> str:
    for prefix in _TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in sd:
            return prefix
    raise ValueError(f"no token embedding under {', '.join(p + 'embed_tokens.weight' for p in _TEXT_PREFIXES)}")


def _is_text_weight(name: str) -> bool:
    """A weight of the language model (a multimodal checkpoint's vision tower is never read)."""
    return name in _LM_HEAD_NAMES or any(
        name.startswith(p + n) for p in _TEXT_PREFIXES for n in ("embed_tokens.", "layers.", "norm.")
    )


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a (possibly sharded) checkpoint folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return [path / name for name in names]


class CheckpointTensors:
    """The language model's tensors of a checkpoint, by name, each read from its file only when taken
    (``pop``): a start that finds a matrix already quantized (``engine.quant_cache``) never reads its float
    weights, and a tensor not taken is never read."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, object] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self._where.update({key: handle for key in handle.keys() if _is_text_weight(key)})  # noqa: SIM118

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def pop(self, name: str) -> torch.Tensor:
        return self._where.pop(name).get_tensor(name)

    def discard(self, name: str) -> None:
        self._where.pop(name, None)


def open_checkpoint(path: Path) -> tuple[CheckpointTensors | GGUFTensors, list[Path]]:
    """A checkpoint folder's tensors, read as they are taken, and the files they are read from: its safetensors,
    or for a GGUF converted without float32 weights, the GGUF (dequantized tensor by tensor)."""
    if has_index(path) and not has_float32_weights(path):
        from engine.gguf.tensors import GGUFTensors  # gguf-py only where a GGUF is read

        tensors = GGUFTensors(path)
        return tensors, [tensors.file]
    files = checkpoint_files(path)
    return CheckpointTensors(files), files
