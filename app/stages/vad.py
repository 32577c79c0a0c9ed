"""Streaming voice activity detection with the Silero VAD v6 ONNX model that faster-whisper ships.

The model is loaded once and shared; each session owns a ``VadStream`` holding its
recurrent state, so no session sees another's audio.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from app.stages.base import VadConfig, VadEvent
from app.stages.onnx import cpu_session

WINDOW = 512  # samples per model call at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window the v6 model expects in front


def _default_model_path() -> str:
    from faster_whisper.utils import get_assets_path

    return os.path.join(get_assets_path(), "silero_vad_v6.onnx")


class VadModel(Protocol):
    def probability(self, window_with_context: np.ndarray, state: tuple[np.ndarray, np.ndarray]): ...


class SileroVad:
    """The shared ONNX session (thread-safe for concurrent ``run`` calls)."""

    def __init__(self, path: str | None = None) -> None:
        self.session = cpu_session(path or _default_model_path(), 1, log_severity=4)

    def probability(self, window_with_context: np.ndarray, state: tuple[np.ndarray, np.ndarray]):
        prob, h, c = self.session.run(None, {"input": window_with_context[None, :], "h": state[0], "c": state[1]})
        return float(prob.reshape(-1)[0]), (h, c)


class VadStream:
    """Feeds 16 kHz float audio through the model window by window and reports speech start/end.

    The decision rule (hysteresis between ``threshold`` and ``neg_threshold``, minimum speech
    and silence runs) is independent of the model: any ``VadModel`` giving a speech
    probability per 32 ms window drives it.
    """

    def __init__(self, model: VadModel, config: VadConfig | None = None) -> None:
        self.model = model
        self.config = config or VadConfig()
        self._pending = np.zeros(0, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._state = (np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 128), np.float32))
        self.samples_seen = 0  # stream position of the next window's first sample
        self.speaking = False
        self.last_probability = 0.0
        self._run_start: int | None = None  # candidate speech start
        self._silence_start: int | None = None  # candidate speech end
        self._quiet_start: int | None = None  # speaking: first of the latest windows under ``threshold``

    @property
    def speech_pending(self) -> bool:
        """Speech-like audio has begun but is not yet long enough to count as a start."""
        return not self.speaking and self._run_start is not None

    @property
    def trailing_silence(self) -> bool:
        """Speaking, but the latest windows were quiet: the speech may be ending (hangover)."""
        return self.speaking and self._silence_start is not None

    @property
    def silence_start(self) -> int | None:
        """In the hangover: the stream sample where the quiet began (the speech end, if it stays quiet)."""
        return self._silence_start if self.speaking else None

    @property
    def quiet_start(self) -> int | None:
        """Speaking, and the latest windows were under ``threshold``: the stream sample where that run began.

        The first sign the speech may be ending, at or before ``silence_start``: after the last sound
        Silero's probability falls over a window or two, through ``threshold`` a window before
        ``neg_threshold`` as a rule (on the benchmark's noisy questions the first such window was in 52 ms
        after the acoustic end at the median, 78 ms at p90, against 72 and 128 ms for ``neg_threshold``).
        """
        return self._quiet_start if self.speaking else None

    def reset(self) -> None:
        self.__init__(self.model, self.config)

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        events: list[VadEvent] = []
        buffer = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        usable = len(buffer) - len(buffer) % WINDOW
        for offset in range(0, usable, WINDOW):
            window = buffer[offset : offset + WINDOW]
            prob, self._state = self.model.probability(np.concatenate([self._context, window]), self._state)
            self._context = window[-CONTEXT:]
            self.last_probability = prob
            event = self._decide(prob, self.samples_seen)
            if event:
                events.append(event)
            self.samples_seen += WINDOW
        self._pending = buffer[usable:].copy()
        return events

    def _decide(self, prob: float, position: int) -> VadEvent | None:
        cfg = self.config
        if not self.speaking:
            if prob >= cfg.threshold:
                if self._run_start is None:
                    self._run_start = position
                if position + WINDOW - self._run_start >= cfg.min_speech_ms * 16:
                    self.speaking, self._silence_start, self._quiet_start = True, None, None
                    return VadEvent("start", self._run_start)
            elif prob < cfg.neg_threshold:
                self._run_start = None
            return None
        if prob >= cfg.threshold:
            self._quiet_start = self._silence_start = None
            return None
        if self._quiet_start is None:
            self._quiet_start = position
        if prob < cfg.neg_threshold:
            if self._silence_start is None:
                self._silence_start = position
            if position + WINDOW - self._silence_start >= cfg.min_silence_ms * 16:
                self.speaking, self._run_start = False, None
                return VadEvent("end", self._silence_start)
        return None
