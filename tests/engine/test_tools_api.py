"""Tools and response_format through the OpenAI SDK against a served engine with the bundled model (fp32).

SmolLM2-135M was never trained to call functions and its template has no tools, so every call
here is decoded under a grammar (the plain JSON format): named and ``required`` calls must come
back with arguments that parse and validate against their schema, streamed or not.
"""

from __future__ import annotations

import json

import pytest
from api_harness import serve_app
from tool_models import schema_errors

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.openai_api.api_server import create_app

MODEL = "test-model"


def _tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


TEXT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "enums": (
        "Order a t-shirt in blue, size M.",
        _object({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}),
    ),
    "nested": (
        "Add Anna, who lives at 5 Main Street in Springfield, to my contacts.",
        _object({"person": _object({"name": TEXT, "address": _object({"street": TEXT, "city": TEXT})})}),
    ),
    "arrays": (
        "Make a shopping list: milk, eggs and bread.",
        _object(
            {
                "items": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 5},
                "priority": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "maxItems": 3},
            }
        ),
    ),
    "bounded numbers": (
        "Set a timer for 10 minutes at volume 0.5, and make it loud.",
        _object(
            {
                "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
                "volume": {"type": "number", "minimum": 0, "maximum": 1},
                "loud": {"type": "boolean"},
                "label": {"anyOf": [TEXT, {"type": "null"}]},
            },
            required=["minutes", "volume", "loud"],
        ),
    ),
}
TOOLS = [_tool(name.replace(" ", "_"), f"Handles {name}", schema) for name, (_, schema) in SCHEMAS.items()]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def sdk(fp32_model):
    from openai import OpenAI

    config = EngineConfig(dtype="float32", device="cpu", num_blocks=96, max_num_seqs=8)
    engine = AsyncLLMEngine(engine=LLMEngine(config, model=fp32_model))
    try:
        with (
            serve_app(create_app(engine, MODEL)) as url,
            OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=180, max_retries=0) as client,
        ):
            yield client
    finally:
        engine.shutdown()


def _ask(sdk, question: str, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 150}
    return sdk.chat.completions.create(**(body | kw))


def _valid_call(call) -> dict:
    args = json.loads(call.function.arguments)
    assert schema_errors(args, SCHEMA_OF[call.function.name]) == [], (call.function.name, args)
    return args


@pytest.mark.parametrize("case", list(SCHEMAS))
def test_a_named_call_has_arguments_that_match_its_schema(sdk, case):
    question, _ = SCHEMAS[case]
    name = case.replace(" ", "_")
    choice = _ask(sdk, question, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == name and call.id.startswith("call_") and call.type == "function"
    _valid_call(call)


# One call: with parallel calls allowed this 135M model, greedy, goes on calling until max_tokens.
ONE_CALL = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}


@pytest.mark.parametrize("question", ["Set a timer for 10 minutes.", "Order a red t-shirt.", "Add Bob to my contacts."])
def test_a_required_call_matches_the_schema_of_the_tool_it_chose(sdk, question):
    choice = _ask(sdk, question, **ONE_CALL).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _valid_call(call)


def test_streamed_calls_reassemble_to_the_non_streamed_ones(sdk):
    whole = _ask(sdk, "Make a shopping list: milk and eggs.", **ONE_CALL).choices[0].message.tool_calls
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Make a shopping list: milk and eggs."}]}
    with sdk.chat.completions.stream(**body, temperature=0, max_tokens=150, **ONE_CALL) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    streamed = final.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    fragments = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(fragments) > 1  # the arguments arrived in pieces


def test_a_json_schema_reply_validates(sdk):
    schema = SCHEMAS["nested"][1]
    fmt = {"type": "json_schema", "json_schema": {"name": "contact", "schema": schema, "strict": True}}
    choice = _ask(sdk, SCHEMAS["nested"][0], response_format=fmt).choices[0]
    assert choice.finish_reason == "stop"
    assert schema_errors(json.loads(choice.message.content), schema) == []


def test_a_json_object_reply_is_an_object_and_completions_take_a_schema_too(sdk):
    reply = _ask(sdk, "Describe Paris.", response_format={"type": "json_object"}, max_tokens=60).choices[0]
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    else:
        assert reply.message.content.startswith("{")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    text = sdk.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer in JSON:",
        max_tokens=20,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
    )
    assert json.loads(text.choices[0].text)["answer"] in ("yes", "no")


def test_auto_on_a_template_without_tools_replies_as_without_tools(sdk):
    question = "What is the capital of France?"
    plain = _ask(sdk, question, max_tokens=12).choices[0].message.content
    auto = _ask(sdk, question, max_tokens=12, tools=TOOLS, tool_choice="auto").choices[0]
    assert auto.message.content == plain and not auto.message.tool_calls


def test_a_conversation_with_a_call_and_its_result_continues(sdk):
    history = [
        {"role": "user", "content": "Set a timer for 10 minutes."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "bounded_numbers",
                        "arguments": '{"minutes": 10, "volume": 0.5, "loud": true}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
    ]
    r = sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def _error(sdk, **body):
    from openai import BadRequestError

    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(BadRequestError) as e:
        sdk.chat.completions.create(**(base | body))
    return e.value.body


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": [_tool("f", "", {"type": "strin"})], "tool_choice": "required"}, "tools", "strin"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
            "strin",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'schema'"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "forced",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [_tool("a b", "", {})]}, "tools[0].function.name", "letters"),
        ({"tools": [_tool("f", "", {}), _tool("f", "", {})]}, "tools", "distinct"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0]", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", "'tool'"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(sdk, body, param, needle):
    err = _error(sdk, **body)
    assert err["param"] == param and needle in err["message"], err
