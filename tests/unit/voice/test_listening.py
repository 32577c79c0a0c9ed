"""The user's side as the settings build it: the VAD's and the endpoint's numbers, the end-of-turn model beside the LLM."""

from __future__ import annotations

import numpy as np
from fakes import FakeStages, ManualClock, ScriptedASR, ScriptedTurnModel, run_inline
from harness import ScriptedLLM

from app.config import Settings
from app.voice.listening import BesideTheLLM, listen


class RecordingStages(FakeStages):
    """Fake stages that keep the VAD config they were asked for."""

    def vad_stream(self, config):
        self.vad_config = config
        return super().vad_stream(config)


def tracker_for(settings: Settings, turn: ScriptedTurnModel | None = None):
    models = RecordingStages(ScriptedASR(), ScriptedLLM([]), turn)

    async def emit(event):
        pass

    tracker = listen(
        models,
        settings,
        emit,
        next_turn_id=lambda: 1,
        clock=ManualClock(),
        run_blocking=run_inline,
        language=lambda: "en",
    )
    return models, tracker


def test_the_settings_tune_the_vad_and_the_endpoint():
    settings = Settings(
        vad_threshold=0.6,
        min_speech_ms=150,
        pause_ms=128,
        endpoint_silence_ms=500,
        endpoint_unfinished_silence_ms=1500,
        endpoint_complete_silence_ms=250,
        partial_interval_ms=300,
        tail_start_ms=64,
    )
    models, tracker = tracker_for(settings)
    vad = models.vad_config
    assert (vad.threshold, vad.min_speech_ms, vad.min_silence_ms) == (0.6, 150, 128)
    assert abs(vad.neg_threshold - 0.45) < 1e-9  # 0.15 under the threshold
    endpointer = tracker.options.endpointer
    assert (endpointer.silence_ms, endpointer.unfinished_silence_ms, endpointer.complete_silence_ms) == (500, 1500, 250)
    assert (tracker.options.partial_interval_ms, tracker.options.tail_start_ms) == (300, 64)
    low, _ = tracker_for(Settings(vad_threshold=0.1))
    assert low.vad_config.neg_threshold == 0.05  # never below


def test_the_end_of_turn_model_runs_on_a_core_the_llm_lends_it():
    llm = ScriptedLLM([])
    lent_during_call = []
    model = ScriptedTurnModel(0.8)
    judge = model.complete_probability
    model.complete_probability = lambda audio: (lent_during_call.append(llm.cores_lent), judge(audio))[1]
    beside = BesideTheLLM(model, llm)
    assert beside.complete_probability(np.zeros(1600, np.float32)) == 0.8
    assert lent_during_call == [1] and llm.cores_lent == 0
