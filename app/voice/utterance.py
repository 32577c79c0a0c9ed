"""The user's side of a turn: 16 kHz audio in, typed utterance events out.

``UtteranceTracker`` keeps the recent input audio, runs the session's VAD over it, and
schedules the two kinds of ASR job:

* partials while the user speaks (every ``partial_interval_ms``, skipped when ASR is busy);
* the tail at each pause: the not-yet-stable audio, transcribed at once so that its text is
  ready (and a reply can be speculated) before the endpoint silence has passed. The job
  starts after ``tail_start_ms`` of quiet, before the VAD calls it a pause (``pause_ms``), and
  the pause takes it over; quiet that turns back into speech wastes that job.

It decides when an utterance ends (the endpoint rule of ``app.voice.turns``) and reports
everything as events; what to do about them (speculate, reply, barge in) is the session's
business. It knows no socket, no protocol and no model: VAD and ASR come in through the
``app.stages.base`` interfaces, time through ``app.voice.clock``.

Timeline of a spoken turn::

  speech ─┬─ Partial texts every partial_interval_ms
          ├─ quiet ≥ tail_start_ms: the tail's transcription starts
          └─ pause (VAD silence ≥ pause_ms): Paused, the tail is transcribed -> TailText
               ├─ the user speaks again: Resumed (a speculation on TailText is void)
               └─ silence reaches the endpoint: Committed (or Dropped when it was noise)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.stages.base import SpeechRecognizer, Transcription, TurnDetector, TurnEndVerdict, VoiceActivity
from app.voice.clock import ArrivalClock, Clock, RunBlocking
from app.voice.text import text_after, without_trailing_loop
from app.voice.turns import Endpointer, PartialStabilizer, is_filler, looks_unfinished

log = logging.getLogger(__name__)

SAMPLES_PER_MS = ASR_SAMPLE_RATE // 1000
PREROLL_MS = 300  # audio kept before the VAD start so the first phoneme is not clipped
# Between utterances the buffer keeps this much: the VAD reports a start only after
# min_speech_ms of speech, pointing back to where it began, and the pre-roll reaches back
# from there. Keeping only PREROLL_MS cut "Can you" off "Can you recommend a good book?"
# in 2 of 28 benchmark turns.
IDLE_KEEP_MS = 1000
STABLE_AFTER_S = 6.0  # shorter utterances are re-decoded whole: more accurate, and cheap
TAIL_PAD_MS = 160  # audio kept after the VAD end (the last phoneme fades)


# ---------------------------------------------------------------- events
@dataclass(frozen=True)
class SpeechStarted:
    turn_id: int
    onset: float  # wall time the speech's first frame arrived (the VAD confirms it ~0.1 s later)


@dataclass(frozen=True)
class Resumed:
    """The user went on speaking after a pause: text of the pause is no longer the end."""

    turn_id: int


@dataclass(frozen=True)
class Paused:
    turn_id: int


@dataclass(frozen=True)
class Speaking:
    """Sent for each chunk of audio heard as speech (barge-in is judged on it).

    Not sent during the VAD's hangover (the quiet windows before it decides speech ended):
    counting those made a 300 ms "mm-hmm" look like 400 ms of speech and interrupt a reply.
    """

    turn_id: int
    speech_ms: float


@dataclass(frozen=True)
class Partial:
    turn_id: int
    text: str | None  # what to show: grows monotonically within an utterance (None: nothing new to show)
    heard: str = ""  # the ASR's whole hypothesis so far, its last word perhaps cut: what the LLM prefills ahead


@dataclass(frozen=True)
class TailText:
    """The utterance's text up to the current pause; ``speech_end`` is when that audio arrived."""

    turn_id: int
    text: str
    speech_end: float
    language: str | None = None
    # the LLM's end-of-turn verdict on ``text``, offered to a speculative reply to read from its own prefill
    # (``TurnEndVerdict``); None where the LLM is not asked (a filler, words that end mid-clause, no text signal)
    verdict: TurnEndVerdict | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Committed:
    """The user finished: a turn with its text and the figures of how it was found."""

    turn_id: int
    text: str
    speech_end: float  # wall time the last speech audio arrived
    commit: float  # wall time the endpoint fired
    endpoint_ms: float
    asr_final_ms: float  # transcript wait after the endpoint
    asr_compute_ms: float
    turn_probability: float | None = None  # the end-of-turn model's verdict at the last pause
    turn_detect_ms: float | None = None  # what that verdict cost
    turn_text_probability: float | None = None  # the LLM's P that the words end there (None: not asked, or late)
    turn_text_ms: float | None = None  # what that verdict cost
    language: str | None = None  # the language the words were heard in

    def figures(self) -> dict[str, float | None]:
        """How the turn was found, as ``protocol.TurnMetrics`` fields."""
        return {
            "endpoint_ms": self.endpoint_ms,
            "asr_final_ms": self.asr_final_ms,
            "asr_compute_ms": self.asr_compute_ms,
            "turn_detect_ms": self.turn_detect_ms,
            "turn_probability": self.turn_probability,
            "turn_text_probability": self.turn_text_probability,
            "turn_text_ms": self.turn_text_ms,
        }


@dataclass(frozen=True)
class Dropped:
    """The utterance was noise or filler ("mm", a cough): not a turn."""

    turn_id: int
    text: str


UtteranceEvent = SpeechStarted | Resumed | Paused | Speaking | Partial | TailText | Committed | Dropped
Emit = Callable[[UtteranceEvent], Awaitable[None]]
TextTurnEnd = Callable[[str], Awaitable[float | None]]
"""P(the user's words end here) from their text (the LLM's, ``listening.TextTurnEnd``); None when it cannot say."""


@dataclass(frozen=True)
class TrackerOptions:
    endpointer: Endpointer = field(default_factory=Endpointer)
    partial_interval_ms: int = 400
    max_utterance_s: float = 30.0
    tail_start_ms: int = 32  # quiet after which the tail's transcription starts (at most the VAD's pause)
    text_wait_ms: int = 400  # the silence up to which the endpoint waits for the LLM's verdict (then: the other cues)


@dataclass
class _TailJob:
    """The tail's transcription (and what it took, in ms) for the quiet that began at stream sample ``pause``;
    its audio ends at ``heard_until``."""

    pause: int
    heard_until: int
    task: asyncio.Task[tuple[Transcription | None, float]]

    def hears_up_to(self, pause: int) -> bool:
        """Whether this job heard all the speech before a pause the VAD placed at ``pause``."""
        return self.pause <= pause <= self.heard_until


@dataclass
class _Utterance:
    """The utterance in progress, from the VAD start until it is committed."""

    start: int  # stream sample where speech began
    turn_id: int  # reserved at the start so partials, the final and the reply share it
    stable_text: str = ""  # text of audio before ``stable_until``, final already
    stable_until: int | None = None
    stabilizer: PartialStabilizer = field(default_factory=PartialStabilizer)
    last_partial_at: int = 0
    pause: int | None = None  # stream sample where the current silence began
    early_tail: _TailJob | None = None  # started at a quiet window the VAD has not yet called a pause
    tail_task: asyncio.Task | None = None  # the tail up to ``pause``: its job, then its events
    tail_text: str | None = None  # its result, once done
    turn_probability: float | None = None  # the end-of-turn model's verdict at this pause
    turn_ms: float | None = None
    text_probability: float | None = None  # the LLM's P that the words end at this pause
    text_ms: float | None = None
    text_asked_at: float | None = None  # when the LLM was asked, while its verdict is awaited
    text_task: asyncio.Task | None = None
    verdict_pending: bool = False  # the tail's words are in, the end-of-turn model's verdict is not yet
    heard_whole: np.ndarray | None = None  # what the end-of-turn model hears at this pause (asked for it or not)
    sound_asked: bool = False  # the end-of-turn model was asked at this pause
    sound_running: bool = False  # the end-of-turn model asked after the LLM, in its task (``_ask_the_sound``)
    language: str | None = None  # what ASR heard the tail in
    asr_ms: float = 0.0
    partial_task: asyncio.Task | None = None
    continued_text: str = ""  # a continued turn: what was committed before the user went on

    def text(self) -> str:
        return " ".join(part for part in (self.stable_text, self.tail_text or "") if part).strip()

    def added_text(self) -> str:
        """The words said in this utterance (of a continued turn: after what was committed before)."""
        return text_after(self.text(), self.continued_text)

    def audio_start(self) -> int:
        return self.stable_until or self.start - PREROLL_MS * SAMPLES_PER_MS

    def cancel_jobs(self) -> None:
        self.forget_early_tail()
        for task in (self.tail_task, self.partial_task, self.text_task):
            if task is not None:
                task.cancel()

    def forget_early_tail(self) -> None:
        if self.early_tail is not None:
            self.early_tail.task.cancel()
            self.early_tail = None


class UtteranceTracker:
    def __init__(
        self,
        vad: VoiceActivity,
        asr: SpeechRecognizer,
        emit: Emit,
        *,
        next_turn_id: Callable[[], int],
        clock: Clock,
        run_blocking: RunBlocking,
        options: TrackerOptions | None = None,
        turn_detector: TurnDetector | None = None,
        text_turn_end: TextTurnEnd | None = None,
        language: Callable[[], str | None] = lambda: None,
        early_tail: Callable[[], bool] = lambda: True,
    ) -> None:
        self._vad = vad
        self._asr = asr
        self._turn_detector = turn_detector
        self._text_turn_end = text_turn_end
        self._language = language  # read at each call, so a session's config applies to the next words
        self._early_tail = early_tail  # read at each quiet window: tail_start_ms applies, or the pause
        self._emit = emit
        self._next_turn_id = next_turn_id
        self._clock = clock
        self._run = run_blocking
        self.options = options or TrackerOptions()
        self._audio = np.zeros(0, dtype=np.float32)  # recent input, ends at stream sample _audio_end
        self._audio_end = 0
        self._arrivals = ArrivalClock(clock)
        self._utterance: _Utterance | None = None

    @property
    def in_utterance(self) -> bool:
        return self._utterance is not None

    @property
    def speech_may_be_ending(self) -> bool:
        """In quiet windows or a pause: the tail (the critical path) is about to run, or runs."""
        utterance = self._utterance
        return utterance is not None and (utterance.pause is not None or self._vad.quiet_start is not None)

    @property
    def buffered_samples(self) -> int:
        return len(self._audio)

    async def feed(self, samples: np.ndarray) -> None:
        """Take the next 16 kHz float32 samples of the stream."""
        if not len(samples):
            return
        self._audio = np.concatenate([self._audio, samples])
        self._audio_end += len(samples)
        self._arrivals.mark(self._audio_end, self._clock.now())
        if self._utterance is None and len(self._audio) > 2 * IDLE_KEEP_MS * SAMPLES_PER_MS:
            self._audio = self._audio[-IDLE_KEEP_MS * SAMPLES_PER_MS :]

        for event in self._vad.feed(samples):
            if event.kind == "start":
                await self._on_speech_start(event.sample)
            else:
                await self._on_pause(event.sample)
        utterance = self._utterance
        if utterance is None:
            return
        if self._vad.speaking:
            # In quiet windows the speech may be ending: a partial started now would hold ASR
            # just when the tail (the words a reply is made from) is wanted.
            if self._vad.quiet_start is None:
                utterance.forget_early_tail()  # any quiet window before was a dip between words
                self._maybe_partial(utterance)
            else:
                self._maybe_start_tail(utterance)
            if not self._vad.trailing_silence:  # the hangover is silence, not speech to count
                await self._emit(Speaking(utterance.turn_id, (self._audio_end - utterance.start) / SAMPLES_PER_MS))
            if utterance is not self._utterance:
                return
            if self._audio_end - utterance.start > self.options.max_utterance_s * ASR_SAMPLE_RATE:
                await self._on_pause(self._audio_end)  # a monologue: answer what we have so far
                await self._commit(utterance, forced=True)
        else:
            await self._maybe_commit(utterance)

    def continue_turn(self, turn_id: int, text: str) -> None:
        """The utterance that just started goes on with the committed turn ``turn_id`` (which said ``text``).

        Its events carry ``turn_id`` and its texts start with ``text`` (also Whisper's context),
        so the turn is committed again as a whole; it is dropped (``Dropped``) when what is
        added is only noise or a filler.
        """
        utterance = self._utterance
        if utterance is None:
            return
        utterance.turn_id = turn_id
        utterance.stable_text = utterance.continued_text = text

    async def transcribe_speech_so_far(self) -> str:
        """The words of the utterance in progress, up to now (to judge a barge-in: "yeah" or "wait, stop")."""
        utterance = self._utterance
        if utterance is None:
            return ""
        audio = self._slice(utterance.audio_start(), self._audio_end)
        result = await self._transcribe(audio, context=utterance.stable_text)
        return result.text if result is not None else ""

    async def drop(self) -> None:
        """Forget the utterance in progress (reset, new input format, session closed)."""
        utterance, self._utterance = self._utterance, None
        if utterance is not None:
            utterance.cancel_jobs()

    # ------------------------------------------------------------------ internals
    def _slice(self, start: int, end: int) -> np.ndarray:
        first = self._audio_end - len(self._audio)
        return self._audio[max(0, start - first) : max(0, end - first)].copy()

    async def _on_speech_start(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None:
            turn_id = self._next_turn_id()
            self._utterance = _Utterance(start=sample, turn_id=turn_id, last_partial_at=sample)
            await self._emit(SpeechStarted(turn_id, self._arrivals.time_of(sample)))
            return
        if utterance.pause is None:
            return
        # The user went on after a pause: what we transcribed up to it becomes stable text.
        if utterance.tail_text is not None and utterance.pause - utterance.start >= STABLE_AFTER_S * ASR_SAMPLE_RATE:
            # Long utterance: freeze the text so far, decode only what follows (with it as context).
            utterance.stable_text = utterance.text()
            utterance.stable_until = utterance.pause + TAIL_PAD_MS * SAMPLES_PER_MS
        for task in (utterance.tail_task, utterance.text_task):
            if task is not None and not task.done():
                task.cancel()  # its transcription, the end-of-turn model after it, the LLM's verdict
        utterance.pause, utterance.tail_task, utterance.tail_text = None, None, None
        utterance.turn_probability = utterance.turn_ms = None
        utterance.text_probability = utterance.text_ms = utterance.text_asked_at = utterance.text_task = None
        utterance.verdict_pending, utterance.heard_whole, utterance.sound_asked = False, None, False
        await self._emit(Resumed(utterance.turn_id))

    async def _on_pause(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None or utterance.pause is not None:
            return
        utterance.pause = sample
        await self._emit(Paused(utterance.turn_id))
        job = utterance.early_tail
        if job is not None and job.hears_up_to(sample):
            utterance.early_tail = None  # the pause takes the job over
        else:  # no early job, or one that did not hear up to the pause
            utterance.forget_early_tail()
            job = self._start_tail_job(utterance, sample)
        end = sample + TAIL_PAD_MS * SAMPLES_PER_MS
        whole = self._slice(utterance.start - PREROLL_MS * SAMPLES_PER_MS, end)  # the turn model hears it all
        utterance.tail_task = asyncio.create_task(self._finish_tail(utterance, job, whole), name="asr-tail")

    def _maybe_start_tail(self, utterance: _Utterance) -> None:
        """After ``tail_start_ms`` of quiet: transcribe the tail now, before the VAD calls it a pause.

        The VAD needs ``pause_ms`` of silence to call a pause, and the reply cannot start before
        the tail's words are known; starting the transcription sooner takes part of that wait off
        the critical path. The quiet counts from the first window under the VAD's speech threshold
        (``quiet_start``), a window before its silence as a rule; the pause takes the job over when
        the job heard up to where the silence began (``_TailJob.hears_up_to``), else a new one starts
        then. Its audio ends where the quiet has reached rather than ``TAIL_PAD_MS`` after the
        silence began (what that cost in accuracy: app/bench/results/turn_flow.md). The end-of-turn model waits for the
        pause: it heard less trailing quiet as a less finished turn.
        """
        quiet = self._vad.quiet_start
        if quiet is None or utterance.pause is not None or not self._early_tail():
            return
        if self._audio_end - quiet < self.options.tail_start_ms * SAMPLES_PER_MS:
            return
        job, silence = utterance.early_tail, self._vad.silence_start
        if job is not None and (silence is None or job.hears_up_to(silence)):
            return  # already started for this quiet
        utterance.forget_early_tail()
        utterance.early_tail = self._start_tail_job(utterance, quiet if silence is None else silence)

    def _start_tail_job(self, utterance: _Utterance, pause: int) -> _TailJob:
        heard_until = min(pause + TAIL_PAD_MS * SAMPLES_PER_MS, self._audio_end)
        audio = self._slice(utterance.audio_start(), heard_until)
        transcribed = self._transcribe_tail(audio, utterance.stable_text)
        return _TailJob(pause, heard_until, asyncio.create_task(transcribed, name="asr-tail-job"))

    async def _transcribe(self, audio: np.ndarray, context: str, wait: bool = True) -> Transcription | None:
        """``audio`` in words (None: ``wait=False`` and ASR was busy), without a loop Whisper ran into at its end."""
        language = self._language()
        result = await self._run(lambda: self._asr.transcribe(audio, wait=wait, context=context, language=language))
        if result is None:
            return None
        return replace(result, text=without_trailing_loop(result.text, len(audio) / ASR_SAMPLE_RATE))

    async def _detect_turn_end(self, audio: np.ndarray) -> tuple[float | None, float]:
        """The end-of-turn model's probability (None when there is no model, or it failed) and its cost."""
        detector, started = self._turn_detector, self._clock.now()
        if detector is None:
            return None, 0.0
        try:
            probability = await self._run(lambda: detector.complete_probability(audio))
        except Exception:  # the words alone still decide
            log.warning("end-of-turn model failed; using the words alone", exc_info=True)
            probability = None
        return probability, (self._clock.now() - started) * 1000

    def _llm_asked(self, utterance: _Utterance) -> bool:
        """Whether the LLM is asked if the words end the turn: not where the words' own cue already waits."""
        text = utterance.text()
        return (
            self._text_turn_end is not None
            and bool(text.strip())
            and not is_filler(text)
            and not looks_unfinished(text, utterance.language)
        )

    def _ask_the_llm(self, utterance: _Utterance, verdict: TurnEndVerdict) -> None:
        """Await the LLM's verdict on whether the words end the turn (where ``_llm_asked``): from the speculative
        reply that took ``verdict``, else asked apart (``TextTurnEnd``).

        Apart from the tail's task: a commit never waits for this verdict (``_commit`` waits for the
        words), and the endpoint waits for it only until the silence reaches ``text_wait_ms`` (``_maybe_commit``): a
        busy engine (several users) then costs a confident turn end at most that silence, not the LLM's delay.
        """
        utterance.text_asked_at = self._clock.now()
        ask = verdict.wait if verdict.taken else functools.partial(self._text_turn_end, utterance.text())
        utterance.text_task = asyncio.create_task(self._llm_verdict(utterance, ask), name="llm-turn-end")

    async def _llm_verdict(self, utterance: _Utterance, ask: Callable[[], Awaitable[float | None]]) -> None:
        started = self._clock.now()
        try:
            probability = await ask()
        except Exception:  # the sound and the words' cue still decide
            log.warning("the LLM's end-of-turn probability failed; using the other cues", exc_info=True)
            probability = None
        utterance.text_probability, utterance.text_asked_at = probability, None
        utterance.text_ms = (self._clock.now() - started) * 1000
        in_time = (
            utterance.pause is not None
            and self._audio_end - utterance.pause < self.options.text_wait_ms * SAMPLES_PER_MS
        )
        if in_time and self._sound_matters(utterance):  # (a late verdict: the words' cue decides, see ``_finish_tail``)
            await self._ask_the_sound(utterance)
        await self._maybe_commit(utterance)

    def _sound_matters(self, utterance: _Utterance) -> bool:
        """Whether the end-of-turn model's verdict could change this pause's endpoint, given the words and the
        LLM's (``Endpointer.sound_matters``); not asked already."""
        if utterance.sound_asked:
            return False
        endpointer = self.options.endpointer
        return endpointer.sound_matters(utterance.text(), utterance.language, utterance.text_probability)

    async def _ask_the_sound(self, utterance: _Utterance) -> None:
        """The end-of-turn model's verdict, asked in the LLM's verdict task after it (``_finish_tail``; cancelled
        with that task); the endpoint waits for it."""
        if utterance.heard_whole is None:
            return
        utterance.sound_asked = utterance.sound_running = utterance.verdict_pending = True
        try:
            utterance.turn_probability, utterance.turn_ms = await self._detect_turn_end(utterance.heard_whole)
        finally:
            utterance.sound_running = utterance.verdict_pending = False

    async def _transcribe_tail(self, audio: np.ndarray, context: str) -> tuple[Transcription | None, float]:
        started = self._clock.now()
        result = await self._transcribe(audio, context=context)
        return result, (self._clock.now() - started) * 1000

    async def _finish_tail(self, utterance: _Utterance, job: _TailJob, whole: np.ndarray) -> None:
        """At the pause: once the tail is heard, ask the LLM whether the words end the turn and tell the
        session (it may speculate); see if the turn ends once the verdicts are in.

        Where the LLM is asked, the end-of-turn model (the sound) is asked after its verdict, and only where it
        could change the endpoint (``Endpointer.sound_matters``: the words' P between ~2e-4 and ~0.09); not
        when the verdict is late past ``text_wait_ms`` (the words' own cue decides then: a sound asked at
        that point made four users' endpoint p50 594 ms instead of 398). Where it is not, the sound is asked at
        the pause, beside ASR on another core. Why: its ~100 ms of CPU at the pause slowed the tail's
        transcription and the speculative reply's first tokens beside it (one user, heard p50 699 -> 589 ms
        in ``bench voice``, three runs each), while on the labelled set the words decide nearly alone (accuracy 93.1 % words,
        92.2 % both: app/bench/results/turn_end.md).
        The words are told without waiting for the model: a speculative reply needs only them. The LLM's verdict
        comes from the speculative reply's own prefill where it takes it (``TurnEndVerdict``): the verdict's prompt
        is the reply's up to the words' end, so one prefill gives both, the verdict with the reply's first token.
        Asked apart (no speculation, or one that cannot read it), its prefill of the words ran beside the reply's;
        asked first, the verdict came ~40 ms after the words and the reply's first token ~50 ms after that (asked
        after the reply, the verdict came ~90 ms later: endpoint p50 231 -> 312 ms, ``bench voice``, 8 turns each).
        """
        utterance.heard_whole = whole
        asked_later = self._text_turn_end is not None  # the LLM is asked first, the sound where it matters
        turn_end = None if asked_later else asyncio.ensure_future(self._detect_turn_end(whole))
        utterance.sound_asked = turn_end is not None
        try:
            result, asr_ms = await job.task
            if utterance.pause is None:
                return  # the user went on speaking; a newer tail will be transcribed
            utterance.tail_text = result.text if result is not None else ""
            utterance.language = result.language if result is not None and result.language else None
            utterance.asr_ms = asr_ms
            utterance.verdict_pending = True
            verdict = TurnEndVerdict() if self._llm_asked(utterance) else None
            if utterance is self._utterance:  # (else already being committed; _commit reads tail_text)
                speech_end = self._arrivals.time_of(utterance.pause)
                tail = TailText(utterance.turn_id, utterance.text(), speech_end, utterance.language, verdict)
                await self._emit(tail)  # a speculative reply may take the verdict, to read it from its own prefill
            asked = verdict is not None
            if asked:
                self._ask_the_llm(utterance, verdict)
            if turn_end is None and not asked and not is_filler(utterance.text()) and self._sound_matters(utterance):
                turn_end = asyncio.ensure_future(self._detect_turn_end(whole))  # no LLM verdict will come
                utterance.sound_asked = True
            if turn_end is not None:
                utterance.turn_probability, utterance.turn_ms = await turn_end
        finally:  # when this one is cancelled (the user went on), so are its jobs
            job.task.cancel()
            if turn_end is not None:
                turn_end.cancel()
        if not utterance.sound_running:  # (else the sound asked after the LLM holds the endpoint)
            utterance.verdict_pending = False
        await self._maybe_commit(utterance)

    def _maybe_partial(self, utterance: _Utterance) -> None:
        if self._audio_end - utterance.last_partial_at < self.options.partial_interval_ms * SAMPLES_PER_MS:
            return
        if utterance.partial_task is not None and not utterance.partial_task.done():
            return
        utterance.last_partial_at = self._audio_end
        audio = self._slice(utterance.audio_start(), self._audio_end)
        utterance.partial_task = asyncio.create_task(self._partial(utterance, audio), name="asr-partial")

    async def _partial(self, utterance: _Utterance, audio: np.ndarray) -> None:
        # wait=False: a partial never queues behind another session's final transcript
        result = await self._transcribe(audio, context=utterance.stable_text, wait=False)
        if result is None or utterance is not self._utterance:
            return
        hypothesis = " ".join(p for p in (utterance.stable_text, result.text) if p)
        shown = utterance.stabilizer.update(hypothesis)
        # shown: the words two hypotheses agree on, one partial behind; the warm-up takes the newest hypothesis
        await self._emit(Partial(utterance.turn_id, shown or None, hypothesis.rstrip(".… ")))

    async def _maybe_commit(self, utterance: _Utterance) -> None:
        if utterance is not self._utterance or utterance.pause is None or self._vad.speech_pending:
            return  # (speech_pending: the user may be starting again; wait for the VAD to decide)
        silence_ms = (self._audio_end - utterance.pause) / SAMPLES_PER_MS
        endpointer = self.options.endpointer
        if utterance.tail_text is None or utterance.verdict_pending:
            if silence_ms >= endpointer.unfinished_silence_ms:
                await self._commit(utterance)  # ASR or the end-of-turn model is late: commit and wait for it
            return
        if utterance.text_asked_at is not None and silence_ms < self.options.text_wait_ms:
            # the LLM has not answered yet: past this silence the words' own cue decides (a later verdict counts;
            # the sound is not asked then, see ``_finish_tail``)
            return
        required = endpointer.required_silence_ms(
            utterance.text(), utterance.turn_probability, utterance.language, utterance.text_probability
        )
        if silence_ms >= required:
            await self._commit(utterance)

    async def _commit(self, utterance: _Utterance, forced: bool = False) -> None:
        self._utterance = None
        commit = self._clock.now()
        for task in (utterance.partial_task, utterance.text_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()  # (an LLM verdict still awaited is no longer needed: its request is aborted)
        tail = utterance.tail_task
        if tail is not None and not tail.done() and tail is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(tail)
        if forced and utterance.tail_text is None:
            await self._emit(Dropped(utterance.turn_id, ""))  # (its transcription was stopped: no words came)
            return
        text = utterance.text()
        end = utterance.pause if utterance.pause is not None else self._audio_end
        speech_end = self._arrivals.time_of(end)
        if is_filler(utterance.added_text()):
            await self._emit(Dropped(utterance.turn_id, text))
            return
        await self._emit(
            Committed(
                turn_id=utterance.turn_id,
                text=text,
                speech_end=speech_end,
                commit=commit,
                endpoint_ms=(commit - speech_end) * 1000,
                asr_final_ms=(self._clock.now() - commit) * 1000,
                asr_compute_ms=utterance.asr_ms,
                turn_probability=utterance.turn_probability,
                turn_detect_ms=utterance.turn_ms,
                turn_text_probability=utterance.text_probability,
                turn_text_ms=utterance.text_ms,
                language=utterance.language,
            )
        )
