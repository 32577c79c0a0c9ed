"""Turn-taking on a real session (real VAD, ASR and TTS; a scripted LLM), fed like a microphone.

Few and robust: each checks what must hold whatever Whisper makes of a borderline word
(one turn and not two, text that only grows, a reply cut to what was heard). The rules
themselves, to the frame, are in tests/unit/voice/test_conversation.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from harness import Harness, ScriptedLLM

from app import protocol
from app.stages.asr import Transcriber
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad
from app.voice.text import words

pytestmark = pytest.mark.models

# No comma: the voice pauses ~380 ms at one, which a 400 ms endpoint may take for the end.
LONG = "Can you tell me what the weather will be like tomorrow morning in London and whether I need an umbrella?"


@pytest.fixture(scope="module")
def shared_models():
    return SileroVad(), Transcriber(), PiperSynthesizer()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * 16000), np.float32)


def trimmed(audio: np.ndarray) -> np.ndarray:
    """The clip without the voice's own leading/trailing silence, so a test's pause is the real gap."""
    loud = np.flatnonzero(np.abs(audio) > 0.003)
    return audio[loud[0] : loud[-1] + 1]


def finals(harness: Harness) -> list[dict]:
    return [e for e in harness.events if e["type"] == "transcript" and e["final"]]


async def test_partials_arrive_before_the_final_and_only_grow(shared_models, speech):
    harness = Harness(shared_models, ScriptedLLM(["Sunlight bends in raindrops."]), speculative_reply=False)
    await harness.speak(speech(LONG), realtime=True)
    await harness.wait_for("turn_done")
    transcripts = [e for e in harness.events if e["type"] == "transcript"]
    partials = [e["text"] for e in transcripts if not e["final"]]
    assert len(partials) >= 3, partials
    assert transcripts[-1]["final"] and all(not e["final"] for e in transcripts[:-1])
    for before, after in zip(partials, partials[1:], strict=False):
        assert words(after)[: len(words(before))] == words(before), (before, after)
        assert len(words(after)) > len(words(before))
    # The whole utterance in one turn: most of its content words, from both ends of it (no single
    # word decides: a busy machine once lost "umbrella" from Whisper tiny.en's hypothesis).
    final = set(words(finals(harness)[0]["text"]))
    assert len({"weather", "tomorrow", "morning", "london", "umbrella"} & final) >= 3, final
    assert {e["turn_id"] for e in transcripts} == {1}


async def test_short_mid_sentence_pause_does_not_commit(shared_models, speech):
    harness = Harness(shared_models, ScriptedLLM(["Paris."]))
    first, second = trimmed(speech("What is the capital")), trimmed(speech("of France?"))
    await harness.speak(np.concatenate([first, silence(0.25), second]), realtime=True)
    await harness.wait_for("turn_done")
    assert len(finals(harness)) == 1
    # both halves, one turn: the words after "capital" are the second half's (tiny.en hears "of France" as
    # "a France" on one CPU and "a friend" on another; no single word decides)
    final = words(finals(harness)[0]["text"])
    assert {"what", "capital"} <= set(final) and final.index("capital") < len(final) - 1, final
    assert len(harness.models.llm.calls) <= 2  # at most one speculation dropped at the pause


async def test_barge_in_stops_audio_aborts_the_llm_and_cuts_the_history(shared_models, speech):
    llm = ScriptedLLM(["Once upon a time there was a dragon. ", "It lived in a cave. "], forever=True)
    harness = Harness(shared_models, llm)
    await harness.session.handle(protocol.UserText(text="Tell me a long story."))
    await asyncio.wait_for(harness.audio_arrived.wait(), 30)
    await asyncio.sleep(1.0)  # the user hears about a second of the story, then talks over it
    await harness.speak(speech("Wait what is the capital of France?"), realtime=True, trailing_s=0.2)
    interrupt = await harness.wait_for("interrupt")
    assert interrupt["turn_id"] == 1
    cut = await harness.wait_for("turn_done", turn_id=1)
    assert cut["interrupted"] is True
    assert llm.closed[0] == f"{harness.session.session_id}-1-1"  # the LLM request was ended
    full = "".join(e["delta"] for e in harness.events if e["type"] == "assistant_text" and e["turn_id"] == 1)
    heard = harness.session.history[1]
    assert heard["role"] == "assistant"
    assert 0 < len(heard["content"]) < len(full)  # only what was played is kept
    assert full.startswith(heard["content"])
    # the interruption is followed by an answer to the new question
    await harness.speak(silence(0.8), realtime=True, trailing_s=0)
    new_turn = await harness.wait_for("transcript", final=True, turn_id=2)
    assert "capital" in words(new_turn["text"])


async def test_a_short_noise_burst_does_not_interrupt(shared_models):
    llm = ScriptedLLM(["Once upon a time there was a dragon. ", "It lived in a cave."])
    harness = Harness(shared_models, llm)
    await harness.session.handle(protocol.UserText(text="Tell me a story."))
    await asyncio.wait_for(harness.audio_arrived.wait(), 30)
    rng = np.random.default_rng(1)
    t = np.arange(int(0.15 * 16000)) / 16000
    cough = (0.3 * rng.standard_normal(len(t)) * np.exp(-t * 12)).astype(np.float32)
    await harness.speak(cough, realtime=True, trailing_s=0.8)
    done = await harness.wait_for("turn_done", turn_id=1)
    assert done["interrupted"] is False
    assert "interrupt" not in harness.types()
    assert finals(harness)[-1]["turn_id"] == 1  # the burst did not become a turn of its own
