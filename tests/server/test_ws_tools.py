"""Tool calls over ``/ws`` itself (the FastAPI app in-process, scripted stages): the wire messages the README
documents, ``config`` with tools, ``tool_call``, ``tool_result``, ``tool_done``, and the server's own tools."""

from __future__ import annotations

import json

from fakes import FakeStages, ScriptedASR, ToolScriptedLLM
from fastapi.testclient import TestClient

from app.config import Settings
from app.server.app import create_app
from app.stages.base import ToolCall

URL = "ws://127.0.0.1:8000/ws"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def app_with(llm: ToolScriptedLLM, **settings):
    settings.setdefault("max_sessions", 4)
    return create_app(Settings(**settings), models=FakeStages(ScriptedASR(), llm))


def llm() -> ToolScriptedLLM:
    return ToolScriptedLLM([["Let me see. ", ToolCall("call_7", "get_weather", '{"city": "Paris"}')], ["Sunny."]])


def events_until(ws, kind: str) -> tuple[list[dict], int]:
    """The JSON events up to one of ``kind``, and the bytes of audio that came with them."""
    events, audio = [], 0
    while not events or events[-1]["type"] != kind:
        message = ws.receive()
        if message.get("bytes"):
            audio += len(message["bytes"])
        elif message.get("text"):
            events.append(json.loads(message["text"]))
    return events, audio


def test_a_client_tool_over_the_wire():
    with (
        TestClient(app_with(llm()), base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect(URL) as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "config", "tools": [WEATHER], "tool_choice": "required"}))
        applied = json.loads(ws.receive_text())
        assert applied["type"] == "config_applied" and applied["tools"][0]["name"] == "get_weather"
        assert applied["tool_choice"] == "required" and applied["parallel_tool_calls"] is False
        ws.send_text(json.dumps({"type": "text", "text": "What is the weather in Paris?"}))
        before, _ = events_until(ws, "tool_call")
        call = before[-1]
        assert call == {
            "type": "tool_call",
            "turn_id": 1,
            "call_id": "call_7",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "runs_on": "client",
        }
        ws.send_text(json.dumps({"type": "tool_result", "call_id": "call_7", "output": '{"sky": "sunny"}'}))
        after, audio = events_until(ws, "turn_done")
        kinds = [e["type"] for e in after]
        assert kinds.index("tool_done") < kinds.index("turn_done") and audio > 0
        assert after[-1]["text"] == "Let me see. Sunny." and after[-1]["metrics"]["tool_calls"] == 1
        ws.send_text(json.dumps({"type": "tool_result", "call_id": "call_7", "output": "again"}))
        assert json.loads(ws.receive_text())["code"] == "unknown_tool_call"


def test_server_tools_over_the_wire():
    app = app_with(llm(), tool_entry_point="fakes:server_tools", tool_choice="required")
    with TestClient(app, base_url="http://127.0.0.1:8000") as client, client.websocket_connect(URL) as ws:
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "What is the weather in Paris?"}))
        events, _ = events_until(ws, "turn_done")
        call = next(e for e in events if e["type"] == "tool_call")
        settled = next(e for e in events if e["type"] == "tool_done")
        assert call["runs_on"] == "server"
        assert settled["status"] == "completed" and json.loads(settled["output"])["celsius"] == 21
        assert events[-1]["text"] == "Let me see. Sunny."
