"""The user's side of a conversation, built from the settings: VAD -> utterance tracker.

The session (``app.voice.session``) builds one at its start and again at each ``start``
(a new input rate, or turn-taking settings tuned live); the tracker itself is in
``app.voice.utterance``, the endpoint's rules in ``app.voice.turns``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.config import Settings
from app.stages.base import ChatLLM, TurnDetector, VadConfig, VoiceStages, scheduling_of
from app.voice.clock import Clock, RunBlocking
from app.voice.turns import Endpointer
from app.voice.utterance import Emit, TrackerOptions, UtteranceTracker


@dataclass(frozen=True)
class BesideTheLLM:
    """The end-of-turn model, run with one core lent to it by the LLM (``LocalScheduling.core_lent``).

    It runs at each pause, just as a speculative reply's first tokens are written on every core,
    and a step split over the core it takes waits for its slowest thread (figures in the README).
    """

    detector: TurnDetector
    llm: ChatLLM

    def complete_probability(self, audio: np.ndarray) -> float:
        if (scheduling := scheduling_of(self.llm)) is None:
            return self.detector.complete_probability(audio)
        with scheduling.core_lent():
            return self.detector.complete_probability(audio)


def listen(
    models: VoiceStages,
    settings: Settings,
    emit: Emit,
    *,
    next_turn_id: Callable[[], int],
    clock: Clock,
    run_blocking: RunBlocking,
    language: Callable[[], str | None],
) -> UtteranceTracker:
    """A tracker of the user's utterances as ``settings`` tune it; ``language``: the one to transcribe in, now."""
    vad = models.vad_stream(
        VadConfig(
            threshold=settings.vad_threshold,
            neg_threshold=max(0.05, settings.vad_threshold - 0.15),
            min_speech_ms=settings.min_speech_ms,
            min_silence_ms=settings.pause_ms,
        )
    )
    return UtteranceTracker(
        vad,
        models.asr,
        emit,
        next_turn_id=next_turn_id,
        clock=clock,
        run_blocking=run_blocking,
        turn_detector=None if models.turn is None else BesideTheLLM(models.turn, models.llm),
        language=language,
        early_tail=lambda: models.solo,  # several sessions share Whisper: no transcriptions wasted on gaps
        options=TrackerOptions(
            endpointer=Endpointer(
                settings.endpoint_silence_ms,
                settings.endpoint_unfinished_silence_ms,
                settings.endpoint_complete_silence_ms,
                settings.turn_complete_threshold,
                settings.turn_incomplete_threshold,
            ),
            partial_interval_ms=settings.partial_interval_ms,
            max_utterance_s=settings.max_utterance_s,
            tail_start_ms=settings.tail_start_ms,
        ),
    )
