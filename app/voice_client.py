"""A scripted voice client: streams speech over the real WebSocket and measures what a user hears.

Used by the end-to-end tests and ``parley bench voice``; voice-to-voice latency is measured
here, on the client side, as DESIGN.md defines it (last speech sample sent -> first reply
audio sample received).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np
import websockets

from app import protocol
from app.audio import float_to_pcm16

FRAME_MS = 20


@dataclass
class TurnResult:
    events: list[dict] = field(default_factory=list)
    reply_audio: bytearray = field(default_factory=bytearray)
    output_sample_rate: int = 0
    speech_end_sent: float | None = None  # monotonic time the last speech sample was sent
    first_audio_received: float | None = None
    last_audio_received: float | None = None

    def texts(self, kind: str, **match) -> list[str]:
        return [
            e.get("text") or e.get("delta", "")
            for e in self.events
            if e["type"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    @property
    def final_transcript(self) -> str:
        return " ".join(self.texts("transcript", final=True))

    @property
    def assistant_text(self) -> str:
        return "".join(self.texts("assistant_text"))

    @property
    def voice_to_voice_ms(self) -> float | None:
        if self.speech_end_sent is None or self.first_audio_received is None:
            return None
        return (self.first_audio_received - self.speech_end_sent) * 1000

    @property
    def reply_samples(self) -> np.ndarray:
        return np.frombuffer(bytes(self.reply_audio), dtype="<i2").astype(np.float32) / 32768.0

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["type"] == kind), None)


async def speak_turn(
    url: str,
    speech: np.ndarray,
    sample_rate: int = protocol.INPUT_SAMPLE_RATE,
    *,
    leading_silence_s: float = 0.3,
    trailing_silence_s: float = 2.0,
    realtime: bool = True,
    timeout_s: float = 120.0,
) -> TurnResult:
    """Send one spoken question in 20 ms frames and collect everything until ``turn_done``."""
    result = TurnResult()
    frame = sample_rate * FRAME_MS // 1000
    lead = np.zeros(int(leading_silence_s * sample_rate), np.float32)
    trail = np.zeros(int(trailing_silence_s * sample_rate), np.float32)
    audio = np.concatenate([lead, speech.astype(np.float32), trail])
    speech_end_frame = (len(lead) + len(speech) - 1) // frame
    done = asyncio.Event()

    async with websockets.connect(url, max_size=1 << 22) as ws:
        await ws.send(json.dumps({"type": "start", "sample_rate": sample_rate}))

        async def receive() -> None:
            async for message in ws:
                now = time.monotonic()
                if isinstance(message, bytes):
                    if result.first_audio_received is None:
                        result.first_audio_received = now
                    result.last_audio_received = now
                    result.reply_audio.extend(message)
                    continue
                event = json.loads(message)
                event["_t"] = now
                result.events.append(event)
                if event["type"] == "ready":
                    result.output_sample_rate = event["output_sample_rate"]
                if event["type"] == "turn_done" or (event["type"] == "error" and event.get("fatal")):
                    done.set()
                    return

        receiver = asyncio.create_task(receive())
        started = time.monotonic()
        try:
            for index in range(0, (len(audio) + frame - 1) // frame):
                if done.is_set():
                    break
                if realtime:
                    delay = started + index * FRAME_MS / 1000 - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await ws.send(float_to_pcm16(audio[index * frame : (index + 1) * frame]))
                if index == speech_end_frame:
                    result.speech_end_sent = time.monotonic()
            # keep the line "silent" (as a real mic would) until the reply is complete
            silence = float_to_pcm16(np.zeros(frame, np.float32))
            deadline = time.monotonic() + timeout_s
            while not done.is_set() and time.monotonic() < deadline:
                await ws.send(silence)
                await asyncio.sleep(FRAME_MS / 1000)
            if not done.is_set():
                raise TimeoutError(f"no turn_done within {timeout_s} s; events: {[e['type'] for e in result.events]}")
        finally:
            receiver.cancel()
    return result
