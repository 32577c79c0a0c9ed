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
from app.stages.base import ChatLLM, Message, TurnDetector, VadConfig, VoiceStages, scheduling_of
from app.voice.clock import Clock, RunBlocking
from app.voice.turns import Endpointer
from app.voice.utterance import Emit, TrackerModels, TrackerOptions, UtteranceTracker


@dataclass(frozen=True)
class BesideTheLLM:
    """The end-of-turn model, run with one core lent to it by the LLM (``LocalScheduling.core_lent``).

    It runs at each pause, just as a speculative reply's first tokens are written on every core,
    and a step split over the core it takes waits for its slowest thread (figures: app/bench/results/engine_cpu.md).
    """

    detector: TurnDetector
    llm: ChatLLM

    def complete_probability(self, audio: np.ndarray) -> float:
        if (scheduling := scheduling_of(self.llm)) is None:
            return self.detector.complete_probability(audio)
        with scheduling.core_lent():
            return self.detector.complete_probability(audio)


@dataclass(frozen=True)
class TextTurnEnd:
    """The LLM's P that the user's words end their turn, asked with the conversation their reply will be
    asked with (``prompt``: the reply's messages for these words), so the prefix cache holds the prompt.

    None where the LLM has no ``LocalScheduling`` (it runs elsewhere): then the sound and the words' cue decide.
    """

    llm: ChatLLM
    prompt: Callable[[str], list[Message]]

    async def __call__(self, text: str) -> float | None:
        if (scheduling := scheduling_of(self.llm)) is None:
            return None
        *conversation, said = self.prompt(text)
        return await scheduling.end_of_turn_probability(conversation, said["content"])


def vad_config(settings: Settings) -> VadConfig:
    """The VAD as the settings tune it: speech starts after ``min_speech_ms``, pauses after ``pause_ms`` of quiet."""
    return VadConfig(
        threshold=settings.vad_threshold,
        neg_threshold=max(0.05, settings.vad_threshold - 0.15),
        min_speech_ms=settings.min_speech_ms,
        min_silence_ms=settings.pause_ms,
    )


def endpointer(settings: Settings) -> Endpointer:
    """The endpoint's rule as the settings tune it."""
    return Endpointer(
        settings.endpoint_silence_ms,
        settings.endpoint_unfinished_silence_ms,
        settings.endpoint_complete_silence_ms,
        settings.turn_complete_threshold,
        settings.turn_incomplete_threshold,
    )


def listen(
    models: VoiceStages,
    settings: Settings,
    emit: Emit,
    *,
    next_turn_id: Callable[[], int],
    clock: Clock,
    run_blocking: RunBlocking,
    language: Callable[[], str | None],
    prompt: Callable[[str], list[Message]] | None = None,
) -> UtteranceTracker:
    """A tracker of the user's utterances as ``settings`` tune it; ``language``: the one to transcribe in, now;
    ``prompt``: the reply's messages for some words (the LLM's end-of-turn signal is asked with them)."""
    vad = models.vad_stream(vad_config(settings))
    heard_with = TrackerModels(
        vad,
        models.asr,
        turn_detector=None if models.turn is None else BesideTheLLM(models.turn, models.llm),
        text_turn_end=TextTurnEnd(models.llm, prompt) if prompt is not None and settings.turn_text_signal else None,
    )
    return UtteranceTracker(
        heard_with,
        emit,
        next_turn_id=next_turn_id,
        clock=clock,
        run_blocking=run_blocking,
        language=language,
        early_tail=lambda: models.solo,  # several sessions share Whisper: no transcriptions wasted on gaps
        options=TrackerOptions(
            endpointer=endpointer(settings),
            partial_interval_ms=settings.partial_interval_ms,
            max_utterance_s=settings.max_utterance_s,
            tail_start_ms=settings.tail_start_ms,
            text_wait_ms=settings.turn_text_wait_ms,
        ),
    )
