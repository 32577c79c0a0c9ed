"""Tool calls through the engine and the API in each family's format (Hermes/Qwen, Llama 3 JSON, Mistral).

The model is the bundled one dressed as each family (``tool_models``). Its replies are scripted
(the sampler is replaced by one that writes a recorded reply token by token), so ``auto`` is
parsed from exactly what such a model writes; ``required`` runs the real sampler under the
family's call grammar, whose markers include special tokens (``[TOOL_CALLS]``).
"""

from __future__ import annotations

import json

import pytest
from api_harness import serve_app
from tool_models import EOS, family_model_dir

import engine.step_outputs as step_outputs_mod
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.openai_api.api_server import create_app

MODEL = "family"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 20}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather and the time in Paris?"}]
CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"timezone": "Europe/Paris"}')]
# what each family's model writes for the two calls, after a few words where the format allows them
RECORDED = {
    "hermes": (
        "I will check both.\n",
        "I will check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
    ),
    "llama3": (
        None,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
    ),
    "mistral": (
        "Sure. ",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
    ),
}


class Script:
    """The replies the sampler writes (None: the real sampler)."""

    def __init__(self) -> None:
        self.tokens: list[int] | None = None

    def sample(self, real):
        def sample(logits, rows):
            if self.tokens is None:
                return real(logits, rows)
            return [self.tokens[min(len(r.output_token_ids), len(self.tokens) - 1)] for r in rows], [None] * len(rows)

        return sample


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral"])
def family(request, fp32_model, tmp_path_factory):
    """(family name, its tokenizer, the script, an openai client of its served API)."""
    from openai import OpenAI

    path = family_model_dir(tmp_path_factory.mktemp("families"), request.param)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_blocks=64, max_num_seqs=4)
    script = Script()
    patch = pytest.MonkeyPatch()
    patch.setattr(step_outputs_mod, "sample", script.sample(step_outputs_mod.sample))
    engine = AsyncLLMEngine(engine=LLMEngine(config, model=fp32_model))
    try:
        with (
            serve_app(create_app(engine, MODEL)) as url,
            OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0) as client,
        ):
            yield request.param, engine.tokenizer, script, client
    finally:
        engine.shutdown()
        patch.undo()


def _script(family, text: str) -> None:
    _, tokenizer, script, _ = family
    script.tokens = [*tokenizer(text, add_special_tokens=False)["input_ids"], EOS]


def _ask(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=120, **kw
    )


def test_auto_parses_the_calls_the_family_writes(family):
    name, _, _, client = family
    content, text = RECORDED[name]
    _script(family, text)
    choice = _ask(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == CALLS
    assert all(c.type == "function" for c in calls) and len({c.id for c in calls}) == 2
    if name == "mistral":  # its templates accept only 9 alphanumerics
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_streamed_calls_reassemble_to_the_non_streamed_ones(family):
    name, _, _, client = family
    _script(family, RECORDED[name][1])
    chunks = list(_ask(client, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    firsts = {}
    for d in deltas:
        if d.index not in firsts:  # a call's first delta: index, id, type and name
            firsts[d.index] = d
            assert d.id and d.type == "function" and d.function.name
        else:
            assert d.id is None and d.function.name is None
    joined = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in firsts}
    assert [(firsts[i].function.name, joined[i]) for i in sorted(firsts)] == CALLS
    assert len([d for d in deltas if d.index == 0]) > 1  # the arguments came in fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (RECORDED[name][0] or "")
    with client.chat.completions.stream(
        model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=120
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == CALLS


def test_a_reply_without_calls_is_content(family):
    _, _, _, client = family
    _script(family, "Paris is sunny today.")
    choice = _ask(client).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "Paris is sunny today."  # no special token shows, not even the stop token


def test_a_malformed_call_is_returned_as_content(family):
    name, _, _, client = family
    text = RECORDED[name][1].replace('"city": "Paris"', "city: Paris")
    _script(family, text)
    choice = _ask(client).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "city: Paris" in choice.message.content


def test_tool_choice_none_leaves_call_text_unparsed(family):
    name, _, _, client = family
    _script(family, RECORDED["hermes"][1])  # hermes text is plain text (markers are not special) in every family
    choice = _ask(client, tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert '"get_weather"' in choice.message.content


def test_a_conversation_with_calls_and_results_continues(family):
    _, _, _, client = family
    _script(family, "It is 21 degrees.")
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "abcDEF123", "type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS[:1]
            ],
        },
        {"role": "tool", "tool_call_id": "abcDEF123", "content": json.dumps({"temp_c": 21})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=20)
    assert r.choices[0].message.content == "It is 21 degrees."


def test_required_decodes_a_call_in_the_familys_format(family):
    name, _, script, client = family
    script.tokens = None  # the real model, under the grammar of this family's call format
    choice = _ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name in {"get_weather", "get_time"}
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"timezone"})
