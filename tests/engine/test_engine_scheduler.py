"""Scheduler and KV cache manager tests with fake model outputs (no model), like vLLM's tests/v1/core."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import RequestRejected, Scheduler, SchedulerOutput

EOS = 2
FAKE_TOKEN = 7


def make(num_blocks=64, block_size=4, max_num_seqs=16, budget=64, max_model_len=1024, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 100, **kw) -> Request:
    return Request(
        rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(EOS,)
    )


def fake_step(s: Scheduler, token: int = FAKE_TOKEN, tokens: dict[str, int] | None = None):
    out = s.schedule()
    sampled = {c.request_id: (tokens or {}).get(c.request_id, token) for c in out.chunks if c.sample}
    return out, s.update_from_output(out, sampled)


def run_all(s: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return outs
        outs.append(fake_step(s)[0])
    raise AssertionError("scheduler did not finish")


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in out.chunks}


def test_token_budget_is_respected_and_prefill_is_chunked():
    s = make(budget=16)
    for i in range(3):
        s.add_request(req(f"r{i}", 10, first=100 * (i + 1)))
    out, _ = fake_step(s)
    assert scheduled(out) == {"r0": 10, "r1": 6}  # r1's prefill is chunked to fit
    assert out.num_tokens <= 16
    assert [c.sample for c in out.chunks] == [True, False]
    out, _ = fake_step(s)
    # running first: r0 decodes, r1 finishes its prefill, then r2 gets the rest of the budget
    assert scheduled(out) == {"r0": 1, "r1": 4, "r2": 11 - 1}
    assert out.chunks[1].start == 6


def test_long_prompt_prefills_in_chunks_without_stalling_decodes():
    s = make(budget=8, num_blocks=64)
    s.add_request(req("short", 3, max_tokens=20))
    fake_step(s)
    s.add_request(req("long", 30, first=1000))
    sizes = []
    while s.requests["long"].num_computed_tokens < 30:
        out, _ = fake_step(s)
        assert scheduled(out)["short"] == 1  # the running decode is never starved
        sizes.append(scheduled(out)["long"])
    assert sizes == [7, 7, 7, 7, 2]
    assert s.requests["long"].output_token_ids == [FAKE_TOKEN]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, first=100 * (i + 1)))
    out, _ = fake_step(s)
    assert set(scheduled(out)) == {"r0", "r1"}
    assert len(s.running) == 2 and len(s.waiting) == 1
    run_all(s)
    assert not s.has_unfinished()


def test_finish_on_max_tokens_eos_and_stop_ids():
    s = make()
    s.add_request(req("len", 5, max_tokens=3))
    s.add_request(req("eos", 5, max_tokens=10))
    s.add_request(req("ign", 5, max_tokens=2, ignore_eos=True))
    s.add_request(req("stopid", 5, max_tokens=10, stop_token_ids=(42,)))
    _, ups = fake_step(s, tokens={"eos": EOS, "ign": EOS, "stopid": 42})
    fin = {u.request.request_id: u.request.finish_reason for u in ups if u.finished}
    assert fin == {"eos": "stop", "stopid": "stop"}
    run_all(s)
    assert not s.has_unfinished()


def test_blocks_freed_on_finish_and_abort():
    s = make(num_blocks=32, block_size=4)
    a, b, c = req("a", 9, max_tokens=2), req("b", 9, max_tokens=50, first=200), req("c", 9, first=300)
    for r in (a, b):
        s.add_request(r)
    fake_step(s)
    assert s.kv.num_used_blocks == 6  # 3 blocks each for 9 tokens
    fake_step(s)
    assert a.is_finished and a.finish_reason == "length"
    assert s.kv.num_used_blocks == 3
    s.finish_request("b", "abort")
    assert b.is_finished and s.kv.num_used_blocks == 0
    s.add_request(c)
    s.finish_request("c", "abort")  # aborting a waiting request
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0


def test_preemption_of_newest_and_resume():
    # 8 blocks of 4 tokens = 32 token slots; each request needs up to 6 + 10 = 16.
    s = make(num_blocks=8, block_size=4, caching=False)
    reqs = [req(f"r{i}", 6, max_tokens=10, first=10 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    preempted: list[str] = []
    for _ in range(200):
        if not s.has_unfinished():
            break
        out, _ = fake_step(s)
        preempted += out.preempted
        assert s.kv.num_used_blocks <= 8
    assert preempted, "the tiny pool must force a preemption"
    assert preempted[0] == "r2"  # the newest running request goes first
    assert all(r.is_finished and r.finish_reason == "length" for r in reqs)
    assert all(r.output_token_ids == [FAKE_TOKEN] * 10 for r in reqs)
    assert s.kv.num_used_blocks == 0
    assert reqs[2].num_preemptions >= 1


def test_preempted_request_goes_to_front_and_recomputes_outputs():
    s = make(num_blocks=6, block_size=4, caching=False)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    while not b.num_preemptions:
        fake_step(s)
    assert s.waiting[0] is b and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and s.kv.block_ids("b") == []
    n_out = len(b.output_token_ids)
    while b.status != RequestStatus.RUNNING:
        out, _ = fake_step(s)
    # on resume, the prompt and the tokens it already generated are recomputed in one prefill
    assert scheduled(out)["b"] == 8 + n_out
    run_all(s)
    assert len(b.output_token_ids) == 12


def test_rejects_requests_that_can_never_fit():
    s = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="KV blocks"):
        s.add_request(req("big", 10, max_tokens=7))  # 17 tokens > 16 slots
    s2 = make(num_blocks=100, block_size=4, max_model_len=20)
    with pytest.raises(RequestRejected, match="max_model_len"):
        s2.add_request(req("long", 15, max_tokens=6))
    s.add_request(req("ok", 10, max_tokens=6))  # exactly 16 fits
    run_all(s)


def test_prefix_cache_hits_share_blocks_with_ref_counts():
    s = make(num_blocks=32, block_size=4)
    prefix = list(range(500, 512))  # 3 full blocks
    a = Request("a", prefix + [1, 2], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    s.add_request(a)
    fake_step(s)
    b = Request("b", prefix + [3, 4, 5], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    s.add_request(b)
    out, _ = fake_step(s)
    assert b.num_cached_tokens == 12
    assert scheduled(out)["b"] == 3  # only the uncached tail is computed
    assert s.kv.block_ids("a")[:3] == s.kv.block_ids("b")[:3]
    shared = [s.kv.pool.blocks[i] for i in s.kv.block_ids("a")[:3]]
    assert [blk.ref_cnt for blk in shared] == [2, 2, 2]
    s.finish_request("a", "abort")
    assert [blk.ref_cnt for blk in shared] == [1, 1, 1]
    s.finish_request("b", "abort")
    assert [blk.ref_cnt for blk in shared] == [0, 0, 0]
    assert s.kv.num_used_blocks == 0
    # freed blocks stay cached: a third request still hits them
    c = Request("c", prefix + [9], SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    s.add_request(c)
    fake_step(s)
    assert c.num_cached_tokens == 12
    assert s.kv.prefix_cache_hit_rate == pytest.approx((12 + 12) / (14 + 15 + 13))


def test_full_prompt_hit_still_computes_last_token():
    s = make(block_size=4)
    p = list(range(300, 308))  # exactly 2 blocks
    s.add_request(Request("a", p, SamplingParams(max_tokens=1), eos_token_ids=(EOS,)))
    run_all(s)
    b = Request("b", list(p), SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.add_request(b)
    out, _ = fake_step(s)
    # the first block by its hash, then the second's first 3 tokens copied (only the last token is computed)
    assert b.num_cached_tokens == 7 and scheduled(out)["b"] == 1
    assert [(c.src, c.num_tokens) for c in out.copies] == [(s.kv.pool.get_cached(b.block_hashes[1]).block_id, 3)]
    assert b.output_token_ids == [FAKE_TOKEN]


def test_prefix_of_generated_tokens_is_cached_too():
    # a second turn re-sends prompt + the first answer: those blocks are hits
    s = make(block_size=4)
    a = req("a", 6, max_tokens=10)
    s.add_request(a)
    run_all(s)
    history = a.prompt_token_ids + a.output_token_ids  # 16 tokens = 4 blocks, last written at decode
    b = Request("b", history + [1, 2, 3], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.add_request(b)
    fake_step(s)
    # 3 full blocks, then the 4th block's first 3 tokens: its last output's K/V was never computed
    assert b.num_cached_tokens == 15


def test_a_freed_partial_block_is_taken_over_by_a_request_continuing_its_tokens():
    """The history warm-up ends mid-block; the next turn's prompt continues it."""
    s = make(block_size=4)
    warm = req("warm", 10, max_tokens=1)  # 2 full blocks, then a tail of 2 tokens (100..109)
    s.add_request(warm)
    run_all(s)
    tail_block = next(b for b in s.kv.pool.blocks if b.tail is not None and len(b.tail[1]) < 4)
    turn = Request("turn", [*range(100, 110), 55, 56, 57], SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    twin = Request("twin", [*range(100, 110), 55, 66], SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    s.add_request(turn)
    s.add_request(twin)
    out, _ = fake_step(s)
    assert turn.num_cached_tokens == 10  # the whole warm-up: 8 in full blocks, 2 in its tail
    assert scheduled(out)["turn"] == 3 and out.chunks[0].start == 10
    assert s.kv.block_ids("turn")[2] == tail_block.block_id and tail_block.tail is None
    assert twin.num_cached_tokens == 8  # the tail is taken over, not shared: the twin computes its own
    run_all(s)
    assert s.kv.num_used_blocks == 0


def test_a_tail_is_reused_up_to_where_the_tokens_part_and_never_after_a_failed_step():
    s = make(block_size=8)
    a = req("a", 14, max_tokens=1)  # tail: 106..113
    s.add_request(a)
    run_all(s)
    b = Request("b", [*range(100, 111), 9, 9, 9], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.add_request(b)
    out, _ = fake_step(s)
    assert b.num_cached_tokens == 11  # 8 + the 3 tail tokens b shares (106..110)
    s.add_request(c := req("c", 13, max_tokens=4))
    out, _ = fake_step(s)
    s.finish_request("c", "error")  # its K/V may be garbage: kept neither as blocks nor as a tail
    d = req("d", 13, max_tokens=1)
    s.add_request(d)
    fake_step(s)
    assert d.num_cached_tokens == 8
    assert c.num_computed_tokens == 13


def test_a_full_block_parted_from_mid_way_is_copied_from_and_stays_cached():
    """The words heard so far filled a block the final transcript parts from mid-way: the start they share is
    copied into a block of the new request's, before its step's forward; the full block keeps its hash."""
    s = make(block_size=4)
    warm = req("warm", 10, max_tokens=1)  # blocks 100..103, 104..107, then a tail 108..109
    s.add_request(warm)
    run_all(s)
    source = s.kv.pool.get_cached(warm.block_hashes[1])
    turn = Request("turn", [*range(100, 106), 55, 56, 57], SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    s.add_request(turn)
    out, _ = fake_step(s)
    assert turn.num_cached_tokens == 6 and scheduled(out)["turn"] == 3
    table = s.kv.block_ids("turn")
    assert source.block_id not in table
    assert [(c.src, c.dst, c.num_tokens) for c in out.copies] == [(source.block_id, table[1], 2)]
    assert source.ref_cnt == 1, "held until the step that copies it has run"
    out, _ = fake_step(s)
    assert source.ref_cnt == 0 and not out.copies
    again = req("again", 10, max_tokens=1)  # the warm-up's own tokens: its blocks by hash, then its tail
    s.add_request(again)
    fake_step(s)
    assert again.num_cached_tokens == 9
    run_all(s)
    assert s.kv.num_used_blocks == 0


def test_lru_eviction_of_cached_free_blocks():
    s = make(num_blocks=4, block_size=4)
    a = Request("a", list(range(8)) + [99], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.add_request(a)
    run_all(s)
    assert s.kv.num_used_blocks == 0
    # a new request needing all 4 blocks evicts the cached ones
    b = Request("b", list(range(50, 63)), SamplingParams(max_tokens=3), eos_token_ids=(EOS,))
    s.add_request(b)
    fake_step(s)
    c = Request("c", list(range(8)) + [98], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.finish_request("b", "abort")
    s.add_request(c)
    fake_step(s)
    assert c.num_cached_tokens == 0


def test_no_prefix_caching_when_disabled():
    s = make(caching=False, block_size=4)
    p = list(range(20))
    s.add_request(Request("a", p, SamplingParams(max_tokens=1), eos_token_ids=(EOS,)))
    run_all(s)
    b = Request("b", p + [1], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    s.add_request(b)
    fake_step(s)
    assert b.num_cached_tokens == 0


def test_update_error_finishes_request_without_token():
    s = make()
    s.add_request(req("a", 5))
    out = s.schedule()
    ups = s.update_from_output(out, {}, {"a": "non-finite logits"})
    assert ups[0].finished and ups[0].new_token_ids == []
    assert ups[0].request.finish_reason == "error" and "non-finite" in ups[0].request.error
    assert s.kv.num_used_blocks == 0


def two_running_with_a_held_back(hold: str) -> Scheduler:
    """Requests a and b, both prefilled; then a step at time 5 with a's ``hold`` ("paused_until" or
    "yields_until") set to 10, which runs only b, and a keeps its blocks and its place."""
    s = make()
    s.add_request(req("a", 5, max_tokens=10))
    s.add_request(req("b", 5, max_tokens=10, first=200))
    fake_step(s)  # both prefilled, one token each
    setattr(s.requests["a"], hold, 10.0)
    out = s.schedule(now=5.0)
    assert scheduled(out) == {"b": 1}
    s.update_from_output(out, {"b": FAKE_TOKEN})
    assert s.kv.block_ids("a") and s.running[0].request_id == "a"
    return s


def test_a_yielding_request_steps_only_while_no_other_request_needs_a_step():
    s = two_running_with_a_held_back("yields_until")  # b needs a step, so a waits
    s.add_request(req("c", 5, max_tokens=10, first=300))
    s.requests["b"].paused_until = 10.0
    out = s.schedule(now=5.0)
    assert scheduled(out) == {"c": 5}, "a waiting prefill needs a step too"
    s.update_from_output(out, {"c": FAKE_TOKEN})
    s.requests["c"].yields_until = 10.0
    assert scheduled(s.schedule(now=5.0)) == {"a": 1, "c": 1}, "only yielding (and paused) ones: they run"
    assert scheduled(s.schedule(now=10.0)) == {"a": 1, "b": 1, "c": 1}  # and all once it ends


def test_a_paused_request_keeps_its_blocks_and_its_place_until_its_pause_ends():
    s = two_running_with_a_held_back("paused_until")
    assert s.has_work(5.0) and s.next_resume() == 10.0
    s.requests["b"].paused_until = 10.0
    assert not s.has_work(5.0), "only paused requests: a step now would compute nothing"
    assert s.schedule(now=5.0).is_empty
    assert scheduled(s.schedule(now=10.0)) == {"a": 1, "b": 1}  # both run again once the pause ends
