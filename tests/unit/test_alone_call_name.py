"""A request that acts only where the user's words stand alone: the reply follows the words alone once their call
names a tool the reply may call; a call to a name nobody declared leaves the conversation's reply (a question
about the conversation, "What is my name?", must not become "Sorry, I can't do that.")."""

from __future__ import annotations

from types import SimpleNamespace

from app.stages.base import ToolSpec
from app.stages.llm_engine import called_name, declared_names


def outputs(*pieces: str) -> list:
    return [SimpleNamespace(text_delta=piece) for piece in pieces]


def test_the_name_is_known_once_its_closing_quote_is_written():
    assert called_name(outputs('{"', "name", '": "', "set")) is None
    assert called_name(outputs('{"', "name", '": "', "set", "_timer")) is None
    assert called_name(outputs('{"', "name", '": "', "set", "_timer", '",')) == "set_timer"
    assert called_name(outputs('{"name":"get_user_name"}')) == "get_user_name"
    assert called_name(outputs("Sure, ten minutes.")) is None


def test_only_declared_tools_count():
    spec = ToolSpec(
        (
            {"type": "function", "function": {"name": "set_timer", "parameters": {}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {}}},
        ),
        "auto",
    )
    assert declared_names(spec) == {"set_timer", "get_time"}
    assert "get_user_name" not in declared_names(spec)
    assert declared_names(None) == set()
