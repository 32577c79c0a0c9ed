"""A reply's pieces spoken: synthesized as they come, sent in short chunks, the first one heard as early as it can be.

The first piece's audio starts at its first audible sample (``LEAD_KEEP_MS`` before it); with
``first_piece_priority`` the LLM pauses while it is synthesized, on more cores; and a reply whose listener has
audio enough ahead lets other replies' LLM steps go first (``ReplyOptions.yield_ahead_s``). The ``Reply`` writes the
pieces and owns what is sent (``Reply.emit``: held back while speculative) and what was heard (its playback).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np

from app import protocol
from app.audio import first_audible, float_to_pcm16, trim_leading_quiet
from app.stages.base import LocalScheduling, Synthesizer
from app.voice.clock import Clock, RunBlocking
from app.voice.pieces import Piece
from app.voice.playback import ReplyPlayback
from app.voice.text import speakable

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
# several users the paused request would also wait for the shared Piper lock (app/bench/results/turn_flow.md).
FIRST_PIECE_PAUSE_MAX_S = 2.0


class SpeakingOptions(Protocol):
    voice: str | None
    first_piece_priority: bool
    yield_ahead_s: float


class SpokenReply(Protocol):
    """What the speaker reads of the reply (``app.voice.reply.Reply``), each at its use: they change as it goes."""

    turn_id: int
    request_id: str  # (the next round of a reply with tools is another request)
    speech_end: float
    speaks: bool
    metrics: protocol.TurnMetrics
    playback: ReplyPlayback
    options: SpeakingOptions

    async def emit(self, item: protocol.ServerMessage | bytes) -> None: ...

    def runs_dry_at(self, now: float) -> float: ...


class ReplyAudio:
    def __init__(
        self,
        reply: SpokenReply,
        tts: Synthesizer,
        scheduling: LocalScheduling | None,
        clock: Clock,
        run_blocking: RunBlocking,
    ) -> None:
        """``tts`` and ``scheduling``: the reply's (its LLM's; None: not on our cores, nothing to pause or yield)."""
        self._reply, self._tts, self._scheduling = reply, tts, scheduling
        self._clock, self._run = clock, run_blocking

    async def speak(self, pieces: asyncio.Queue[Piece | None]) -> None:
        """Speak each piece as it comes (None: the reply is written to its end)."""
        reply = self._reply
        sample_rate = self._tts.sample_rate
        while (piece := await pieces.get()) is not None:
            text = speakable(piece.text)
            if not text or not reply.speaks:
                continue
            tts_started = self._clock.now()
            first = reply.metrics.tts_first_audio_ms is None
            urgent = first and reply.options.first_piece_priority
            paused = self._scheduling if urgent else None  # the LLM waits while this piece is synthesized
            request_id = reply.request_id  # (the next round of a reply with tools is another request)
            if paused is not None:
                paused.pause(request_id, FIRST_PIECE_PAUSE_MAX_S)
            deadline = reply.runs_dry_at(tts_started)
            # audio as it is made: a piece decoded head first (``PiperSynthesizer``) is heard before its rest exists
            chunks = iter(self._tts.synthesize(text, reply.options.voice, urgent=urgent, deadline=deadline))
            quiet = np.zeros(0, np.float32)  # a first piece's chunks with nothing audible yet: trimmed with the next
            try:
                while (samples := await self._run(lambda c=chunks: next(c, None))) is not None:
                    if first and reply.metrics.tts_first_audio_ms is None:
                        samples = np.concatenate([quiet, samples])
                        if first_audible(samples) is None:
                            quiet = samples
                            continue
                        samples = trim_leading_quiet(samples, sample_rate, LEAD_KEEP_MS)
                        await self._first_audio(tts_started, sample_rate)
                    if piece.answer and reply.metrics.answer_ms is None:
                        reply.metrics.answer_ms = (self._clock.now() - reply.speech_end) * 1000
                    await self._send_audio(samples)
            finally:
                if paused is not None:
                    paused.resume(request_id)
            if first and reply.metrics.tts_first_audio_ms is None:
                await self._first_audio(tts_started, sample_rate)  # (a piece with nothing audible: sent whole)
                await self._send_audio(quiet)
            reply.playback.add_piece("" if piece.filler else piece.text)
            self._yield_if_ahead()

    async def _send_audio(self, samples: np.ndarray) -> None:
        """In ``AUDIO_CHUNK_MS`` pieces, so an interrupt drops little."""
        reply = self._reply
        chunk = self._tts.sample_rate * AUDIO_CHUNK_MS // 1000
        for offset in range(0, len(samples), chunk):
            await reply.emit(float_to_pcm16(samples[offset : offset + chunk]))

    async def _first_audio(self, tts_started: float, sample_rate: int) -> None:
        reply = self._reply
        reply.metrics.tts_first_audio_ms = (self._clock.now() - tts_started) * 1000
        await reply.emit(protocol.AudioStart(turn_id=reply.turn_id, sample_rate=sample_rate))

    def _yield_if_ahead(self) -> None:
        """Let other replies' LLM steps go first while this one's listener has audio enough (``yield_ahead_s``)."""
        reply = self._reply
        now = self._clock.now()
        ahead_s = reply.runs_dry_at(now) - now
        yield_ahead_s = reply.options.yield_ahead_s
        if self._scheduling is not None and yield_ahead_s and ahead_s > yield_ahead_s:
            self._scheduling.yield_to_others(reply.request_id, ahead_s - yield_ahead_s)
