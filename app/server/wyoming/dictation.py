"""Wyoming speech-to-text: ``transcribe``, ``audio-start``, ``audio-chunk``…, ``audio-stop`` -> ``transcript``.

The audio goes to the server's one Whisper (``models.asr``, shared with every conversation), in the same
calls a conversation makes: partial transcriptions while the audio arrives (``wait=False``: they give way
to a final anyone waits on), the whole audio on ``audio-stop``. Streaming is always on, since clients
that do not stream skip what they do not know: ``transcript-start`` when the audio starts,
``transcript-chunk`` with each word two partials agree on (``PartialStabilizer``: chunks only ever add
words), then the final ``transcript`` (the authoritative text) and ``transcript-stop``.

A partial runs only where the audio comes at about the pace it was spoken (Home Assistant streams the
microphone): audio sent all at once gets no partials, which would only delay its final.

The final is started early, as a conversation's tail is: the server's VAD runs over the audio, and at each
pause in the speech (``pause_ms`` of quiet) the audio so far is transcribed at once. Home Assistant ends
the stream only after its own VAD heard ~0.7 s of silence; if nothing was said after the pause by then,
the transcript is already made when ``audio-stop`` comes. Speech after the pause voids that job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
from wyoming.asr import Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart
from wyoming.event import Event

from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float
from app.protocol import MAX_INPUT_SAMPLE_RATE, MIN_INPUT_SAMPLE_RATE
from app.server.wyoming.wire import WireError
from app.stages.base import SpeechRecognizer, Transcription, VoiceActivity
from app.voice.clock import run_in_thread
from app.voice.text import without_trailing_loop
from app.voice.turns import PartialStabilizer

log = logging.getLogger(__name__)

Send = Callable[[Event], Awaitable[None]]
MAX_CHANNELS = 2
# Silence put before the audio of a final. A client's stream may begin with the first word (Home Assistant
# starts it after the wake word), and Whisper then often drops that word ("How are you today?" -> "Are you
# today?"); a conversation's utterance has 300 ms of real audio before it (``utterance.PREROLL_MS``). On 72
# spoken requests at 20 dB SNR (``parley bench wyoming``'s corpus, seeds 1 and 2: not the benchmark's own)
# the bundled tiny.en's word errors went from 13 to 10 of 468 (with 30 s windows: 22 to 7).
LEAD_IN_SAMPLES = int(0.3 * ASR_SAMPLE_RATE)


def language_code(asked: str | None, languages: list[str]) -> str | None:
    """The Whisper language for a client's ``language`` ("en", "en-US", "de_DE"); None: the model's default."""
    if not asked:
        return None
    code = asked.replace("_", "-").split("-")[0].lower()
    if code not in languages:
        offered = [language for language in languages if language] or ["en"]
        raise WireError("unsupported_language", f"the speech model takes no language {asked!r}; it takes {offered}")
    return code


class Dictation:
    """One request's audio, from ``audio-start`` to ``audio-stop``, and its transcript.

    ``max_seconds``: audio past it is not kept (the final covers the first ``max_seconds``, as a
    conversation's utterance is cut there); ``partial_interval_s``: how often a partial runs.
    """

    def __init__(
        self,
        asr: SpeechRecognizer,
        send: Send,
        *,
        language: str | None,
        max_seconds: float,
        partial_interval_s: float,
        vad: VoiceActivity | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._asr, self._send, self._language, self._vad, self._clock = asr, send, language, vad, clock
        self._max_samples = int(max_seconds * ASR_SAMPLE_RATE)
        self._partial_interval_s = partial_interval_s
        self._format: tuple[int, int, int] | None = None
        self._resampler: StreamResampler | None = None
        self._parts: list[np.ndarray] = []
        self._samples = 0
        self._started_at = 0.0
        self._partial: asyncio.Task | None = None
        self._partial_at = 0.0  # wall time the last partial started
        self._partial_samples = 0  # audio the last partial had
        self._stable = PartialStabilizer()
        self._sent = ""  # the words sent as transcript-chunks so far
        self._early: asyncio.Task | None = None  # the final, started at a pause in the speech (None: none, or void)
        self.dropped_s = 0.0

    async def start(self, event: Event) -> None:
        start = AudioStart.from_event(_complete(event, ("rate", "width", "channels")))
        self._format = _checked_format(start.rate, start.width, start.channels)
        self._resampler = StreamResampler(start.rate, ASR_SAMPLE_RATE)
        self._started_at = self._partial_at = self._clock()
        await self._send(TranscriptStart(language=self._language).event())

    async def chunk(self, event: Event) -> None:
        if self._format is None or self._resampler is None:
            raise WireError("audio_not_started", "audio-chunk before audio-start")
        if not event.payload:
            return  # (an empty chunk: nothing to hear)
        chunk = AudioChunk.from_event(_complete(event, ("rate", "width", "channels")))
        if (chunk.rate, chunk.width, chunk.channels) != self._format:
            raise WireError("audio_format_changed", "an audio-chunk's format differs from its audio-start")
        rate, width, channels = self._format
        if len(chunk.audio) % (width * channels):
            raise WireError("bad_audio", f"an audio-chunk must hold whole samples of {width * channels} bytes")
        samples = pcm16_to_float(chunk.audio)
        if channels > 1:
            samples = samples.reshape(-1, channels).mean(axis=1)
        samples = self._resampler(samples)
        self._keep(samples)
        if self._vad is not None:
            self._watch_pauses(samples)
        if self._early is None:
            self._maybe_partial()

    def _keep(self, samples: np.ndarray) -> None:
        room = self._max_samples - self._samples
        if len(samples) > room:
            self.dropped_s += (len(samples) - max(0, room)) / ASR_SAMPLE_RATE
            samples = samples[: max(0, room)]
        if len(samples):
            self._parts.append(samples)
            self._samples += len(samples)

    async def stop(self) -> str:
        """The final transcript, sent (with the last chunk and ``transcript-stop``); returns its text."""
        if self._format is None:
            raise WireError("audio_not_started", "audio-stop before audio-start")
        if self._partial is not None:
            self._partial.cancel()  # (its thread gives way to the final: ``wait=False``)
        if self._resampler is not None:
            self._keep(self._resampler.flush())
        audio = self._audio()
        if self.dropped_s:
            log.warning("wyoming: %.1f s of audio past max_utterance_s were not transcribed", self.dropped_s)
        early, self._early = self._early, None
        if early is not None and self._vad is not None and (self._vad.speaking or self._vad.speech_pending):
            early.cancel()  # words after the pause, not yet a start: the whole audio it is
            early = None
        result = await early if early is not None else await self._transcribe(audio)
        text = ""
        if result is not None:
            text = without_trailing_loop(result.text.strip(), result.audio_seconds)
        rest = text[len(self._sent) :] if text.startswith(self._sent) else ""
        if rest.strip():
            await self._send(TranscriptChunk(text=rest).event())
        await self._send(Transcript(text=text, language=self._language).event())
        await self._send(TranscriptStop().event())
        return text

    def close(self) -> None:
        for task in (self._partial, self._early):
            if task is not None:
                task.cancel()

    async def _transcribe(self, audio: np.ndarray) -> Transcription | None:
        if not len(audio):
            return None
        audio = np.concatenate([np.zeros(LEAD_IN_SAMPLES, np.float32), audio])
        return await run_in_thread(lambda: self._asr.transcribe(audio, language=self._language))

    def _watch_pauses(self, samples: np.ndarray) -> None:
        """A pause in the speech starts the final on the audio so far; speech after it voids that job."""
        assert self._vad is not None
        for event in self._vad.feed(samples):
            if event.kind == "start" and self._early is not None:
                self._early.cancel()
                self._early = None
            elif event.kind == "end" and self._early is None:
                self._early = asyncio.create_task(self._transcribe(self._audio()))

    def _audio(self) -> np.ndarray:
        if len(self._parts) > 1:
            self._parts = [np.concatenate(self._parts)]
        return self._parts[0] if self._parts else np.zeros(0, np.float32)

    def _maybe_partial(self) -> None:
        """Start a partial when the last is done, ``partial_interval_s`` of new audio came, and as much time passed."""
        now, interval = self._clock(), self._partial_interval_s
        if self._partial is not None and not self._partial.done():
            return
        if now - self._partial_at < interval:
            return
        if (self._samples - self._partial_samples) < interval * ASR_SAMPLE_RATE:
            return
        if self._samples / ASR_SAMPLE_RATE > 2.0 * (now - self._started_at) + interval:
            return  # audio arriving far faster than it was spoken: its final comes at once, no partial
        self._partial_at, self._partial_samples = now, self._samples
        self._partial = asyncio.create_task(self._run_partial(self._audio()))

    async def _run_partial(self, audio: np.ndarray) -> None:
        result = await run_in_thread(lambda: self._asr.transcribe(audio, wait=False, language=self._language))
        if result is None:
            return
        shown = self._stable.update(result.text.strip())
        if shown and shown.startswith(self._sent) and len(shown) > len(self._sent):
            added = shown[len(self._sent) :]
            self._sent = shown
            await self._send(TranscriptChunk(text=added).event())


def _complete(event: Event, keys: tuple[str, ...]) -> Event:
    missing = [key for key in keys if key not in event.data]
    if missing:
        raise WireError("bad_event", f"{event.type}: missing {', '.join(missing)}")
    return event


def _checked_format(rate: object, width: object, channels: object) -> tuple[int, int, int]:
    for name, value in (("rate", rate), ("width", width), ("channels", channels)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError("bad_audio_format", f"audio {name} must be an integer")
    assert isinstance(rate, int) and isinstance(width, int) and isinstance(channels, int)
    if not MIN_INPUT_SAMPLE_RATE <= rate <= MAX_INPUT_SAMPLE_RATE:
        raise WireError("bad_audio_format", f"audio rate {rate} Hz: {MIN_INPUT_SAMPLE_RATE}-{MAX_INPUT_SAMPLE_RATE}")
    if width != 2:
        raise WireError("bad_audio_format", f"audio width {width}: only 16-bit PCM (width 2) is taken")
    if not 1 <= channels <= MAX_CHANNELS:
        raise WireError("bad_audio_format", f"audio channels {channels}: 1 or {MAX_CHANNELS} are taken")
    return rate, width, channels
