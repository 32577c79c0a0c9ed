"""The fused CPU kernels against the ATen ops they replace, and the fused forward against the ATen forward.

The kernels round once per output where ATen rounds per op, so 16-bit results agree to
bf16 precision, not bit for bit; the fp32 engine never uses them (checked here too).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.fused as fused_module
from engine.config import EngineConfig
from engine.fused import fused_kernels
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

fk = fused_kernels()
pytestmark = pytest.mark.skipif(fk is None, reason="no C++ compiler: fused kernels unavailable")

BF16 = torch.bfloat16
REPO = Path(__file__).resolve().parents[2]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 0.02) -> bool:
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= rel * b.abs().max())


def test_add_rms_norm_matches_residual_add_then_rms_norm():
    torch.manual_seed(0)
    h = torch.randn(5, 576, dtype=BF16)
    delta = torch.randn(5, 576, dtype=BF16)
    w = torch.rand(576, dtype=BF16) + 0.5
    ref_h = h + delta
    ref_x = F.rms_norm(ref_h, (576,), w, 1e-5)
    got_h, got_x = fk.add_rms_norm(h.clone(), delta, w, 1e-5)
    assert torch.equal(got_h, ref_h)  # the residual stream is one bf16 add, exactly as eager
    assert close(got_x, ref_x)
    _, x_only = fk.add_rms_norm(ref_h.clone(), None, w, 1e-5)
    assert torch.equal(x_only, got_x)


def test_rotary_kv_write_matches_eager_rotary_and_cache_write():
    torch.manual_seed(1)
    T, H, KV, D, blocks, bs = 4, 9, 3, 64, 6, 16
    qkv = torch.randn(T, (H + 2 * KV) * D, dtype=BF16)
    pos = torch.tensor([0, 17, 40, 95])
    slots = torch.tensor([3, 20, 51, 90])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(128).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    cache = torch.zeros(2, KV, blocks, bs, D, dtype=BF16)

    qk = qkv[:, : (H + KV) * D].view(T, H + KV, D).float()
    rot = torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), -1)
    ref = qk * cos[pos].float()[:, None] + rot * sin[pos].float()[:, None]
    v = qkv[:, (H + KV) * D :].view(T, KV, D).clone()

    got = qkv.clone()
    fk.rotary_kv_write(got, cos, sin, pos, cache, slots, H, KV, D)
    assert close(got[:, : (H + KV) * D].view(T, H + KV, D), ref)
    flat = cache.view(2, KV, blocks * bs, D)
    assert torch.equal(flat[0][:, slots].transpose(0, 1), got[:, H * D : (H + KV) * D].view(T, KV, D))
    assert torch.equal(flat[1][:, slots].transpose(0, 1), v)
    with pytest.raises(RuntimeError, match="slot out of the KV cache"):
        fk.rotary_kv_write(qkv.clone(), cos, sin, pos, cache, torch.tensor([0, 1, 2, 96]), H, KV, D)
    with pytest.raises(RuntimeError, match="position out of the rope table"):
        fk.rotary_kv_write(qkv.clone(), cos, sin, torch.tensor([0, 1, 2, 128]), cache, slots, H, KV, D)


def test_paged_decode_attention_matches_sdpa_over_gathered_blocks():
    torch.manual_seed(2)
    B, H, KV, D, bs, pool = 3, 9, 3, 64, 16, 20
    cache = torch.randn(2, KV, pool, bs, D, dtype=BF16)
    tables = torch.tensor([[7, 2, 11, 0], [5, 0, 0, 0], [19, 3, 8, 14]])
    lens = torch.tensor([40, 1, 64])
    qkv = torch.randn(B, (H + 2 * KV) * D, dtype=BF16)
    got = fk.paged_decode_attention(qkv, cache, tables, lens, H, D, D**-0.5)
    for b in range(B):
        n = int(lens[b])
        kv = cache[:, :, tables[b]].flatten(2, 3)[:, :, :n].float()  # [2, KV, n, D]
        q = qkv[b, : H * D].view(KV, H // KV, D).float()
        ref = F.scaled_dot_product_attention(q, kv[0], kv[1])  # [KV, G, D]
        assert close(got[b], ref.reshape(H, D)), b
    with pytest.raises(RuntimeError, match="context length"):
        fk.paged_decode_attention(qkv, cache, tables, torch.tensor([40, 1, 65]), H, D, D**-0.5)
    with pytest.raises(RuntimeError, match="block id out of the KV cache"):
        fk.paged_decode_attention(qkv, cache, tables + 10, lens, H, D, D**-0.5)


def test_paged_rows_of_a_prefill_chunk_match_causal_sdpa():
    # a chunk of 5 rows after 37 cached tokens: each row a decode over the chunk's table up to its own position
    torch.manual_seed(4)
    H, KV, D, bs, pool, start, n = 14, 2, 64, 16, 12, 37, 5
    cache = torch.randn(2, KV, pool, bs, D, dtype=BF16)
    blocks = torch.tensor([9, 4, 0])  # 42 tokens: three blocks
    qkv = torch.randn(n, (H + 2 * KV) * D, dtype=BF16)
    positions = torch.arange(start, start + n)
    got = fk.paged_decode_attention(qkv, cache, blocks.expand(n, 3).contiguous(), positions + 1, H, D, D**-0.5)
    kv = cache[:, :, blocks].flatten(2, 3).float()  # [2, KV, 48, D]
    q = qkv[:, : H * D].view(n, KV, H // KV, D).permute(1, 2, 0, 3).float()  # [KV, G, n, D]
    mask = torch.arange(48)[None, :] <= positions[:, None]  # causal, offset by the cached context
    ref = F.scaled_dot_product_attention(q, kv[0][:, None], kv[1][:, None], attn_mask=mask)  # [KV, G, n, D]
    assert close(got, ref.permute(2, 0, 1, 3).reshape(n, H, D))


def test_short_prefill_chunks_take_the_paged_rows_and_score_as_aten_does(bf16_pair, prompts):
    """A prompt continuing a cached one: its tail is a chunk of a few rows over cached blocks (the voice turn's
    case), attended by the paged kernel row by row; its tokens' log-probabilities match the ATen forward's."""
    fused, plain = bf16_pair
    calls = []

    class Counting:
        def __init__(self, kernels):
            self._kernels = kernels

        def __getattr__(self, name):
            if name == "paged_decode_attention":
                return lambda qkv, *a: calls.append(qkv.shape[0]) or self._kernels.paged_decode_attention(qkv, *a)
            return getattr(self._kernels, name)

    prefix = prompts[-1] + prompts[-2] + prompts[-3]
    tail = prompts[1][1:9]
    prompt = prefix + tail
    params = SamplingParams(max_tokens=1, prompt_logprobs_from=len(prefix), prompt_logprobs_to=len(prompt))
    scores = []
    for eng in (fused, plain):
        eng.generate([prefix], SamplingParams(max_tokens=1))  # cached, as the words heard so far are
        kernels = eng.model.fused
        eng.model.fused = Counting(kernels) if kernels is not None else None
        try:
            rid = eng.add_request(None, prompt, params)
            outputs = {}
            while eng.has_unfinished():
                for out in eng.step():
                    outputs[out.request_id] = out
            scores.append(torch.tensor(outputs[rid].prompt_logprobs))
        finally:
            eng.model.fused = kernels
    assert 1 < max(calls) <= 16, calls  # the tail's rows went through the kernel together (no decode is > 1 row)
    assert len(scores[0]) == len(tail) and (scores[0] - scores[1]).abs().max() < 0.2, scores


def test_silu_mul_matches_eager():
    gu = torch.randn(3, 2 * 1536, dtype=BF16)
    g, u = gu.chunk(2, dim=-1)
    assert close(fk.silu_mul(gu), F.silu(g) * u)


@pytest.mark.parametrize("dtype", [BF16, torch.half, torch.float32])
def test_argmax_rows_is_torch_argmax_first_maximum_and_nan_included(dtype):
    torch.manual_seed(5)
    rows = [torch.randn(151_936).to(dtype) for _ in range(3)] + [torch.randn(13).to(dtype)]  # 13: no full vector
    tie = torch.zeros(1003, dtype=dtype)
    tie[[17, 400, 1002]] = 5.0  # three equal maxima: the first
    late = torch.full((1003,), -1.0, dtype=dtype)
    late[1001] = 2.0  # the maximum in the tail past the last full vector
    nan = torch.randn(1003).to(dtype)
    nan[[700, 901]] = float("nan")  # a NaN wins, its first index (torch's rule)
    nan_tail = torch.randn(1003).to(dtype)
    nan_tail[1002] = float("nan")
    cases = rows + [tie, late, nan, nan_tail, torch.full((40,), float("-inf"), dtype=dtype)]
    inf = torch.randn(1003).to(dtype)
    inf[[9, 600]] = float("inf")
    cases.append(inf)
    for row in cases:
        x = row[None, :]
        assert fk.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist(), row[:8]
    batch = torch.randn(8, 4099).to(dtype)
    assert torch.equal(fk.argmax_rows(batch), torch.argmax(batch, dim=-1))


def test_the_sampler_takes_the_loaded_kernels_argmax(monkeypatch):
    from engine import sampling

    calls = []

    class Counting:
        def argmax_rows(self, x):
            calls.append(x.shape)
            return fk.argmax_rows(x)

    monkeypatch.setattr(sampling, "loaded_fused_kernels", lambda: Counting())
    logits = torch.randn(2, 5000).to(BF16)
    plain = sampling.SamplerRow(SamplingParams(max_tokens=4))
    biased = sampling.SamplerRow(SamplingParams(max_tokens=4, logit_bias={int(logits[1].argmax()): -100.0}))
    tokens, errors = sampling.sample(logits, [plain, biased])
    assert errors == [None, None]
    assert tokens[0] == int(torch.argmax(logits[0]))
    expected = logits[1].float().clone()
    expected[int(logits[1].argmax())] -= 100.0
    assert tokens[1] == int(torch.argmax(expected))
    assert calls == [(2, 5000), (1, 5000)]  # the raw rows, then the processed one


def _kernel_call(kernel: str):
    """A call of ``kernel`` on inputs that keep it busy a few milliseconds."""
    torch.manual_seed(3)
    if kernel == "add_rms_norm":
        h, w = torch.randn(256, 4096, dtype=BF16), torch.rand(4096, dtype=BF16) + 0.5
        return lambda: fk.add_rms_norm(h, None, w, 1e-5)
    if kernel == "silu_mul":
        gate_up = torch.randn(256, 2 * 4096, dtype=BF16)
        return lambda: fk.silu_mul(gate_up)
    if kernel == "paged_decode_attention":
        B, H, KV, D, bs, blocks = 8, 9, 3, 64, 16, 64
        cache = torch.randn(2, KV, B * blocks, bs, D, dtype=BF16)
        tables, lens = torch.arange(B * blocks).view(B, blocks), torch.full((B,), blocks * bs)
        qkv = torch.randn(B, (H + 2 * KV) * D, dtype=BF16)
        return lambda: fk.paged_decode_attention(qkv, cache, tables, lens, H, D, D**-0.5)
    if kernel == "rotary_kv_write":
        T, H, KV, D, blocks, bs = 512, 9, 3, 64, 64, 16
        qkv = torch.randn(T, (H + 2 * KV) * D, dtype=BF16)
        cos, sin = torch.randn(T, D, dtype=BF16), torch.randn(T, D, dtype=BF16)
        cache, positions = torch.zeros(2, KV, blocks, bs, D, dtype=BF16), torch.arange(T)
        return lambda: fk.rotary_kv_write(qkv, cos, sin, positions, cache, positions, H, KV, D)
    if not fk.has_int8_linear():
        pytest.skip("int8_linear needs AVX2 and FMA")
    x, w = torch.randn(64, 2048, dtype=BF16), torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    scale = torch.rand(2048, dtype=BF16)
    return lambda: fk.int8_linear(x, w, scale)


@pytest.mark.parametrize(
    "kernel", ["add_rms_norm", "silu_mul", "paged_decode_attention", "rotary_kv_write", "int8_linear"]
)
def test_a_kernel_lets_other_python_threads_run_while_it_computes(kernel):
    # The engine steps on its own thread beside the server's event loop: a kernel holding the GIL stalled the
    # loop (other users' audio, /healthz) for as long as its parallel region waited on busy cores.
    call = _kernel_call(kernel)
    call()
    started, main_ran, finished = threading.Event(), threading.Event(), threading.Event()

    def calls() -> None:  # until the main thread has run (it can only between two bytecodes, or in a kernel)
        started.set()
        kept = []  # (kept: freeing a large tensor may let the GIL go by itself)
        while not main_ran.is_set() and len(kept) < 100:
            kept.append(call())
        finished.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # the GIL changes hands only where its holder lets it go
    worker = threading.Thread(target=calls)
    try:
        worker.start()
        assert started.wait(30)
        ran_meanwhile = not finished.is_set()
        main_ran.set()
    finally:
        worker.join(60)
        sys.setswitchinterval(switch)
    assert ran_meanwhile


@pytest.fixture(scope="module")
def bf16_pair():
    fused = LLMEngine(EngineConfig(dtype="bfloat16", device="cpu"))
    plain = LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", fused_kernels=False))
    assert fused.model_info()["fused_kernels"] and not plain.model_info()["fused_kernels"]
    return fused, plain


def test_fused_forward_agrees_with_aten_forward_on_mixed_batches(bf16_pair, prompts):
    """Concurrent requests (decodes next to prefill chunks, prefix hits): greedy tokens mostly identical."""
    fused, plain = bf16_pair
    sel = prompts[:10]
    params = SamplingParams(max_tokens=8)
    a = fused.generate(sel, params)
    b = plain.generate(sel, params)
    same_start = sum(x[:4] == y[:4] for x, y in zip(a, b, strict=True))
    assert same_start >= 8, (a, b)


def test_fp32_engine_keeps_aten_ops(engine):
    assert engine.model.fused is None and not engine.model_info()["fused_kernels"]


def _load_in_a_new_process(cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    code = "from engine.fused import fused_kernels; import sys; sys.exit(0 if fused_kernels() is not None else 3)"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, timeout=timeout, capture_output=True, text=True)


def _build_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(fused_module.this_build_name(), verbose=False))


def test_each_kind_of_cpu_gets_its_own_build():
    """-march=native: a build from a CPU with AVX2 dies with SIGILL on one without (a shared ~/.cache)."""
    source = fused_module._SOURCE.read_bytes()
    here = fused_module.cpu_features()
    assert here == fused_module.cpu_features()
    if platform.machine() == "x86_64":
        assert "__SSE2__" in here  # what -march=native turns on was read
    without_avx2 = here.replace("#define __AVX2__ 1", "")
    with_avx2 = f"{without_avx2}\n#define __AVX2__ 1"
    assert fused_module.build_name(source, with_avx2) != fused_module.build_name(source, without_avx2)
    assert fused_module.build_name(source + b"//", here) != fused_module.build_name(source, here)


def test_each_environment_gets_its_own_build():
    """Two clones, each with its own venv: the torch paths in the build command differ, and one shared build
    folder was rebuilt (~40 s) at every start of the other one."""
    source, here = fused_module._SOURCE.read_bytes(), fused_module.cpu_features()
    assert fused_module.build_name(source, here, "/a/.venv/torch") != fused_module.build_name(source, here, "/b/torch")
    assert fused_module.this_build_name() == fused_module.build_name(source, here, fused_module.torch_root())


def test_a_build_lock_left_by_a_killed_build_does_not_block_the_next_start():
    """torch waits forever on its lock file; a start interrupted mid-build used to leave one behind."""
    lock = _build_dir() / "lock"
    lock.touch()  # as a build killed a moment ago leaves it
    try:
        done = _load_in_a_new_process(REPO, timeout=600)  # waited forever before
        assert done.returncode == 0, done.stderr[-2000:]
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)


def test_every_checkout_builds_from_one_source_path_so_a_new_clone_reuses_the_build(tmp_path):
    """ninja rebuilds when the command changes, and the command names the source path."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "engine", clone / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    done = _load_in_a_new_process(clone)
    assert done.returncode == 0, done.stderr[-2000:]
    ninja = (_build_dir() / "build.ninja").read_text()
    assert str(_build_dir() / "src" / "fused_cpu.cpp") in ninja
    assert str(clone) not in ninja and str(REPO / "engine") not in ninja


int8_dot = pytest.mark.skipif(fk is None or not fk.has_int8_linear(), reason="int8_linear needs AVX2")


@int8_dot
@pytest.mark.parametrize("dtype", [BF16, torch.half, torch.float32])
def test_int8_linear_matches_the_dequantized_product(dtype):
    from engine.quant import quantize_per_channel

    torch.manual_seed(0)
    for out_features, in_features in ((960, 576), (7, 96)):  # (7, 96): fewer outputs than a thread's share, odd blocks
        q, scale = quantize_per_channel(torch.randn(out_features, in_features) * 0.05)
        scale = scale.to(dtype)
        for rows in (*range(1, 10), 13, 38):  # every remainder of the 4-row blocking, below and in 2-row tiles
            x = torch.randn(rows, in_features).to(dtype)
            exact = x.float() @ (q.float() * scale.float()[:, None]).T
            got = fk.int8_linear(x, q, scale)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            # the activations are int8 per block of 32: ~0.5% of the output's scale, as bf16 rounding
            assert close(got, exact, rel=0.015), (out_features, in_features, rows)
            assert F.cosine_similarity(got.float().flatten(), exact.flatten(), dim=0) > 0.9999
    with pytest.raises(RuntimeError, match="multiple of 32"):
        fk.int8_linear(torch.randn(1, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))


@pytest.mark.skipif(fk is None, reason="the fused CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_a_prefill_dequantizes_into_one_kept_buffer_the_values_aten_gives(dtype):
    """A prefill's dense product takes the int8 weight dequantized into the thread's buffer (``DenseWeight``): the
    same values as ``q.to(dtype) * scale``, the same buffer call after call, and the product unchanged."""
    from engine.quant import Int8PackLinear, quantize_per_channel

    torch.manual_seed(0)
    quantized = quantize_per_channel(torch.randn(96, 64) * 0.05)
    linear = Int8PackLinear(None, torch.randn(96).to(dtype), dtype, quantized=quantized)
    linear.use_fused_kernels(fk)
    linear.max_rows = 4  # (so that 8 rows take the dense product on any CPU)
    assert linear.dequantize is not None
    w = linear.dequantize.weight(linear.dense_dtype)
    assert torch.equal(w, linear.qweight.to(linear.dense_dtype) * linear.scale_col)
    other = Int8PackLinear(torch.randn(32, 64), None, dtype)
    other.use_fused_kernels(fk)
    assert other.dequantize.weight(linear.dense_dtype).data_ptr() == w.data_ptr()  # one buffer, overwritten
    x = torch.randn(8, 64).to(dtype)
    reference = Int8PackLinear(None, linear.bias, dtype, quantized=quantized)
    reference.max_rows = 4
    assert torch.equal(linear(x), reference(x))  # (ATen's dequantization: no fused kernels)


@int8_dot
def test_int8_linear_keeps_a_non_finite_input_non_finite():
    """A NaN must reach the logits (the sampler refuses non-finite ones), not become a plausible number."""
    q = torch.ones(4, 64, dtype=torch.int8)
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = 1e-40  # a subnormal beside ones: an ordinary block
    y = fk.int8_linear(x, q, torch.ones(4))
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()
    assert fk.int8_linear(torch.full((1, 32), 1e-41), q[:, :32].contiguous(), torch.ones(4)).abs().max() < 1e-30


# How far the kernel's perplexity of STORY may move from int8pack's: the spread of the measurement, not a
# number one CPU met (see the test's docstring for the figures).
INT8_DOT_PERPLEXITY_BOUND = 0.03
COARSE_LEVELS = 7  # the negative control: activations on +-7 levels per block of 32 (int4), a step 18x the kernel's


@int8_dot
def test_int8_dot_kernel_keeps_perplexity_and_greedy_answers(prompts, monkeypatch):
    """The kernel quantizes activations: against the same engine on int8pack, perplexity and greedy answers.

    Why 3%: per block of 32 the kernel rounds each activation to amax / 127 steps, an error of at most
    0.4% of the block's largest value (RMS ~0.23%), once per linear. What that costs the perplexity of
    STORY (94 tokens) depends less on the method than on which way each value happens to round, and that
    changes with the CPU's bf16 arithmetic upstream (and int8pack's own path for the reference). Measured
    on an AVX2 EPYC: 0.995; a 2-core Xeon with AVX-512 VNNI: 1.012 (it failed the former bound of 1%).
    The same run with every activation nudged by half a bf16 ulp (24 seeds, standing for other CPUs'
    arithmetic): mean 1.004, sd 0.008, max 1.021 (1.023 against int8pack nudged alike). So the method
    costs ~0.5% and one 94-token measurement scatters ~1% around that: 3% is about three standard
    deviations above the mean. (A 512-token text narrows the scatter to ~0.4% at five times the
    perplexity time.)

    The negative control is the same measurement through the same kernel with the activations first
    rounded to +-7 levels per block (an int4 step, 18x the kernel's; an error as gross as a wrong block
    scale): 2.08 here, 1.64-2.62 over the nudged seeds, so the bound catches it on any CPU. Rounding
    only 4x coarser (+-31 levels) measures 1.05 +- 0.03: this text cannot tell that from the kernel's
    own error, and the bound does not claim to.
    """
    from engine_prompts import STORY

    dot = LLMEngine(EngineConfig(dtype="bfloat16", quantization="int8", device="cpu"))
    pack = LLMEngine(EngineConfig(dtype="bfloat16", quantization="int8", device="cpu"))
    linears = [pack.model.lm_head_linear] + [
        getattr(layer, name) for layer in pack.model.layers for name in ("qkv", "o", "gate_up", "down")
    ]
    assert all(linear.dot is not None for linear in linears)
    for linear in linears:
        linear.dot = None  # the same fused engine, its int8 linears on int8pack
    calls = []
    product = type(dot.model.layers[0].qkv.dot).product
    monkeypatch.setattr(
        type(dot.model.layers[0].qkv.dot), "product", lambda self, x: calls.append(1) or product(self, x)
    )

    ids = dot.tokenizer(STORY)["input_ids"]
    reference = pack.perplexity(ids)
    with monkeypatch.context() as every_row:  # every row of the prompt through the kernel (one step, any CPU)
        for layer in dot.model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                every_row.setattr(getattr(layer, name), "max_rows", 1 << 20)
        ratio = dot.perplexity(ids) / reference
        assert abs(ratio - 1) < INT8_DOT_PERPLEXITY_BOUND, ratio
        assert len(calls) >= 4 * len(dot.model.layers)

        def coarsely(self, x):  # the same kernel, its input already rounded to COARSE_LEVELS per block of 32
            blocks = x.float().view(x.shape[0], -1, 32)
            step = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / COARSE_LEVELS
            return product(self, (torch.round(blocks / step) * step).view(x.shape).to(x.dtype))

        every_row.setattr(type(dot.model.layers[0].qkv.dot), "product", coarsely)
        coarse = dot.perplexity(ids) / reference
        assert coarse > 1 + INT8_DOT_PERPLEXITY_BOUND, f"the bound would miss a far coarser rounding: {coarse}"
    params = SamplingParams(max_tokens=8)
    sel = prompts[:10]
    calls.clear()
    a, b = dot.generate(sel, params), pack.generate(sel, params)
    assert calls, "decode never reached the kernel"
    # as the int8 engine against bf16 (test_engine_quant): 7-8 of 10 measured, int8pack vs bf16 alike
    assert sum(x[:4] == y[:4] for x, y in zip(a, b, strict=True)) >= 6, (a, b)
