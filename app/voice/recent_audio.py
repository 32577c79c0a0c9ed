"""The input audio an utterance may still need, by stream sample, and when each part of it arrived.

Its own unit because two parts of the user's side read it: the utterance tracker (``app.voice.utterance``: the
partials, the turn model's audio, the latency figures) and the tail's transcription jobs
(``app.voice.transcription``), which cut their audio from it themselves.
"""

from __future__ import annotations

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.voice.clock import ArrivalClock, Clock

SAMPLES_PER_MS = ASR_SAMPLE_RATE // 1000
# Between utterances the buffer keeps this much: the VAD reports a start only after
# min_speech_ms of speech, pointing back to where it began, and the pre-roll reaches back
# from there. Keeping only PREROLL_MS cut "Can you" off "Can you recommend a good book?"
# in 2 of 28 benchmark turns.
IDLE_KEEP_MS = 1000


class RecentAudio:
    """The stream's recent 16 kHz samples; they end at stream sample ``end``."""

    def __init__(self, clock: Clock) -> None:
        self._audio = np.zeros(0, dtype=np.float32)
        self.end = 0
        self._clock = clock
        self._arrivals = ArrivalClock(clock)

    def __len__(self) -> int:
        return len(self._audio)

    def append(self, samples: np.ndarray, *, idle: bool) -> None:
        """The next samples of the stream, arrived now; ``idle`` (no utterance in progress): only the last
        ``IDLE_KEEP_MS`` are kept, once twice that has built up."""
        self._audio = np.concatenate([self._audio, samples])
        self.end += len(samples)
        self._arrivals.mark(self.end, self._clock.now())
        if idle and len(self._audio) > 2 * IDLE_KEEP_MS * SAMPLES_PER_MS:
            self._audio = self._audio[-IDLE_KEEP_MS * SAMPLES_PER_MS :]

    def slice(self, start: int, end: int) -> np.ndarray:
        """A copy of the samples from stream sample ``start`` to ``end`` (what is still kept of them)."""
        first = self.end - len(self._audio)
        return self._audio[max(0, start - first) : max(0, end - first)].copy()

    def time_of(self, sample: int) -> float:
        """The wall time the audio at stream sample ``sample`` arrived."""
        return self._arrivals.time_of(sample)
