"""A voice session driven frame by frame without a network: real VAD/ASR/TTS, a scripted LLM."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from app import protocol
from app.audio import float_to_pcm16
from app.config import Settings
from app.models import Models
from app.session import VoiceSession


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


class Harness:
    def __init__(self, shared_models, llm, **settings) -> None:
        vad, asr, tts = shared_models
        self.models = Models(vad=vad, asr=asr, llm=llm, tts=tts)
        self.events: list[dict] = []
        self.audio = bytearray()
        self.audio_arrived = asyncio.Event()
        self.session = VoiceSession(self.models, Settings(**settings), self._send_json, self._send_bytes)

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

    async def speak(
        self, audio: np.ndarray, sample_rate: int = 16000, trailing_s: float = 1.0, realtime: bool = False
    ) -> None:
        """Send 20 ms frames (10 frames of silence first); ``realtime`` paces them like a microphone."""
        frame = sample_rate // 50
        padded = np.concatenate(
            [np.zeros(frame * 10, np.float32), audio, np.zeros(int(trailing_s * sample_rate), np.float32)]
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, offset in enumerate(range(0, len(padded), frame)):
            await self.session.handle_audio(float_to_pcm16(padded[offset : offset + frame]))
            await asyncio.sleep(max(0.0, started + (index + 1) * 0.02 - loop.time()) if realtime else 0)
