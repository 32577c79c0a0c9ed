"""Shared fixtures: a real `parley serve` on a free loopback port, synthesized speech, artifacts folder."""

from __future__ import annotations

import hashlib
import wave
from pathlib import Path

import numpy as np
import pytest
from harness import start_server, stop_server

from app.audio import float_to_pcm16
from app.bench.launcher import ROOT
from app.bench.samples import synthesize_speech

OUTPUT_DIR = ROOT / "test-output"


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
