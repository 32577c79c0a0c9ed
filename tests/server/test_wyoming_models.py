"""The Wyoming door with the real bundled Whisper and Piper: a sentence synthesized as streamed audio comes back
as words when that audio is sent to the door's speech-to-text (at the voice's own rate: the door resamples)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from harness import ScriptedLLM
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop

from app.config import Settings
from app.server.app import create_app
from app.stages.asr import Transcriber
from app.stages.registry import Models
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad

pytestmark = pytest.mark.models


async def speak(client: AsyncTcpClient, sentences: list[str]) -> tuple[AudioStart, bytes, int]:
    """The door's streamed synthesis of ``sentences``: the audio format, the audio, and how many streams it came in."""
    await client.write_event(SynthesizeStart().event())
    for sentence in sentences:
        await client.write_event(SynthesizeChunk(text=sentence + " ").event())
    await client.write_event(SynthesizeStop().event())
    audio, streams, start = b"", 0, None
    while (event := await client.read_event()).type != "synthesize-stopped":
        if event.type == "audio-start":
            start, streams = AudioStart.from_event(event), streams + 1
        elif event.type == "audio-chunk":
            audio += event.payload
    return start, audio, streams


async def transcribe(client: AsyncTcpClient, start: AudioStart, audio: bytes) -> str:
    await client.write_event(Transcribe(language="en").event())
    await client.write_event(start.event())
    step = 2048
    for offset in range(0, len(audio), step):
        chunk = AudioChunk(
            rate=start.rate, width=start.width, channels=start.channels, audio=audio[offset : offset + step]
        )
        await client.write_event(chunk.event())
    await client.write_event(AudioStop().event())
    while (event := await client.read_event()).type != "transcript":
        pass
    return Transcript.from_event(event).text


def test_a_streamed_sentence_spoken_by_the_door_is_heard_back_by_the_door():
    models = Models(vad=SileroVad(), asr=Transcriber(), llm=ScriptedLLM(["Sure."]), tts=PiperSynthesizer())
    app = create_app(Settings(wyoming_port=0), models=models)

    async def script(port: int):
        async with AsyncTcpClient("127.0.0.1", port, read_timeout=60) as client:
            start, audio, streams = await speak(client, ["Please set a timer.", "It should run for ten minutes."])
        async with AsyncTcpClient("127.0.0.1", port, read_timeout=60) as client:
            return start, audio, streams, await transcribe(client, start, audio)

    with TestClient(app, base_url="http://127.0.0.1:8000"):
        start, audio, streams, text = asyncio.run(script(app.state.wyoming.port))
    assert (start.rate, start.width, start.channels) == (models.tts.sample_rate, 2, 1)
    assert streams >= 2  # one audio stream per piece, as the text came
    assert len(audio) / 2 / start.rate > 2.0
    heard = text.lower()
    assert "timer" in heard and "minutes" in heard, text
