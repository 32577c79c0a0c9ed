"""When the tail is heard: ``UtteranceTracker`` alone, on the energy VAD, scripted ASR and a manual clock.

The ASR records when each transcription ran (the clock is audio time: 20 ms a frame); the
runner counts the blocking jobs asked for and can hold them back, standing in for an ASR that
takes a while.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fakes import FRAME_S, RATE, EnergyVadModel, ManualClock, ScriptedASR, ScriptedTurnModel

from app.stages.base import VadConfig
from app.stages.vad import VadStream
from app.voice import utterance as heard

PAUSE_MS, VAD_WINDOW_MS, FRAME_MS = 96, 32, 20
QUESTION = "What is the capital of France?"


class Runner:
    """Runs blocking work inline once ``open`` is set (cleared: an ASR that takes a while); counts the jobs asked for.

    The jobs numbered in ``slow`` (1 = the first asked) wait for ``slow_done`` as well.
    """

    def __init__(self) -> None:
        self.asked = 0
        self.open = asyncio.Event()
        self.open.set()
        self.slow: set[int] = set()
        self.slow_done = asyncio.Event()

    async def __call__(self, work):
        self.asked += 1
        if self.asked in self.slow:
            await self.slow_done.wait()
        await self.open.wait()
        return work()


class TimedASR(ScriptedASR):
    """Also records the clock at each transcription."""

    def __init__(self, clock: ManualClock, text: str) -> None:
        super().__init__(text)
        self.clock = clock
        self.at: list[float] = []

    def transcribe(self, audio, **options):
        self.at.append(self.clock.now())
        return super().transcribe(audio, **options)


FADING = 0.03  # a level FadingVadModel hears at P 0.4: under the speech threshold, over the silence one


class FadingVadModel(EnergyVadModel):
    """As the energy VAD, but a faint window (the last sound of a word dying away) is heard at P 0.4, as Silero's
    probability falls through the speech threshold (0.5) a window before the silence threshold (0.35)."""

    def probability(self, window_with_context, state):
        level = float(np.sqrt(np.mean(window_with_context[-512:] ** 2)))
        return (1.0 if level > 0.05 else 0.4 if level > 0.01 else 0.0), state


class Ear:
    """One tracker and the events it emits; ``speech_end`` is the clock when the last loud frame ended."""

    def __init__(self, tail_start_ms: int = VAD_WINDOW_MS, vad_model=None) -> None:
        self.clock = ManualClock()
        self.asr = TimedASR(self.clock, QUESTION)
        self.run = Runner()
        self.events: list[heard.UtteranceEvent] = []
        self.speech_end = 0.0
        turn_ids = iter(range(1, 1000))
        self.vad = VadStream(vad_model or EnergyVadModel(), VadConfig(min_silence_ms=PAUSE_MS))
        self.turn_model = ScriptedTurnModel(0.9)
        self.tracker = heard.UtteranceTracker(
            heard.TrackerModels(self.vad, self.asr, turn_detector=self.turn_model),
            self._emit,
            next_turn_id=lambda: next(turn_ids),
            clock=self.clock,
            run_blocking=self.run,
            options=heard.TrackerOptions(tail_start_ms=tail_start_ms, partial_interval_ms=60_000),  # no partials
        )

    async def _emit(self, event) -> None:
        self.events.append(event)

    async def feed(self, seconds: float, level: float) -> None:
        for _ in range(round(seconds / FRAME_S)):
            self.clock.advance(FRAME_S)
            await self.tracker.feed(np.full(int(FRAME_S * RATE), level, np.float32))
            for _ in range(10):
                await asyncio.sleep(0)
        if level:
            self.speech_end = self.clock.now()

    def of(self, kind: type) -> list:
        return [event for event in self.events if isinstance(event, kind)]

    def transcribed_ms(self) -> list[float]:
        """When each transcription ran, in ms after the speech ended."""
        return [(t - self.speech_end) * 1000 for t in self.asr.at]


async def test_the_tail_is_transcribed_at_the_first_quiet_window():
    ear = Ear()
    await ear.feed(1.0, 0.3)
    await ear.feed(0.6, 0.0)
    [started] = ear.transcribed_ms()
    # once the first wholly quiet window is in (the window the speech ended in still sounds
    # loud), not PAUSE_MS of quiet later when the VAD confirms the pause
    assert started <= 2 * VAD_WINDOW_MS + FRAME_MS < PAUSE_MS
    [tail] = ear.of(heard.TailText)
    assert tail.text == QUESTION and ear.of(heard.Committed)[0].text == QUESTION


async def test_tail_start_ms_sets_how_much_quiet_starts_the_tail():
    starts = []
    for tail_start_ms in (VAD_WINDOW_MS, 2 * VAD_WINDOW_MS, PAUSE_MS):
        ear = Ear(tail_start_ms)
        await ear.feed(1.0, 0.3)
        await ear.feed(0.6, 0.0)
        [started] = ear.transcribed_ms()
        starts.append(started)
        assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]
    assert starts[0] < starts[1] < starts[2] and starts[2] >= PAUSE_MS  # 96: when the pause is confirmed


async def test_the_turn_model_waits_for_the_pause_and_hears_its_quiet():
    ear = Ear()
    await ear.feed(0.5, 0.0)
    ear.run.open.clear()
    await ear.feed(1.0, 0.3)
    await ear.feed(0.06, 0.0)
    assert ear.run.asked == 1  # the tail's transcription only
    await ear.feed(0.1, 0.0)
    assert ear.of(heard.Paused) and ear.run.asked == 2
    ear.run.open.set()
    await ear.feed(0.1, 0.0)
    [heard_s] = ear.turn_model.heard_seconds
    assert heard_s >= 1.0 + 0.3 + PAUSE_MS / 1000  # the speech, the pre-roll and the pause's quiet


async def test_the_words_are_told_before_a_slow_turn_model_answers_and_the_turn_waits_for_it():
    ear = Ear()
    ear.run.slow = {2}  # job 1: the tail's transcription; job 2: the end-of-turn model, at the pause
    await ear.feed(1.0, 0.3)
    await ear.feed(0.6, 0.0)
    assert ear.run.asked == 2
    # the words are out (a reply can be speculated on them) ...
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]
    # ... but the turn is not committed on the words alone while the model's verdict is due
    # (600 ms of quiet: more than the endpoint's 400 ms without a verdict, less than 1200)
    assert not ear.of(heard.Committed)
    ear.run.slow_done.set()
    await ear.feed(0.04, 0.0)
    [turn] = ear.of(heard.Committed)
    assert turn.text == QUESTION and turn.turn_probability == 0.9


async def test_a_turn_model_that_never_answers_holds_the_turn_only_as_long_as_a_late_transcript():
    ear = Ear()
    ear.run.slow = {2}
    await ear.feed(1.0, 0.3)
    await ear.feed(1.0, 0.0)
    assert not ear.of(heard.Committed)
    # 1.4 s of quiet: past the endpoint's 1200 ms for a late ASR, the turn ends and waits for the verdict
    feeding = asyncio.create_task(ear.feed(0.4, 0.0))
    for _ in range(10_000):
        if not ear.tracker.in_utterance:
            break
        await asyncio.sleep(0)
    assert not ear.tracker.in_utterance
    assert not ear.of(heard.Committed)
    ear.run.slow_done.set()
    await feeding
    [turn] = ear.of(heard.Committed)  # with the verdict in its figures
    assert turn.text == QUESTION and turn.turn_probability == 0.9


async def test_a_slow_early_job_is_taken_over_by_the_pause_not_run_again():
    ear = Ear()
    ear.run.open.clear()  # ASR takes a while
    await ear.feed(1.0, 0.3)
    await ear.feed(0.3, 0.0)
    assert ear.of(heard.Paused) and not ear.of(heard.TailText)
    ear.run.open.set()
    await ear.feed(0.3, 0.0)
    assert len(ear.asr.calls) == 1
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]


async def test_a_dip_between_words_is_not_a_tail():
    ear = Ear()
    ear.asr.text = "What is the"
    await ear.feed(0.6, 0.3)
    await ear.feed(0.06, 0.0)  # one quiet VAD window: an early job starts
    assert len(ear.asr.calls) == 1
    ear.asr.text = QUESTION
    await ear.feed(0.6, 0.3)
    await ear.feed(0.6, 0.0)
    assert not ear.of(heard.Paused)[1:] and not ear.of(heard.Resumed)
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]
    assert [turn.text for turn in ear.of(heard.Committed)] == [QUESTION]


async def test_speech_after_a_dip_cancels_an_early_job_still_waiting_for_asr():
    ear = Ear()
    ear.run.open.clear()
    await ear.feed(0.6, 0.3)
    await ear.feed(0.06, 0.0)
    await ear.feed(0.1, 0.3)
    ear.run.open.set()
    await ear.feed(0.5, 0.3)
    assert ear.run.asked == 1 and ear.asr.calls == []  # the dip's job never ran
    await ear.feed(0.6, 0.0)
    assert len(ear.asr.calls) == 1 and ear.of(heard.Committed)[0].text == QUESTION


async def test_the_tail_and_the_turn_leave_out_a_loop_whisper_ran_into():
    ear = Ear()
    ear.asr.text = "Why is the sky blue? Why is the sky blue? Why"
    await ear.feed(1.0, 0.3)
    await ear.feed(0.6, 0.0)
    assert [tail.text for tail in ear.of(heard.TailText)] == ["Why is the sky blue?"]
    assert [turn.text for turn in ear.of(heard.Committed)] == ["Why is the sky blue?"]


async def test_the_tail_starts_at_the_first_window_under_the_speech_threshold_and_the_pause_takes_it_over():
    ear = Ear(vad_model=FadingVadModel())
    silent_at_asr = []
    transcribe = ear.asr.transcribe
    ear.asr.transcribe = lambda audio, **options: (
        silent_at_asr.append(ear.vad.trailing_silence),
        transcribe(audio, **options),
    )[1]
    await ear.feed(1.0, 0.3)
    await ear.feed(0.04, FADING)  # a window at P 0.4: not speech enough, not yet the VAD's silence
    await ear.feed(0.04, 0.0)  # that window complete, the next (the silence's first) not yet
    assert len(ear.asr.calls) == 1 and silent_at_asr == [False]  # started before the silence began
    assert ear.tracker.speech_may_be_ending
    await ear.feed(0.6, 0.0)
    assert len(ear.asr.calls) == 1  # the pause (at the silence, a window later) took the job over
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]
    assert [turn.text for turn in ear.of(heard.Committed)] == [QUESTION]


async def test_a_faint_dip_between_words_is_not_a_tail():
    ear = Ear(vad_model=FadingVadModel())
    ear.asr.text = "What is the"
    await ear.feed(0.6, 0.3)
    await ear.feed(0.06, FADING)
    assert len(ear.asr.calls) == 1
    ear.asr.text = QUESTION
    await ear.feed(0.6, 0.3)
    assert not ear.tracker.speech_may_be_ending
    await ear.feed(0.6, 0.0)
    assert not ear.of(heard.Resumed) and len(ear.of(heard.Paused)) == 1
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]


async def test_a_job_that_did_not_hear_up_to_the_silence_is_started_again_there():
    ear = Ear(vad_model=FadingVadModel())
    ear.asr.text = "What is the capital of"
    await ear.feed(1.0, 0.3)
    await ear.feed(0.3, FADING)  # a long faint stretch (a trailing "of ..." said softly): the job heard its start
    assert len(ear.asr.calls) == 1
    ear.asr.text = QUESTION
    await ear.feed(0.6, 0.0)
    assert len(ear.asr.calls) == 2  # again once the silence began, and the pause took that one over
    assert [tail.text for tail in ear.of(heard.TailText)] == [QUESTION]
    assert [turn.text for turn in ear.of(heard.Committed)] == [QUESTION]
