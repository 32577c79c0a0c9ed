"""The assistant's side of a turn: chat messages in, reply events and audio out.

A ``Reply`` streams LLM deltas through the clause splitter into TTS and sends the audio in
short chunks, all overlapped: the first clause is spoken while the LLM still writes the
rest. A reply can be *speculative*: produced before the user's turn is committed, with
everything it would send held back until ``release()``; if the user goes on speaking the
session cancels it and nothing was ever sent. Cancelling closes the LLM stream, which
aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from app import protocol
from app.audio import float_to_pcm16, trim_leading_quiet
from app.stages.base import ChatLLM, Message, Synthesizer, scheduling_of
from app.voice.clock import Clock, RunBlocking
from app.voice.playback import ReplyPlayback
from app.voice.text import FIRST_PHRASE_MAX_WORDS, SentenceSplitter, loop_end, speakable, words

log = logging.getLogger(__name__)

AUDIO_CHUNK_MS = 100  # reply audio is sent in pieces this long so an interrupt drops little
# A reply's audio starts this long before its first audible sample. Piper's bundled voice
# begins each piece with ~50 ms of near-silence; sent whole, it was waited for before the first
# word. Later pieces keep theirs: it is part of the gap between pieces, and of the audio buffered
# ahead of the next piece (with four users on 2 cores, cutting it from every piece went with
# more underruns).
LEAD_KEEP_MS = 20
# With first_piece_priority the LLM waits (at most this long) while the first piece is
# synthesized: nothing can be heard before that audio, and the text is already ahead of it.
# The session asks for it while the server has one session open (``Settings.solo_speedups``): with
# several users the paused request would also wait for the shared Piper lock (README).
FIRST_PIECE_PAUSE_MAX_S = 2.0
# A reply's text runs far ahead of its speech (120 tokens written in a few seconds are 20 s of
# audio), and with several users each of its decode steps slows a reply whose listener hears
# nothing yet (a bigger batch, and cores shared with ASR and Piper). So once a reply has more than
# ``yield_ahead_s`` (the setting ``llm_yield_ahead_s``) of audio still to play, its LLM request
# yields to the others for the excess: it is stepped only when no other request needs a step. That
# leaves this much audio for its next piece to be written and synthesized in, with four users on 2 cores
# (figures: README, How a turn flows).
YIELD_AHEAD_S = 3.0
# A piece of at least this many words said again word for word ends the reply: the bundled
# SmolLM2-135M loops ("I'm not today. I'm not today.", or a 120-token run-on that repeats one
# clause), which is 30 s of the same words for the listener. (Loops inside one piece:
# ``app.voice.text.loop_end``.)
REPEAT_MIN_WORDS = 3

SendJson = Callable[[protocol.ServerMessage], Awaitable[None]]
SendBytes = Callable[[bytes], Awaitable[None]]


class Reply:
    def __init__(
        self,
        turn_id: int,
        user_text: str,
        *,
        llm: ChatLLM,
        tts: Synthesizer,
        send_json: SendJson,
        send_bytes: SendBytes,
        clock: Clock,
        run_blocking: RunBlocking,
        request_id: str,
        first_clause_chars: int = 0,
        first_piece_words: int = FIRST_PHRASE_MAX_WORDS,
        first_piece_priority: bool = False,
        yield_ahead_s: float = YIELD_AHEAD_S,
        voice: str | None = None,
        speak: bool = True,
        on_complete: Callable[[Reply], None] | None = None,
        on_failed: Callable[[Reply], None] | None = None,
        on_metrics: Callable[[protocol.TurnMetrics], None] | None = None,
    ) -> None:
        self.turn_id = turn_id
        self.user_text = user_text
        self.request_id = request_id
        self.playback = ReplyPlayback(tts.sample_rate)
        self.metrics = protocol.TurnMetrics()
        self.released = False
        self.finished = False  # produced to the end (not cancelled, not failed)
        self.text_parts: list[str] = []
        self.speech_end = 0.0  # wall time the user's speech ended (start of voice-to-voice)
        self.commit = 0.0  # wall time the turn was committed (0 while speculative)
        self._llm, self._tts = llm, tts
        self._scheduling = scheduling_of(llm)  # None: the LLM is not on our cores, nothing to pause or yield
        self._send_json, self._send_bytes = send_json, send_bytes
        self._clock, self._run = clock, run_blocking
        self._first_clause_chars = first_clause_chars
        self._first_piece_words = first_piece_words
        self._first_piece_priority = first_piece_priority
        self._yield_ahead_s = yield_ahead_s
        self._voice = voice
        self.speaks = speak  # False: a text-only reply (the client's ``reply_audio``), no TTS
        self._on_complete, self._on_failed, self._on_metrics = on_complete, on_failed, on_metrics
        self._held: list[protocol.ServerMessage | bytes] = []
        self._task: asyncio.Task | None = None
        self._produce_started = 0.0
        self._produced_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts).strip()

    @property
    def producing(self) -> bool:
        return self._task is not None and not self._task.done()

    def active(self) -> bool:
        """Still being produced, or still playing at the client."""
        return self.producing or self.playback.playing(self._clock.now())

    def heard_text(self, now: float) -> str:
        """What the user has had of the reply by ``now``: the audio played, or all the text sent when it is not spoken."""
        if not self.speaks:
            return self.text if self.released else ""
        return self.playback.heard_text(now)

    def start(self, messages: list[Message], *, released: bool) -> None:
        self.released = released
        self._task = asyncio.create_task(self._produce(messages), name=f"turn-{self.turn_id}")

    def hold(self) -> None:
        """Send nothing more for now (the user may be going on with their turn); ``release`` resumes."""
        self.released = False

    async def release(self) -> None:
        """Send what a speculation held back, and everything it produces from now on."""
        self.released = True
        held, self._held = self._held, []
        for item in held:
            await self._emit(item)
        if self.finished and self._on_complete:
            self._on_complete(self)

    async def cancel(self) -> None:
        if self._task is not None:
            await cancel_task(self._task)

    def final_metrics(self) -> protocol.TurnMetrics:
        metrics = self.metrics.model_copy()
        playback = self.playback
        if playback.sent_s:
            # RTF from the turn commit (or, for a speculation, from when its production began)
            began = min(self.commit, self._produce_started) if self.commit else self._produce_started
            spent = (self._produced_at or self._clock.now()) - began
            metrics.reply_audio_s = playback.sent_s
            metrics.rtf = playback.sent_s / max(1e-6, spent)
        metrics.underruns = playback.underruns
        metrics.underrun_s = playback.underrun_s if playback.sent_s else None
        if self._on_metrics:
            self._on_metrics(metrics)
        return metrics

    # ------------------------------------------------------------------ production
    async def _emit(self, item: protocol.ServerMessage | bytes) -> None:
        """Send now if released, else hold it back (speculation)."""
        if not self.released:
            self._held.append(item)
            return
        if isinstance(item, bytes):
            now = self._clock.now()
            if self.playback.started_at is None:
                self.metrics.voice_to_voice_ms = (now - self.speech_end) * 1000
            self.playback.on_send(len(item) // 2, now)
            await self._send_bytes(item)
            return
        if isinstance(item, protocol.TurnDone):
            item = item.model_copy(update={"metrics": self.final_metrics()})
        await self._send_json(item)

    async def _produce(self, messages: list[Message]) -> None:
        """LLM tokens -> clauses/sentences -> TTS -> audio, all overlapped."""
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(pieces), name=f"tts-{self.turn_id}")
        splitter = SentenceSplitter(
            first_clause_chars=self._first_clause_chars, first_piece_words=self._first_piece_words
        )
        self._produce_started = self._clock.now()
        stream = self._llm.stream(messages, self.request_id)
        said: list[str] = []
        repeated = looping = False  # a piece said again word for word; a few words said again and again
        try:
            try:
                async for delta in stream:
                    if not self.text_parts:
                        self.metrics.llm_ttft_ms = (self._clock.now() - self._produce_started) * 1000
                    self.text_parts.append(delta)
                    await self._emit(protocol.AssistantText(turn_id=self.turn_id, delta=delta))
                    written = "".join(self.text_parts)
                    loop_at = loop_end(written)
                    if looping := loop_at is not None:  # say the loop's first time, not the rest
                        before = len(written) - len(delta)
                        splitter.forget_last(max(0, before - loop_at))
                        delta = delta[: max(0, loop_at - before)]
                    for piece in splitter.push(delta):
                        if self.metrics.llm_first_piece_ms is None:
                            self.metrics.llm_first_piece_ms = (self._clock.now() - self._produce_started) * 1000
                        if repeated := _repeats(piece, said):
                            break
                        said.append(piece)
                        pieces.put_nowait(piece)
                    if repeated or looping:
                        log.info("turn %s: the LLM repeated itself; the reply ends before the repeat", self.turn_id)
                        break
            finally:
                await stream.aclose()  # aborts the LLM request if we stopped early
            rest = None if repeated else splitter.flush()
            if rest and _repeats(rest, said):  # the last piece, said again at the very end
                rest, repeated = None, True
            if rest:
                if self.metrics.llm_first_piece_ms is None:  # the whole reply was one short piece
                    self.metrics.llm_first_piece_ms = (self._clock.now() - self._produce_started) * 1000
                said.append(rest)
                pieces.put_nowait(rest)
            if repeated or looping:
                self.text_parts = [" ".join(said)]  # what is spoken (the page and the history get it)
                self._count_guards(repeated=repeated, looping=looping)
            pieces.put_nowait(None)
            await speaker
            self._produced_at = self._clock.now()
            self.finished = True
            await self._emit(protocol.TurnDone(turn_id=self.turn_id, text=self.text))
            if self.released and self._on_complete:
                self._on_complete(self)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one failed turn must not end the conversation
            log.exception("turn %s failed", self.turn_id)
            if self._on_failed is not None:
                self._on_failed(self)
            await self._emit(protocol.Error(code="turn_failed", message=f"could not answer: {exc}"))
        finally:
            await cancel_task(speaker)

    def _count_guards(self, *, repeated: bool, looping: bool) -> None:
        """Which guard cut the reply, as per-turn counts (``TurnMetrics.guard_*``): how often the LLM needed one."""
        if repeated:
            self.metrics.guard_repeat = (self.metrics.guard_repeat or 0) + 1
        if looping:
            self.metrics.guard_loop = (self.metrics.guard_loop or 0) + 1

    async def _speak(self, pieces: asyncio.Queue[str | None]) -> None:
        sample_rate = self._tts.sample_rate
        chunk = sample_rate * AUDIO_CHUNK_MS // 1000
        while (piece := await pieces.get()) is not None:
            text = speakable(piece)
            if not text or not self.speaks:
                continue
            tts_started = self._clock.now()
            first = self.metrics.tts_first_audio_ms is None
            urgent = first and self._first_piece_priority
            paused = self._scheduling if urgent else None  # the LLM waits while this piece is synthesized
            if paused is not None:
                paused.pause(self.request_id, FIRST_PIECE_PAUSE_MAX_S)
            deadline = self._runs_dry_at(tts_started)
            try:
                audio = await self._run(
                    lambda t=text, u=urgent, d=deadline: list(
                        self._tts.synthesize(t, self._voice, urgent=u, deadline=d)
                    )
                )
            finally:
                if paused is not None:
                    paused.resume(self.request_id)
            if first:
                if audio:
                    audio[0] = trim_leading_quiet(audio[0], sample_rate, LEAD_KEEP_MS)
                self.metrics.tts_first_audio_ms = (self._clock.now() - tts_started) * 1000
                await self._emit(protocol.AudioStart(turn_id=self.turn_id, sample_rate=sample_rate))
            for samples in audio:
                for offset in range(0, len(samples), chunk):
                    await self._emit(float_to_pcm16(samples[offset : offset + chunk]))
            self.playback.add_piece(piece)
            self._yield_if_ahead()

    def _runs_dry_at(self, now: float) -> float:
        """When the listener runs out of audio: what was sent has played, and what is held back after it."""
        held_s = sum(len(item) // 2 for item in self._held if isinstance(item, bytes)) / self._tts.sample_rate
        return self.playback.runs_dry_at(now) + held_s

    def _yield_if_ahead(self) -> None:
        """Let other replies' LLM steps go first while this one's listener has audio enough (``yield_ahead_s``)."""
        now = self._clock.now()
        ahead_s = self._runs_dry_at(now) - now
        if self._scheduling is not None and self._yield_ahead_s and ahead_s > self._yield_ahead_s:
            self._scheduling.yield_to_others(self.request_id, ahead_s - self._yield_ahead_s)


def _repeats(piece: str, said: list[str]) -> bool:
    """``piece`` says again, word for word, one of the pieces ``said`` before it (and is long enough to count)."""
    spoken = words(piece)
    return len(spoken) >= REPEAT_MIN_WORDS and any(words(earlier) == spoken for earlier in said)


async def cancel_task(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has finished unwinding (its own errors are not ours)."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
