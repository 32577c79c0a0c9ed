"""Prometheus metrics of the voice server: per-stage latency histograms, RTF, barge-ins, underruns, memory."""

from __future__ import annotations

import ctypes
import ctypes.util

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.protocol import GUARD_FIELDS, TurnMetrics
from app.server.admission import Admission
from engine.metrics import EngineCollector

_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# one histogram per latency figure of a turn, named and described by ``TurnMetrics`` itself
_STAGES = {
    name: TurnMetrics.model_fields[name].description
    for name in (
        "voice_to_voice_ms",
        "endpoint_ms",
        "asr_final_ms",
        "llm_ttft_ms",
        "llm_first_piece_ms",
        "tts_first_audio_ms",
    )
}


class VoiceMetrics:
    def __init__(self, admission: Admission | None = None) -> None:
        self.registry = CollectorRegistry()
        self._admission = admission
        self.stage_seconds = {
            key: Histogram(
                f"parley_{key.removesuffix('_ms')}_seconds", help_text, registry=self.registry, buckets=_LATENCY_BUCKETS
            )
            for key, help_text in _STAGES.items()
        }
        self.rtf = Histogram(
            "parley_rtf",
            "reply audio seconds per wall second spent producing it",
            registry=self.registry,
            buckets=(0.5, 0.8, 1.0, 1.25, 1.5, 2, 3, 5, 10, 20),
        )
        self.turns = Counter("parley_turns_total", "turns answered", registry=self.registry)
        self.barge_ins = Counter("parley_barge_ins_total", "replies interrupted by the user", registry=self.registry)
        self.underruns = Counter("parley_underruns_total", "reply audio chunks sent late", registry=self.registry)
        self.guards = Counter(
            "parley_reply_guards_total",
            "replies cut short by a guard (repeat, loop, runaway, length: app/voice/pieces.py)",
            ["guard"],
            registry=self.registry,
        )
        self.sessions = Gauge("parley_sessions", "open voice sessions", registry=self.registry)
        self.evictions = Counter(
            "parley_evictions_total", "connections closed by the server's limits", ["reason"], registry=self.registry
        )
        self.rate_limited = Counter(
            "parley_rate_limited_audio_seconds_total",
            "microphone audio dropped for arriving too fast",
            registry=self.registry,
        )
        if admission is not None:
            self.registry.register(_AdmissionCollector(admission))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open files
        if heap_bytes() is not None:
            self.registry.register(_HeapCollector())
        self._llm_attached = False

    def observe_turn(self, metrics: TurnMetrics) -> None:
        if self._admission is not None:
            self._admission.observe(metrics)
        self.turns.inc()
        for key, histogram in self.stage_seconds.items():
            value = getattr(metrics, key)
            if value is not None:
                histogram.observe(value / 1000)
        if metrics.rtf is not None:
            self.rtf.observe(metrics.rtf)
        if metrics.barge_in:
            self.barge_ins.inc()
        self.underruns.inc(metrics.underruns)
        for field in GUARD_FIELDS:
            if getattr(metrics, field):
                self.guards.labels(guard=field.removeprefix("guard_")).inc(getattr(metrics, field))

    def attach_llm(self, llm: object) -> None:
        """Export the in-process engine's figures (``parley_engine_*``, the names ``parley engine serve`` uses)."""
        stats = getattr(llm, "stats", None)
        if stats is not None and not self._llm_attached:
            self.registry.register(EngineCollector(stats))
            self._llm_attached = True

    def render(self, sessions: int) -> bytes:
        self.sessions.set(sessions)
        return generate_latest(self.registry)


class _AdmissionCollector(Collector):
    """The admission gates, read when /metrics is scraped."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self):
        refused = CounterMetricFamily("parley_refused_sessions", "new sessions refused, by gate", labels=["reason"])
        for reason, count in self._admission.refused.items():
            refused.add_metric([reason], count)
        yield refused
        yield GaugeMetricFamily(
            "parley_breaker_open",
            "1 while the latency circuit breaker refuses new sessions",
            value=1.0 if self._admission.breaker_open() else 0.0,
        )
        yield GaugeMetricFamily(
            "parley_max_sessions",
            "the session cap (max_sessions, or the default for this machine)",
            value=self._admission.max_sessions,
        )
        yield GaugeMetricFamily(
            "parley_memory_in_use_ratio",
            "share of memory in use (GPU memory too on CUDA)",
            value=self._admission.memory_fraction(),
        )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33+), or None (another libc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> dict[str, int] | None:
    """The C heap as glibc's allocator sees it, every arena summed (None on another libc): ``in_use`` (live
    allocations, Python's, torch's and the ONNX runtimes' alike), ``free_held`` (freed but kept by the arenas,
    counted in the RSS only where touched) and ``mmapped`` (large blocks, returned to the system when freed).
    Why: a resident set that grows is one of these, or memory no allocator manages (mapped model files,
    stacks); ``parley bench soak`` reads them per round to say which."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return {"in_use": info.uordblks, "free_held": info.fordblks, "mmapped": info.hblkhd}


class _HeapCollector(Collector):
    def collect(self):
        gauge = GaugeMetricFamily(
            "parley_heap_bytes", "the C heap by glibc's allocator: in_use, free_held, mmapped", labels=["kind"]
        )
        for kind, value in (heap_bytes() or {}).items():
            gauge.add_metric([kind], value)
        yield gauge
