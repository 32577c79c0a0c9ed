"""PCM conversions and resampling shared by the server, clients, tests and benchmarks."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import soxr

ASR_SAMPLE_RATE = 16_000
# A sample at least this loud (-34 dBFS) is heard. TTS audio starts with quieter near-silence
# (Piper's bundled voice: ~50 ms before the first word) that is sent but not a reply yet.
AUDIBLE_LEVEL = 0.02


def pcm16_to_float(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample a whole float32 buffer (high quality)."""
    if from_rate == to_rate:
        return samples.astype(np.float32, copy=False)
    return soxr.resample(samples.astype(np.float32, copy=False), from_rate, to_rate).astype(np.float32)


class StreamResampler:
    """Resamples a stream chunk by chunk with filter state carried across chunks (no clicks at frame edges)."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate, self.to_rate = from_rate, to_rate
        self._stream = None if from_rate == to_rate else soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32")

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples.astype(np.float32, copy=False))

    def flush(self) -> np.ndarray:
        """The stream has ended: the samples the filter still holds (its delay's worth)."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a PCM16 WAV as mono float32 (channels averaged) and its sample rate."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
        rate, channels = wav.getframerate(), wav.getnchannels()
        samples = pcm16_to_float(wav.readframes(wav.getnframes()))
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    return samples, rate


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(float_to_pcm16(samples))
    return buffer.getvalue()


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> None:
    Path(path).write_bytes(wav_bytes(samples, sample_rate))


def first_audible(samples: np.ndarray) -> int | None:
    """The index of the first sample that reaches ``AUDIBLE_LEVEL``; None when none does."""
    loud = np.flatnonzero(np.abs(samples) >= AUDIBLE_LEVEL)
    return int(loud[0]) if len(loud) else None


def trim_leading_quiet(samples: np.ndarray, sample_rate: int, keep_ms: float) -> np.ndarray:
    """``samples`` from ``keep_ms`` before the first ``AUDIBLE_LEVEL`` sample, the kept quiet faded in.

    A voice's first word then plays as soon as its audio does; the few quiet milliseconds kept
    hold a soft onset ("h", "f"), and the fade keeps the cut from clicking. Audio with no audible
    sample is returned whole.
    """
    loud = first_audible(samples)
    start = max(0, loud - int(keep_ms * sample_rate / 1000)) if loud is not None else 0
    if start == 0:
        return samples
    kept = samples[start:].copy()
    lead = loud - start
    kept[:lead] *= np.linspace(0.0, 1.0, lead, endpoint=False, dtype=kept.dtype)
    return kept
