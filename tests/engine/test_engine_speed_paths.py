"""The speed paths compute what the plain paths compute: packed oneDNN linears, decode attention
through precomputed flat block indices (one request without a mask, several with one).

Correctness only; the speed itself is measured by `parley bench engine` and engine/benchmarks/peer.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.layers.attention import AttentionMetadata, decode_attention
from engine.layers.linear import DenseLinear, PackedLinear, onednn_packing_available
from engine.llm_engine import LLMEngine
from engine.model import LlamaModel
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.step_inputs import prepare_inputs

needs_packing = pytest.mark.skipif(
    not onednn_packing_available(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU"
)


@needs_packing
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_packed_linear_matches_f_linear(m):
    torch.manual_seed(m)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(m, 64, dtype=torch.bfloat16)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = PackedLinear(w, bias)(x).float()
        assert got.shape == (m, 96)
        assert torch.allclose(got, ref, rtol=2e-2, atol=5e-2), (got - ref).abs().max()


def _decode_meta(tables: list[list[int]], ctx_lens: list[int], bs: int, flat: bool) -> AttentionMetadata:
    B = len(tables)
    nb = max(-(-n // bs) for n in ctx_lens)
    rows = [t[:nb] + [0] * (nb - len(t[:nb])) for t in tables]
    table = torch.tensor(rows, dtype=torch.long)
    lens = torch.tensor(ctx_lens)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None]).view(B, 1, 1, nb * bs)
    return AttentionMetadata(
        slot_mapping=torch.zeros(B, dtype=torch.long),
        num_decodes=B,
        decode_block_tables=table,
        decode_mask=None if (flat and B == 1) else mask,
        prefills=[],
        sample_indices=torch.arange(B),
        decode_flat_blocks=table.flatten() if flat else None,
        decode_ctx_len=ctx_lens[0] if (flat and B == 1) else None,
    )


@pytest.mark.parametrize("case", ["one", "several"])
def test_flat_block_decode_attention_matches_gather(case):
    torch.manual_seed(0)
    KV, G, D, bs, nblocks = 3, 3, 64, 4, 40
    cache = torch.randn(2, KV, nblocks, bs, D)
    if case == "one":
        tables, lens = [[7, 3, 12, 30, 5]], [18]
    else:
        tables, lens = [[7, 3, 12, 30, 5], [1, 2], [39, 0, 22]], [18, 6, 9]
    q = torch.randn(len(tables), KV * G, D)
    ref = decode_attention(q, cache, _decode_meta(tables, lens, bs, flat=False))
    got = decode_attention(q, cache, _decode_meta(tables, lens, bs, flat=True))
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # and against attention written out by hand
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        k = cache[0][:, t].flatten(1, 2)[:, :n]  # [KV, n, D]
        v = cache[1][:, t].flatten(1, 2)[:, :n]
        qi = q[i].view(KV, G, D)
        w = torch.softmax(qi @ k.transpose(1, 2) / D**0.5, dim=-1)
        assert torch.allclose(got[i], w @ v, atol=1e-5)


@needs_packing
def test_bf16_engine_packs_linears_and_matches_unpacked(model_path):
    eng = LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", num_blocks=64))
    model = eng.model
    assert eng.model_info()["packed_linears"] == 4 * len(model.layers) + 1
    assert eng.linear_kernel == "onednn-packed"
    assert isinstance(model.layers[0].qkv, PackedLinear) and isinstance(model.lm_head_linear, PackedLinear)
    plain = LlamaModel(model_path, torch.bfloat16, "cpu")  # same weights, F.linear everywhere
    assert isinstance(plain.layers[0].qkv, DenseLinear)
    ids = eng.tokenize("The lighthouse keeper climbed the stairs every evening to")
    inputs = prepare_inputs([ScheduledChunk("t", ids, 0, [0, 1, 2, 3], True)], 16, "cpu", all_logits=True)
    a = model.args
    caches = [torch.zeros(a.num_layers, 2, a.num_kv_heads, 4, 16, a.head_dim, dtype=torch.bfloat16) for _ in "ab"]
    with torch.inference_mode():
        got = model.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, caches[0]).float()
        ref = plain.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata, caches[1]).float()
    # Not bit-exact: the packed kernels add the bf16 products in another order, which moves the top
    # logits by up to 0.375 here (1.0 over the engine test prompts). The top tokens agreed at every
    # position measured, but this prompt has an exact tie at position 1 (a coin toss on another CPU):
    # so the packed path's top token must be the plain path's best within that noise. Wrong packing
    # misses by whole logits.
    best = ref.max(-1).values
    chosen = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    assert (best - chosen).max() <= 0.5, best - chosen
    assert torch.allclose(got.softmax(-1), ref.softmax(-1), atol=0.05)
    # and the engine decodes with it, batch of one and of several
    out = eng.generate([ids, ids[:5], ids[:9]], SamplingParams(max_tokens=6))
    assert all(len(o) == 6 for o in out)
    assert out[0] == eng.generate([ids], SamplingParams(max_tokens=6))[0]


def test_sampler_fast_finite_check_and_bf16_argmax():
    from engine.sampling import SamplerRow, sample

    big = torch.full((5,), 3e38)  # finite entries whose sum overflows to inf: still a fine row
    logits = torch.stack(
        [
            torch.tensor([0.0, 1.0, 2.0, 2.0, -1.0]),
            torch.tensor([0.0, float("nan"), 2.0, 1.0, 0.0]),
            torch.tensor([0.0, float("inf"), 2.0, 1.0, 0.0]),
            big,
        ]
    )
    rows = [SamplerRow(SamplingParams())] * 4
    tokens, errors = sample(logits, rows)
    assert errors[0] is None and errors[3] is None
    assert errors[1] is not None and errors[2] is not None
    assert tokens[0] == 2 and tokens[3] == 0  # first maximum, as torch.argmax
    lb = torch.randn(6, 1000).to(torch.bfloat16)
    got, _ = sample(lb, [SamplerRow(SamplingParams())] * 6)
    assert got == lb.float().argmax(-1).tolist()
