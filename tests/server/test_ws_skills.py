"""The built-in skills over ``/ws`` (the FastAPI app in-process, scripted stages, the real skills and wall clock): a
call acts, its result says what was understood, and a timer rings in the conversation that set it, shown and said."""

from __future__ import annotations

import datetime
import json

from fakes import FakeStages, ScriptedASR, ToolScriptedLLM
from fastapi.testclient import TestClient
from test_ws_tools import URL, events_until

from app.config import Settings
from app.server.app import create_app
from app.stages.base import ToolCall


def app_with(llm: ToolScriptedLLM, **settings):
    settings.setdefault("max_sessions", 4)
    return create_app(Settings(**settings), models=FakeStages(ScriptedASR(), llm))


def test_a_timer_is_set_by_a_call_and_rings_in_its_conversation(tmp_path):
    set_it = ToolCall("call_1", "set_timer", json.dumps({"duration": "one second", "label": "tea"}))
    llm = ToolScriptedLLM([[set_it], ["Your tea timer is set."]])
    with (
        TestClient(app_with(llm, data_dir=str(tmp_path)), base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect(URL) as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "Set a tea timer for one second."}))
        events, _ = events_until(ws, "turn_done")
        call = next(e for e in events if e["type"] == "tool_call")
        done = next(e for e in events if e["type"] == "tool_done")
        assert call["runs_on"] == "server" and call["name"] == "set_timer"
        assert done["status"] == "completed" and "1 second" in done["output"]
        # the skill said what it did: its words are the answer, with no second LLM round to write them again
        assert events[-1]["text"] == "Your tea timer is set for 1 second." and len(llm.specs) == 1
        # the timer ends: shown at once, then said as a turn of the assistant's own
        rang, audio = events_until(ws, "turn_done")
        notice = next(e for e in rang if e["type"] == "notice")
        assert notice["code"] == "timer" and "tea" in notice["message"]
        assert rang[-1]["text"] == notice["message"] and audio > 0
    assert llm.specs and {t["function"]["name"] for t in llm.specs[0].tools} >= {"set_timer", "get_time", "calculate"}
    # the prompt every conversation starts with was prefilled at start-up, with the tools its replies declare, and
    # again as the conversation opened (cheap when cached: it evicts nothing new)
    assert llm.warmed[0] == llm.warmed[1] == [{"role": "system", "content": Settings().system_prompt}]
    assert llm.warmed_tools[0] == llm.warmed_tools[1] == llm.specs[0]


def test_the_clock_answers_with_the_local_date_and_an_operator_can_turn_skills_off(tmp_path):
    ask = ToolCall("call_1", "get_time", "{}")
    llm = ToolScriptedLLM([[ask], ["It is noon."]])
    with (
        TestClient(app_with(llm, data_dir=str(tmp_path), skills="clock"), base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect(URL) as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "ready"
        days = {f"{datetime.date.today().day} {datetime.date.today():%B}"}
        ws.send_text(json.dumps({"type": "text", "text": "What time is it?"}))
        events, _ = events_until(ws, "turn_done")
        days.add(f"{datetime.date.today().day} {datetime.date.today():%B}")
        done = next(e for e in events if e["type"] == "tool_done")
        assert done["status"] == "completed" and any(day in done["output"] for day in days)
        assert events[-1]["text"].startswith("It is ") and any(day in events[-1]["text"] for day in days)
    assert [t["function"]["name"] for t in llm.specs[0].tools] == ["get_time"]


def test_no_skills_means_no_tools_and_a_call_to_an_unknown_tool_fails_at_once(tmp_path):
    ghost = ToolCall("call_1", "play_music", json.dumps({"song": "anything"}))
    llm = ToolScriptedLLM([[ghost], ["I cannot play music."]])
    app = app_with(llm, data_dir=str(tmp_path), skills="", tool_entry_point="fakes:server_tools")
    with TestClient(app, base_url="http://127.0.0.1:8000") as client, client.websocket_connect(URL) as ws:
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "Play some music."}))
        events, _ = events_until(ws, "turn_done")
        done = next(e for e in events if e["type"] == "tool_done")
        assert done["status"] == "failed" and "no tool named 'play_music'" in done["output"]
        assert events[-1]["text"] == "Sorry, I can't do that." and len(llm.specs) == 1  # said as is: no LLM round


def test_a_call_the_user_did_not_ask_for_is_taken_back_and_the_reply_written_without_tools(tmp_path):
    """The 0.5B default brain called get_time for "My name is Maya.": the clock refuses a call the words do not ask
    for, the round is taken back (not in the history), and the reply is written again with no tools."""
    ask = ToolCall("call_1", "get_time", "{}")
    llm = ToolScriptedLLM([[ask]], pieces=["Nice to meet you, Maya."])
    with (
        TestClient(app_with(llm, data_dir=str(tmp_path)), base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect(URL) as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "My name is Maya."}))
        events, _ = events_until(ws, "turn_done")
        done = next(e for e in events if e["type"] == "tool_done")
        assert "not asked" in done["output"] and events[-1]["text"] == "Nice to meet you, Maya."
        assert len(llm.specs) == 1 and llm.calls[-1][-1] == {"role": "user", "content": "My name is Maya."}
        retried = llm.calls[-1]
        ws.send_text(json.dumps({"type": "text", "text": "What time is it?"}))
        events_until(ws, "turn_done")
    history = llm.calls[-1]
    assert not any(m.get("tool_calls") or m["role"] == "tool" for m in history)  # the call taken back left no trace
    # the prompt written again without tools had its start prefilled without them (not a cold prompt), and so
    # had the next turn's: after each conversation's change, the prompt with the tools first, then without
    untooled = [m for m, tools in zip(llm.warmed, llm.warmed_tools, strict=True) if tools is None]
    assert retried[:-1] in untooled and history[:-1] in untooled
    assert [tools is None for tools in llm.warmed_tools[-2:]] == [False, True]


def test_the_prompt_without_tools_is_prefilled_only_while_no_other_conversation_uses_the_llm(tmp_path):
    """That warm-up serves only a reply whose call was refused: with other conversations' requests in the LLM it
    would slow theirs, so it waits for idle cores and is skipped otherwise (the prompt with the tools is not)."""
    llm = ToolScriptedLLM([["Hello!"]])
    llm.idle_now = False  # another conversation's request is in the LLM
    with (
        TestClient(app_with(llm, data_dir=str(tmp_path)), base_url="http://127.0.0.1:8000") as client,
        client.websocket_connect(URL) as ws,
    ):
        assert json.loads(ws.receive_text())["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "Hi there."}))
        events_until(ws, "turn_done")
        ws.send_text(json.dumps({"type": "text", "text": "How are you?"}))
        events_until(ws, "turn_done")
    assert llm.warmed_tools and None not in llm.warmed_tools
