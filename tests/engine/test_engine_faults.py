"""Failure containment: a failure inside one request fails that request only; a failed forward fails its
step's requests; a broken loop is restarted by the async front. No KV block leaks in any case."""

from __future__ import annotations

import asyncio
import time

import pytest

import engine.step_outputs as step_outputs_mod
from engine.async_engine import AsyncLLMEngine
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=8)


def run(eng, prompts: dict[str, list[int]], params=PARAMS) -> dict[str, list]:
    """Run requests to completion; return each request's outputs."""
    for rid, p in prompts.items():
        eng.add_request(rid, p, params)
    outs: dict[str, list] = {rid: [] for rid in prompts}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            outs[o.request_id].append(o)
    assert not eng.has_unfinished()
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids_delta]


@pytest.fixture()
def eng(make_engine):
    return make_engine(num_blocks=64, max_num_seqs=8)


def assert_clean(eng) -> None:
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0, st
    assert not eng._states


def test_sampler_failure_fails_only_that_request(eng, prompts, hf_reference, monkeypatch):
    real = step_outputs_mod.sample

    def flaky(logits, rows):
        if any(r is eng._states["bad"].row for r in rows if "bad" in eng._states):
            raise RuntimeError("sampler exploded")
        return real(logits, rows)

    monkeypatch.setattr(step_outputs_mod, "sample", flaky)
    outs = run(eng, {"a": prompts[0], "bad": prompts[1], "b": prompts[2]})
    assert outs["bad"][-1].finish_reason == "error" and "sampler exploded" in outs["bad"][-1].error
    assert outs["bad"][-1].error_type == "internal"
    assert tokens(outs["a"]) == hf_reference(prompts[0], 8)
    assert tokens(outs["b"]) == hf_reference(prompts[2], 8)
    assert_clean(eng)
    monkeypatch.setattr(step_outputs_mod, "sample", real)
    assert tokens(run(eng, {"later": prompts[3]})["later"]) == hf_reference(prompts[3], 8)


def test_out_of_vocabulary_token_fails_only_that_request(eng, prompts, hf_reference, monkeypatch):
    real = step_outputs_mod.sample

    def bad_token(logits, rows):
        toks, errs = real(logits, rows)
        return [
            10**9 if "bad" in eng._states and r is eng._states["bad"].row else t
            for t, r in zip(toks, rows, strict=True)
        ], errs

    monkeypatch.setattr(step_outputs_mod, "sample", bad_token)
    outs = run(eng, {"a": prompts[0], "bad": prompts[1]})
    assert outs["bad"][-1].finish_reason == "error" and "outside the vocabulary" in outs["bad"][-1].error
    assert tokens(outs["a"]) == hf_reference(prompts[0], 8)
    assert_clean(eng)


def test_detokenizer_failure_fails_only_that_request(eng, prompts, hf_reference, monkeypatch):
    real = IncrementalDetokenizer.add

    def add(self, token_ids, finished):
        state = eng._states.get("bad")
        if state is not None and self is state.detok and len(self.ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "forged")
        return real(self, token_ids, finished)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    outs = run(eng, {"a": prompts[0], "bad": prompts[1], "b": prompts[2]})
    last = outs["bad"][-1]
    assert last.finished and last.finish_reason == "error" and "UnicodeDecodeError" in last.error
    assert len(tokens(outs["bad"])) == 2  # the tokens streamed before it failed
    assert tokens(outs["a"]) == hf_reference(prompts[0], 8)
    assert tokens(outs["b"]) == hf_reference(prompts[2], 8)
    assert_clean(eng)


def test_stop_string_check_failure_fails_only_that_request(eng, prompts, hf_reference):
    eng.add_request("a", prompts[0], PARAMS)
    eng.add_request("bad", prompts[1], SamplingParams(max_tokens=8, stop=("zz",)))
    eng._states["bad"].detok.stop = (None,)  # len(None) raises TypeError inside the stop check
    outs = {"a": [], "bad": []}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    assert outs["bad"][-1].finish_reason == "error" and "TypeError" in outs["bad"][-1].error
    assert tokens(outs["a"]) == hf_reference(prompts[0], 8)
    assert_clean(eng)


def test_bad_prompt_token_id_is_rejected_before_it_reaches_a_batch(eng, prompts, hf_reference):
    outs = run(eng, {"a": prompts[0], "bad": [1, 2, 10**7]})
    assert outs["bad"][-1].finish_reason == "error" and "outside the vocabulary" in outs["bad"][-1].error
    assert outs["bad"][-1].error_type == "invalid_request"
    assert tokens(outs["a"]) == hf_reference(prompts[0], 8)
    assert_clean(eng)


def test_failed_forward_fails_its_step_and_the_loop_goes_on(eng, prompts, hf_reference, monkeypatch):
    real = eng.runner.execute
    calls = {"n": 0}

    def once(sched):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step of both requests
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(sched)

    monkeypatch.setattr(eng.runner, "execute", once)
    outs = run(eng, {"a": prompts[5], "b": prompts[6]})
    for rid in ("a", "b"):
        assert outs[rid][-1].finish_reason == "error" and "model forward failed" in outs[rid][-1].error
    assert_clean(eng)
    # later requests work, and the prefix cache holds no block the failed step registered unwritten
    again = run(eng, {"a2": prompts[5], "b2": prompts[6], "c": prompts[7]})
    assert tokens(again["a2"]) == hf_reference(prompts[5], 8)
    assert tokens(again["b2"]) == hf_reference(prompts[6], 8)
    assert tokens(again["c"]) == hf_reference(prompts[7], 8)
    assert_clean(eng)


def test_failed_prefill_forgets_the_prefix_blocks_it_registered(make_engine, prompts, hf_reference, monkeypatch):
    eng = make_engine(num_blocks=64, block_size=4)
    real = eng.runner.execute
    calls = {"n": 0}

    def first_fails(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(sched)

    monkeypatch.setattr(eng.runner, "execute", first_fails)
    long_prompt = prompts[10]
    assert len(long_prompt) > 16
    outs = run(eng, {"x": long_prompt})
    assert outs["x"][-1].finish_reason == "error"
    assert not eng.kv.pool._cached, "a failed prefill left prefix-cache entries over unwritten K/V"
    assert tokens(run(eng, {"y": long_prompt})["y"]) == hf_reference(long_prompt, 8)
    assert_clean(eng)


# ------------------------------------------------------------------ the async front
async def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_crashed_loop_is_restarted_and_inflight_requests_fail_clearly(make_engine, prompts, hf_reference):
    inner = make_engine(num_blocks=64)
    aeng = AsyncLLMEngine(engine=inner, restart_backoff_s=0.3)
    try:
        real_step = inner.step
        state = {"crash": False}

        def step():
            if state["crash"]:
                state["crash"] = False
                raise RuntimeError("scheduler bookkeeping broke")
            return real_step()

        inner.step = step
        got = []

        async def consume():
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async for o in aeng.generate(prompts[5], params, request_id="inflight"):
                got.append(o)

        task = asyncio.create_task(consume())
        await wait_for(lambda: len(got) >= 2)
        state["crash"] = True
        await asyncio.wait_for(task, 20)
        assert got[-1].finished and got[-1].finish_reason == "error"
        assert "engine loop crashed" in got[-1].error and "scheduler bookkeeping broke" in got[-1].error
        await wait_for(lambda: not aeng.is_running(), 5)  # down during the backoff
        assert "scheduler bookkeeping broke" in aeng.down_reason()
        await wait_for(aeng.is_running)
        assert aeng.down_reason() is None and aeng.stats()["loop_restarts_total"] == 1
        outs = [o async for o in aeng.generate(prompts[0], SamplingParams(max_tokens=8))]
        assert [t for o in outs for t in o.token_ids_delta] == hf_reference(prompts[0], 8)
        await wait_for(lambda: aeng.stats()["kv_blocks_used"] == 0)
    finally:
        aeng.shutdown()


async def test_loop_gives_up_after_its_restarts(make_engine, prompts):
    inner = make_engine(num_blocks=64)
    aeng = AsyncLLMEngine(engine=inner, max_restarts=0)
    try:

        def step():
            raise RuntimeError("always broken")

        inner.step = step
        outs = [o async for o in aeng.generate(prompts[0], SamplingParams(max_tokens=4))]
        assert outs[-1].finish_reason == "error" and "always broken" in outs[-1].error
        await wait_for(lambda: "gave up" in (aeng.down_reason() or ""))
        assert not aeng.is_running()
        with pytest.raises(RuntimeError, match="always broken"):
            async for _ in aeng.generate(prompts[0], SamplingParams(max_tokens=4)):
                pass
        assert inner.stats()["kv_blocks_used"] == 0
    finally:
        aeng.shutdown()
