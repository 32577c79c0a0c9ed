"""One voice conversation: audio in, VAD, ASR, LLM, TTS, audio and events out.

The session is transport-agnostic: the server hands it frames and gives it two async
callbacks to send JSON events and binary audio. Model work runs on worker threads; the
event loop only routes frames and makes turn-taking decisions (policy in ``app.turns``).

Timeline of a spoken turn:
  speech ─┬─ partial transcripts every ``partial_interval_ms`` (only if ASR is idle)
          └─ pause (VAD silence ≥ ``pause_ms``): transcribe the not-yet-stable tail now
               ├─ text looks finished: start the reply speculatively (held back, not sent)
               ├─ user speaks again: drop the speculation, keep the tail text as stable
               └─ silence reaches the endpoint (longer if the text ends mid-clause): commit;
                  a held reply is released at once, so the endpoint wait hides ASR + LLM + TTS
While a reply plays, sustained speech (``barge_in_ms``) interrupts it: the LLM request is
aborted, queued audio dropped, and the history keeps only what the user heard.
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
from dataclasses import dataclass, field

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, float_to_pcm16, pcm16_to_float
from app.config import Settings
from app.llm import Message
from app.models import Models
from app.text import SentenceSplitter, speakable
from app.turns import Endpointer, PartialStabilizer, ReplyPlayback, history_window, is_filler, looks_unfinished
from app.vad import VadConfig, VadStream

log = logging.getLogger(__name__)

SendJson = Callable[[protocol.ServerMessage], Awaitable[None]]
SendBytes = Callable[[bytes], Awaitable[None]]

SAMPLES_PER_MS = ASR_SAMPLE_RATE // 1000
PREROLL_MS = 300  # audio kept before the VAD start so the first phoneme is not clipped
# Between utterances the buffer keeps this much: the VAD reports a start only after
# min_speech_ms of speech, pointing back to where it began, and the pre-roll reaches back
# from there. Keeping only PREROLL_MS (as before) cut "Can you" off "Can you recommend a
# good book?" in 2 of 28 benchmark turns.
IDLE_KEEP_MS = 1000
STABLE_AFTER_S = 6.0  # shorter utterances are re-decoded whole: more accurate, and cheap
TAIL_PAD_MS = 160  # audio kept after the VAD end (the last phoneme fades)
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


@dataclass
class _Utterance:
    """The user's current utterance, from the VAD start until it is committed as a turn."""

    start: int  # stream sample where speech began
    turn_id: int  # reserved at the start so partials, the final and the reply share it
    stable_text: str = ""  # text of audio before ``stable_until``, final already
    stable_until: int | None = None
    stabilizer: PartialStabilizer = field(default_factory=PartialStabilizer)
    last_partial_at: int = 0
    pause: int | None = None  # stream sample where the current silence began
    tail_task: asyncio.Task | None = None  # transcribing the tail up to ``pause``
    tail_text: str | None = None  # its result, once done
    asr_ms: float = 0.0
    partial_task: asyncio.Task | None = None

    def text(self) -> str:
        return " ".join(part for part in (self.stable_text, self.tail_text or "") if part).strip()


@dataclass
class _Reply:
    """One assistant reply; ``released`` is False while it is only a speculation."""

    turn_id: int
    user_text: str
    playback: ReplyPlayback
    released: bool = False
    held: list[protocol.ServerMessage | bytes] = field(default_factory=list)
    task: asyncio.Task | None = None
    text_parts: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    speech_end: float = 0.0
    commit: float = 0.0
    produce_started: float = 0.0
    produced_at: float | None = None
    finished: bool = False


class VoiceSession:
    def __init__(self, models: Models, settings: Settings, send_json: SendJson, send_bytes: SendBytes) -> None:
        self.models = models
        self.settings = settings
        self._send_json = send_json
        self._send_bytes = send_bytes
        self.session_id = uuid.uuid4().hex[:12]
        self.history: list[Message] = []
        self._turn_ids = itertools.count(1)
        self._endpointer = Endpointer(settings.endpoint_silence_ms, settings.endpoint_unfinished_silence_ms)
        self._reply: _Reply | None = None
        self._speculation: _Reply | None = None
        self._warm_task: asyncio.Task | None = None
        self._utterance: _Utterance | None = None
        self._closed = False
        self.on_turn_metrics: Callable[[dict[str, float]], None] | None = None
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
                min_silence_ms=self.settings.pause_ms,
            ),
        )
        self._audio = np.zeros(0, dtype=np.float32)  # recent 16 kHz input, ends at stream sample _audio_end
        self._audio_end = 0
        self._utterance = None
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
            await self._drop_utterance()
            self._configure_input(message.sample_rate)
            await self._ready()
        elif isinstance(message, protocol.UserText):
            await self._interrupt_reply()
            now = time.monotonic()
            await self._start_turn(next(self._turn_ids), message.text, speech_end=now, commit=now, metrics={})
        elif isinstance(message, protocol.Reset):
            await self._interrupt_reply()
            await self._drop_utterance()
            self.history.clear()
        elif isinstance(message, protocol.Playback):
            reply = self._reply
            if reply is not None and reply.turn_id == message.turn_id:
                reply.playback.reported_played_s = message.played_ms / 1000

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
        if self._utterance is None and len(self._audio) > 2 * IDLE_KEEP_MS * SAMPLES_PER_MS:
            self._audio = self._audio[-IDLE_KEEP_MS * SAMPLES_PER_MS :]

        for event in self._vad.feed(samples):
            if event.kind == "start":
                await self._on_speech_start(event.sample)
            else:
                await self._on_pause(event.sample)
        utterance = self._utterance
        if utterance is None:
            return
        if self._vad.speaking:
            self._maybe_partial(utterance)
            await self._maybe_barge_in(utterance)
            if self._audio_end - utterance.start > self.settings.max_utterance_s * ASR_SAMPLE_RATE:
                await self._on_pause(self._audio_end)  # a monologue: answer what we have so far
                await self._commit(utterance, forced=True)
        else:
            await self._maybe_commit(utterance)

    def _slice(self, start: int, end: int) -> np.ndarray:
        first = self._audio_end - len(self._audio)
        return self._audio[max(0, start - first) : max(0, end - first)].copy()

    # ------------------------------------------------------------------ utterance
    async def _on_speech_start(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None:
            self._utterance = _Utterance(start=sample, turn_id=next(self._turn_ids), last_partial_at=sample)
        elif utterance.pause is not None:
            # The user went on after a pause: what we transcribed up to it becomes stable text.
            await self._cancel_speculation()
            if utterance.tail_task is not None and not utterance.tail_task.done():
                utterance.tail_task.cancel()
            elif (
                utterance.tail_text is not None
                and utterance.pause - utterance.start >= STABLE_AFTER_S * ASR_SAMPLE_RATE
            ):
                # Long utterance: freeze the text so far, decode only what follows (with it as context).
                utterance.stable_text = utterance.text()
                utterance.stable_until = utterance.pause + TAIL_PAD_MS * SAMPLES_PER_MS
            utterance.pause, utterance.tail_task, utterance.tail_text = None, None, None
        await self._send_json(protocol.SpeechStarted())

    async def _on_pause(self, sample: int) -> None:
        utterance = self._utterance
        if utterance is None or utterance.pause is not None:
            return
        utterance.pause = sample
        await self._send_json(protocol.SpeechStopped())
        begin = utterance.stable_until or utterance.start - PREROLL_MS * SAMPLES_PER_MS
        audio = self._slice(begin, sample + TAIL_PAD_MS * SAMPLES_PER_MS)
        utterance.tail_task = asyncio.create_task(self._transcribe_tail(utterance, audio), name="asr-tail")

    async def _transcribe_tail(self, utterance: _Utterance, audio: np.ndarray) -> None:
        started = time.monotonic()
        result = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.models.asr.transcribe(audio, context=utterance.stable_text)
        )
        if utterance.pause is None:
            return  # the user went on speaking; a newer tail will be transcribed
        utterance.tail_text = result.text
        utterance.asr_ms = (time.monotonic() - started) * 1000
        if utterance is not self._utterance:
            return  # already being committed; _commit reads tail_text
        text = utterance.text()
        if self.settings.speculative_reply and not is_filler(text) and not looks_unfinished(text):
            await self._speculate(utterance.turn_id, text, self._clock.time_of(utterance.pause))
        await self._maybe_commit(utterance)

    def _maybe_partial(self, utterance: _Utterance) -> None:
        interval = self.settings.partial_interval_ms * SAMPLES_PER_MS
        if self._audio_end - utterance.last_partial_at < interval:
            return
        if utterance.partial_task is not None and not utterance.partial_task.done():
            return
        utterance.last_partial_at = self._audio_end
        begin = utterance.stable_until or utterance.start - PREROLL_MS * SAMPLES_PER_MS
        audio = self._slice(begin, self._audio_end)
        utterance.partial_task = asyncio.create_task(self._partial(utterance, audio), name="asr-partial")

    async def _partial(self, utterance: _Utterance, audio: np.ndarray) -> None:
        # wait=False: a partial never queues behind another session's final transcript
        result = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.models.asr.transcribe(audio, wait=False, context=utterance.stable_text)
        )
        if result is None or utterance is not self._utterance:
            return
        shown = utterance.stabilizer.update(" ".join(p for p in (utterance.stable_text, result.text) if p))
        if shown:
            await self._send_json(protocol.Transcript(turn_id=utterance.turn_id, text=shown, final=False))

    async def _maybe_commit(self, utterance: _Utterance) -> None:
        if utterance is not self._utterance or utterance.pause is None or self._vad.speech_pending:
            return  # (speech_pending: the user may be starting again; wait for the VAD to decide)
        silence_ms = (self._audio_end - utterance.pause) / SAMPLES_PER_MS
        if utterance.tail_text is None:
            if silence_ms >= self.settings.endpoint_unfinished_silence_ms:
                await self._commit(utterance)  # ASR is late: commit and wait for it
            return
        if silence_ms >= self._endpointer.required_silence_ms(utterance.text()):
            await self._commit(utterance)

    async def _commit(self, utterance: _Utterance, forced: bool = False) -> None:
        """The user has finished: turn the utterance into a turn (or drop it if it was noise)."""
        self._utterance = None
        commit = time.monotonic()
        if utterance.partial_task is not None:
            utterance.partial_task.cancel()
        tail = utterance.tail_task
        if tail is not None and not tail.done() and tail is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(utterance.tail_task)
        if forced and utterance.tail_text is None:
            return
        text = utterance.text()
        end = utterance.pause if utterance.pause is not None else self._audio_end
        speech_end = self._clock.time_of(end)
        ready = time.monotonic()
        metrics = {
            "endpoint_ms": (commit - speech_end) * 1000,
            "asr_final_ms": (ready - commit) * 1000,  # transcript wait after the endpoint
            "asr_compute_ms": utterance.asr_ms,
        }
        if is_filler(text):
            await self._cancel_speculation()
            return  # a cough, "mm", or noise: not a turn, and the reply (if any) goes on
        await self._interrupt_reply()
        speculation = self._speculation
        if speculation is not None and speculation.user_text == text:
            self._speculation = None
            await self._send_json(protocol.Transcript(turn_id=speculation.turn_id, text=text, final=True))
            self.history.append({"role": "user", "content": text})
            speculation.commit, speculation.speech_end = commit, speech_end
            speculation.metrics.update(metrics, speculative=1.0)
            self._reply = speculation
            await self._release(speculation)
            return
        await self._cancel_speculation()
        await self._start_turn(utterance.turn_id, text, speech_end=speech_end, commit=commit, metrics=metrics)

    async def _drop_utterance(self) -> None:
        utterance, self._utterance = self._utterance, None
        if utterance is not None:
            for task in (utterance.tail_task, utterance.partial_task):
                if task is not None:
                    task.cancel()
        await self._cancel_speculation()

    # ------------------------------------------------------------------ replies
    def _new_reply(self, turn_id: int, user_text: str) -> _Reply:
        return _Reply(turn_id=turn_id, user_text=user_text, playback=ReplyPlayback(self.models.tts.sample_rate))

    async def _start_turn(
        self, turn_id: int, text: str, *, speech_end: float, commit: float, metrics: dict[str, float]
    ) -> None:
        reply = self._new_reply(turn_id, text)
        reply.speech_end, reply.commit = speech_end, commit
        reply.metrics.update(metrics)
        await self._send_json(protocol.Transcript(turn_id=reply.turn_id, text=text, final=True))
        self.history.append({"role": "user", "content": text})
        self._reply = reply
        reply.released = True
        reply.task = asyncio.create_task(self._produce(reply, self._messages()), name=f"turn-{reply.turn_id}")

    async def _speculate(self, turn_id: int, text: str, speech_end: float) -> None:
        """Start answering ``text`` before the endpoint; nothing is sent unless it is released."""
        if self._speculation is not None and self._speculation.user_text == text:
            return
        await self._cancel_speculation()
        reply = self._new_reply(turn_id, text)
        reply.speech_end = speech_end
        self._speculation = reply
        messages = [*self._messages(), {"role": "user", "content": text}]
        reply.task = asyncio.create_task(self._produce(reply, messages), name=f"turn-{reply.turn_id}")

    async def _cancel_speculation(self) -> None:
        reply, self._speculation = self._speculation, None
        if reply is not None and reply.task is not None:
            await _cancel(reply.task)

    async def _release(self, reply: _Reply) -> None:
        reply.released = True
        held, reply.held = reply.held, []
        for item in held:
            await self._emit(reply, item)
        if reply.finished:
            self._finish_history(reply)

    def _messages(self, history: list[Message] | None = None) -> list[Message]:
        window = history_window(self.history if history is None else history, self.settings.max_history_messages)
        return [{"role": "system", "content": self.settings.system_prompt}, *window]

    def _warm_next_prompt(self) -> None:
        """Prefill what the next turn's prompt will start with, while the user listens.

        The history just changed (a reply, or what of it was heard); computing its KV now,
        in the gap between turns, takes it off the next turn's critical path. Cheap when
        the prefix cache already holds most of it.
        """
        if self._closed or self.settings.max_history_messages <= 0:
            return
        upcoming = self._messages([*self.history, {"role": "user", "content": ""}])[:-1]
        if self._warm_task is not None:
            self._warm_task.cancel()
        self._warm_task = asyncio.create_task(self._warm(upcoming), name="llm-warm")

    async def _warm(self, messages: list[Message]) -> None:
        try:
            await self.models.llm.warm(messages)
        except asyncio.CancelledError:
            raise
        except Exception:  # only an optimisation: the next turn computes it anyway
            log.debug("prefix warm-up failed", exc_info=True)

    async def _emit(self, reply: _Reply, item: protocol.ServerMessage | bytes) -> None:
        """Send now if the reply is released, else hold it back (speculation)."""
        if not reply.released:
            reply.held.append(item)
            return
        if isinstance(item, bytes):
            now = time.monotonic()
            if reply.playback.started_at is None:
                reply.metrics["voice_to_voice_ms"] = (now - reply.speech_end) * 1000
            reply.playback.on_send(len(item) // 2, now)
            await self._send_bytes(item)
        else:
            if isinstance(item, protocol.TurnDone):
                item = item.model_copy(update={"metrics": self._final_metrics(reply)})
            await self._send_json(item)

    def _final_metrics(self, reply: _Reply) -> dict[str, float]:
        metrics = dict(reply.metrics)
        playback = reply.playback
        if playback.sent_s:
            # RTF from the turn commit (or, for a speculation, from when its production began)
            began = min(reply.commit, reply.produce_started) if reply.commit else reply.produce_started
            spent = (reply.produced_at or time.monotonic()) - began
            metrics["reply_audio_s"] = playback.sent_s
            metrics["rtf"] = playback.sent_s / max(1e-6, spent)
        metrics["underruns"] = float(playback.underruns)
        if self.on_turn_metrics:
            self.on_turn_metrics(metrics)
        return metrics

    async def _produce(self, reply: _Reply, messages: list[Message]) -> None:
        """LLM tokens -> clauses/sentences -> TTS -> audio, all overlapped."""
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, pieces), name=f"tts-{reply.turn_id}")
        splitter = SentenceSplitter(first_clause_chars=self.settings.first_clause_chars)
        llm_started = reply.produce_started = time.monotonic()
        stream = self.models.llm.stream(messages, f"{self.session_id}-{reply.turn_id}")
        try:
            try:
                async for delta in stream:
                    if not reply.text_parts:
                        reply.metrics["llm_ttft_ms"] = (time.monotonic() - llm_started) * 1000
                    reply.text_parts.append(delta)
                    await self._emit(reply, protocol.AssistantText(turn_id=reply.turn_id, delta=delta))
                    for piece in splitter.push(delta):
                        pieces.put_nowait(piece)
            finally:
                await stream.aclose()  # aborts the LLM request if we stopped early
            rest = splitter.flush()
            if rest:
                pieces.put_nowait(rest)
            pieces.put_nowait(None)
            await speaker
            reply.produced_at = time.monotonic()
            reply.finished = True
            text = "".join(reply.text_parts).strip()
            await self._emit(reply, protocol.TurnDone(turn_id=reply.turn_id, text=text))
            if reply.released:
                self._finish_history(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one failed turn must not end the conversation
            log.exception("turn %s failed", reply.turn_id)
            await self._emit(reply, protocol.Error(code="turn_failed", message=f"could not answer: {exc}"))
        finally:
            await _cancel(speaker)

    async def _speak(self, reply: _Reply, pieces: asyncio.Queue[str | None]) -> None:
        loop = asyncio.get_running_loop()
        sample_rate = self.models.tts.sample_rate
        chunk = sample_rate * AUDIO_CHUNK_MS // 1000
        while (piece := await pieces.get()) is not None:
            text = speakable(piece)
            if not text:
                continue
            tts_started = time.monotonic()
            audio = await loop.run_in_executor(None, lambda t=text: list(self.models.tts.synthesize(t)))
            if "tts_first_audio_ms" not in reply.metrics:
                reply.metrics["tts_first_audio_ms"] = (time.monotonic() - tts_started) * 1000
                await self._emit(reply, protocol.AudioStart(turn_id=reply.turn_id, sample_rate=sample_rate))
            for samples in audio:
                for offset in range(0, len(samples), chunk):
                    await self._emit(reply, float_to_pcm16(samples[offset : offset + chunk]))
            reply.playback.add_piece(piece)

    def _finish_history(self, reply: _Reply) -> None:
        text = "".join(reply.text_parts).strip()
        if text:
            self.history.append({"role": "assistant", "content": text})
            self._warm_next_prompt()

    async def _maybe_barge_in(self, utterance: _Utterance) -> None:
        reply = self._reply
        if reply is None or not self._reply_active(reply):
            return
        if (self._audio_end - utterance.start) / SAMPLES_PER_MS >= self.settings.barge_in_ms:
            await self._interrupt_reply()

    def _reply_active(self, reply: _Reply) -> bool:
        producing = reply.task is not None and not reply.task.done()
        return producing or reply.playback.playing(time.monotonic())

    async def _interrupt_reply(self) -> None:
        """Barge-in: stop the reply, tell the client to stop playing, keep only what was heard."""
        reply, self._reply = self._reply, None
        if reply is None or not self._reply_active(reply):
            return
        producing = reply.task is not None and not reply.task.done()
        if reply.task is not None:
            await _cancel(reply.task)
        heard = reply.playback.heard_text(time.monotonic())
        if not producing and self.history and self.history[-1]["role"] == "assistant":
            self.history.pop()  # the full reply was recorded; replace it by what was heard
        if heard:
            self.history.append({"role": "assistant", "content": heard})
        self._warm_next_prompt()
        if self._closed:
            return
        await self._send_json(protocol.Interrupt(turn_id=reply.turn_id))
        reply.metrics["barge_in"] = 1.0
        await self._send_json(
            protocol.TurnDone(turn_id=reply.turn_id, text=heard, interrupted=True, metrics=self._final_metrics(reply))
        )

    async def close(self) -> None:
        """The client is gone: stop the reply and free its LLM request and TTS work."""
        self._closed = True
        await self._drop_utterance()
        reply, self._reply = self._reply, None
        if reply is not None and reply.task is not None:
            await _cancel(reply.task)
        if self._warm_task is not None:
            await _cancel(self._warm_task)


async def _cancel(task: asyncio.Task) -> None:
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
