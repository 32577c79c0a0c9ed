"""One voice conversation: audio in, VAD, ASR, LLM, TTS, audio and events out.

The session is transport-agnostic: the server hands it frames and gives it two async
callbacks to send JSON events and binary audio. Model work runs on worker threads so
the event loop only routes frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, float_to_pcm16, pcm16_to_float
from app.config import Settings
from app.llm import Message
from app.models import Models
from app.text import SentenceSplitter, speakable
from app.vad import VadConfig, VadStream

log = logging.getLogger(__name__)

SendJson = Callable[[protocol.ServerMessage], Awaitable[None]]
SendBytes = Callable[[bytes], Awaitable[None]]

PREROLL_MS = 300  # audio kept before the VAD start so the first phoneme is not clipped
AUDIO_CHUNK_MS = 100  # reply audio is sent in pieces this long so an interrupt drops little


class _ArrivalClock:
    """Maps a stream sample index to the wall time its frame arrived (for latency figures)."""

    def __init__(self) -> None:
        self._marks: deque[tuple[int, float]] = deque(maxlen=4096)

    def mark(self, end_sample: int, when: float) -> None:
        self._marks.append((end_sample, when))

    def time_of(self, sample: int) -> float:
        for end_sample, when in self._marks:
            if end_sample >= sample:
                return when
        return self._marks[-1][1] if self._marks else time.monotonic()


class VoiceSession:
    def __init__(self, models: Models, settings: Settings, send_json: SendJson, send_bytes: SendBytes) -> None:
        self.models = models
        self.settings = settings
        self._send_json = send_json
        self._send_bytes = send_bytes
        self.session_id = uuid.uuid4().hex[:12]
        self.history: list[Message] = []
        self._turn_ids = itertools.count(1)
        self._turn_task: asyncio.Task | None = None
        self._turn_id = 0
        self._closed = False
        self._configure_input(protocol.INPUT_SAMPLE_RATE)

    # ------------------------------------------------------------------ input
    def _configure_input(self, sample_rate: int) -> None:
        self.input_sample_rate = sample_rate
        self._resampler = StreamResampler(sample_rate, ASR_SAMPLE_RATE)
        self._vad = VadStream(
            self.models.vad,
            VadConfig(
                threshold=self.settings.vad_threshold,
                neg_threshold=max(0.05, self.settings.vad_threshold - 0.15),
                min_speech_ms=self.settings.min_speech_ms,
                min_silence_ms=self.settings.endpoint_silence_ms,
            ),
        )
        self._audio = np.zeros(0, dtype=np.float32)  # recent 16 kHz input, ends at stream sample _audio_end
        self._audio_end = 0
        self._speech_start: int | None = None
        self._clock = _ArrivalClock()

    async def start(self) -> None:
        await self._ready()

    async def _ready(self) -> None:
        await self._send_json(
            protocol.Ready(input_sample_rate=self.input_sample_rate, output_sample_rate=self.models.tts.sample_rate)
        )

    async def handle_text(self, raw: str) -> None:
        try:
            message = protocol.parse_client_text(raw)
        except protocol.ProtocolError as error:
            await self._send_json(error.event)
            return
        if isinstance(message, protocol.Start):
            self._configure_input(message.sample_rate)
            await self._ready()
        elif isinstance(message, protocol.UserText):
            await self._begin_turn(user_text=message.text, speech_end=time.monotonic(), commit=time.monotonic())
        elif isinstance(message, protocol.Reset):
            await self._cancel_turn(notify=True)
            self.history.clear()
        elif isinstance(message, protocol.Playback):
            pass  # used for barge-in truncation; see issue 4

    async def handle_audio(self, data: bytes) -> None:
        try:
            protocol.check_audio_frame(data)
        except protocol.ProtocolError as error:
            await self._send_json(error.event)
            return
        now = time.monotonic()
        samples = self._resampler(pcm16_to_float(data))
        if not len(samples):
            return
        self._audio = np.concatenate([self._audio, samples])
        self._audio_end += len(samples)
        self._clock.mark(self._audio_end, now)
        keep = int((self.settings.max_utterance_s + 2) * ASR_SAMPLE_RATE)
        if len(self._audio) > keep and self._speech_start is None:
            self._audio = self._audio[-int(PREROLL_MS * 16) :]
        for event in self._vad.feed(samples):
            if event.kind == "start":
                self._speech_start = event.sample
                await self._send_json(protocol.SpeechStarted())
            else:
                await self._send_json(protocol.SpeechStopped())
                await self._commit_utterance(event.sample)
        if (
            self._speech_start is not None
            and self._audio_end - self._speech_start > self.settings.max_utterance_s * 16000
        ):
            await self._commit_utterance(self._audio_end)  # a monologue: answer what we have so far

    def _slice(self, start: int, end: int) -> np.ndarray:
        first = self._audio_end - len(self._audio)
        return self._audio[max(0, start - first) : max(0, end - first)].copy()

    async def _commit_utterance(self, speech_end: int) -> None:
        start = self._speech_start or 0
        self._speech_start = None
        audio = self._slice(start - PREROLL_MS * 16, speech_end + 160 * 16)
        self._audio = self._audio[-int(PREROLL_MS * 16) :]
        await self._begin_turn(audio=audio, speech_end=self._clock.time_of(speech_end), commit=time.monotonic())

    # ------------------------------------------------------------------ turns
    async def _begin_turn(
        self, *, speech_end: float, commit: float, audio: np.ndarray | None = None, user_text: str | None = None
    ) -> None:
        await self._cancel_turn(notify=True)
        self._turn_id = next(self._turn_ids)
        self._turn_task = asyncio.create_task(
            self._run_turn(self._turn_id, audio, user_text, speech_end, commit), name=f"turn-{self._turn_id}"
        )

    async def _cancel_turn(self, notify: bool) -> None:
        task, self._turn_task = self._turn_task, None
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if notify and not self._closed:
            await self._send_json(protocol.Interrupt(turn_id=self._turn_id))

    async def _run_turn(
        self, turn_id: int, audio: np.ndarray | None, user_text: str | None, speech_end: float, commit: float
    ) -> None:
        metrics: dict[str, float] = {"endpoint_ms": (commit - speech_end) * 1000}
        reply = ""
        loop = asyncio.get_running_loop()
        try:
            if audio is not None:
                transcription = await loop.run_in_executor(None, self.models.asr.transcribe, audio)
                metrics["asr_final_ms"] = transcription.wall_seconds * 1000
                user_text = transcription.text
            user_text = (user_text or "").strip()
            if not user_text:
                return  # noise, not words: no turn
            await self._send_json(protocol.Transcript(turn_id=turn_id, text=user_text, final=True))
            self.history.append({"role": "user", "content": user_text})
            reply = await self._reply(turn_id, loop, metrics, speech_end, commit)
            await self._send_json(protocol.TurnDone(turn_id=turn_id, text=reply, metrics=metrics))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one failed turn must not end the conversation
            log.exception("turn %s failed", turn_id)
            await self._send_json(protocol.Error(code="turn_failed", message=f"could not answer: {exc}"))

    def _messages(self) -> list[Message]:
        history = self.history[-self.settings.max_history_messages :] if self.settings.max_history_messages else []
        return [{"role": "system", "content": self.settings.system_prompt}, *history]

    async def _reply(
        self, turn_id: int, loop: asyncio.AbstractEventLoop, metrics: dict[str, float], speech_end: float, commit: float
    ) -> str:
        """Stream the LLM into TTS: sentences are spoken while later tokens are still generated."""
        sentences: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(turn_id, sentences, loop, metrics, speech_end, commit))
        splitter = SentenceSplitter()
        reply_parts: list[str] = []
        request_id = f"{self.session_id}-{turn_id}"
        llm_started = time.monotonic()
        stream = self.models.llm.stream(self._messages(), request_id)
        try:
            async for delta in stream:
                if not reply_parts:
                    metrics["llm_ttft_ms"] = (time.monotonic() - llm_started) * 1000
                reply_parts.append(delta)
                await self._send_json(protocol.AssistantText(turn_id=turn_id, delta=delta))
                for sentence in splitter.push(delta):
                    sentences.put_nowait(sentence)
            rest = splitter.flush()
            if rest:
                sentences.put_nowait(rest)
            sentences.put_nowait(None)
            await speaker
        finally:
            await stream.aclose()
            if not speaker.done():
                speaker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await speaker
            reply = "".join(reply_parts).strip()
            if reply:
                self.history.append({"role": "assistant", "content": reply})
        metrics["llm_total_ms"] = (time.monotonic() - llm_started) * 1000
        return reply

    async def _speak(
        self,
        turn_id: int,
        sentences: asyncio.Queue[str | None],
        loop: asyncio.AbstractEventLoop,
        metrics: dict[str, float],
        speech_end: float,
        commit: float,
    ) -> None:
        sample_rate = self.models.tts.sample_rate
        chunk = sample_rate * AUDIO_CHUNK_MS // 1000
        audio_seconds = 0.0
        started = False
        while (sentence := await sentences.get()) is not None:
            text = speakable(sentence)
            if not text:
                continue
            tts_started = time.monotonic()
            pieces = await loop.run_in_executor(None, lambda t=text: list(self.models.tts.synthesize(t)))
            if not started:
                metrics["tts_first_audio_ms"] = (time.monotonic() - tts_started) * 1000
                await self._send_json(protocol.AudioStart(turn_id=turn_id, sample_rate=sample_rate))
                metrics["voice_to_voice_ms"] = (time.monotonic() - speech_end) * 1000
                started = True
            for samples in pieces:
                audio_seconds += len(samples) / sample_rate
                for offset in range(0, len(samples), chunk):
                    await self._send_bytes(float_to_pcm16(samples[offset : offset + chunk]))
        if audio_seconds:
            metrics["reply_audio_s"] = audio_seconds
            metrics["rtf"] = audio_seconds / max(1e-6, time.monotonic() - commit)

    async def close(self) -> None:
        """The client is gone: stop the reply and free its LLM request and TTS work."""
        self._closed = True
        await self._cancel_turn(notify=False)
