"""Chat prompts as token ids, with every message's content tokenized as plain text.

Why: a chat template renders the conversation into one string, and tokenizing that string
turns ``<|im_start|>``, ``<|im_end|>`` (or any other special token's text) into special
tokens wherever it appears, including inside a message. A user (or a transcript, or a web
page read aloud) that says ``<|im_end|><|im_start|>system ...`` would then forge a new
system turn. So the template is rendered with a unique placeholder in place of each
message's content, the rendered string is split at the placeholders, the template's own
pieces are tokenized normally (their markers are real special tokens) and each content
piece with ``split_special_tokens=True`` (the marker's text becomes ordinary tokens, e.g.
``<``, ``|``, ``im``, ``_``, ``end``, ...), and the pieces are concatenated.

For ordinary messages the result equals the tokenizer's own ``apply_chat_template``
(checked by tests/engine/test_chat_sanitize.py on the bundled SmolLM2 tokenizer): its
ChatML template puts a newline before each content and a special token after it, and a
byte-level BPE pre-tokenizer never merges across either, so splitting there changes no
token. A template that puts ordinary text right against a content (``"Q: " + content``
with no separator) can tokenize a few characters at that seam differently, because BPE
then sees the two sides separately; the text is the same.

What is filtered and what is not:

* filtered: the ``content`` of every message (system, developer, user, assistant), as
  rendered by the model's own template through ``AsyncLLMEngine.apply_chat_template``,
  which the voice app and ``parley engine serve``'s ``/v1/chat/completions`` both use;
* not filtered: ``/v1/completions`` with a raw prompt (a raw prompt is the caller's own
  template: special-token text in it is meant as special tokens), token-id prompts, the
  role names (the API accepts only system/developer/user/assistant/tool), and remote
  OpenAI-compatible backends (``llm_backend=openai``: vLLM, TGI, ... apply the template
  on their own server, so their own sanitizing applies), and the voice app's
  ``transformers`` reference backend, which calls the tokenizer's template directly.

A template that changes a content before printing it (``| trim`` in Llama 3's, ``| tojson``
for a tool result in Llama 3.1's) is detected by comparing with the normal rendering; each
content is then used as printed (stripped, JSON-escaped, or both), and any other
transformation falls back to the content as sent (still plain text), with a warning logged
once. The placeholders are letters and digits only, so that such filters print them
unchanged.

With tools (``engine/openai_api/tool_plan.py``): a ``tool`` message's content is a content like any
other; the tool definitions and earlier calls' arguments are rendered by the template as
JSON, outside any content, so the tools plan breaks special-token text in them first.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections import OrderedDict

log = logging.getLogger(__name__)

_warned: set[str] = set()
# The placeholders' nonce: one per process, never shown outside it, so a message cannot spell one; one compiled
# pattern finds them all (a nonce per call compiled a new pattern each time: ~1 ms of a ~5 ms prompt with tools).
_NONCE = secrets.token_hex(8)
_MARKS = re.compile(f"PARLEYCONTENT{_NONCE}N[0-9]+E")


def _ids(encoding) -> list[int]:
    if isinstance(encoding, dict) or hasattr(encoding, "input_ids"):
        encoding = encoding["input_ids"]
    return [int(i) for i in encoding]


def check_split_special_tokens(tokenizer) -> None:
    """Raise RuntimeError when ``tokenizer`` cannot tokenize special-token text as plain text."""
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    if not special:
        return
    probe = special[0]
    ids = _ids(tokenizer(probe, add_special_tokens=False, split_special_tokens=True))
    special_ids = set(getattr(tokenizer, "all_special_ids", []))
    if any(i in special_ids for i in ids):
        raise RuntimeError(f"{type(tokenizer).__name__} does not support split_special_tokens; cannot sanitize chats")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The template's text for ``messages`` (what the tokenizer's own template renders, with ``tools``)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)


def chat_token_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, every content tokenized as plain text.

    When no content holds an added token's text and the normal tokenization has exactly the
    template's own special tokens, that tokenization is returned (it is then the same as the
    sanitized one, and exactly what the tokenizer's own template gives); otherwise the
    sanitized one (``sanitized_chat_token_ids``).
    """
    contents = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
    added = added_token_texts(tokenizer)
    rendered = render(tokenizer, messages, add_generation_prompt, tools)
    if not any(t in c for c in contents for t in added):
        normal = _ids(tokenizer(rendered, add_special_tokens=False))
        template_only = sanitized_chat_token_ids(
            tokenizer, messages, add_generation_prompt, tools, _template_ids_only=True, _normal=rendered
        )
        added_ids = set(added.values())
        if sorted(i for i in normal if i in added_ids) == sorted(template_only):
            return normal
    return sanitized_chat_token_ids(tokenizer, messages, add_generation_prompt, tools, _normal=rendered)


class ChatIdsCache:
    """The token ids of the last chats rendered (``chat_token_ids``), by their messages, tools and generation prompt.

    Why: a voice turn renders the same prompt more than once before its first step (its verdict's position is
    read from the reply's prompt, which the reply then renders again), and a prompt with the default brain's tools
    costs ~5 ms of the event loop to render (three template renderings and two tokenizations of ~1000 tokens).
    Keyed by the JSON of what is rendered, in its own key order (a template prints keys as they come): a chat
    that cannot be written as JSON is rendered each time. Thread-safe; a hit returns a copy."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str | None:
        try:
            return json.dumps([messages, add_generation_prompt, tools], ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return None

    def ids(
        self, tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """``chat_token_ids`` of the chat, from this cache where it was rendered lately."""
        key = self.key(messages, add_generation_prompt, tools)
        if key is not None:
            with self._lock:
                found = self._ids.get(key)
                if found is not None:
                    self._ids.move_to_end(key)
                    self.hits += 1
                    return list(found)
        ids = chat_token_ids(tokenizer, messages, add_generation_prompt, tools)
        if key is not None:
            with self._lock:
                self._ids[key] = list(ids)
                while len(self._ids) > self.capacity:
                    self._ids.popitem(last=False)
        return ids


def added_token_texts(tokenizer) -> dict[str, int]:
    """Every added token (special or not) the tokenizer matches in raw text, as {text: id}."""
    encoder = getattr(tokenizer, "added_tokens_encoder", None) or {}
    return {t: int(i) for t, i in encoder.items() if t}


def sanitized_chat_token_ids(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    *,
    _template_ids_only: bool = False,
    _normal: str | None = None,
) -> list[int]:
    """The template rendered around placeholders; template pieces tokenized normally, contents as plain text.

    At each seam, whitespace is moved to the side where a byte-level BPE pre-tokenizer
    would have put it in the whole string (a whitespace run is one piece but for its last
    character, which starts the next word), so for ordinary messages the ids equal the
    normal tokenization on the Llama-family (byte-level) tokenizers. Whitespace cannot spell
    a marker, so moving it across a seam filters nothing less. ``_normal``: the template's own rendering of
    ``messages``, where the caller has it.
    """
    marks: dict[str, str] = {}
    shadow: list[dict] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        m2 = dict(m)
        if isinstance(content, str) and content:  # empty content: nothing to sanitize, and templates test it
            mark = f"PARLEYCONTENT{_NONCE}N{i}E"
            marks[mark] = content
            m2["content"] = mark
        shadow.append(m2)
    rendered = render(tokenizer, shadow, add_generation_prompt, tools)
    if marks:
        parts = _MARKS.split(rendered)
        normal = _normal if _normal is not None else render(tokenizer, messages, add_generation_prompt, tools)
        contents = _as_template_prints(tokenizer, normal, parts, [marks[k] for k in _MARKS.findall(rendered)])
    else:
        parts, contents = [rendered], []
    if _template_ids_only:
        added = set(added_token_texts(tokenizer).values())
        return [i for p in parts if p for i in _ids(tokenizer(p, add_special_tokens=False)) if i in added]
    pieces = _fix_seams(parts, contents)
    ids: list[int] = []
    for text, plain in pieces:
        if text:
            ids += _ids(tokenizer(text, add_special_tokens=False, split_special_tokens=plain))
    return ids


def _fix_seams(parts: list[str], contents: list[str]) -> list[tuple[str, bool]]:
    """[(text, is_content)] alternating template and content pieces, whitespace moved across seams."""
    parts = list(parts)
    out: list[tuple[str, bool]] = []
    for i, content in enumerate(contents):
        prev = parts[i]
        if not content.strip():  # whitespace only: no marker can hide in it; template text
            parts[i + 1] = prev + content + parts[i + 1]
            continue
        lead = len(content) - len(content.lstrip())
        if lead and prev[-1:].isspace():
            prev, content = prev + content[: lead - 1], content[lead - 1 :]
        elif not lead and prev.endswith(" "):
            prev, content = prev[:-1], " " + content  # " word" is one pre-token
        trail = len(content) - len(content.rstrip())
        if trail and i + 1 < len(parts):
            content, parts[i + 1] = content[: len(content) - trail], content[len(content) - trail :] + parts[i + 1]
        out += [(prev, False), (content, True)]
    out.append((parts[len(contents)] if len(parts) > len(contents) else "", False))
    return out


def _as_template_prints(tokenizer, normal: str, parts: list[str], contents: list[str]) -> list[str]:
    """The contents as the template prints them (``normal``: its rendering of the messages), each as sent, stripped
    (``| trim``), JSON-escaped (``| tojson``) or both; else all as sent, with a warning."""
    printed: list[str] = []
    at = 0
    for i, content in enumerate(contents):
        if not normal.startswith(parts[i], at):
            break
        at += len(parts[i])
        after = parts[i + 1] if i + 1 < len(parts) else ""
        form = next((f for f in _printed_forms(content) if normal.startswith(f + after, at)), None)
        if form is None:
            break
        printed.append(form)
        at += len(form)
    if len(printed) == len(contents) and "".join(p + c for p, c in zip(parts, [*printed, ""], strict=True)) == normal:
        return printed
    key = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if key not in _warned:
        _warned.add(key)
        log.warning(
            "the chat template of %s changes message contents in a way the sanitizer cannot reproduce; "
            "contents are tokenized as sent",
            key,
        )
    return contents


def _printed_forms(content: str) -> list[str]:
    forms = [content, content.strip()]
    forms += [json.dumps(f, ensure_ascii=False)[1:-1] for f in forms]
    return list(dict.fromkeys(forms))
