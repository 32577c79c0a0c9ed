"""A reply that talks about its tools instead of calling one (``app.voice.tool_talk``): what counts as naming a
declared tool, and what the reply does then (the round written again without tools, an announced call made, the
talk cut). Model-free: the LLM is scripted."""

from __future__ import annotations

from fakes import ToolScriptedLLM
from test_tool_turns import ANSWER, CALL, done, tool_session, until

from app import protocol
from app.stages.base import ToolSpec
from app.voice.pieces import PieceCutter
from app.voice.tool_talk import gone_on, tool_named_at, tool_talk_pattern


def spec(*names: str) -> ToolSpec:
    return ToolSpec(tuple({"type": "function", "function": {"name": name, "parameters": {}}} for name in names))


def test_a_declared_identifier_is_found_with_or_without_backticks_and_nothing_else_is():
    pattern = tool_talk_pattern(spec("set_timer", "get_time", "HassTurnOn"))
    text = "To tie a tie, you can call the `set_timer` function."
    assert text[tool_named_at(text, pattern) :].startswith("set_timer")
    assert tool_named_at("Use get_time to know it.", pattern) == 4
    assert tool_named_at("Try HassTurnOn.", pattern) == 4
    for speech in (
        "Set a timer for ten minutes.",
        "It is time to get up.",
        "A reset_timer_x is not a declared tool.",  # a longer identifier that holds a declared one
        "my_set_timer",
    ):
        assert tool_named_at(speech, pattern) is None, speech


def test_a_plain_word_tool_is_found_only_as_code():
    pattern = tool_talk_pattern(spec("calculate"))
    assert tool_named_at("I can calculate that for you: it is twelve.", pattern) is None
    assert tool_named_at("You can use `calculate` here.", pattern) == 12
    assert tool_named_at("Call calculate(12 * 3).", pattern) == 5


def test_no_tools_no_pattern():
    assert tool_talk_pattern(None) is None and tool_talk_pattern(ToolSpec(())) is None
    assert tool_named_at("get_time", None) is None


def test_the_talk_has_gone_on_past_its_sentence_or_a_bound():
    assert not gone_on("set_timer` function with the duration as the argument.")
    assert not gone_on("get_time`. ")  # a call may follow
    assert gone_on("get_time` function. You can also")
    assert gone_on("x" * 300)


def cutter(said: list[str], **kwargs) -> PieceCutter:
    return PieceCutter(
        said, first_clause_chars=0, first_piece_words=3, tools=tool_talk_pattern(spec("set_timer")), **kwargs
    )


def test_nothing_from_the_name_on_is_said_and_a_call_after_it_is_no_guard():
    said: list[str] = []
    cut = cutter(said)
    pieces = cut.push("To tie a tie, you ") + cut.push("can call the `set_timer` ") + cut.push("function.")
    pieces += cut.flush()
    assert "set_timer" not in " ".join(pieces) and not cut.stopped
    assert cut.ended(called=False) == "tool_talk" and cut.ended(called=True) is None
    assert cut.push(" You can also call it again.") == [] and cut.stop == "tool_talk"


def test_a_round_written_again_does_not_say_its_opening_twice():
    said = ["To tie a tie,"]
    cut = cutter(said, opening=["To tie a tie,"])
    pieces = cut.push("To tie a tie, cross the wide end over the narrow one.") + cut.flush()
    assert pieces[0] != "To tie a tie," and "cross" in pieces[0]
    assert said[0] == "To tie a tie," and said.count("To tie a tie,") == 1


async def test_a_round_that_talks_about_a_tool_is_written_again_without_tools():
    talk = ["You can call the ", "`get_weather` function ", "to check the weather."]
    llm = ToolScriptedLLM([talk], pieces=["It is sunny ", "in Paris today."])
    conv = await tool_session(llm)
    await conv.type("Tell me about Paris.")
    await until(conv, lambda: done(conv))
    [turn] = done(conv)
    assert turn.text == "It is sunny in Paris today."
    spoken = " ".join(text for _, text in conv.session.models.tts.spoken)
    assert "get_weather" not in spoken and "It is sunny in Paris today." in spoken
    assert not conv.of(protocol.CallTool)
    assert len(llm.specs) == 1 and len(llm.calls) == 2, "the second request was written without tools"
    assert conv.session.history[-1] == {"role": "assistant", "content": "It is sunny in Paris today."}
    assert not turn.metrics.guard_runaway
    assert len(set(llm.request_ids)) == 2


async def test_a_call_announced_by_name_is_made():
    llm = ToolScriptedLLM([["I will use `get_weather`. ", CALL], ANSWER])
    conv = await tool_session(llm)
    await conv.type("What is the weather in Paris?")
    [call] = conv.of(protocol.CallTool)
    assert call.name == "get_weather"
    await conv.session.handle(protocol.ToolResult(call_id="call_1", output="21 degrees"))
    await until(conv, lambda: done(conv))
    assert done(conv)[0].text.endswith("It is 21 degrees in Paris.")
    assert "get_weather" not in " ".join(text for _, text in conv.session.models.tts.spoken)


async def test_talk_about_a_tool_after_an_earlier_round_said_something_is_cut_there():
    talk = ["Next you can call ", "`get_weather` again. ", "It is a good tool."]
    llm = ToolScriptedLLM([["Let me check. ", CALL], talk])
    conv = await tool_session(llm)
    await conv.type("What is the weather in Paris?")
    await conv.session.handle(protocol.ToolResult(call_id="call_1", output="21 degrees"))
    await until(conv, lambda: done(conv))
    [turn] = done(conv)
    assert "get_weather" not in turn.text and turn.metrics.guard_runaway == 1
    assert len(llm.calls) == 2, "not written again: the reply had said something before the round"
