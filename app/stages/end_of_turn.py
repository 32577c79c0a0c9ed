"""End of turn from the sound of speech: Smart Turn v3 (pipecat's ONNX model, BSD-2-Clause).

The model hears the last 8 s of the user's audio and says how likely it is that the turn is
complete (intonation, rhythm, a trailing "um"), in 23 languages. Parley runs it at each pause
and combines it with the words' own cue (``app.voice.turns``): when the model is confident
the turn is over, the endpoint comes after a short silence; when it is confident the user is
mid-thought, the endpoint waits longer.

The ONNX file ships inside the ``pipecat-ai`` wheel; only that file is used (the package is
installed without its dependencies, see docker/install.sh). Its input features are Whisper's
log-mel spectrogram of the zero-mean, unit-variance waveform, which faster-whisper's own
feature extractor computes (checked against pipecat's implementation in the tests).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.stages.onnx import cpu_session

log = logging.getLogger(__name__)

WINDOW_S = 8  # the model's input: the last 8 s, zero-padded at the start
MODEL_FILE = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"


def bundled_model_path() -> Path | None:
    """The ONNX file inside the installed ``pipecat`` package (found without importing it), or None."""
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.is_file() else None


class SmartTurn:
    """One shared ONNX session; ``complete_probability`` is thread-safe.

    A call costs the same whatever the speech's length (its 8 s window is 400 encoder
    positions); it runs on one core beside the tail transcription, and `parley bench voice`
    reports it as ``turn_detect``.
    """

    def __init__(self, path: str | Path | None = None, threads: int = 1) -> None:
        from faster_whisper.feature_extractor import FeatureExtractor

        model = Path(path) if path else bundled_model_path()
        if model is None or not model.is_file():
            raise FileNotFoundError(
                "Smart Turn v3 model not found: install it with `pip install --no-deps pipecat-ai==1.14.0` "
                "(or set turn_model=none)"
            )
        self.session = cpu_session(model, threads, log_severity=3)
        self._features = FeatureExtractor(feature_size=80, chunk_length=WINDOW_S)
        self._lock = threading.Lock()  # the feature extractor keeps buffers

    def complete_probability(self, audio: np.ndarray) -> float:
        """How likely the turn is over, given 16 kHz float32 audio that ends where the speech paused."""
        samples = WINDOW_S * ASR_SAMPLE_RATE
        audio = audio[-samples:].astype(np.float32, copy=False)
        if len(audio) < samples:
            audio = np.concatenate([np.zeros(samples - len(audio), np.float32), audio])
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + 1e-7)
        with self._lock:
            features = self._features(audio, padding=0)[:, : WINDOW_S * 100]
        (logits,) = self.session.run(None, {"input_features": features[None].astype(np.float32)})
        return float(np.asarray(logits).reshape(-1)[0])
