"""What one chat request needs of the tools machinery: the prompt's conversation and tools, the grammar, the parser.

``tool_choice`` decides (OpenAI's meanings):

* ``none``: the tools are not shown to the model and the reply is text (earlier calls and
  their results in the history are still rendered);
* ``auto``: the template renders the tools and the reply is parsed for calls in the model's
  format. A template without tools cannot tell the model about them, so ``auto`` is ``none``
  there (logged); so it is with a JSON ``response_format``, which leaves no room for a call;
* ``required`` / a named function: as ``auto``, and the reply is decoded under a grammar of the
  model's call format around the tools' (or that one tool's) argument schemas, so it is a call
  whose arguments parse and match their schema. With a template without tools, the plain JSON
  format is described to the model in a system message.

Every message's ``content`` (a tool's result included) stays plain text (``engine/chat.py``).
Tool definitions and earlier calls' arguments reach the template as JSON, outside any content,
so a special token's text in them gets a zero-width space after its first character: it
reads the same and can never tokenize as that token.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from engine.chat import added_token_texts
from engine.openai_api.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition, NamedToolChoice
from engine.structured_output.formats import HERMES, ToolFormat
from engine.structured_output.grammar import LazyGrammar, lazy_call_grammar, opener_ids, tool_call_grammar

log = logging.getLogger(__name__)

_BREAK = "\u200b"  # zero-width space


class PlanError(ValueError):
    """A request whose tools cannot be served as asked; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict]  # for the chat template
    tools: list[dict] | None  # for the chat template (None: not rendered)
    tool_format: ToolFormat | None  # the reply is parsed for calls in this format (None: plain text)
    grammar: str | None  # the reply's grammar: forced calls, or the response_format
    grammar_param: str | None  # the request field the grammar comes from (for errors)
    skip_special_tokens: bool  # False when a call marker is a special token (it must reach the parser)
    lazy_grammar: LazyGrammar | None = None  # tool_choice "auto": free text, or a well-formed call once one opens


def special_tokens(tokenizer) -> dict[str, int]:
    """Text -> id of the tokenizer's special added tokens."""
    found = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: int(i) for i, t in found.items() if getattr(t, "special", False)}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` the first time only: a voice session on a model without tools plans every turn alike."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s (said once)", message)


def plan_chat(req: ChatCompletionRequest, fmt: ToolFormat, tokenizer) -> ChatPlan:
    """The plan for ``req`` on a model whose template speaks ``fmt``; PlanError if it cannot be served."""
    choice = req.effective_tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    forced = choice == "required" or named is not None
    reply_grammar = req.response_format.grammar() if req.response_format is not None else None
    if forced and reply_grammar is not None:
        raise PlanError("a JSON response_format cannot be combined with a forced tool call", "response_format")
    if choice == "auto" and (not fmt.template_tools or reply_grammar is not None):
        why = "a JSON response_format" if reply_grammar is not None else "the model's chat template has no tools"
        _warn_once(f"tool_choice 'auto' behaves as 'none': {why}")
        choice = "none"
    defuse = _defuser(tokenizer)
    messages = _history(req.messages, fmt, defuse)
    if choice == "none":
        return ChatPlan(messages, None, None, reply_grammar, "response_format", True)
    chosen = [t.function for t in req.tools or () if named is None or t.function.name == named]
    tools = None
    if fmt.template_tools:
        tools = defuse([t.model_dump(exclude_none=True) for t in req.tools or ()])
    else:
        messages = _with_system_note(messages, _plain_json_note(chosen))
    grammar = lazy = None
    pairs = [(f.name, f.arguments_schema) for f in chosen]
    added = added_token_texts(tokenizer)
    marker_ids = {m: added[m] for m in fmt.markers if m in added}
    if forced:
        grammar = tool_call_grammar(fmt, pairs, req.parallel_tool_calls and named is None, marker_ids)
    elif fmt is HERMES:  # (the one format whose bare calls are a model's slip, not its template's syntax)
        lazy = lazy_call_grammar(fmt, pairs, opener_ids(tokenizer))
    keep_special = any(m in special_tokens(tokenizer) for m in fmt.markers)
    return ChatPlan(messages, tools, fmt, grammar, "tools", not keep_special, lazy)


def _history(messages: list[ChatMessage], fmt: ToolFormat, defuse) -> list[dict]:
    """The conversation for the template: ``developer`` as ``system``; earlier calls as the template
    takes them (arguments as objects), or written into the content as plain JSON calls when the
    template has no tools; each tool result with its call's id and function name."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.tool_calls:
            names.update((c.id, c.function.name) for c in m.tool_calls)
            calls = [(c.id, c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
            if fmt.template_tools:
                d["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": defuse(a)}} for i, n, a in calls
                ]
            else:
                written = [json.dumps({"name": n, fmt.args_key: a}, ensure_ascii=False) for _, n, a in calls]
                d["content"] = "\n".join(p for p in (m.content or "", *written) if p)
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id or "")
            if name:
                d["name"] = name
        out.append(d)
    return out


def _arguments(text: str):
    """Arguments as the templates take them: the parsed object, or the text when it is not a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _plain_json_note(functions: list[FunctionDefinition]) -> str:
    listed = "\n".join(
        json.dumps(
            {"name": f.name, "description": f.description or "", "parameters": f.arguments_schema}, ensure_ascii=False
        )
        for f in functions
    )
    return (
        f"You can call these functions:\n{listed}\n"
        'To call one, reply with a JSON object only: {"name": <function name>, "arguments": <its arguments>}.'
    )


def _with_system_note(messages: list[dict], note: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{note}".strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _defuser(tokenizer):
    """A function that breaks every added token's text inside a JSON-like value (see the module's docstring)."""
    texts = sorted((t for t in added_token_texts(tokenizer) if len(t) > 1), key=len, reverse=True)

    def defuse(value):
        if isinstance(value, str):
            for t in texts:
                if t in value:
                    value = value.replace(t, t[0] + _BREAK + t[1:])
            return value
        if isinstance(value, dict):
            return {defuse(k): defuse(v) for k, v in value.items()}
        if isinstance(value, list):
            return [defuse(v) for v in value]
        return value

    return defuse
