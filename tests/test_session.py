"""The voice session frame-in/frame-out, without a network: real VAD/ASR/TTS, a scripted LLM."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from app import protocol
from app.asr import Transcriber
from app.audio import float_to_pcm16, resample
from app.config import Settings
from app.models import Models
from app.session import VoiceSession
from app.text import words
from app.tts import PiperSynthesizer
from app.vad import SileroVad

QUESTION = "What is the capital of France?"


class ScriptedLLM:
    """Yields scripted pieces; ``gate`` (if set) must open before the pieces after the first sentence."""

    name = "scripted"

    def __init__(self, pieces: list[str], gate: asyncio.Event | None = None, forever: bool = False) -> None:
        self.pieces, self.gate, self.forever = pieces, gate, forever
        self.calls: list[list[dict]] = []
        self.closed: list[str] = []
        self.gate_was_open_early = False

    async def stream(self, messages, request_id):
        self.calls.append([dict(m) for m in messages])
        try:
            for index, piece in enumerate(self.pieces):
                if index == 1 and self.gate is not None:
                    await asyncio.wait_for(self.gate.wait(), timeout=30)
                    self.gate_was_open_early = True
                yield piece
            while self.forever:
                await asyncio.sleep(0.05)
                yield " more"
        finally:
            self.closed.append(request_id)

    def abort(self, request_id):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def shared_models():
    return SileroVad(), Transcriber(), PiperSynthesizer()


class Harness:
    def __init__(self, shared_models, llm) -> None:
        vad, asr, tts = shared_models
        self.models = Models(vad=vad, asr=asr, llm=llm, tts=tts)
        self.events: list[dict] = []
        self.audio = bytearray()
        self.audio_arrived = asyncio.Event()
        self.session = VoiceSession(self.models, Settings(), self._send_json, self._send_bytes)

    async def _send_json(self, message) -> None:
        self.events.append(json.loads(protocol.encode(message)))

    async def _send_bytes(self, data: bytes) -> None:
        self.audio.extend(data)
        self.audio_arrived.set()

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def wait_for(self, kind: str, timeout: float = 60, **match) -> dict:
        async def poll():
            while True:
                for event in self.events:
                    if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                        return event
                await asyncio.sleep(0.02)

        return await asyncio.wait_for(poll(), timeout)

    async def speak(self, audio: np.ndarray, sample_rate: int = 16000, trailing_s: float = 1.0) -> None:
        frame = sample_rate // 50
        padded = np.concatenate(
            [np.zeros(frame * 10, np.float32), audio, np.zeros(int(trailing_s * sample_rate), np.float32)]
        )
        for offset in range(0, len(padded), frame):
            await self.session.handle_audio(float_to_pcm16(padded[offset : offset + frame]))
            await asyncio.sleep(0)


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
    assert finals == [{"type": "transcript", "turn_id": 1, "text": QUESTION, "final": True}]
    assert done["text"] == "Paris is the capital of France. It is lovely."
    assert {"endpoint_ms", "asr_final_ms", "llm_ttft_ms", "tts_first_audio_ms", "rtf"} <= done["metrics"].keys()
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
    await harness.session.handle_text(json.dumps({"type": "text", "text": "Capital of France?"}))
    await harness.wait_for("turn_done")
    # The LLM could only produce its second sentence after audio of the first had been sent.
    assert llm.gate_was_open_early
    assert "error" not in harness.types()


async def test_input_at_48k_is_resampled(shared_models, speech):
    harness = Harness(shared_models, ScriptedLLM(["Paris."]))
    await harness.session.handle_text(json.dumps({"type": "start", "sample_rate": 48000}))
    assert harness.events[-1]["type"] == "ready" and harness.events[-1]["input_sample_rate"] == 48000
    await harness.speak(resample(speech(QUESTION), 16000, 48000), sample_rate=48000)
    transcript = await harness.wait_for("transcript", final=True)
    assert words(transcript["text"]) == words(QUESTION)


async def test_history_is_sent_back_each_turn_with_the_system_prompt(shared_models):
    llm = ScriptedLLM(["Hello there friend."])
    harness = Harness(shared_models, llm)
    for text in ["Hi!", "How are you?"]:
        harness.events.clear()
        await harness.session.handle_text(json.dumps({"type": "text", "text": text}))
        done = await harness.wait_for("turn_done")
        # the client reports it has played the whole reply, so the next question does not interrupt it
        played_ms = done["metrics"]["reply_audio_s"] * 1000
        await harness.session.handle_text(
            json.dumps({"type": "playback", "turn_id": done["turn_id"], "played_ms": played_ms})
        )
    second = llm.calls[1]
    assert second[0]["role"] == "system"
    assert [m["content"] for m in second[1:]] == ["Hi!", "Hello there friend.", "How are you?"]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{nope", "bad_json"),
        ('{"type": "sing"}', "unknown_type"),
        ('{"type": "start", "sample_rate": 3}', "bad_message"),
        (b"\x01\x02\x03", "bad_audio"),
        (b"\x00" * (protocol.MAX_AUDIO_FRAME_BYTES + 2), "frame_too_large"),
    ],
)
async def test_bad_input_gets_an_error_event_and_the_session_goes_on(shared_models, frame, code):
    harness = Harness(shared_models, ScriptedLLM(["Fine, thanks."]))
    if isinstance(frame, bytes):
        await harness.session.handle_audio(frame)
    else:
        await harness.session.handle_text(frame)
    assert harness.events[-1]["type"] == "error" and harness.events[-1]["code"] == code
    assert harness.events[-1]["fatal"] is False
    await harness.session.handle_text(json.dumps({"type": "text", "text": "Still there?"}))
    assert (await harness.wait_for("turn_done"))["text"] == "Fine, thanks."


async def test_close_mid_reply_stops_the_llm_and_the_speaker(shared_models):
    llm = ScriptedLLM(["Let me tell you a long story. ", "Once upon a time"], forever=True)
    harness = Harness(shared_models, llm)
    await harness.session.handle_text(json.dumps({"type": "text", "text": "Tell me a story"}))
    await asyncio.wait_for(harness.audio_arrived.wait(), 30)
    await harness.session.close()
    assert llm.closed == [f"{harness.session.session_id}-1"]  # the LLM stream was closed (request aborted)
    sent = len(harness.events), len(harness.audio)
    await asyncio.sleep(0.5)
    assert (len(harness.events), len(harness.audio)) == sent  # nothing more is produced
    turn_tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("turn-")]
    assert all(t.done() for t in turn_tasks)
