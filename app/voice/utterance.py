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

Its parts: the recent audio (``app.voice.recent_audio``), the transcription of the tail, started early in quiet
windows (``app.voice.transcription``), and the judges of a pause besides the words' own cue: the LLM and the
end-of-turn model (``app.voice.turn_end``).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.stages.base import SpeechRecognizer, TurnDetector, TurnEndVerdict, VoiceActivity
from app.voice.clock import Clock, RunBlocking
from app.voice.recent_audio import SAMPLES_PER_MS, RecentAudio
from app.voice.text import text_after
from app.voice.transcription import TAIL_PAD_MS, TailJob, TailJobs, Transcriber
from app.voice.turn_end import Ask, PauseVerdicts, TextTurnEnd, TurnEndJudges
from app.voice.turns import Endpointer, PartialStabilizer, is_filler

PREROLL_MS = 300  # audio kept before the VAD start so the first phoneme is not clipped
STABLE_AFTER_S = 6.0  # shorter utterances are re-decoded whole: more accurate, and cheap


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


@dataclass(frozen=True)
class TrackerModels:
    """What a tracker hears the user with: its VAD stream, ASR, and the judges of a pause besides the words' own cue,
    the end-of-turn model (``turn_detector``) and the LLM (``text_turn_end``): None where there is none, or it is
    not asked. Together because they come together, from the session's models (``listening.listen``)."""

    vad: VoiceActivity
    asr: SpeechRecognizer
    turn_detector: TurnDetector | None = None
    text_turn_end: TextTurnEnd | None = None


@dataclass(frozen=True)
class TrackerOptions:
    endpointer: Endpointer = field(default_factory=Endpointer)
    partial_interval_ms: int = 400
    max_utterance_s: float = 30.0
    tail_start_ms: int = 32  # quiet after which the tail's transcription starts (at most the VAD's pause)
    text_wait_ms: int = 400  # the silence up to which the endpoint waits for the LLM's verdict (then: the other cues)


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
    tail_task: asyncio.Task | None = None  # the tail up to ``pause``: its job, then its events
    tail_text: str | None = None  # its result, once done
    verdicts: PauseVerdicts = field(default_factory=PauseVerdicts)  # whether this pause ends the turn
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
        for task in (self.tail_task, self.partial_task, self.verdicts.text_task):
            if task is not None:
                task.cancel()


class UtteranceTracker:
    def __init__(
        self,
        models: TrackerModels,
        emit: Emit,
        *,
        next_turn_id: Callable[[], int],
        clock: Clock,
        run_blocking: RunBlocking,
        options: TrackerOptions | None = None,
        language: Callable[[], str | None] = lambda: None,
        early_tail: Callable[[], bool] = lambda: True,
    ) -> None:
        """``language``: the one to transcribe in, read at each call (a session's config applies to the next words);
        ``early_tail``: whether the tail's transcription may start before the pause, read at each quiet window."""
        self._vad = models.vad
        self._emit = emit
        self._next_turn_id = next_turn_id
        self._clock = clock
        self.options = options or TrackerOptions()
        self._audio = RecentAudio(clock)
        self._transcriber = Transcriber(models.asr, run_blocking, clock, language)
        tail_start_ms = self.options.tail_start_ms
        self._tails = TailJobs(self._transcriber, self._audio, self._vad, tail_start_ms=tail_start_ms, early=early_tail)
        self._judges = TurnEndJudges(
            models.turn_detector,
            models.text_turn_end,
            endpointer=self.options.endpointer,
            clock=clock,
            run_blocking=run_blocking,
        )
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
        self._audio.append(samples, idle=self._utterance is None)
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
                self._tails.forget()  # any quiet window before was a dip between words
                self._maybe_partial(utterance)
            elif utterance.pause is None:
                self._tails.quiet(utterance.audio_start(), utterance.stable_text)
            if not self._vad.trailing_silence:  # the hangover is silence, not speech to count
                await self._emit(Speaking(utterance.turn_id, (self._audio.end - utterance.start) / SAMPLES_PER_MS))
            if utterance is not self._utterance:
                return
            if self._audio.end - utterance.start > self.options.max_utterance_s * ASR_SAMPLE_RATE:
                await self._on_pause(self._audio.end)  # a monologue: answer what we have so far
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
        audio = self._audio.slice(utterance.audio_start(), self._audio.end)
        result = await self._transcriber.transcribe(audio, context=utterance.stable_text)
        return result.text if result is not None else ""

    async def drop(self) -> None:
        """Forget the utterance in progress (reset, new input format, session closed)."""
        utterance, self._utterance = self._utterance, None
        if utterance is not None:
            self._tails.forget()
            utterance.cancel_jobs()

    # ------------------------------------------------------------------ internals
    async def _on_speech_start(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None:
            turn_id = self._next_turn_id()
            self._utterance = _Utterance(start=sample, turn_id=turn_id, last_partial_at=sample)
            await self._emit(SpeechStarted(turn_id, self._audio.time_of(sample)))
            return
        if utterance.pause is None:
            return
        # The user went on after a pause: what we transcribed up to it becomes stable text.
        if utterance.tail_text is not None and utterance.pause - utterance.start >= STABLE_AFTER_S * ASR_SAMPLE_RATE:
            # Long utterance: freeze the text so far, decode only what follows (with it as context).
            utterance.stable_text = utterance.text()
            utterance.stable_until = utterance.pause + TAIL_PAD_MS * SAMPLES_PER_MS
        for task in (utterance.tail_task, utterance.verdicts.text_task):
            if task is not None and not task.done():
                task.cancel()  # its transcription, the end-of-turn model after it, the LLM's verdict
        utterance.pause, utterance.tail_task, utterance.tail_text = None, None, None
        utterance.verdicts.reset()
        await self._emit(Resumed(utterance.turn_id))

    async def _on_pause(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None or utterance.pause is not None:
            return
        utterance.pause = sample
        await self._emit(Paused(utterance.turn_id))
        job = self._tails.at_pause(sample, utterance.audio_start(), utterance.stable_text)
        end = sample + TAIL_PAD_MS * SAMPLES_PER_MS
        whole = self._audio.slice(utterance.start - PREROLL_MS * SAMPLES_PER_MS, end)  # the turn model hears it all
        utterance.tail_task = asyncio.create_task(self._finish_tail(utterance, job, whole), name="asr-tail")

    def _ask_the_llm(self, utterance: _Utterance, verdict: TurnEndVerdict) -> None:
        """Await the LLM's verdict on whether the words end the turn (``TurnEndJudges.question``).

        Apart from the tail's task: a commit never waits for this verdict (``_commit`` waits for the
        words), and the endpoint waits for it only until the silence reaches ``text_wait_ms`` (``_maybe_commit``): a
        busy engine (several users) then costs a confident turn end at most that silence, not the LLM's delay.
        """
        verdicts = utterance.verdicts
        verdicts.text_asked_at = self._clock.now()
        ask = self._judges.question(utterance.text(), verdict)
        verdicts.text_task = asyncio.create_task(self._llm_verdict(utterance, ask), name="llm-turn-end")

    async def _llm_verdict(self, utterance: _Utterance, ask: Ask) -> None:
        verdicts = utterance.verdicts
        await self._judges.read_the_words(verdicts, ask)
        in_time = (
            utterance.pause is not None
            and self._audio.end - utterance.pause < self.options.text_wait_ms * SAMPLES_PER_MS
        )
        # (a late verdict: the words' cue decides, see ``TurnEndJudges``)
        if in_time and self._judges.sound_matters(verdicts, utterance.text(), utterance.language):
            await self._judges.ask_the_sound(verdicts)
        await self._maybe_commit(utterance)

    async def _finish_tail(self, utterance: _Utterance, job: TailJob, whole: np.ndarray) -> None:
        """At the pause: once the tail is heard, ask the LLM whether the words end the turn and tell the
        session (it may speculate); see if the turn ends once the verdicts are in.

        The LLM is asked first where there is one, the end-of-turn model (the sound) after it where it matters; else
        the sound at the pause (why: ``TurnEndJudges``). The words are told without waiting for either: a speculative
        reply needs only them, and may take the LLM's verdict to read it from its own prefill (``TurnEndVerdict``).
        """
        verdicts, judges = utterance.verdicts, self._judges
        turn_end = judges.sound_at_pause(verdicts, whole)
        try:
            result, asr_ms = await job.task
            if utterance.pause is None:
                return  # the user went on speaking; a newer tail will be transcribed
            utterance.tail_text = result.text if result is not None else ""
            utterance.language = result.language if result is not None and result.language else None
            utterance.asr_ms = asr_ms
            verdicts.pending = True
            verdict = TurnEndVerdict() if judges.asks_the_words(utterance.text(), utterance.language) else None
            if utterance is self._utterance:  # (else already being committed; _commit reads tail_text)
                speech_end = self._audio.time_of(utterance.pause)
                tail = TailText(utterance.turn_id, utterance.text(), speech_end, utterance.language, verdict)
                await self._emit(tail)  # a speculative reply may take the verdict, to read it from its own prefill
            if verdict is not None:
                self._ask_the_llm(utterance, verdict)
            elif turn_end is None:
                turn_end = judges.sound_where_it_matters(verdicts, whole, utterance.text(), utterance.language)
            if turn_end is not None:
                verdicts.turn_probability, verdicts.turn_ms = await turn_end
        finally:  # when this one is cancelled (the user went on), so are its jobs
            job.task.cancel()
            if turn_end is not None:
                turn_end.cancel()
        if not verdicts.sound_running:  # (else the sound asked after the LLM holds the endpoint)
            verdicts.pending = False
        await self._maybe_commit(utterance)

    def _maybe_partial(self, utterance: _Utterance) -> None:
        if self._audio.end - utterance.last_partial_at < self.options.partial_interval_ms * SAMPLES_PER_MS:
            return
        if utterance.partial_task is not None and not utterance.partial_task.done():
            return
        utterance.last_partial_at = self._audio.end
        audio = self._audio.slice(utterance.audio_start(), self._audio.end)
        utterance.partial_task = asyncio.create_task(self._partial(utterance, audio), name="asr-partial")

    async def _partial(self, utterance: _Utterance, audio: np.ndarray) -> None:
        # wait=False: a partial never queues behind another session's final transcript
        result = await self._transcriber.transcribe(audio, context=utterance.stable_text, wait=False)
        if result is None or utterance is not self._utterance:
            return
        hypothesis = " ".join(p for p in (utterance.stable_text, result.text) if p)
        shown = utterance.stabilizer.update(hypothesis)
        # shown: the words two hypotheses agree on, one partial behind; the warm-up takes the newest hypothesis
        await self._emit(Partial(utterance.turn_id, shown or None, hypothesis.rstrip(".… ")))

    async def _maybe_commit(self, utterance: _Utterance) -> None:
        if utterance is not self._utterance or utterance.pause is None or self._vad.speech_pending:
            return  # (speech_pending: the user may be starting again; wait for the VAD to decide)
        silence_ms = (self._audio.end - utterance.pause) / SAMPLES_PER_MS
        endpointer, verdicts = self.options.endpointer, utterance.verdicts
        if utterance.tail_text is None or verdicts.pending:
            if silence_ms >= endpointer.unfinished_silence_ms:
                await self._commit(utterance)  # ASR or the end-of-turn model is late: commit and wait for it
            return
        if verdicts.text_asked_at is not None and silence_ms < self.options.text_wait_ms:
            # the LLM has not answered yet: past this silence the words' own cue decides (a later verdict counts;
            # the sound is not asked then, see ``TurnEndJudges``)
            return
        required = endpointer.required_silence_ms(
            utterance.text(), verdicts.turn_probability, utterance.language, verdicts.text_probability
        )
        if silence_ms >= required:
            await self._commit(utterance)

    async def _commit(self, utterance: _Utterance, forced: bool = False) -> None:
        self._utterance = None
        commit = self._clock.now()
        verdicts = utterance.verdicts
        for task in (utterance.partial_task, verdicts.text_task):
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
        end = utterance.pause if utterance.pause is not None else self._audio.end
        speech_end = self._audio.time_of(end)
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
                turn_probability=verdicts.turn_probability,
                turn_detect_ms=verdicts.turn_ms,
                turn_text_probability=verdicts.text_probability,
                turn_text_ms=verdicts.text_ms,
                language=utterance.language,
            )
        )
