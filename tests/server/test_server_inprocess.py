"""The FastAPI app in-process (Starlette's test client), with real VAD/ASR/TTS and a scripted LLM."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from harness import ScriptedLLM

from app.config import Settings
from app.server.app import create_app
from app.stages.asr import Transcriber
from app.stages.registry import Models
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def models():
    return Models(vad=SileroVad(), asr=Transcriber(), llm=ScriptedLLM(["Hello there."]), tts=PiperSynthesizer())


def test_sessions_over_the_limit_get_a_clear_error_and_others_keep_working(models):
    app = create_app(Settings(max_sessions=1), models=models)
    with (
        TestClient(app, base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect("ws://127.0.0.1:8000/ws") as first,
    ):
        assert json.loads(first.receive_text())["type"] == "ready"
        with client.websocket_connect("ws://127.0.0.1:8000/ws") as second:
            event = json.loads(second.receive_text())
            assert (event["type"], event["code"], event["fatal"]) == ("error", "overloaded", True)
        first.send_text(json.dumps({"type": "text", "text": "Hi"}))
        kinds = []
        while "turn_done" not in kinds:
            message = first.receive()
            if message.get("text"):
                kinds.append(json.loads(message["text"])["type"])
        assert "assistant_text" in kinds
        assert client.get("/healthz").json()["sessions"] == 1


def test_the_solo_speedups_follow_the_number_of_open_sessions(models):
    app = create_app(Settings(max_sessions=2), models=models)
    with (
        TestClient(app, base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect("ws://127.0.0.1:8000/ws") as first,
    ):
        assert json.loads(first.receive_text())["type"] == "ready"
        assert models.solo
        with client.websocket_connect("ws://127.0.0.1:8000/ws") as second:
            assert json.loads(second.receive_text())["type"] == "ready"
            assert not models.solo
        deadline = time.monotonic() + 10  # the server sees the second one close on its own task
        while not models.solo and time.monotonic() < deadline:
            time.sleep(0.01)
        assert models.solo
    assert not models.solo


def test_page_static_files_and_health(models):
    with TestClient(create_app(Settings(), models=models), base_url="http://127.0.0.1:8000") as client:
        assert "<html" in client.get("/").text.lower()
        assert client.get("/static/app.js").status_code == 200
        health = client.get("/healthz").json()
        assert (health["status"], health["sessions"], health["llm"], health["auth_required"]) == (
            "ok",
            0,
            "scripted",
            False,
        )
        assert "parley_sessions 0.0" in client.get("/metrics").text
