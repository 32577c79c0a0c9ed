"""How a model family writes its tool calls, and which one a chat template speaks.

Why from the template: the template is what taught the model the format (it renders the tools
and earlier calls), so it is also the best witness of what the model will write. A template
that never mentions tools (the bundled SmolLM2-135M's) gets the plain JSON format: the API
describes the tools in a system message and decodes forced calls under a grammar, so even a
model never trained for it writes calls that parse.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """One family's call syntax, as the parser and the grammar need it.

    ``open``/``close``: the text around a block of calls (``close`` None: the block ends where
    its JSON does). ``json_at_start``: a reply that opens with a JSON object whose first key is
    ``"name"`` is a call even without ``open``. ``array``: the calls of a block form a JSON
    array. ``separator``: between two calls of a block, besides whitespace. ``args_key``: the
    key the model writes arguments under (the parser accepts ``arguments`` and ``parameters``).
    ``template_tools``: the chat template renders the tools itself.
    """

    name: str
    open: str | None = None
    close: str | None = None
    json_at_start: bool = False
    array: bool = False
    separator: str = ""
    args_key: str = "arguments"
    template_tools: bool = True

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.open, self.close) if m)

    def call_id(self) -> str:
        """A new call id: Mistral's templates accept only 9 alphanumerics, others take OpenAI's shape."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


# Qwen 2.5/3, Hermes 2 Pro, SmolLM3 and the SmolLM2 1.7B: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
# (small Qwen models often write the JSON bare, without the tags: a reply that opens with a call object is one too)
HERMES = ToolFormat("hermes", open="<tool_call>", close="</tool_call>", json_at_start=True)
# Llama 3.1-3.3 JSON calls: {"name": ..., "parameters": ...}, optionally after <|python_tag|>, several joined by ";"
LLAMA3 = ToolFormat("llama3", open="<|python_tag|>", json_at_start=True, separator=";", args_key="parameters")
# Mistral 7B v0.3 / Nemo (before the v11 tokenizer): [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
MISTRAL = ToolFormat("mistral", open="[TOOL_CALLS]", array=True, separator=",")
# a template without tools: one JSON object per call, several on separate lines
PLAIN_JSON = ToolFormat("json", json_at_start=True, template_tools=False)
# a template that renders tools in a syntax not listed here: its tools are rendered, calls read as JSON
TEMPLATE_JSON = ToolFormat("template_json", json_at_start=True)

FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, PLAIN_JSON, TEMPLATE_JSON)}


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text ("" without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template or ""


def detect_format(tokenizer) -> ToolFormat:
    """The call format the tokenizer's chat template speaks (``PLAIN_JSON`` when it has no tools)."""
    template = chat_template_text(tokenizer)
    if "tools" not in template:
        return PLAIN_JSON
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return LLAMA3
    return TEMPLATE_JSON
