"""The async front: streaming, abort, consumer cancellation, stats, and a non-blocking event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def aengine(make_engine):
    eng = AsyncLLMEngine(engine=make_engine())
    yield eng
    eng.shutdown()


async def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_stream_matches_sync_greedy(aengine, engine, prompts, hf_reference):
    ref = hf_reference(prompts[0], 16)
    outs = [o async for o in aengine.generate(prompts[0], SamplingParams(max_tokens=16), request_id="s1")]
    assert [t for o in outs for t in o.token_ids_delta] == ref
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert "".join(o.text_delta for o in outs) == aengine.tokenizer.decode(ref, skip_special_tokens=True)
    assert outs[0].first_token_time is not None and outs[0].first_token_time >= outs[0].arrival_time
    with pytest.raises(AttributeError):  # immutable record
        outs[0].text_delta = "x"


async def test_concurrent_streams(aengine, prompts, hf_reference):
    async def one(i):
        return [t async for o in aengine.generate(prompts[i], SamplingParams(max_tokens=16)) for t in o.token_ids_delta]

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert results == [hf_reference(prompts[i], 16) for i in range(6)]


async def test_abort_frees_blocks(aengine, prompts):
    got = []

    async def consume():
        async for o in aengine.generate(prompts[5], SamplingParams(max_tokens=200, ignore_eos=True), request_id="ab"):
            got.append(o)

    task = asyncio.create_task(consume())
    await wait_for(lambda: len(got) >= 2)
    assert aengine.stats()["kv_blocks_used"] > 0
    aengine.abort("ab")
    await asyncio.wait_for(task, 10)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    await wait_for(lambda: aengine.stats()["kv_blocks_used"] == 0)
    assert aengine.stats()["requests_aborted_total"] >= 1


async def test_consumer_break_and_cancel_abort_the_request(aengine, prompts):
    before = aengine.stats()["requests_aborted_total"]
    gen = aengine.generate(prompts[5], SamplingParams(max_tokens=200, ignore_eos=True), request_id="brk")
    async for _ in gen:
        break
    await gen.aclose()

    started = asyncio.Event()

    async def consume():
        async for _ in aengine.generate(prompts[6], SamplingParams(max_tokens=200, ignore_eos=True), request_id="cnl"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: aengine.stats()["requests_aborted_total"] >= before + 2)
    await wait_for(lambda: aengine.stats()["kv_blocks_used"] == 0 and aengine.stats()["running"] == 0)


async def test_event_loop_is_not_blocked(aengine, prompts):
    ticks = 0
    stop = False

    async def ticker():
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0.005)

    t = asyncio.create_task(ticker())
    start = time.monotonic()
    async for _ in aengine.generate(prompts[5], SamplingParams(max_tokens=24, ignore_eos=True)):
        pass
    elapsed = time.monotonic() - start
    stop = True
    await t
    # the loop kept ticking while the model ran (a blocked loop would tick about once per step)
    assert ticks >= elapsed / 0.005 * 0.3


async def test_chat_template_and_stats(aengine):
    ids = aengine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    out = [o async for o in aengine.generate(ids, SamplingParams(max_tokens=8))]
    assert out[-1].finished
    st = aengine.stats()
    for key in (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "prefix_cache_hit_rate",
        "generation_tokens_per_s",
        "prompt_tokens_total",
        "generation_tokens_total",
        "requests_aborted_total",
        "requests_finished_total",
    ):
        assert key in st
    assert st["generation_tokens_total"] > 0 and st["kv_blocks_total"] > 0


async def test_rejection_and_bad_input_are_reported(aengine):
    outs = [o async for o in aengine.generate([1] * 10, SamplingParams(max_tokens=10**6))]
    assert outs[-1].finish_reason == "error" and "max_model_len" in outs[-1].error
    outs = [o async for o in aengine.generate([], SamplingParams(max_tokens=4))]
    assert outs[-1].finish_reason == "error" and "empty" in outs[-1].error


def test_the_engine_is_built_on_the_thread_that_steps_it(monkeypatch):
    """torch's CPU kernels run on an OpenMP team per calling thread: loading on one thread and
    stepping on another left two teams on the cores and slowed every decode step."""
    import threading

    import engine.async_engine as async_engine

    threads: dict[str, threading.Thread] = {}

    class RecordingEngine:
        def __init__(self, config):
            threads["built"] = threading.current_thread()
            self.config, self.tokenizer = config, None
            self.stepped = threading.Event()

        def stats(self):
            return {}

        def has_work(self):
            if not self.stepped.is_set():
                threads["stepped"] = threading.current_thread()
                self.stepped.set()
            return False

        def seconds_to_resume(self):
            return None

    monkeypatch.setattr(async_engine, "LLMEngine", RecordingEngine)
    eng = AsyncLLMEngine(async_engine.EngineConfig())
    try:
        assert eng.engine.stepped.wait(5)
        assert threads["built"] is threads["stepped"] is not threading.current_thread()
    finally:
        eng.shutdown()


def test_an_engine_that_cannot_be_built_fails_its_constructor(monkeypatch):
    import engine.async_engine as async_engine

    def refuse(config):
        raise RuntimeError("no such model")

    monkeypatch.setattr(async_engine, "LLMEngine", refuse)
    with pytest.raises(RuntimeError, match="no such model"):
        AsyncLLMEngine(async_engine.EngineConfig())


@pytest.mark.parametrize(
    ("first_tokens", "requests", "lent", "expected"),
    # the prompt, then one token a step; two requests decode side by side: never urgent, unless they are one
    # group (one reply's prompt and its words alone, added together); with a core lent to another model, no step
    # uses it
    [
        (0, 1, 0, [2, 1, 1, 1]),
        (3, 1, 0, [2, 2, 2, 1]),
        (3, 2, 0, [2, 1, 1, 1]),
        (3, "grouped", 0, [2, 2, 2, 1]),
        (3, 1, 1, [1, 1, 1, 1]),
    ],
)
def test_prefill_steps_use_the_prefill_threads_and_decode_steps_the_others(
    make_engine, prompts, first_tokens, requests, lent, expected
):
    """Run on a thread of its own: torch's thread setting belongs to the calling thread. With
    ``prefill_threads_first_tokens`` the steps that write a lone request's first tokens count as prefill."""
    import threading

    import torch

    seen: list[int] = []

    def run() -> None:
        eng = make_engine(num_threads=1, prefill_threads=2, prefill_threads_first_tokens=first_tokens)
        for _ in range(lent):
            eng.runner.lend_core()
        execute = eng.runner.execute

        def recording(sched):
            out = execute(sched)
            seen.append(torch.get_num_threads())
            return out

        eng.runner.execute = recording
        grouped = requests == "grouped"
        for i in range(2 if grouped else requests):
            eng.add_request(f"t{i}", prompts[i], SamplingParams(max_tokens=4, ignore_eos=True), "t0" if grouped else "")
        while eng.has_unfinished():
            eng.step()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == expected


async def test_a_lent_core_is_given_back_even_when_the_borrower_fails(aengine):
    runner = aengine.engine.runner
    with pytest.raises(RuntimeError), aengine.core_lent():
        with aengine.core_lent():
            assert runner.cores_lent == 2
        assert runner.cores_lent == 1
        raise RuntimeError("the end-of-turn model failed")
    assert runner.cores_lent == 0


async def test_a_paused_request_gets_no_tokens_until_resumed_and_the_loop_sleeps_meanwhile(aengine, prompts):
    got = []

    async def consume(request_id):
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        async for o in aengine.generate(prompts[1], params, request_id=request_id):
            got.append(o)

    task = asyncio.create_task(consume("paused"))
    await wait_for(lambda: got)
    aengine.pause("paused", 60.0)
    request = aengine.engine.scheduler.requests["paused"]
    await wait_for(lambda: request.paused_until > 0)  # set on the engine thread, between two steps
    written = len(request.output_token_ids)
    steps = []
    real_step = aengine.engine.step
    aengine.engine.step = lambda: steps.append(1) or real_step()
    try:
        await asyncio.sleep(0.5)
    finally:
        del aengine.engine.step
    assert len(request.output_token_ids) == written and not task.done(), "a paused request went on"
    assert len(steps) <= 2, f"the loop stepped {len(steps)} times with nothing to run"
    aengine.resume("paused")
    await asyncio.wait_for(task, 30)
    assert got[-1].finish_reason == "length" and sum(len(o.token_ids_delta) for o in got) == 12


async def test_a_pause_ends_by_itself(aengine, prompts):
    outputs = aengine.generate(prompts[2], SamplingParams(max_tokens=6, ignore_eos=True), request_id="pause-ends")
    first = await outputs.__anext__()
    aengine.pause("pause-ends", 0.2)  # never resumed
    rest = [o async for o in outputs]
    assert sum(len(o.token_ids_delta) for o in [first, *rest]) == 6 and rest[-1].finished


async def test_a_yielding_request_waits_for_the_others_then_goes_on_alone(aengine, prompts):
    outputs = aengine.generate(prompts[2], SamplingParams(max_tokens=8, ignore_eos=True), request_id="yields")
    first = await outputs.__anext__()
    aengine.yield_to_others("yields", 60.0)
    request = aengine.engine.scheduler.requests["yields"]
    await wait_for(lambda: request.yields_until > 0)  # set on the engine thread, between two steps
    steps: list[set[str]] = []  # the requests of each step
    execute = aengine.engine.runner.execute
    aengine.engine.runner.execute = lambda sched: steps.append({c.request_id for c in sched.chunks}) or execute(sched)
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        other = [o async for o in aengine.generate(prompts[1], params, request_id="other")]
    finally:
        del aengine.engine.runner.execute
    assert sum(len(o.token_ids_delta) for o in other) == 6
    assert sum("other" in step for step in steps) >= 6  # (a prefill may take two)
    assert not any(step == {"other", "yields"} for step in steps), "it stepped beside a request that needed the steps"
    rest = [o async for o in outputs]  # alone now: it runs although its yield has not ended
    assert sum(len(o.token_ids_delta) for o in [first, *rest]) == 8 and rest[-1].finished


async def test_requests_added_together_are_stepped_together_and_closing_aborts_them(aengine, prompts, hf_reference):
    """``generate_many``: both prompts are in the first step, so each first token comes before either's second (added
    one by one, the loop may step the first alone); the outputs are each request's own; closing aborts the rest."""
    requests = [(prompts[i], SamplingParams(max_tokens=8), f"many-{i}") for i in (1, 2)]
    order, tokens = [], {0: [], 1: []}
    groups = set()
    async for index, out in aengine.generate_many(requests):
        order.append(index)
        tokens[index] += out.token_ids_delta
        groups |= {r.group_key for r in aengine.engine.scheduler.requests.values() if r.request_id.startswith("many")}
    assert sorted(order[:2]) == [0, 1]
    assert groups == {"many-1"}, "one group: a step of theirs alone gets a lone reply's threads"
    assert [tokens[0], tokens[1]] == [hf_reference(prompts[1], 8), hf_reference(prompts[2], 8)]
    long = [(prompts[i], SamplingParams(max_tokens=200, ignore_eos=True), f"many-long-{i}") for i in (3, 4)]
    aborted_before = aengine.stats().get("requests_aborted_total", 0)
    outputs = aengine.generate_many(long)
    await anext(outputs)
    await outputs.aclose()
    await wait_for(lambda: aengine.stats()["kv_blocks_used"] == 0)
    assert aengine.stats()["requests_aborted_total"] == aborted_before + 2
    with pytest.raises(ValueError, match="duplicate request id"):
        await anext(aengine.generate_many([(prompts[0], None, "twice"), (prompts[1], None, "twice")]))


def test_the_restart_backoff_doubles_and_the_loop_stays_down_after_too_many_recent_crashes():
    """A fake clock: crashes within the window double the wait; one more than allowed keeps the loop down; crashes
    that fell out of the window no longer count."""
    from engine.async_engine import RestartPolicy

    policy = RestartPolicy(max_restarts=3, window_s=300.0, backoff_s=0.5)
    assert [policy.after_crash(t) for t in (0.0, 10.0, 20.0)] == [0.5, 1.0, 2.0]
    assert policy.after_crash(30.0) is None and policy.recent == 4
    assert policy.after_crash(315.0) == 2.0 and policy.recent == 3  # those at 0 and 10 fell out of the window
    assert policy.after_crash(700.0) == 0.5 and policy.recent == 1
