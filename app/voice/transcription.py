"""How the user's audio becomes words: ASR as the utterance tracker runs it (``Transcriber``), and the tail's
transcription (``TailJobs``), started in quiet windows before the VAD calls a pause.

Its own unit because the tracker (``app.voice.utterance``) decides what an utterance is and when it ends, while
getting the tail's words early (the reply cannot start before them) has rules of its own: which quiet starts a
job, and when the pause takes that job over or starts afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.stages.base import SpeechRecognizer, Transcription, VoiceActivity
from app.voice.clock import Clock, RunBlocking
from app.voice.recent_audio import SAMPLES_PER_MS, RecentAudio
from app.voice.text import without_trailing_loop

TAIL_PAD_MS = 160  # audio kept after the VAD end (the last phoneme fades)


@dataclass(frozen=True)
class Transcriber:
    """ASR off the event loop, in the language the session asks for now (``language``, read at each call), without
    a loop Whisper ran into at the end of the audio."""

    asr: SpeechRecognizer
    run_blocking: RunBlocking
    clock: Clock
    language: Callable[[], str | None]

    async def transcribe(self, audio: np.ndarray, context: str, wait: bool = True) -> Transcription | None:
        """``audio`` in words (None: ``wait=False`` and ASR was busy)."""
        language = self.language()
        result = await self.run_blocking(
            lambda: self.asr.transcribe(audio, wait=wait, context=context, language=language)
        )
        if result is None:
            return None
        return replace(result, text=without_trailing_loop(result.text, len(audio) / ASR_SAMPLE_RATE))

    async def timed(self, audio: np.ndarray, context: str) -> tuple[Transcription | None, float]:
        """``transcribe``, and what it took in ms."""
        started = self.clock.now()
        result = await self.transcribe(audio, context=context)
        return result, (self.clock.now() - started) * 1000


@dataclass
class TailJob:
    """The tail's transcription (and what it took, in ms) for the quiet that began at stream sample ``pause``;
    its audio ends at ``heard_until``."""

    pause: int
    heard_until: int
    task: asyncio.Task[tuple[Transcription | None, float]]

    def hears_up_to(self, pause: int) -> bool:
        """Whether this job heard all the speech before a pause the VAD placed at ``pause``."""
        return self.pause <= pause <= self.heard_until


class TailJobs:
    """The tail's transcription jobs of the utterance in progress: the one started early, in quiet the VAD has not
    yet called a pause (``quiet``), and the one the pause gets (``at_pause``).

    Each takes the audio from ``audio_start`` (after the utterance's stable text, which is its ``context``).
    ``early``: whether a job may start before the pause, read at each quiet window (several sessions share
    Whisper: no transcriptions wasted on gaps between words).
    """

    def __init__(
        self,
        transcriber: Transcriber,
        audio: RecentAudio,
        vad: VoiceActivity,
        *,
        tail_start_ms: int,
        early: Callable[[], bool],
    ) -> None:
        self._transcriber, self._audio, self._vad = transcriber, audio, vad
        self._tail_start_ms, self._early = tail_start_ms, early
        self._early_job: TailJob | None = None  # started at a quiet window the VAD has not yet called a pause

    def quiet(self, audio_start: int, context: str) -> None:
        """After ``tail_start_ms`` of quiet: transcribe the tail now, before the VAD calls it a pause.

        The VAD needs ``pause_ms`` of silence to call a pause, and the reply cannot start before
        the tail's words are known; starting the transcription sooner takes part of that wait off
        the critical path. The quiet counts from the first window under the VAD's speech threshold
        (``quiet_start``), a window before its silence as a rule; the pause takes the job over when
        the job heard up to where the silence began (``TailJob.hears_up_to``), else a new one starts
        then. Its audio ends where the quiet has reached rather than ``TAIL_PAD_MS`` after the
        silence began (what that cost in accuracy: app/bench/results/turn_flow.md). The end-of-turn model waits for the
        pause: it heard less trailing quiet as a less finished turn.
        """
        quiet = self._vad.quiet_start
        if quiet is None or not self._early():
            return
        if self._audio.end - quiet < self._tail_start_ms * SAMPLES_PER_MS:
            return
        job, silence = self._early_job, self._vad.silence_start
        if job is not None and (silence is None or job.hears_up_to(silence)):
            return  # already started for this quiet
        self.forget()
        self._early_job = self.start(quiet if silence is None else silence, audio_start, context)

    def at_pause(self, pause: int, audio_start: int, context: str) -> TailJob:
        """The job of a pause the VAD placed at ``pause``: the early one where it heard up to there, else a new one."""
        job = self._early_job
        if job is not None and job.hears_up_to(pause):
            self._early_job = None  # the pause takes the job over
            return job
        self.forget()  # no early job, or one that did not hear up to the pause
        return self.start(pause, audio_start, context)

    def start(self, pause: int, audio_start: int, context: str) -> TailJob:
        heard_until = min(pause + TAIL_PAD_MS * SAMPLES_PER_MS, self._audio.end)
        audio = self._audio.slice(audio_start, heard_until)
        transcribed = self._transcriber.timed(audio, context)
        return TailJob(pause, heard_until, asyncio.create_task(transcribed, name="asr-tail-job"))

    def forget(self) -> None:
        """The early job is void (the user spoke on, or the utterance is dropped)."""
        if self._early_job is not None:
            self._early_job.task.cancel()
            self._early_job = None
