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
    audio_arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, samples)

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

    @property
    def reply_seconds(self) -> float:
        return len(self.reply_audio) / 2 / self.output_sample_rate if self.output_sample_rate else 0.0

    @property
    def underruns(self) -> int:
        """Chunks that arrived after the audio before them had finished playing (gapless playback)."""
        count, playing_until = 0, None
        for arrived, samples in self.audio_arrivals:
            if playing_until is not None and arrived > playing_until + 0.005:
                count += 1
            playing_until = max(playing_until or arrived, arrived) + samples / self.output_sample_rate
        return count

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["type"] == kind), None)


class VoiceClient:
    """One conversation over one WebSocket, sending microphone-like audio continuously."""

    def __init__(self, url: str, sample_rate: int = protocol.INPUT_SAMPLE_RATE, realtime: bool = True) -> None:
        self.url, self.sample_rate, self.realtime = url, sample_rate, realtime
        self.frame = sample_rate * FRAME_MS // 1000
        self._ws = None
        self._receiver: asyncio.Task | None = None
        self._current: TurnResult | None = None
        self._done = asyncio.Event()
        self.output_sample_rate = 0
        self._clock_start = 0.0
        self._frames_sent = 0

    async def __aenter__(self) -> VoiceClient:
        self._ws = await websockets.connect(self.url, max_size=1 << 22)
        await self._ws.send(json.dumps({"type": "start", "sample_rate": self.sample_rate}))
        self._receiver = asyncio.create_task(self._receive())
        self._clock_start = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._receiver:
            self._receiver.cancel()
        await self._ws.close()

    async def _receive(self) -> None:
        async for message in self._ws:
            now = time.monotonic()
            result = self._current
            if isinstance(message, bytes):
                if result is not None:
                    if result.first_audio_received is None:
                        result.first_audio_received = now
                    result.last_audio_received = now
                    result.audio_arrivals.append((now, len(message) // 2))
                    result.reply_audio.extend(message)
                continue
            event = json.loads(message)
            event["_t"] = now
            if event["type"] == "ready":
                self.output_sample_rate = event["output_sample_rate"]
            if result is not None:
                result.events.append(event)
                if event["type"] == "turn_done" or (event["type"] == "error" and event.get("fatal")):
                    self._done.set()

    async def send_audio(self, audio: np.ndarray, mark_end_at: int | None = None) -> None:
        """Send ``audio`` in 20 ms frames, paced like a microphone when ``realtime``."""
        for index in range(0, (len(audio) + self.frame - 1) // self.frame):
            if self.realtime:
                delay = self._clock_start + self._frames_sent * FRAME_MS / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -0.5:  # we fell behind (a busy machine): do not burst to catch up
                    self._clock_start -= delay
            await self._ws.send(float_to_pcm16(audio[index * self.frame : (index + 1) * self.frame]))
            self._frames_sent += 1
            if mark_end_at is not None and index == mark_end_at and self._current is not None:
                self._current.speech_end_sent = time.monotonic()

    async def send_silence(self, seconds: float) -> None:
        await self.send_audio(np.zeros(int(seconds * self.sample_rate), np.float32))

    async def ask(
        self,
        speech: np.ndarray,
        *,
        leading_silence_s: float = 0.3,
        trailing_silence_s: float = 2.0,
        timeout_s: float = 120.0,
    ) -> TurnResult:
        """Say ``speech`` and keep the line open (silence) until the reply is complete."""
        result = TurnResult(output_sample_rate=self.output_sample_rate)
        self._current, self._done = result, asyncio.Event()
        lead = np.zeros(int(leading_silence_s * self.sample_rate), np.float32)
        trail = np.zeros(int(trailing_silence_s * self.sample_rate), np.float32)
        audio = np.concatenate([lead, speech.astype(np.float32), trail])
        speech_end_frame = (len(lead) + len(speech) - 1) // self.frame
        await self.send_audio(audio, mark_end_at=speech_end_frame)
        deadline = time.monotonic() + timeout_s
        while not self._done.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no turn_done within {timeout_s} s; events: {[e['type'] for e in result.events]}")
            await self.send_silence(FRAME_MS / 1000)
        result.output_sample_rate = self.output_sample_rate
        return result

    async def listen_until_played(self, result: TurnResult, extra_s: float = 0.3) -> None:
        """Keep sending silence until the reply would have finished playing (as a polite user waits)."""
        if result.first_audio_received is None:
            return
        ends = result.first_audio_received + result.reply_seconds + extra_s
        while time.monotonic() < ends:
            await self.send_silence(FRAME_MS / 1000)


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
    """Connect, say one question, return everything received for it."""
    async with VoiceClient(url, sample_rate, realtime) as client:
        while not client.output_sample_rate:
            await asyncio.sleep(0.01)
        return await client.ask(
            speech, leading_silence_s=leading_silence_s, trailing_silence_s=trailing_silence_s, timeout_s=timeout_s
        )
