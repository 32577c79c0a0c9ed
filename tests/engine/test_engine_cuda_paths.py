"""The CUDA path's CPU-checkable parts: bucket choice, KV sizing from GPU memory (faked), and the padded
static-buffer decode path of the CUDA graph runner through the whole engine (``eager_capture`` stands in
for ``torch.cuda.graph``, which only a GPU can run: ``parley doctor --gpu`` checks that part)."""

from __future__ import annotations

import pytest
import torch

import engine.cuda as cuda
from engine.config import EngineConfig
from engine.cuda import batch_buckets, context_bucket, eager_capture, kv_cache_bytes_for_gpu, pick_bucket
from engine.sampling import SamplingParams

GIB = 2**30


def test_batch_buckets_and_pick():
    assert batch_buckets(1) == [1]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = batch_buckets(32)
    picked = [pick_bucket(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 25, 32, 33)]
    assert picked == [1, 2, 4, 8, 8, 16, 24, 32, 32, None]


def test_context_bucket():
    assert [context_bucket(n, 512) for n in (1, 2, 3, 5, 64, 65, 300, 512)] == [1, 2, 4, 8, 64, 128, 512, 512]
    assert context_bucket(7, 6) == 7  # never fewer than the blocks needed


def test_kv_sizing_arithmetic():
    # 80 GiB GPU, 10 GiB used (weights, other processes), 2 GiB of activations, 0.25 GiB reserve
    kv = kv_cache_bytes_for_gpu(80 * GIB, 70 * GIB, 0.9, 2 * GIB, reserve_bytes=GIB // 4)
    assert kv == int(0.9 * 80 * GIB) - 10 * GIB - 2 * GIB - GIB // 4
    assert kv_cache_bytes_for_gpu(80 * GIB, 70 * GIB, 0.9, 2 * GIB, max_useful_bytes=GIB) == GIB
    with pytest.raises(ValueError, match="leaves no room for the KV cache: 20.0 GiB already in use"):
        kv_cache_bytes_for_gpu(24 * GIB, 4 * GIB, 0.8, GIB)


def test_kv_pool_from_faked_gpu_memory(fp32_model, monkeypatch):
    """gpu_kv_cache_bytes as the runner calls it on CUDA, with torch.cuda.mem_get_info and the profile faked."""
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: calls.append(dev) or (30 * GIB, 40 * GIB))
    monkeypatch.setattr(cuda, "profile_activation_bytes", lambda model, n, bs: n * 1024 * 1024)
    config = EngineConfig(dtype="float32", device="cpu", gpu_memory_fraction=0.5, max_num_batched_tokens=512)
    per_block = 1 << 20
    kv = cuda.gpu_kv_cache_bytes(fp32_model, config, per_block, max_model_len=8192)
    budget = int(0.5 * 40 * GIB) - 10 * GIB - 512 * 2**20 - cuda.GRAPH_RESERVE_BYTES
    useful = 2 * config.max_num_seqs * (8192 // 16) * per_block
    assert kv == min(budget, useful) and calls
    with pytest.raises(ValueError):
        EngineConfig(gpu_memory_fraction=0)
    with pytest.raises(ValueError):
        EngineConfig(gpu_memory_fraction=1.5)


@pytest.fixture()
def graph_engine(make_engine):
    eng = make_engine(num_blocks=128, max_num_seqs=8)
    eng.runner.enable_graphs(capture=eager_capture)
    return eng


def test_graph_decode_path_is_token_exact(graph_engine, prompts, hf_reference):
    eng = graph_engine
    assert eng.runner.scratch_block == eng.kv.num_blocks == 128  # the scratch block is never handed out
    assert eng.runner.kv_cache.shape[3] == 129
    for n in (1, 3, 5):  # batch buckets 1, 4 and 8: padded rows
        sel = prompts[:n]
        got = eng.generate(sel, SamplingParams(max_tokens=20))
        assert got == [hf_reference(p, 20) for p in sel], n
    g = eng.runner.graphs
    assert g.replays > 0 and {b for b, _ in g.graphs} == {1, 4, 8}
    assert len({nb for _, nb in g.graphs}) > 1  # the context grew across block buckets
    assert eng.stats()["kv_blocks_used"] == 0
    assert "CUDA graphs on" in eng.describe()


def test_mixed_steps_run_eagerly_and_capture_failure_falls_back(graph_engine, prompts, hf_reference):
    eng = graph_engine

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    eng.runner.graphs.capture = broken
    got = eng.generate(prompts[:2], SamplingParams(max_tokens=8))
    assert got == [hf_reference(p, 8) for p in prompts[:2]]
    g = eng.runner.graphs
    assert not g.graphs and g.failed and g.eager_steps > 0


def test_graph_runner_skips_prefills_and_oversized_batches(graph_engine):
    from engine.scheduler import ScheduledChunk

    g = graph_engine.runner.graphs
    decode = ScheduledChunk("a", [5], 20, [0, 1], sample=True)
    prefill = ScheduledChunk("b", [1, 2, 3], 0, [2], sample=True)
    assert g.key([decode]) == (1, 2)
    assert g.key([decode, prefill]) is None
    assert g.key([decode] * 9) is None  # above max_num_seqs = 8
    assert g.key([ScheduledChunk("c", [5], 3, [0], sample=False)]) is None


def test_cpu_runner_has_no_graphs_and_says_so(engine):
    assert engine.runner.graphs is None
    assert "CUDA graphs off (CPU)" in engine.describe()
    assert engine.model_info()["cuda_graphs"] == "off (CPU)"


def test_a_step_s_token_budget_follows_the_device_unless_set(monkeypatch):
    """128 tokens a step on a CPU that emulates bfloat16 (prompts in chunks the int8 kernel takes), 256 on one that
    computes it (the dense bfloat16 product over 32 rows; ``EngineConfig.step_tokens``), 512 on CUDA; a value given
    wins on each; the scheduler takes the resolved one."""
    import engine.config
    from engine.config import CPU_BF16_STEP_TOKENS, CPU_STEP_TOKENS, CUDA_STEP_TOKENS

    monkeypatch.setattr(engine.config, "cpu_computes_bf16", lambda: False)
    assert EngineConfig(device="cpu").step_tokens() == CPU_STEP_TOKENS == 128
    monkeypatch.setattr(engine.config, "cpu_computes_bf16", lambda: True)
    assert EngineConfig(device="cpu").step_tokens() == CPU_BF16_STEP_TOKENS == 256
    assert EngineConfig(device="cuda").step_tokens() == CUDA_STEP_TOKENS == 512
    assert EngineConfig(device="cpu", max_num_batched_tokens=40).step_tokens() == 40
    assert EngineConfig(device="cuda", max_num_batched_tokens=40).step_tokens() == 40
    with pytest.raises(ValueError, match="must be positive"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_engine_schedules_with_the_resolved_budget(engine):
    assert engine.scheduler.max_num_batched_tokens == engine.config.step_tokens()
