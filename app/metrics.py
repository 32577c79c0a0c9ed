"""Prometheus metrics of the voice server: per-stage latency histograms, RTF, barge-ins, underruns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_STAGES = {
    "voice_to_voice_ms": "first reply audio sent after the end of the user's speech",
    "endpoint_ms": "end of speech to turn committed",
    "asr_final_ms": "turn committed to final transcript ready",
    "llm_ttft_ms": "LLM request to first token",
    "tts_first_audio_ms": "first clause to its audio",
}


class VoiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.sessions = Gauge("parley_sessions", "open voice sessions", registry=self.registry)
        self.llm = Gauge(
            "parley_llm", "LLM engine figures (in-process engine only)", ["figure"], registry=self.registry
        )

    def observe_turn(self, metrics: dict[str, float]) -> None:
        self.turns.inc()
        for key, histogram in self.stage_seconds.items():
            if key in metrics:
                histogram.observe(metrics[key] / 1000)
        if "rtf" in metrics:
            self.rtf.observe(metrics["rtf"])
        if metrics.get("barge_in"):
            self.barge_ins.inc()
        self.underruns.inc(metrics.get("underruns", 0))

    def render(self, sessions: int, llm_stats: dict | None) -> bytes:
        self.sessions.set(sessions)
        for figure, value in (llm_stats or {}).items():
            if isinstance(value, int | float):
                self.llm.labels(figure=figure).set(value)
        return generate_latest(self.registry)
