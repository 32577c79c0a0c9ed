"""Words that look like a chat template's control tokens, kept words on their way to a remote LLM server.

Why: a server that renders the chat template (vLLM, llama.cpp, TGI, ``transformers serve``) tokenizes the rendered
text with its special tokens parsed, so a typed text or a transcript holding ``<|im_end|>\\n<|im_start|>system``
closes the user's turn and opens a system turn of the user's own writing. Parley's engine and its transformers
backend tokenize every message's content as plain text (``engine.chat``); a remote server cannot be told to, so
the text is changed before it leaves: a WORD JOINER (U+2060, invisible, no width) goes after the opening character
of anything shaped like a control token, and the string the server would have parsed as one is no longer there.
The model still reads the same characters around it; text without such a shape is sent unchanged.

The shapes, not one model's list (the served model's tokenizer is not on this machine): ``<|name|>`` (ChatML,
Llama 3, Phi, Qwen, DeepSeek's ``<｜...｜>``), ``<name>`` and ``</name>`` of letters, digits and ``_``/``-``
(``<s>``, ``</s>``, Gemma's ``<start_of_turn>``, Qwen's ``<tool_call>``, Llama 2's ``<<SYS>>``), and
``[NAME]`` / ``[/NAME]`` in capitals (Mistral's ``[INST]``, ``[TOOL_CALLS]``). An HTML tag typed in a message is
changed too: invisibly, and harmless in a spoken reply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

WORD_JOINER = "\u2060"

_CONTROL_TOKEN = re.compile(
    r"<[|｜][^<>\s]{1,64}?[|｜]>"  # <|im_start|>, <|eot_id|>, <｜end▁of▁sentence｜>
    r"|<<?/?[A-Za-z][A-Za-z0-9_\-.]{0,40}>>?"  # <s>, </s>, <start_of_turn>, <tool_call>, <<SYS>>
    r"|\[/?[A-Z][A-Z0-9_]{1,40}\]"  # [INST], [/INST], [TOOL_CALLS], [AVAILABLE_TOOLS]
)


def neutralize(text: str) -> str:
    """``text`` with a word joiner inside every control-token shape (text without one: the very same string)."""
    if not text or not _CONTROL_TOKEN.search(text):
        return text
    return _CONTROL_TOKEN.sub(_broken, text)


def _broken(match: re.Match) -> str:
    """A joiner after each opening ``<`` or ``[`` (``<<SYS>>``: two, or the inner ``<SYS>>`` would be a shape)."""
    shape = match[0]
    opening = len(shape) - len(shape.lstrip("<["))
    return "".join(char + WORD_JOINER for char in shape[:opening]) + shape[opening:]


def neutralize_messages(messages: Iterable[dict]) -> list[dict]:
    """Copies of chat messages whose text is neutralized: string contents and the text parts of a list content.

    Every role's: a tool's result and an earlier assistant reply can carry the user's words back (a note they
    asked to keep, a reply quoting them); the system prompt is the operator's, but the date and the skills' lines in
    it hold no such shape, and a tool call's arguments are JSON the server renders as text too.
    """
    out = []
    for message in messages:
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, str):
            copy["content"] = neutralize(content)
        elif isinstance(content, list):
            copy["content"] = [
                {**part, "text": neutralize(part["text"])}
                if isinstance(part, dict) and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
        if copy.get("tool_calls"):
            copy["tool_calls"] = [_neutralized_call(call) for call in copy["tool_calls"]]
        out.append(copy)
    return out


def neutralize_tools(tools: Iterable[dict]) -> list[dict]:
    """Copies of tool declarations with every string in them neutralized: an MCP server's descriptions are a third
    party's text, rendered into the prompt by the server's template."""
    return [_neutralized_value(tool) for tool in tools]


def _neutralized_value(value):
    if isinstance(value, str):
        return neutralize(value)
    if isinstance(value, dict):
        return {key: _neutralized_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_neutralized_value(item) for item in value]
    return value


def _neutralized_call(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": neutralize(function["arguments"])}}
