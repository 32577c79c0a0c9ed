"""The GPU's INT8 schemes checked on the CPU: the weight-only Triton kernel (in Triton's interpreter), W8A8's
per-token quantization and ``torch._int_mm`` product, both through the whole engine and its CUDA-graph decode
path (``eager_capture``), and the choice ``quantization="auto"`` makes on CUDA from the doctor's figures.
Only speed needs a GPU (``parley doctor --gpu``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import engine.int8_choice as int8_choice
import engine.quant as quant
from engine.config import EngineConfig, resolve_quantization
from engine.int8_choice import Int8Choice, choose, load_record, record_path, save_record
from engine.quant import get_quant_method, int8_linear_class, quantize_per_channel

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the test extra installs Triton")
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="the test extra installs torchao"
)


def reference(x, q, scale, bias=None):
    y = x.double() @ (q.double() * scale.double()[:, None]).T
    return y + bias.double() if bias is not None else y


@needs_triton
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "with_bias"),
    [
        (1, 96, 128, torch.bfloat16, False),  # a decode row
        (5, 100, 72, torch.float16, True),  # N and K not multiples of the tiles: masked edges
        (40, 64, 96, torch.float32, True),  # several row tiles
    ],
)
def test_weight_only_kernel_matches_the_dequantized_product(m, n, k, dtype, with_bias):
    from engine.triton_int8 import w8a16_linear

    g = torch.Generator().manual_seed(m * 1000 + n)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = w8a16_linear(x, q, scale, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = reference(x, q, scale, bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # the output's own rounding
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (y, ref)
    with pytest.raises(ValueError, match="does not fit"):
        w8a16_linear(x[:, :-1], q, scale)


@needs_triton
def test_weight_only_kernel_split_over_k_adds_its_slices():
    """Decode-sized products on a GPU split K into slices (more programs streaming weights); the slices' float32
    partial sums are added, then scaled: the same product. K of 1100 in slices of 512: the last one partial."""
    from engine.triton_int8 import w8a16_linear

    g = torch.Generator().manual_seed(9)
    q, scale = quantize_per_channel(torch.randn(40, 1100, generator=g))
    x, bias = torch.randn(3, 1100, generator=g).half(), torch.randn(40, generator=g).half()
    ref = reference(x, q, scale, bias)
    for split in (1, 3):
        y = w8a16_linear(x, q, scale, bias, split=split)
        assert y.dtype == torch.float16 and (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max(), split


def test_split_k_only_for_decode_sized_products_that_leave_sms_idle():
    from engine.triton_int8 import split_k

    assert split_k(1, 4096, 14336, 132) == 4  # an 8B down projection: 64 tiles of 64 on 132 SMs
    assert split_k(1, 28672, 4096, 132) == 1  # the 8B gate/up: 448 tiles already
    assert split_k(8, 2048, 8192, 132) == 8  # a 1B down projection: 32 tiles, 256 programs
    assert split_k(32, 4096, 14336, 132) == 1  # prefill-sized: enough tiles over rows
    assert split_k(1, 4096, 14336, None) == 1  # no SM count (the interpreter)
    assert split_k(1, 64, 1024, 132) == 2  # a slice is never shorter than 512


@pytest.mark.parametrize("where", ["torch", pytest.param("triton", marks=needs_triton)])
def test_per_token_quantization_round_trips_within_half_a_step(where):
    if where == "triton":  # W8A8's kernel, one row per program
        from engine.triton_int8 import quantize_rows
    else:  # the reference math
        from engine.int8_rows import quantize_rows

    x = (
        torch.randn(6, 1100, generator=torch.Generator().manual_seed(6))
        * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    )
    x[3] = 0.0  # an all-zero row: no division by zero
    q, scale = quantize_rows(x.bfloat16())
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert q.abs().max() == 127 and q[3].abs().max() == 0
    err = (q.float() * scale[:, None] - x.bfloat16().float()).abs()
    # half a step, up to float32 rounding of x / scale (relative: a row of scale ~1 errs by ~1e-5 absolute)
    assert (err <= scale[:, None] / 2 * (1 + 1e-4)).all()
    if where == "triton":
        from engine.int8_rows import quantize_rows as reference_rows

        ref_q, ref_scale = reference_rows(x.bfloat16())
        assert torch.allclose(scale, ref_scale) and (q.int() - ref_q.int()).abs().max() <= 1  # (halves: away from 0)


@needs_triton
def test_w8a8_epilogue_scales_rows_and_channels_in_one_pass():
    from engine.triton_int8 import scale_int32

    g = torch.Generator().manual_seed(4)
    acc = torch.randint(-(2**20), 2**20, (37, 200), generator=g, dtype=torch.int32)  # a K of thousands of int8s
    acc[0, 0] = 2**31 - 1  # the largest int32 a product may reach
    xs, ws = torch.rand(37, generator=g) / 2**10, torch.rand(200, generator=g) / 2**10  # scales: absmax / 127
    bias = torch.randn(200, generator=g).half()
    y = scale_int32(acc, xs, ws, bias, torch.float16)
    ref = acc.double() * xs.double()[:, None] * ws.double()[None, :] + bias.double()
    assert y.dtype == torch.float16 and ((y.double() - ref).abs() <= 1e-3 * ref.abs() + 1e-2).all()
    assert torch.equal(scale_int32(acc, xs, ws, None, torch.float32), (acc.float() * xs[:, None]) * ws[None, :])


@needs_triton
def test_w8a8_takes_the_int8_tensor_core_product_from_17_rows():
    from engine.int8_gpu import W8A8_MIN_ROWS, Int8DynamicLinear, Int8WeightOnlyLinear

    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(64, 96, generator=g), torch.randn(64, generator=g).bfloat16()
    lin = Int8DynamicLinear(w, bias, torch.bfloat16)
    only = Int8WeightOnlyLinear(None, bias, torch.bfloat16, quantized=(lin.qweight, lin.scale))
    calls = []
    real = torch._int_mm
    for m in (1, W8A8_MIN_ROWS - 1, W8A8_MIN_ROWS, 48):
        x = torch.randn(m, 96, generator=g).bfloat16()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
            y = lin(x)
        ref = reference(x, lin.qweight, lin.scale, bias)
        # per-token int8 activations: about 1 % of the row's size (a broken scale is off by far more)
        assert (y.double() - ref).abs().max() <= 0.03 * ref.abs().max(), m
        if m < W8A8_MIN_ROWS:
            assert torch.equal(y, only(x))  # decode-sized: the weight-only kernel, exactly
    assert calls == [W8A8_MIN_ROWS, 48]
    odd = Int8DynamicLinear(torch.randn(60, 96, generator=g), None, torch.bfloat16)
    assert not odd.int_mm  # cuBLASLt's int8 GEMM wants multiples of 8: this layer stays weight-only
    x = torch.randn(32, 96, generator=g).bfloat16()
    assert torch.equal(odd(x), odd.weight_only(x))
    assert lin.nbytes() == 64 * 96 + 64 * 4 + 64 * 2  # int8 rows, float32 scales, the bf16 bias


@needs_triton
def test_the_gpu_schemes_as_int8_methods(monkeypatch):
    from engine.int8_gpu import Int8DynamicLinear, Int8WeightOnlyLinear

    assert int8_linear_class("weight_only", "cpu") is Int8WeightOnlyLinear  # the interpreter: tests only
    assert int8_linear_class("w8a8", "cpu") is Int8DynamicLinear
    method = get_quant_method("int8", "cpu", "w8a8")
    assert method.per_channel_int8 and method.quantize_embedding and not method.quantize_vocab
    assert get_quant_method("int8", "cpu", "auto").per_channel_int8  # int8pack's rows, as before
    with pytest.raises(ValueError, match="int8_method must be one of"):
        EngineConfig(quantization="int8", int8_method="fp8")
    # on CUDA, auto follows the card's figures, else W8A8 where Triton compiles
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: Int8Choice("int8", "weight_only", "measured"))
    monkeypatch.setattr("engine.int8_gpu.triton_runs_on", lambda dev: True)
    assert int8_linear_class("auto", "cuda") is Int8WeightOnlyLinear
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: Int8Choice(None, "auto", "no figures"))
    assert int8_linear_class("auto", "cuda") is Int8DynamicLinear
    monkeypatch.setattr("engine.int8_gpu.triton_runs_on", lambda dev: False)
    monkeypatch.setattr(quant, "_bitsandbytes_importable", lambda: True)
    assert int8_linear_class("auto", "cuda") is quant.BnbLinear
    with pytest.raises(ValueError, match="needs Triton on CUDA"):
        int8_linear_class("w8a8", "cuda")


@needs_torchao
@pytest.mark.parametrize("method", ["torchao_weight_only", "torchao_w8a8"])
def test_torchaos_schemes_are_the_comparison(method):
    from engine.int8_gpu import TorchaoLinear

    cls = int8_linear_class(method, "cpu")
    assert issubclass(cls, TorchaoLinear) and not get_quant_method("int8", "cpu", method).per_channel_int8
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    lin = cls(w.bfloat16(), bias.bfloat16(), torch.bfloat16)
    x = torch.randn(20, 96, generator=g).bfloat16()
    ref = x.double() @ w.double().T + bias.double()
    assert (lin(x).double() - ref).abs().max() <= 0.03 * ref.abs().max()
    assert 64 * 96 <= lin.nbytes() < 64 * 96 * 2  # int8 and its scales, not a 16-bit copy


# --- the choice on CUDA -------------------------------------------------------------------------------------

BF16 = {"1": 500.0, "8": 3000.0, "32": 9000.0}


def record(**schemes) -> dict:
    speeds = {"1b": {"bf16": BF16, **{s: dict(zip(BF16, r, strict=True)) for s, (r, _) in schemes.items()}}}
    return {"measured": "2026-12-07", "speeds": speeds, "perplexity": {s: p for s, (_, p) in schemes.items()}}


def test_auto_on_cuda_takes_int8_only_where_the_cards_figures_show_it_wins():
    card = "NVIDIA H200"
    none = choose(None, card)
    assert none.quantization is None and "no INT8 figures for NVIDIA H200" in none.why
    won = choose(
        record(
            bitsandbytes=((40.0, 250.0, 900.0), 1.003),
            weight_only=((800.0, 3100.0, 9000.0), 1.004),
            w8a8=((750.0, 3600.0, 12000.0), 1.006),
        ),
        card,
    )
    assert (won.quantization, won.int8_method) == ("int8", "w8a8")  # the best geometric mean of its ratios
    assert "1b batch 1 1.50x" in won.why and "2026-12-07" in won.why
    slower = choose(record(weight_only=((800.0, 3100.0, 8000.0), 1.004)), card)  # slower at batch 32
    assert slower.quantization is None and "weight_only, 1b batch 32 0.89x" in slower.why
    worse = choose(record(w8a8=((750.0, 3600.0, 12000.0), 1.05)), card)  # faster, but its perplexity is off
    assert worse.quantization is None and "perplexity" in worse.why
    partial = choose({"speeds": {"1b": {"bf16": BF16, "w8a8": {"1": 900.0}}}, "perplexity": {"w8a8": 1.0}}, card)
    assert partial.quantization is None and "incomplete" in partial.why


def test_the_doctors_record_is_kept_per_card(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path))
    assert load_record("NVIDIA H100 80GB HBM3") is None
    path = save_record("NVIDIA H100 80GB HBM3", {"1b": {"bf16": BF16}}, {"w8a8": 1.004}, {"torch": "2.13"})
    assert path == record_path("NVIDIA H100 80GB HBM3") == tmp_path / "gpu" / "nvidia-h100-80gb-hbm3.json"
    assert load_record("NVIDIA H100 80GB HBM3")["perplexity"] == {"w8a8": 1.004}
    path.write_text("{not json")
    assert load_record("NVIDIA H100 80GB HBM3") is None  # a damaged record is ignored (with a warning): bf16


def test_resolve_quantization_on_cuda_follows_the_choice(monkeypatch):
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: Int8Choice("int8", "w8a8", "measured"))
    assert resolve_quantization("auto", "cuda") == "int8"
    monkeypatch.setattr(int8_choice, "cuda_choice", lambda: Int8Choice(None, "auto", "no figures"))
    assert resolve_quantization("auto", "cuda:0") is None
    assert resolve_quantization("auto", "cpu") == "int8"
    assert resolve_quantization("int8", "cuda") == "int8"


def test_cuda_choice_reads_this_cards_record_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    int8_choice.cuda_choice.cache_clear()
    try:
        with caplog.at_level("INFO", logger="engine.int8_choice"):
            assert int8_choice.cuda_choice().quantization is None
        assert "llm_quantization=auto on CUDA: bf16: no INT8 figures for NVIDIA H200" in caplog.text
        speeds = record(w8a8=((750.0, 3600.0, 12000.0), 1.006))
        save_record("NVIDIA H200", speeds["speeds"], speeds["perplexity"], {})
        int8_choice.cuda_choice.cache_clear()
        assert int8_choice.cuda_choice() == Int8Choice("int8", "w8a8", int8_choice.cuda_choice().why)
    finally:
        int8_choice.cuda_choice.cache_clear()


# --- through the whole engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    from engine.doctor_measure import build_model

    return build_model(tmp_path_factory.mktemp("int8gpu"), "tiny")  # untied: the embedding becomes int8 rows


@needs_triton
@pytest.mark.models
@pytest.mark.parametrize("method", ["weight_only", "w8a8", "torchao_w8a8", "torchao_weight_only"])
def test_gpu_schemes_through_the_engine_and_its_graph_path(tiny_untied, method):
    if method.startswith("torchao") and importlib.util.find_spec("torchao") is None:
        pytest.skip("the test extra installs torchao")
    from engine.cuda import eager_capture
    from engine.llm_engine import LLMEngine
    from engine.quant import Int8Embedding
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (8, 20, 5)]
    fp32 = LLMEngine(EngineConfig(model=str(tiny_untied), dtype="float32", device="cpu", num_blocks=32))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    text = fp32.generate(prompts, params)
    ids = [t for p, out in zip(prompts, text, strict=True) for t in p + out]
    config = EngineConfig(
        model=str(tiny_untied), dtype="bfloat16", quantization="int8", int8_method=method, device="cpu", num_blocks=32
    )
    eng = LLMEngine(config)
    model = eng.model
    cls = int8_linear_class(method, "cpu")
    assert all(isinstance(lin, cls) for lin in (model.layers[0].qkv, model.layers[-1].down))
    assert isinstance(model.vocab, Int8Embedding) and model.lm_head is not None  # int8 lookups, 16-bit lm_head
    assert model.graph_safe()
    # a prefill of 20 rows takes W8A8's product; perplexity of fp32's own greedy text within int8's bound
    assert eng.perplexity(ids) / fp32.perplexity(ids) <= 1.02
    eager = eng.generate(prompts, params)
    eng.runner.enable_graphs(capture=eager_capture)  # the decode graphs' static, padded buffers
    graphed = eng.generate(prompts, params)
    if not method.startswith("torchao"):
        # ours are row for row the same whatever else is in the batch; torchao's W8A8 on the CPU is not (a
        # request's tokens changed with the batch beside it, with and without graphs): its figures only compare
        assert graphed == eager
    assert eng.runner.graphs.replays > 0
    assert eng.stats()["kv_blocks_used"] == 0


def test_greedy_agreement_and_the_bars():
    from engine.doctor_int8 import bars, greedy_agreement, table

    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == pytest.approx((0.5 + 1.0) / 2)
    speeds = {
        "8b": {"bf16": {"1": 100.0, "32": 1000.0}, "w8a8": {"1": 150.0, "32": 990.0}},
        "1b": {"bf16": {"8": 500.0, "32": 900.0}, "w8a8": {"8": 520.0, "32": 950.0}},
    }
    memory = {"8b": {"bf16": 16e9, "w8a8": 8.6e9}}
    quality = {"w8a8": {"perplexity_ratio": 1.004, "greedy_agreement": 0.9}}
    (line,) = bars(speeds, memory, quality)
    assert line.startswith("w8a8: misses the bars") and "8b batch 32 0.99x (>= 1.0)" in line  # one bar missed
    assert "8b batch 1 1.50x (>= 1.4)" in line and "8b weights 0.54x" in line
    rows = table(speeds, memory, quality)
    assert "| 8b | w8a8 | 150 (1.50x) | - | 990 (0.99x) | 8.01 GiB (0.54x) | 1.0040 | 0.90 |" in rows


@needs_triton
@pytest.mark.models
def test_the_doctors_int8_section_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """``parley doctor --gpu``'s INT8 comparison, on a tiny shape with the kernels interpreted: every scheme
    loads, decodes at batch 1, 8 and 32, is scored against fp32, and the card's record is kept and read."""
    import argparse

    from engine.doctor_int8 import run_section
    from engine.doctor_measure import Report, build_model
    from engine.model import LlamaModel
    from engine.model_runner import perplexity

    monkeypatch.setenv("PARLEY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    path = build_model(tmp_path, "tiny")
    ids = torch.randint(1, 512, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    fp32_ppl = perplexity(LlamaModel(path, torch.float32, "cpu"), ids)
    # ours (torchao's go through the same code: the engine test above runs them)
    args = argparse.Namespace(
        int8_sizes=["tiny"], int8_schemes=["weight_only", "w8a8"], new_tokens=4, max_ppl_ratio=1.03
    )
    env = {"bitsandbytes_version": None, "torch_version": torch.__version__}
    out = run_section(Report(), tmp_path, args, env, (path, ids), fp32_ppl, device="cpu")
    speeds, memory = out["speeds"]["tiny"], out["weight_bytes"]["tiny"]
    assert set(speeds) == {"bf16", "weight_only", "w8a8"}
    assert all(set(by_batch) == {"1", "8", "32"} and min(by_batch.values()) > 0 for by_batch in speeds.values())
    assert memory["w8a8"] == memory["weight_only"] < 0.75 * memory["bf16"]
    for scheme in ("weight_only", "w8a8"):
        assert out["quality"][scheme]["perplexity_ratio"] == pytest.approx(1.0, abs=0.03)
        assert 0.0 <= out["quality"][scheme]["greedy_agreement"] <= 1.0
    assert load_record("Test GPU")["speeds"]["tiny"]["w8a8"] == speeds["w8a8"]
    assert not (tmp_path / "cache" / "quantized").exists()  # a random checkpoint's int8 matrices are not kept
    assert "Test GPU" in out["choice"]["why"]
