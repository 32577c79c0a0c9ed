"""The voice session frame-in/frame-out, without a network: real VAD/ASR/TTS, a scripted LLM."""

from __future__ import annotations

import asyncio
import json

import pytest
from harness import Harness, ScriptedLLM
from heard import heard_as

from app import protocol
from app.audio import resample
from app.stages.asr import Transcriber
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad

pytestmark = pytest.mark.models

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def shared_models():
    return SileroVad(), Transcriber(), PiperSynthesizer()


async def test_spoken_turn_produces_transcript_text_audio_in_order(shared_models, speech):
    harness = Harness(shared_models, ScriptedLLM(["Paris is the capital ", "of France. ", "It is lovely."]))
    await harness.session.start()
    await harness.speak(speech(QUESTION))
    done = await harness.wait_for("turn_done")
    types = harness.types()
    assert types[0] == "ready"
    assert types.index("speech_started") < types.index("speech_stopped") < types.index("transcript")
    assert types.index("transcript") < types.index("assistant_text") < types.index("audio_start")
    finals = [e for e in harness.events if e["type"] == "transcript" and e["final"]]
    assert finals == [{"type": "transcript", "turn_id": 1, "text": QUESTION, "final": True, "language": "en"}]
    assert done["text"] == "Paris is the capital of France. It is lovely."
    stages = {"endpoint_ms", "asr_final_ms", "llm_ttft_ms", "llm_first_piece_ms", "tts_first_audio_ms", "rtf"}
    assert stages <= done["metrics"].keys()
    assert done["metrics"]["llm_first_piece_ms"] >= done["metrics"]["llm_ttft_ms"]
    seconds = len(harness.audio) / 2 / shared_models[2].sample_rate
    assert 2.0 < seconds < 8.0
    assert harness.session.history == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris is the capital of France. It is lovely."},
    ]


async def test_first_sentence_is_spoken_while_llm_still_generates(shared_models):
    harness = Harness(shared_models, None)
    llm = ScriptedLLM(["Paris is the capital of France. ", "It is a lovely city."], gate=harness.audio_arrived)
    harness.models.llm = llm
    await harness.session.handle(protocol.UserText(text="Capital of France?"))
    await harness.wait_for("turn_done")
    # The LLM could only produce its second sentence after audio of the first had been sent.
    assert llm.gate_was_open_early
    assert "error" not in harness.types()


async def test_input_at_48k_is_resampled(shared_models, speech):
    harness = Harness(shared_models, ScriptedLLM(["Paris."]))
    await harness.session.handle(protocol.parse_client_text(json.dumps({"type": "start", "sample_rate": 48000})))
    assert harness.events[-1]["type"] == "ready" and harness.events[-1]["input_sample_rate"] == 48000
    await harness.speak(resample(speech(QUESTION), 16000, 48000), sample_rate=48000)
    transcript = await harness.wait_for("transcript", final=True)
    assert heard_as(transcript["text"], QUESTION), transcript


async def test_history_is_sent_back_each_turn_with_the_system_prompt(shared_models):
    llm = ScriptedLLM(["Hello there friend."])
    harness = Harness(shared_models, llm)
    for text in ["Hi!", "How are you?"]:
        harness.events.clear()
        await harness.session.handle(protocol.UserText(text=text))
        done = await harness.wait_for("turn_done")
        # the client reports it has played the whole reply, so the next question does not interrupt it
        played_ms = done["metrics"]["reply_audio_s"] * 1000
        await harness.session.handle(
            protocol.parse_client_text(
                json.dumps({"type": "playback", "turn_id": done["turn_id"], "played_ms": played_ms})
            )
        )
    second = llm.calls[1]
    assert second[0]["role"] == "system"
    assert [m["content"] for m in second[1:]] == ["Hi!", "Hello there friend.", "How are you?"]
    # after each reply, the start of the next prompt was prefilled ahead of time
    assert llm.warmed[0] == second[:-1]


async def test_history_window_keeps_the_prompt_prefix_for_several_turns(shared_models):
    llm = ScriptedLLM(["Sure."])
    harness = Harness(shared_models, llm, max_history_messages=8)
    for i in range(8):
        harness.events.clear()
        await harness.session.handle(protocol.parse_client_text(json.dumps({"type": "text", "text": f"Question {i}?"})))
        done = await harness.wait_for("turn_done")
        played_ms = done["metrics"]["reply_audio_s"] * 1000
        await harness.session.handle(
            protocol.parse_client_text(
                json.dumps({"type": "playback", "turn_id": done["turn_id"], "played_ms": played_ms})
            )
        )
    firsts = [call[1]["content"] for call in llm.calls]
    # the window (at most 8 messages, 2 per turn) jumps by 4 messages every 2 turns instead of sliding each turn
    assert firsts == ["Question 0?"] * 4 + ["Question 2?"] * 2 + ["Question 4?"] * 2
    assert all(len(call) - 1 <= 8 for call in llm.calls)


async def test_close_mid_reply_stops_the_llm_and_the_speaker(shared_models):
    llm = ScriptedLLM(["Let me tell you a long story. ", "Once upon a time"], forever=True)
    harness = Harness(shared_models, llm)
    await harness.session.handle(protocol.UserText(text="Tell me a story"))
    await asyncio.wait_for(harness.audio_arrived.wait(), 30)
    await harness.session.close()
    assert llm.closed == [f"{harness.session.session_id}-1-1"]  # the LLM stream was closed (request aborted)
    sent = len(harness.events), len(harness.audio)
    await asyncio.sleep(0.5)
    assert (len(harness.events), len(harness.audio)) == sent  # nothing more is produced
    turn_tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("turn-")]
    assert all(t.done() for t in turn_tasks)
