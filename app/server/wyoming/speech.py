"""Wyoming text-to-speech: ``synthesize`` (whole text) or ``synthesize-start`` / ``-chunk``… / ``-stop`` (streamed text).

Text is cut as a reply's is (``SentenceSplitter`` with the server's ``first_clause_chars`` and
``first_piece_words``: the first piece short, so its audio starts early) and each piece goes to the
server's Piper (``models.tts``, shared with every conversation), its first on every core (``urgent``: a
listener waits on it) and decoded head first, its audio sent as it is made; while the server has no other
session (``models.solo``), every piece gets every core. A whole text is one audio
stream (``audio-start``, chunks, ``audio-stop``); streamed text is one audio stream per piece, then
``synthesize-stopped``, as the protocol has it. A streamed request's pieces are synthesized by a task
of their own while its text keeps arriving; the ``synthesize`` that clients send inside a stream (for
servers that do not stream) is ignored there.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event
from wyoming.tts import SynthesizeStopped, SynthesizeVoice

from app.audio import float_to_pcm16
from app.server.wyoming.wire import WireError
from app.stages.base import Synthesizer
from app.voice.clock import run_in_thread
from app.voice.reply_audio import AUDIO_CHUNK_MS
from app.voice.text import SentenceSplitter, speakable

Send = Callable[[Event], Awaitable[None]]
MAX_SPEECH_CHARS = 10_000  # one request's text (about ten minutes of speech)
WIDTH, CHANNELS = 2, 1


def chosen_voice(tts: Synthesizer, voice: SynthesizeVoice | None) -> str | None:
    """The voice a request names (by name, else by language); None: the default. An unknown name is an error."""
    if voice is None:
        return None
    if voice.name is not None:
        if voice.name not in tts.voices:
            raise WireError("unknown_voice", f"no voice {voice.name!r}; the voices are {tts.voices}")
        return voice.name
    if voice.language:
        return tts.voice_for(voice.language.replace("_", "-").split("-")[0].lower())
    return None


class Speech:
    """One synthesis request: text in (``add``, then ``finish``), audio events out through ``send``."""

    def __init__(
        self,
        tts: Synthesizer,
        send: Send,
        *,
        voice: str | None,
        streamed: bool,
        first_clause_chars: int,
        first_piece_words: int,
        solo: Callable[[], bool] = lambda: False,
    ) -> None:
        self._tts, self._send, self._voice, self.streamed, self._solo = tts, send, voice, streamed, solo
        self._splitter = SentenceSplitter(first_clause_chars=first_clause_chars, first_piece_words=first_piece_words)
        self._chars = 0
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self._speaker = asyncio.create_task(self._speak())
        self._started = False  # (a whole text: its one audio-start is sent)
        self._first = True
        self._first_piece_pending = True
        self._heard_from: float | None = None  # when the first audio was sent (a listener starts hearing it)
        self._sent_s = 0.0  # audio sent so far

    def add(self, text: str, *, whole: bool = False) -> None:
        """More text; ``whole``: all of it (a ``synthesize``), so its last sentence ends with it, not at a phrase."""
        if whole:
            text += " "  # (a sentence's end is seen at the space after it, as in a stream)
        self._chars += len(text)
        if self._chars > MAX_SPEECH_CHARS:
            raise WireError("text_too_long", f"over {MAX_SPEECH_CHARS} characters to speak in one request")
        # Word by word until the first piece is cut (a reply's LLM writes it so: a whole first sentence would
        # be one piece, heard only once all of it is encoded), then as it comes (whole sentences, fewer seams).
        words = re.findall(r"\S+\s*|\s+", text) if self._first_piece_pending else [text]
        for index, word in enumerate(words):
            self._queue(self._splitter.push(word))
            if not self._first_piece_pending:
                self._queue(self._splitter.push("".join(words[index + 1 :])))
                return

    def _queue(self, pieces: list[str]) -> None:
        for piece in pieces:
            self._first_piece_pending = False
            self._pieces.put_nowait(piece)

    async def finish(self) -> None:
        """The text is complete: its last piece is spoken, and the request's closing events sent."""
        rest = self._splitter.flush()
        if rest:
            self._queue([rest])
        self._pieces.put_nowait(None)
        await self._speaker
        if self.streamed:
            await self._send(SynthesizeStopped().event())
        else:
            if not self._started:
                await self._send(self._audio_start())
            await self._send(AudioStop().event())

    def close(self) -> None:
        self._speaker.cancel()

    async def _speak(self) -> None:
        while (piece := await self._pieces.get()) is not None:
            text = speakable(piece)
            if not text:
                continue
            # every core for the first piece (it is waited on), and for all while this is the server's one session
            urgent, self._first = self._first or self._solo(), False
            # a later piece is due when the audio before it has played (the first: now): decoded whole, and in
            # deadline order with other sessions' pieces
            deadline = None if self._heard_from is None else self._heard_from + self._sent_s
            chunks = iter(self._tts.synthesize(text, self._voice, urgent=urgent, deadline=deadline))
            if self.streamed or not self._started:
                await self._send(self._audio_start())
                self._started = True
            while (samples := await run_in_thread(lambda c=chunks: next(c, None))) is not None:
                await self._send_audio(samples)
            if self.streamed:
                await self._send(AudioStop().event())

    def _audio_start(self) -> Event:
        return AudioStart(rate=self._tts.sample_rate, width=WIDTH, channels=CHANNELS).event()

    async def _send_audio(self, samples: np.ndarray) -> None:
        rate = self._tts.sample_rate
        if self._heard_from is None:
            self._heard_from = time.monotonic()
        self._sent_s += len(samples) / rate
        step = rate * AUDIO_CHUNK_MS // 1000
        for offset in range(0, len(samples), step):
            pcm = float_to_pcm16(samples[offset : offset + step])
            await self._send(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=pcm).event())
