"""A scripted user for benchmarks and end-to-end tests: speaks like a microphone, collects one turn.

``VoiceClient`` streams speech in real time over ``app.clients.core.Connection`` and gathers what
the server sends back for one turn (``TurnResult``). Voice-to-voice latency is measured here, on
the client side, as a user hears it (last speech sample sent -> first audible reply sample played).
Only benchmarks and tests use it; ``parley mic`` does not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from app import protocol
from app.audio import first_audible
from app.clients.core import FRAME_MS, Connection, Event, open_connection


@dataclass
class TurnResult:
    """Everything one client received for one turn, with arrival times (``time.monotonic``)."""

    events: list[protocol.ServerMessage] = field(default_factory=list)
    event_times: list[float] = field(default_factory=list)
    reply_audio: bytearray = field(default_factory=bytearray)
    output_sample_rate: int = 0
    speech_end_sent: float | None = None  # when the last speech sample was sent
    first_audio_received: float | None = None
    last_audio_received: float | None = None
    audio_arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, samples)
    withdrawn_audio_s: float = 0.0  # reply audio received, then withdrawn by ``turn_continued``
    withdrawn_audio_before_speech_end: bool = False  # some of it arrived while the user was still speaking

    def _audio_before_speech_end(self) -> bool:
        first = self.first_audio_received
        return first is not None and (self.speech_end_sent is None or first < self.speech_end_sent)

    @property
    def talked_over(self) -> bool:
        """Reply audio arrived while the user was still speaking (a withdrawn reply's too)."""
        return self.withdrawn_audio_before_speech_end or self._audio_before_speech_end()

    def withdraw_reply(self) -> None:
        """``turn_continued``: the audio so far answered half a question; the real answer follows."""
        if self._audio_before_speech_end():
            self.withdrawn_audio_before_speech_end = True
        if self.output_sample_rate:
            self.withdrawn_audio_s += len(self.reply_audio) / 2 / self.output_sample_rate
        self.reply_audio.clear()
        self.audio_arrivals.clear()
        self.first_audio_received = self.last_audio_received = None

    def all(self, kind: type[Event]) -> list[Event]:
        return [event for event in self.events if isinstance(event, kind)]

    def event(self, kind: type[Event]) -> Event | None:
        """The first event of ``kind`` (e.g. ``protocol.TurnDone``), if any arrived."""
        return next(iter(self.all(kind)), None)

    @property
    def final_transcript(self) -> str:
        """What the server heard: each turn's last final transcript (a continued turn's replaces its first)."""
        finals = {event.turn_id: event.text for event in self.all(protocol.Transcript) if event.final}
        return " ".join(finals.values())

    @property
    def assistant_text(self) -> str:
        """The reply's text (a reply withdrawn by ``turn_continued`` left out)."""
        deltas: list[protocol.AssistantText] = []
        for event in self.events:
            if isinstance(event, protocol.AssistantText):
                deltas.append(event)
            elif isinstance(event, protocol.TurnContinued):
                deltas = [delta for delta in deltas if delta.turn_id != event.turn_id]
        return "".join(delta.delta for delta in deltas)

    @property
    def turn_done(self) -> protocol.TurnDone | None:
        """The end of the turn this question made (not an earlier reply's interrupted end)."""
        finals = {event.turn_id for event in self.all(protocol.Transcript) if event.final}
        own = (event for event in self.all(protocol.TurnDone) if event.turn_id in finals)
        return next(own, None) or self.event(protocol.TurnDone)

    @property
    def server_metrics(self) -> protocol.TurnMetrics:
        """The server's figures for this turn (empty when no ``turn_done`` arrived)."""
        done = self.turn_done
        return done.metrics if done is not None else protocol.TurnMetrics()

    @property
    def voice_to_voice_ms(self) -> float | None:
        """Last speech sample sent -> first audible reply sample played, as the user experiences it."""
        heard = self.first_audible_at
        if self.speech_end_sent is None or heard is None:
            return None
        return (heard - self.speech_end_sent) * 1000

    @property
    def first_audible_at(self) -> float | None:
        """When the reply's first sample of ``AUDIBLE_LEVEL`` plays, played gaplessly from its arrival.

        The quiet a TTS voice starts with is audio received but nothing heard; a reply with no
        audible sample at all counts from its first audio.
        """
        first = self.first_audio_received
        if first is None or not self.output_sample_rate:
            return first
        target = first_audible(self.reply_samples)
        if target is None:
            return first
        offset, playing_until = 0, first
        for arrived, samples in self.audio_arrivals:
            starts = max(arrived, playing_until)
            if target < offset + samples:
                return starts + (target - offset) / self.output_sample_rate
            offset, playing_until = offset + samples, starts + samples / self.output_sample_rate
        return playing_until + (target - offset) / self.output_sample_rate  # (arrivals not recorded)

    @property
    def reply_samples(self) -> np.ndarray:
        return np.frombuffer(bytes(self.reply_audio), dtype="<i2").astype(np.float32) / 32768.0

    @property
    def reply_seconds(self) -> float:
        return len(self.reply_audio) / 2 / self.output_sample_rate if self.output_sample_rate else 0.0

    @property
    def underrun_gaps(self) -> list[float]:
        """The silences mid-reply (s): each chunk that arrived after the audio before it had finished
        playing (gapless playback) leaves the listener waiting from that end to its arrival."""
        gaps, playing_until = [], None
        for arrived, samples in self.audio_arrivals:
            if playing_until is not None and arrived > playing_until + 0.005:
                gaps.append(arrived - playing_until)
            playing_until = max(playing_until or arrived, arrived) + samples / self.output_sample_rate
        return gaps

    @property
    def underruns(self) -> int:
        return len(self.underrun_gaps)

    def client_metrics(self) -> protocol.TurnMetrics:
        """The figures measured here, at the client, in the protocol's vocabulary."""
        gaps = self.underrun_gaps
        return protocol.TurnMetrics(
            voice_to_voice_ms=self.voice_to_voice_ms,
            reply_audio_s=self.reply_seconds,
            underruns=len(gaps),
            underrun_s=sum(gaps) if self.audio_arrivals else None,
        )


# TurnMetrics fields a client measures itself (the rest only the server knows).
CLIENT_MEASURED = frozenset(TurnResult().client_metrics().model_fields_set)


class VoiceClient:
    """One conversation over one WebSocket, sending microphone-like audio continuously."""

    def __init__(
        self,
        url: str,
        sample_rate: int = protocol.INPUT_SAMPLE_RATE,
        realtime: bool = True,
        noise_rms: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.url, self.sample_rate, self.realtime = url, sample_rate, realtime
        self.noise_rms = noise_rms  # background noise under everything sent, silences included
        self._rng = np.random.default_rng(seed)
        self.frame = sample_rate * FRAME_MS // 1000
        self.connection: Connection | None = None
        self._receiver: asyncio.Task | None = None
        self._current: TurnResult | None = None
        self._done = asyncio.Event()
        self.output_sample_rate = 0
        self._clock_start = 0.0
        self._frames_sent = 0

    async def __aenter__(self) -> VoiceClient:
        self.connection = await open_connection(self.url, self.sample_rate)
        self.output_sample_rate = self.connection.output_sample_rate
        self._receiver = asyncio.create_task(self._receive())
        self._clock_start = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._receiver:
            self._receiver.cancel()
        await self.connection.close()

    async def _receive(self) -> None:
        async for item in self.connection:
            now = time.monotonic()
            result = self._current
            if isinstance(item, bytes):
                if result is not None:
                    if result.first_audio_received is None:
                        result.first_audio_received = now
                    result.last_audio_received = now
                    result.audio_arrivals.append((now, len(item) // 2))
                    result.reply_audio.extend(item)
                continue
            if isinstance(item, protocol.Ready):
                self.output_sample_rate = item.output_sample_rate
            if result is not None:
                result.events.append(item)
                result.event_times.append(now)
                if isinstance(item, protocol.TurnContinued):
                    result.withdraw_reply()
                if isinstance(item, protocol.Error) and item.fatal:
                    self._done.set()
                elif isinstance(item, protocol.TurnDone) and any(
                    isinstance(e, protocol.Transcript) and e.final and e.turn_id == item.turn_id for e in result.events
                ):
                    # the end of the turn this question started; the interrupted end of an earlier
                    # reply (the question cut it short) is not the answer
                    self._done.set()

    def _check_receiver(self) -> None:
        """Raise what stopped the receiver (a closed socket, an unknown event) instead of waiting on."""
        if self._receiver is not None and self._receiver.done():
            self._receiver.result()
            raise ConnectionError("the server closed the connection")

    async def send_audio(self, audio: np.ndarray, mark_end_at: int | None = None) -> None:
        """Send ``audio`` in 20 ms frames, paced like a microphone when ``realtime``."""
        for index in range(0, (len(audio) + self.frame - 1) // self.frame):
            if self.realtime:
                delay = self._clock_start + self._frames_sent * FRAME_MS / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -0.5:  # we fell behind (a busy machine): do not burst to catch up
                    self._clock_start -= delay
            else:
                await asyncio.sleep(0)  # let the receiver run between frames
            frame = audio[index * self.frame : (index + 1) * self.frame]
            if self.noise_rms:
                frame = frame + self._rng.normal(0.0, self.noise_rms, len(frame)).astype(np.float32)
            await self.connection.send_audio(frame)
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
            self._check_receiver()
            if time.monotonic() > deadline:
                dropped = [f"{e.reason} ({e.heard!r})" for e in result.all(protocol.SpeechDropped)]
                raise TimeoutError(
                    f"no turn_done within {timeout_s} s; events: {[e.type for e in result.events]}"
                    + (f"; speech dropped as {', '.join(dropped)}" if dropped else "")
                )
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
        return await client.ask(
            speech, leading_silence_s=leading_silence_s, trailing_silence_s=trailing_silence_s, timeout_s=timeout_s
        )
