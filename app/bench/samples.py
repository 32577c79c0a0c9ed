"""Spoken questions synthesized with the bundled voice, for tests, benchmarks and demos."""

from __future__ import annotations

import hashlib

import numpy as np

from app.audio import ASR_SAMPLE_RATE, read_wav, resample, write_wav
from engine.weights import cache_dir


def synthesize_speech(text: str, synthesizer=None, sample_rate: int = ASR_SAMPLE_RATE) -> np.ndarray:
    """``text`` spoken by the bundled Piper voice as mono float32 at ``sample_rate``; cached on disk."""
    key = hashlib.sha1(f"{text}|{sample_rate}".encode()).hexdigest()[:16]
    path = cache_dir() / "speech" / f"{key}.wav"
    if path.is_file():
        return read_wav(path)[0]
    if synthesizer is None:
        from app.stages.tts import PiperSynthesizer

        synthesizer = PiperSynthesizer()
    audio = np.concatenate(list(synthesizer.synthesize(text)))
    audio = resample(audio, synthesizer.sample_rate, sample_rate)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{np.random.randint(1 << 30)}.tmp")
    write_wav(tmp, audio, sample_rate)
    tmp.replace(path)
    return audio
