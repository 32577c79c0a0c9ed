"""Access policy, per-connection limits and admission gates, with fake clocks and fake memory readings."""

from __future__ import annotations

import pytest

from app import protocol
from app.config import Settings
from app.server.access import AccessPolicy
from app.server.admission import Admission, LatencyBreaker, default_max_sessions
from app.server.limits import Every, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("[::1]:8000", True),
        ("192.168.1.20:8000", True),  # an IP literal cannot be rebound
        ("app.localhost", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("127.0.0.1.evil.example", False),
        (None, False),
        ("", False),
    ],
)
def test_host_header_outside_the_policy_is_refused(host, ok):
    assert AccessPolicy(Settings()).host_allowed(host) is ok


def test_allowed_hosts_extend_the_policy():
    policy = AccessPolicy(Settings(allowed_hosts=["parley.lan"]))
    assert policy.host_allowed("parley.lan:8000") and not policy.host_allowed("other.lan")
    assert AccessPolicy(Settings(allowed_hosts=["*"])).host_allowed("anything.example")


@pytest.mark.parametrize(
    ("origin", "host", "ok"),
    [
        (None, "127.0.0.1:8000", True),  # not a browser
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),  # our own page
        ("https://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("http://localhost:8000", "127.0.0.1:8000", False),  # another origin, even on this machine
        ("http://127.0.0.1:9999", "127.0.0.1:8000", False),
        ("http://evil.example", "127.0.0.1:8000", False),
        ("null", "127.0.0.1:8000", False),
        ("file://", "127.0.0.1:8000", False),
    ],
)
def test_only_same_origin_pages_may_open_the_socket(origin, host, ok):
    assert AccessPolicy(Settings()).origin_allowed(origin, host) is ok


def test_allowed_origins_and_the_wildcard():
    policy = AccessPolicy(Settings(allowed_origins=["https://app.example/"]))
    assert policy.origin_allowed("https://app.example", "127.0.0.1:8000")
    assert not policy.origin_allowed("https://other.example", "127.0.0.1:8000")
    star = AccessPolicy(Settings(allowed_origins=["*"]))
    assert star.origin_allowed("http://evil.example", "127.0.0.1:8000")
    assert any("any web page" in warning for warning in star.startup_warnings())


def test_api_key_by_header_subprotocol_or_query():
    key = "k" * 24
    policy = AccessPolicy(Settings(api_key=key))
    assert policy.key_required()
    assert policy.key_ok({"authorization": f"Bearer {key}"}, {})
    assert policy.key_ok({}, {}, ["parley", f"parley.key.{key}"])
    assert policy.key_ok({}, {"key": key})
    assert not policy.key_ok({}, {})
    assert not policy.key_ok({"authorization": "Bearer wrong"}, {"key": "also-wrong"})
    assert AccessPolicy(Settings()).key_ok({}, {})  # no key configured: open


def test_binding_beyond_loopback_without_a_key_warns():
    assert any("without an api_key" in w for w in AccessPolicy(Settings(host="0.0.0.0")).startup_warnings())
    assert not AccessPolicy(Settings(host="0.0.0.0", api_key="k" * 20)).startup_warnings()
    assert not AccessPolicy(Settings()).startup_warnings()


def test_audio_budget_admits_real_time_and_cuts_a_flood():
    clock = Clock()
    budget = TokenBucket(rate=2.0, burst=2.0, clock=clock)
    for _ in range(500):  # 10 s of real-time audio in 20 ms frames
        clock.t += 0.02
        assert budget.admit(0.02)
    admitted = sum(budget.admit(0.02) for _ in range(1000))  # 20 s of audio at once
    assert 98 <= admitted <= 100  # only the 2 s burst (float rounding may cost a frame or two)
    clock.t += 1.0
    refilled = sum(budget.admit(0.02) for _ in range(1000))
    assert 98 <= refilled <= 100  # refilled at 2x real time
    assert budget.dropped == pytest.approx((2000 - admitted - refilled) * 0.02)


def test_taking_past_the_burst_says_how_long_to_wait():
    clock = Clock()
    pace = TokenBucket(rate=100.0, burst=10.0, clock=clock)
    assert [pace.take(1.0) for _ in range(10)] == [0.0] * 10
    assert pace.take(1.0) == pytest.approx(0.01)  # one frame into debt: 10 ms at 100 a second
    assert pace.take(1.0) == pytest.approx(0.02)
    clock.t += 0.02
    assert pace.take(1.0) == pytest.approx(0.01)


def test_every_limits_repeats():
    clock = Clock()
    every = Every(1.0, clock)
    assert every() and not every()
    clock.t += 1.0
    assert every()


def test_breaker_opens_on_slow_turns_and_closes_as_they_age_out():
    clock = Clock()
    breaker = LatencyBreaker(threshold_ms=1000, window_s=30, min_samples=5, clock=clock)
    for _ in range(4):
        breaker.observe(3000)
    assert not breaker.open()  # too few samples to judge
    breaker.observe(3000)
    assert breaker.open() and 29 <= breaker.retry_after_s() <= 30
    clock.t += 31
    assert not breaker.open()
    for value in (400, 500, 450, 600, 3000):
        breaker.observe(value)
    assert breaker.open()  # p95 of five is the slowest


def test_the_breaker_says_when_it_will_close_not_when_its_first_slow_figure_ages_out():
    clock = Clock()
    breaker = LatencyBreaker(threshold_ms=1000, window_s=30, min_samples=5, clock=clock)
    for _ in range(10):  # ten slow turns, one a second
        breaker.observe(3000)
        clock.t += 1
    # six must age out before too few are left to judge (5): the sixth was seen 5 s ago
    assert breaker.open() and breaker.retry_after_s() == pytest.approx(30 - 5)
    clock.t += breaker.retry_after_s() - 0.01
    assert breaker.open()
    clock.t += 0.02
    assert not breaker.open()


def admission(clock=None, **settings) -> Admission:
    return Admission(
        Settings(**settings),
        clock=clock or Clock(),
        memory=lambda: 0.1,
        gpu_memory=lambda: None,
        headroom=lambda red_line: 8 << 30,
    )


def test_admission_gates_and_their_retry_hints():
    clock = Clock()
    memory = {"used": 0.5}
    released = []
    gates = Admission(
        Settings(max_sessions=2, breaker_voice_to_voice_ms=1000, memory_red_line=0.9),
        clock=clock,
        memory=lambda: memory["used"],
        gpu_memory=lambda: None,
        on_memory_pressure=lambda: released.append(1),
    )
    assert gates.check(1) is None
    full = gates.check(2)
    assert full.reason == "sessions" and full.retry_after_s == 5
    error = gates.refuse(full)
    assert error.code == "overloaded" and error.fatal and error.retry_after_s == 5
    assert "all 2 sessions are in use" in error.message
    for _ in range(5):
        gates.observe(protocol.TurnMetrics(voice_to_voice_ms=2500, llm_ttft_ms=50))
    slow = gates.check(0)
    assert "voice-to-voice p95 2500 ms" in slow.message and 29 <= slow.retry_after_s <= 30
    gates.refuse(slow)
    clock.t += 31
    assert gates.check(0) is None
    memory["used"] = 0.95
    high = gates.check(0)
    assert "memory 95%" in high.message and high.retry_after_s == 10
    assert released == []  # looking (/healthz) is not refusing
    gates.refuse(high)
    assert released == [1]
    assert gates.refused == {"sessions": 1, "latency": 1, "memory": 1}


def test_the_default_session_cap_is_per_core_as_far_as_memory_goes():
    assert default_max_sessions(cores=2) == 4  # lets a 2nd, 3rd and 4th user in on the 2-core VM
    assert default_max_sessions(cores=8) == 16
    assert default_max_sessions(cores=2, free_bytes=100 << 20) == 3  # 32 MiB a session
    assert default_max_sessions(cores=2, free_bytes=0) == 1  # past the red line: the memory gate refuses
    assert admission(max_sessions=7).max_sessions == 7
    sized = Admission(Settings(), memory=lambda: 0.1, headroom=lambda red_line: 64 << 20)
    assert sized.max_sessions == 2


def test_interrupted_turns_do_not_feed_the_breaker():
    clock = Clock()
    gates = admission(clock, breaker_voice_to_voice_ms=1000)
    for _ in range(10):
        gates.observe(protocol.TurnMetrics(voice_to_voice_ms=5000, barge_in=True))
    assert gates.check(0) is None
