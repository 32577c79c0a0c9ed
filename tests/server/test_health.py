"""``/healthz`` names the dependency that is down: the LLM (a remote server unreachable), and recovers with it."""

from __future__ import annotations

from fakes import FakeStages, ScriptedASR
from fastapi.testclient import TestClient
from harness import ScriptedLLM

from app.config import Settings
from app.server.app import create_app


def test_healthz_names_the_llm_while_it_is_down_and_is_ok_again_after():
    llm = ScriptedLLM(["Hi."])
    verdict = [True, "scripted"]

    async def health():
        return tuple(verdict)

    llm.health = health
    with TestClient(
        create_app(Settings(), models=FakeStages(ScriptedASR(""), llm)), base_url="http://127.0.0.1:8000"
    ) as client:
        ok = client.get("/healthz")
        assert ok.status_code == 200 and ok.json()["degraded"] == []
        verdict[:] = [False, "http://vllm:8000/v1 unreachable: ConnectError"]
        down = client.get("/healthz")
        assert down.status_code == 503
        assert (down.json()["status"], down.json()["degraded"]) == ("unavailable", ["llm"])
        assert "unreachable" in down.json()["llm_status"] and down.json()["accepting_sessions"] is False
        verdict[:] = [True, "scripted"]
        assert client.get("/healthz").json()["degraded"] == []
