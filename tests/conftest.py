"""Shared fixtures: a real `parley serve` on a free loopback port, synthesized speech, artifacts folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.audio import float_to_pcm16
from app.samples import synthesize_speech

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = ROOT / "test-output"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str], log_path: Path, ready_path: str = "/healthz", timeout_s: float = 180):
    """Start a `parley` subprocess and wait until ``ready_path`` answers 200; returns (process, base_url)."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process below
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.close()
            raise RuntimeError(f"server exited early:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base_url + ready_path, timeout=1).status_code == 200:
                process.log_file = log  # type: ignore[attr-defined]
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    log.close()
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{log_path.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.log_file.close()  # type: ignore[attr-defined]


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
        path = output_dir / f"speech-{abs(hash((text, sample_rate))) % 10**10}-{sample_rate}.wav"
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(sample_rate)
            wav.writeframes(float_to_pcm16(np.asarray(audio)))
        return path

    return make
