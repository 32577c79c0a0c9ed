"""Admission control: who gets a new session when the machine is busy.

Three gates, checked when a connection arrives (sessions already open keep working):

* a session cap (``max_sessions``; by default what memory holds at the measured cost of a
  session, at most ``SESSIONS_PER_CORE`` a core, see ``default_max_sessions``); a session
  idle for ``idle_evict_s`` gives its slot up to a newcomer (``app.server.connection``);
* a latency circuit breaker: when the p95 of recent voice-to-voice latencies (or LLM
  time to first token) passes its threshold, new sessions are refused with a retry hint;
  the samples age out of the window, so the breaker closes again by itself once the
  sessions already admitted are served fast again;
* a memory red line: when the machine's memory in use (the container's limit counts, and
  GPU memory on CUDA) passes ``memory_red_line``, new sessions are refused and the LLM is
  asked to drop its cached prefixes.

``check`` only looks (``/healthz`` asks it); ``refuse`` counts a refusal and words it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
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

    def retry_after_s(self) -> float:
        """Seconds until the breaker closes if no new figure comes: once enough slow ones aged out, or too few are left."""
        recent = self._recent()
        values = [value for _, value in recent]
        for aged in range(len(recent) + 1):  # the oldest age out first
            if not self._opens(values[aged:]):
                return 1.0 if aged == 0 else max(1.0, recent[aged - 1][0] + self.window_s - self._clock())
        return self.window_s  # unreachable while min_samples >= 1: an empty window is closed

    def p95(self) -> float | None:
        recent = self._recent()
        return percentile([value for _, value in recent], 95)

    def open(self) -> bool:
        return self._opens([value for _, value in self._recent()])

    def _opens(self, values: list[float]) -> bool:
        return len(values) >= self.min_samples and percentile(values, 95) > self.threshold_ms


# A session is budgeted at about twice the memory a talking session was measured to add, and up
# to 2 are let in a core, as four users on 2 cores were served fast (app/bench/results/capacity.md);
# the latency breaker guards the rest.
SESSION_MEMORY_BYTES = 32 << 20
SESSIONS_PER_CORE = 2


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_max_sessions(cores: int | None = None, free_bytes: int | None = None) -> int:
    """The session cap when ``max_sessions`` is not set: ``SESSIONS_PER_CORE`` a core, as far as ``free_bytes`` hold."""
    by_cores = (cores or available_cores()) * SESSIONS_PER_CORE
    if free_bytes is None:
        return by_cores
    return max(1, min(by_cores, free_bytes // SESSION_MEMORY_BYTES))


def _memory_readings() -> list[tuple[int, int]]:
    """(bytes in use, bytes in all) of the machine, and of the container when its limit is lower."""
    info = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    readings = [(total - available, total)]
    limit_file, usage_file = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        limit = limit_file.read_text().strip()
        if limit != "max" and int(limit) < total:
            readings.append((int(usage_file.read_text()), int(limit)))
    except (OSError, ValueError):
        pass
    return readings


def memory_in_use() -> float:
    """Fraction of the memory this process may use that is in use (the container limit when there is one)."""
    return max(used / total for used, total in _memory_readings())


def memory_headroom(red_line: float) -> int:
    """Bytes that may still be taken before the memory in use reaches ``red_line`` (0 when past it)."""
    return max(0, min(int(total * red_line) - used for used, total in _memory_readings()))


def gpu_memory_in_use() -> float | None:
    """Fraction of the current CUDA device's memory in use, or None without CUDA (torch is imported only if loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return 1.0 - free / total


@dataclass(frozen=True)
class Refusal:
    """Why a new session is not let in now, and when trying again makes sense."""

    reason: str  # the gate: "sessions", "latency" or "memory"
    message: str
    retry_after_s: float

    def retry_sooner(self, retry_after_s: float) -> Refusal:
        return replace(self, retry_after_s=max(1.0, min(self.retry_after_s, retry_after_s)))


FULL_RETRY_S = 5.0  # all slots taken: sessions end at any moment, so a refused client asks again soon
MEMORY_RETRY_S = 10.0


class Admission:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        memory: Callable[[], float] = memory_in_use,
        gpu_memory: Callable[[], float | None] = gpu_memory_in_use,
        headroom: Callable[[float], int] = memory_headroom,
        on_memory_pressure: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        window = settings.breaker_window_s
        self.voice_to_voice = LatencyBreaker(settings.breaker_voice_to_voice_ms, window, clock=clock)
        self.llm_ttft = LatencyBreaker(settings.breaker_llm_ttft_ms, window, clock=clock)
        self._memory, self._gpu_memory, self._headroom = memory, gpu_memory, headroom
        self._on_memory_pressure = on_memory_pressure
        self.refused: dict[str, int] = {"sessions": 0, "latency": 0, "memory": 0}
        self.size_cap()

    def size_cap(self) -> None:
        """``max_sessions``, else the default for the cores and the memory free now (sized again once models load)."""
        self.max_sessions = self.settings.max_sessions or default_max_sessions(
            free_bytes=self._headroom(self.settings.memory_red_line)
        )

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

    def check(self, open_sessions: int) -> Refusal | None:
        """None when a new session may come in, else why not (nothing is counted: ``refuse`` does)."""
        if open_sessions >= self.max_sessions:
            return Refusal("sessions", f"all {self.max_sessions} sessions are in use", FULL_RETRY_S)
        breakers = [("voice-to-voice", self.voice_to_voice), ("LLM first token", self.llm_ttft)]
        tripped = [(name, breaker) for name, breaker in breakers if breaker.open()]
        if tripped:
            figures = ", ".join(
                f"{name} p95 {breaker.p95():.0f} ms (limit {breaker.threshold_ms:.0f})" for name, breaker in tripped
            )
            retry = max(breaker.retry_after_s() for _, breaker in tripped)
            return Refusal("latency", f"the server is answering slowly ({figures})", retry)
        fraction = self.memory_fraction()
        if fraction >= self.settings.memory_red_line:
            red_line = self.settings.memory_red_line
            return Refusal("memory", f"memory {fraction:.0%} in use (red line {red_line:.0%})", MEMORY_RETRY_S)
        return None

    def refuse(self, refusal: Refusal) -> protocol.Error:
        """Count the refusal (memory pressure also asks the LLM to free its cache); the ``overloaded`` error to send."""
        self.refused[refusal.reason] += 1
        if refusal.reason == "memory" and self._on_memory_pressure is not None:
            self._on_memory_pressure()
        log.warning("refused a new session: %s", refusal.message)
        return protocol.Error(
            code="overloaded",
            message=f"{refusal.message}; try again later",
            fatal=True,
            retry_after_s=round(refusal.retry_after_s, 1),
        )
