"""Shared fixtures: a real `parley serve` on a free loopback port, synthesized speech, artifacts folder.

And the check that keeps the ``models`` marker honest: a run with no ``models`` test in it
(``make test-fast`` deselects them) makes every bundled-model loader in this process raise, and
starting a `parley` server too, so a test that needs a model file but is not marked fails there
instead of passing on a warm cache. (A model loaded by some other subprocess is not caught.)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # The GPU's weight-only int8 kernel (engine/triton_int8.py) is tested in Triton's interpreter, which Triton must
    # know of before it is first imported (transformers and bitsandbytes import it where it is installed).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness import start_server, stop_server  # noqa: E402

from app.audio import float_to_pcm16
from app.bench.launcher import ROOT
from app.bench.samples import synthesize_speech

# The suite's LLM is the bundled SmolLM2-135M (fast, and always installed), not the default brain ("auto": the
# fetched Qwen2.5-Coder-0.5B): every `Settings()` and every `parley serve` a test starts reads this. The tests of
# the default brain itself name it (``llm_model="auto"`` or "qwen2.5-coder-0.5b").
os.environ.setdefault("PARLEY_LLM_MODEL", "bundled")
# What a server keeps across restarts (the reminders' database) goes to a folder of this process, never the user's
# (and not one that another worker of a parallel run, `pytest -n 2`, shares).
os.environ["PARLEY_DATA_DIR"] = tempfile.mkdtemp(prefix="parley-test-data-")

OUTPUT_DIR = ROOT / "test-output"
MODELS = "models"
# The shared fixtures that load a bundled model (``model_path`` is under every engine fixture):
# a test that uses one is marked ``models`` here; any other test that needs a model is marked in its file.
MODEL_FIXTURES = frozenset({"model_path", "live_server", "speech", "speech_wav"})

_model_guard: tuple[pytest.MonkeyPatch, Path] | None = None


def _forbidden(what: str):
    """A stand-in for a model loader that says which marker the calling test lacks."""

    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"{what}: this run has no test marked `{MODELS}`, yet a test needs a model file; "
            f"mark it `@pytest.mark.{MODELS}` (or `pytestmark = pytest.mark.{MODELS}` for its module)"
        )

    return refuse


def forbid_model_files(patch: pytest.MonkeyPatch, empty_cache: Path) -> None:
    """Make every way to a bundled model file raise: the files' locators, the loaders, a `parley` server.

    The cache (``PARLEY_CACHE_DIR``: converted SmolLM2, joined Whisper base, synthesized speech)
    is pointed at an empty folder, so what another run left there cannot hide a model load.
    """
    import faster_whisper
    import onnxruntime
    import piper

    import app.stages.asr
    import app.stages.end_of_turn
    import app.stages.vad
    import engine.weights
    from app.bench.launcher import ServerProcess

    patch.setenv("PARLEY_CACHE_DIR", str(empty_cache))
    for owner, name, what in (
        (app.stages.asr, "bundled_asr_path", "Whisper tiny.en"),
        (app.stages.asr, "_package_data", "Whisper base"),
        (faster_whisper, "WhisperModel", "a Whisper model"),
        (app.stages.vad, "_default_model_path", "Silero VAD"),
        (app.stages.end_of_turn, "bundled_model_path", "Smart Turn"),
        (onnxruntime, "InferenceSession", "an ONNX model (VAD, Smart Turn, Piper)"),
        (piper.PiperVoice, "load", "a Piper voice"),
        (engine.weights, "bundled_gguf_path", "SmolLM2"),
        (ServerProcess, "__init__", "a `parley` server (it loads the bundled models)"),
    ):
        patch.setattr(owner, name, _forbidden(what))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(MODELS)


def pytest_collection_finish(session: pytest.Session) -> None:
    global _model_guard
    if any(item.get_closest_marker(MODELS) for item in session.items):
        return
    _model_guard = pytest.MonkeyPatch(), Path(tempfile.mkdtemp(prefix="parley-no-models-"))
    forbid_model_files(*_model_guard)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _model_guard is not None:
        patch, empty_cache = _model_guard
        patch.undo()
        shutil.rmtree(empty_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _apps_in_the_test_process_keep_the_heap_unfrozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """An app started in this process would collect and freeze the whole suite's heap (~0.1 s each, hundreds
    of starts). The freeze is for a server's own process: the `parley serve` subprocesses still do it."""
    server_app = sys.modules.get("app.server.app")
    if server_app is not None:
        monkeypatch.setattr(server_app, "freeze_startup_heap", lambda: None)


@pytest.fixture(scope="session")
def output_dir() -> Path:
    OUTPUT_DIR.mkdir(exist_ok=True)
    return OUTPUT_DIR


@pytest.fixture(scope="session")
def live_server(output_dir: Path):
    """A real `parley serve` with the bundled models, shared by the end-to-end tests."""
    process, base_url = start_server(["serve"], output_dir / "server.log")
    yield base_url
    stop_server(process)


@pytest.fixture(scope="session")
def speech():
    """``speech(text) -> float32 16 kHz`` spoken by the bundled voice."""
    return synthesize_speech


@pytest.fixture(scope="session")
def speech_wav(output_dir: Path):
    """``speech_wav(text, sample_rate=16000) -> Path`` of a mono PCM16 WAV of ``text`` spoken."""

    def make(text: str, sample_rate: int = 16_000) -> Path:
        audio = synthesize_speech(text, sample_rate=sample_rate)
        key = hashlib.sha1(text.encode()).hexdigest()[:12]
        path = output_dir / f"speech-{key}-{sample_rate}.wav"
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(sample_rate)
            wav.writeframes(float_to_pcm16(np.asarray(audio)))
        return path

    return make
