"""Admission control: who gets a new session when the machine is busy.

Three gates, checked when a connection arrives (sessions already open keep working):

* a session cap (``max_sessions``; by default what the machine serves in real time, see
  ``default_max_sessions``);
* a latency circuit breaker: when the p95 of recent voice-to-voice latencies (or LLM
  time to first token) passes its threshold, new sessions are refused with a retry hint;
  the samples age out of the window, so the breaker closes again by itself once the
  sessions already admitted are served fast again;
* a memory red line: when the machine's memory in use (the container's limit counts, and
  GPU memory on CUDA) passes ``memory_red_line``, new sessions are refused and the LLM is
  asked to drop its cached prefixes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from app import protocol
from app.config import Settings
from engine.metrics import percentile

log = logging.getLogger(__name__)


class LatencyBreaker:
    """Open while the p95 of the figures seen in the last ``window_s`` is over ``threshold_ms``."""

    def __init__(
        self, threshold_ms: float, window_s: float, min_samples: int = 5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold_ms, self.window_s, self.min_samples = threshold_ms, window_s, min_samples
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, value_ms: float | None) -> None:
        if value_ms is not None:
            self._samples.append((self._clock(), value_ms))

    def _recent(self) -> list[tuple[float, float]]:
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return list(self._samples)

    def p95(self) -> float | None:
        recent = self._recent()
        return percentile([value for _, value in recent], 95)

    def open(self) -> bool:
        recent = self._recent()
        return len(recent) >= self.min_samples and percentile([v for _, v in recent], 95) > self.threshold_ms

    def retry_after_s(self) -> float:
        """When enough of the slow samples will have aged out for the breaker to be able to close."""
        recent = self._recent()
        slow = [when for when, value in recent if value > self.threshold_ms]
        if not slow:
            return 1.0
        return max(1.0, slow[0] + self.window_s - self._clock())


# Measured with `parley bench load --step-s 90 --max-users 3` (users join one by one and talk
# without pause; a number of users is "real time" when the turns answered while that many were
# connected had a heard voice-to-voice p95 under 2000 ms and every reply an RTF >= 1) on a
# 2-core AMD EPYC (znver3, no native bf16, so a float32 LLM): 1 user (p95 1872 ms, RTF min
# 2.18); 2 users had p95 2559 ms. (A 40 s step, 3 turns a step, had passed 2 users by chance.)
# Most of a turn's work is CPU-bound on any device (VAD, Piper, and on a CPU-only machine
# Whisper and the LLM), so the default scales with the cores. Not measured on a GPU machine.
MEASURED_CORES = 2
REAL_TIME_SESSIONS_MEASURED = 1


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_max_sessions(cores: int | None = None) -> int:
    """The session cap when ``max_sessions`` is not set: the measured real-time users per core, times the cores."""
    cores = cores or available_cores()
    return max(1, math.floor(cores * REAL_TIME_SESSIONS_MEASURED / MEASURED_CORES))


def memory_in_use() -> float:
    """Fraction of the memory this process may use that is in use (the container limit when there is one)."""
    info = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    fraction = 1.0 - available / total
    limit_file, usage_file = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        limit = limit_file.read_text().strip()
        if limit != "max" and int(limit) < total:
            fraction = max(fraction, int(usage_file.read_text()) / int(limit))
    except (OSError, ValueError):
        pass
    return fraction


def gpu_memory_in_use() -> float | None:
    """Fraction of the current CUDA device's memory in use, or None without CUDA (torch is imported only if loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return 1.0 - free / total


class Admission:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        memory: Callable[[], float] = memory_in_use,
        gpu_memory: Callable[[], float | None] = gpu_memory_in_use,
        on_memory_pressure: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.max_sessions = settings.max_sessions or default_max_sessions()
        window = settings.breaker_window_s
        self.voice_to_voice = LatencyBreaker(settings.breaker_voice_to_voice_ms, window, clock=clock)
        self.llm_ttft = LatencyBreaker(settings.breaker_llm_ttft_ms, window, clock=clock)
        self._memory, self._gpu_memory = memory, gpu_memory
        self._on_memory_pressure = on_memory_pressure
        self.refused: dict[str, int] = {"sessions": 0, "latency": 0, "memory": 0}

    def observe(self, metrics: protocol.TurnMetrics) -> None:
        if metrics.barge_in:
            return  # an interrupted turn's figures say little about the server
        self.voice_to_voice.observe(metrics.voice_to_voice_ms)
        self.llm_ttft.observe(metrics.llm_ttft_ms)

    def breaker_open(self) -> bool:
        return self.voice_to_voice.open() or self.llm_ttft.open()

    def memory_fraction(self) -> float:
        fractions = [self._memory()]
        gpu = self._gpu_memory()
        if gpu is not None:
            fractions.append(gpu)
        return max(fractions)

    def refuse_reason(self, open_sessions: int) -> protocol.Error | None:
        """None to admit a new session, else the ``overloaded`` error to send it."""
        if open_sessions >= self.max_sessions:
            return self._refuse("sessions", f"all {self.max_sessions} sessions are in use", 5.0)
        if self.breaker_open():
            figures = ", ".join(
                f"{name} p95 {breaker.p95():.0f} ms (limit {breaker.threshold_ms:.0f})"
                for name, breaker in (("voice-to-voice", self.voice_to_voice), ("LLM first token", self.llm_ttft))
                if breaker.open()
            )
            retry = max(self.voice_to_voice.retry_after_s(), self.llm_ttft.retry_after_s())
            return self._refuse("latency", f"the server is answering slowly ({figures})", retry)
        fraction = self.memory_fraction()
        if fraction >= self.settings.memory_red_line:
            if self._on_memory_pressure is not None:
                self._on_memory_pressure()
            return self._refuse(
                "memory", f"memory {fraction:.0%} in use (red line {self.settings.memory_red_line:.0%})", 10.0
            )
        return None

    def _refuse(self, reason: str, message: str, retry_after_s: float) -> protocol.Error:
        self.refused[reason] += 1
        log.warning("refused a new session: %s", message)
        return protocol.Error(
            code="overloaded", message=f"{message}; try again later", fatal=True, retry_after_s=round(retry_after_s, 1)
        )
