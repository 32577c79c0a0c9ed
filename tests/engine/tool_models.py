"""Shared helpers for the tool-calling tests: the bundled model dressed as other families, and a small
JSON-schema checker.

Why dressed: the tool formats are chosen from the chat template, and Hermes, Llama 3 and Mistral
tokenizers are not on this machine. So a family's model is the bundled SmolLM2 with four of its
unused added tokens renamed to the family's markers (``<tool_call>``, ``</tool_call>`` as ordinary
added tokens as in Qwen, ``[TOOL_CALLS]`` and ``<|python_tag|>`` as special ones) and a compact
template modelled on the family's own (how it renders tools, earlier calls and tool results).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.weights import resolve_model

# id -> (new text, special): SmolLM2's <repo_name>, <reponame>, <file_sep>, <filename>
MARKER_TOKENS = {
    3: ("<tool_call>", False),
    4: ("</tool_call>", False),
    5: ("[TOOL_CALLS]", True),
    6: ("<|python_tag|>", True),
}
EOS = 2  # <|im_end|>

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1's JSON tool calling on ChatML markers; a tool result is printed through tojson, as Llama 3.1's template does
LLAMA3_TEMPLATE = """{%- if tools %}<|im_start|>system
Environment: ipython
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}Given the following functions, please respond with a JSON for a function call with its proper arguments.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson(indent=4) }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content | trim }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
<|python_tag|>{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>ipython
{% if message.content is mapping or message.content is iterable %}{{ message.content | tojson }}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content | trim }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
[TOOL_CALLS] [{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
[TOOL_RESULTS] {"content": {{ message.content | string }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def family_model_dir(root: Path, family: str) -> Path:
    """The bundled model's directory with the family's markers and template (the weights are linked)."""
    src = resolve_model(float32_weights=True)
    out = root / family
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if not (out / name).exists():
            (out / name).symlink_to(src / name)
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for entry in tok["added_tokens"]:
        if entry["id"] in MARKER_TOKENS:
            text, special = MARKER_TOKENS[entry["id"]]
            vocab.pop(entry["content"], None)
            vocab[text] = entry["id"]
            entry["content"], entry["special"] = text, special
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "chat_template.jinja").write_text(TEMPLATES[family])
    return out


def family_tokenizer(root: Path, family: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(family_model_dir(root, family)), local_files_only=True)


def schema_errors(value, schema: dict, at: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the keywords the tests' schemas use); [] when it matches.

    ``jsonschema`` is used when installed; this covers type, enum, const, properties, required,
    additionalProperties, items, min/maxItems, min/maxLength, minimum/maximum and anyOf.
    """
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    errors: list[str] = []
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
        "integer": int,
        "number": (int, float),
    }
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, types[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return [f"{at}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{at}: {value!r} != {schema['const']!r}")
    if "anyOf" in schema and all(schema_errors(value, s, at) for s in schema["anyOf"]):
        errors.append(f"{at}: matches none of anyOf")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: unexpected {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{at}.{k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{at}: {len(value)} items outside the bounds")
        errors += [e for i, v in enumerate(value) for e in schema_errors(v, schema.get("items", {}), f"{at}[{i}]")]
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        errors.append(f"{at}: length {len(value)} outside the bounds")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{at}: {value} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    return errors
