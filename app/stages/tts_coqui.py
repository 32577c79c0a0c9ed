"""Coqui XTTS-v2 as an optional TTS backend, for the GPU image: ``pip install 'parley[coqui]'``.

Same interface as ``app.stages.tts.Synthesizer``: ``sample_rate`` (24 kHz) and ``synthesize(text)``,
which yields float32 chunks as XTTS streams them (the first after ~20 GPT tokens).

Coqui is imported inside the class, so a CPU install never needs it (on the CPU torch from
PyPI it does not even import: PyPI's torchaudio is a CUDA build). The weights are never
bundled: ``model_dir`` is a local copy of ``coqui/XTTS-v2`` (the Docker entrypoint fetches it
into the models volume). The XTTS-v2 weights are under the Coqui Public Model License
(non-commercial use only); the ``coqui-tts`` code is MPL-2.0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from app.stages.scheduling import DeadlineLock

XTTS_LANGUAGES = frozenset("en es fr de it pt pl tr ru nl cs ar zh ja hu ko hi".split())
INSTALL_HINT = "pip install 'parley[coqui]' (needs a CUDA torch build; see docker/Dockerfile)"
DEFAULT_SPEAKER = "Ana Florence"  # one of the studio speakers shipped in XTTS-v2's speakers_xtts.pth


class CoquiUnavailable(RuntimeError):
    """Coqui TTS (the ``coqui-tts`` package) or one of its parts cannot be imported."""


class CoquiSynthesizer:
    def __init__(
        self,
        model_dir: str,
        *,
        speaker: str = DEFAULT_SPEAKER,
        speaker_wav: str | None = None,
        language: str = "en",
        device: str = "cuda",
        stream_chunk_size: int = 20,
    ) -> None:
        try:
            import torch
            from TTS.tts.configs.xtts_config import XttsConfig
            from TTS.tts.models.xtts import Xtts
        except (ImportError, OSError) as error:
            raise CoquiUnavailable(f"Coqui TTS is not available ({error}): {INSTALL_HINT}") from error

        folder = Path(model_dir)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir!r} is not an XTTS-v2 folder (no config.json); fetch coqui/XTTS-v2")
        config = XttsConfig()
        config.load_json(str(folder / "config.json"))
        self.model = Xtts.init_from_config(config)
        self.model.load_checkpoint(config, checkpoint_dir=str(folder), use_deepspeed=False)
        self.model.to(device).eval()
        self.sample_rate: int = int(config.audio.output_sample_rate)
        self.language = language
        self.voices = [speaker_wav and Path(speaker_wav).stem or speaker]
        self.stream_chunk_size = stream_chunk_size
        with torch.inference_mode():
            if speaker_wav:  # voice cloning from a few seconds of reference audio
                self.gpt_cond_latent, self.speaker_embedding = self.model.get_conditioning_latents(
                    audio_path=[speaker_wav]
                )
            else:
                speakers = self.model.speaker_manager.speakers if self.model.speaker_manager else {}
                if speaker not in speakers:
                    raise ValueError(
                        f"XTTS speaker {speaker!r} not in {model_dir}/speakers_xtts.pth; give a speaker_wav"
                    )
                self.gpt_cond_latent, self.speaker_embedding = speakers[speaker].values()  # as Xtts.synthesize does
        self._torch = torch
        self._lock = DeadlineLock()  # one model; a GPU runs one stream at a time well

    @classmethod
    def from_settings(cls, settings) -> CoquiSynthesizer:
        """Build from ``app.config.Settings``; settings not defined there yet fall back to defaults."""
        return cls(
            settings.tts_voice,
            speaker=getattr(settings, "tts_speaker", DEFAULT_SPEAKER),
            speaker_wav=getattr(settings, "tts_speaker_wav", None),
            language=getattr(settings, "tts_language", "en"),
            device=getattr(settings, "tts_device", "cuda"),
        )

    def voice_for(self, language: str) -> str | None:
        """XTTS-v2 speaks its 17 languages with the same (cloned or studio) speaker."""
        return self.voices[0] if language in XTTS_LANGUAGES else None

    def synthesize(
        self, text: str, voice: str | None = None, *, urgent: bool = False, deadline: float | None = None
    ) -> Iterator[np.ndarray]:
        with self._lock.hold(deadline), self._torch.inference_mode():
            for chunk in self.model.inference_stream(
                text,
                self.language,
                self.gpt_cond_latent,
                self.speaker_embedding,
                stream_chunk_size=self.stream_chunk_size,
                enable_text_splitting=False,  # the session already speaks sentence by sentence
            ):
                yield chunk.detach().float().cpu().numpy().reshape(-1)
