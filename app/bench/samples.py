"""Spoken questions synthesized with the bundled voice, for tests, benchmarks and demos."""

from __future__ import annotations

import hashlib

import numpy as np

from app.audio import ASR_SAMPLE_RATE, read_wav, resample, write_wav
from engine.weights import cache_dir


def synthesize_speech(
    text: str, synthesizer=None, sample_rate: int = ASR_SAMPLE_RATE, length_scale: float = 1.0
) -> np.ndarray:
    """``text`` spoken by the bundled Piper voice as mono float32 at ``sample_rate``; cached on disk.

    ``length_scale`` > 1 speaks slower, < 1 faster (Piper's own knob).
    """
    rate = "" if length_scale == 1.0 else f"|{length_scale:g}"
    key = hashlib.sha1(f"{text}|{sample_rate}{rate}".encode()).hexdigest()[:16]
    path = cache_dir() / "speech" / f"{key}.wav"
    if path.is_file():
        return read_wav(path)[0]
    if synthesizer is None:
        from app.stages.tts import PiperSynthesizer

        synthesizer = PiperSynthesizer(length_scale=None if length_scale == 1.0 else length_scale)
    audio = np.concatenate(list(synthesizer.synthesize(text)))
    audio = resample(audio, synthesizer.sample_rate, sample_rate)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{np.random.randint(1 << 30)}.tmp")
    write_wav(tmp, audio, sample_rate)
    tmp.replace(path)
    return audio


def noise_rms(clips: list[np.ndarray], snr_db: float) -> float:
    """The RMS of background noise ``snr_db`` under the speech of ``clips`` (its loud samples, not its pauses)."""
    speech = np.concatenate(clips)
    loud = speech[np.abs(speech) > 0.01]
    return float(np.sqrt(np.mean(loud**2))) / 10 ** (snr_db / 20)


FRAME = ASR_SAMPLE_RATE // 100  # 10 ms


def _frame_rms(audio: np.ndarray) -> np.ndarray:
    usable = len(audio) // FRAME * FRAME
    return np.sqrt(np.mean(audio[:usable].reshape(-1, FRAME) ** 2, axis=1))


def speech_bounds(audio: np.ndarray, below_peak_db: float = 40.0) -> tuple[int, int]:
    """First and one-past-last sample of speech: where 10 ms frames rise above the noise floor
    (``below_peak_db`` under the loudest frame). The end is the acoustic end of the utterance,
    from which a user feels the assistant's silence."""
    rms = _frame_rms(audio)
    floor = max(3e-3, float(rms.max()) * 10 ** (-below_peak_db / 20))
    loud = np.flatnonzero(rms > floor)
    if not len(loud):
        return 0, 0
    return int(loud[0]) * FRAME, (int(loud[-1]) + 1) * FRAME


def trim_to_speech(audio: np.ndarray, keep_s: float = 0.05) -> np.ndarray:
    """The clip from a little before its first speech sample to exactly its acoustic end."""
    start, end = speech_bounds(audio)
    return audio[max(0, start - int(keep_s * ASR_SAMPLE_RATE)) : end]


def with_pause(audio: np.ndarray, pause_s: float) -> tuple[np.ndarray, int]:
    """Stretch the longest quiet gap in the middle of ``audio`` into a ``pause_s`` silence.

    The sentence is synthesized whole, so the words before the gap keep the intonation of a
    sentence going on (synthesizing the halves apart would end the first half like a finished
    sentence, which no end-of-turn cue could tell from a real end). Returns the audio and the
    sample where the pause starts.
    """
    rms = _frame_rms(audio)
    floor = max(3e-3, float(rms.max()) * 10 ** (-30 / 20))
    quiet = rms <= floor
    best, best_len, run_start = None, 0, None
    lo, hi = int(len(rms) * 0.25), int(len(rms) * 0.8)
    for index in range(lo, hi + 1):
        if index < hi and quiet[index]:
            run_start = index if run_start is None else run_start
        elif run_start is not None:
            if index - run_start > best_len:
                best, best_len = run_start, index - run_start
            run_start = None
    if best is None:
        raise ValueError("no gap between words to stretch into a pause")
    start, end = best * FRAME, (best + best_len) * FRAME
    silence = np.zeros(max(0, int(pause_s * ASR_SAMPLE_RATE)), np.float32)
    return np.concatenate([audio[:start], silence, audio[end:]]), start
