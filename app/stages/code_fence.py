"""A reply that opens with a markdown code fence: the fence taken off before the text is read for calls.

Why: asked through a remote server (vLLM), the default brain (Qwen2.5-Coder-0.5B, a coding model) wrote its call
as ```` ```json\n{"name": "set_timer", ...}\n``` ````: neither vLLM's hermes parser nor a bare-JSON reader takes
it, and the user heard the JSON read out. In process the lazy grammar (``engine.structured_output``) never lets
the fence be written; a remote server has no such grammar, so its text is unfenced here, streaming: only a
reply's opening is held until it is known not to be a fence, and a closing fence is dropped only at the end.
"""

from __future__ import annotations

import re

_OPENING = re.compile(r"\s*```[A-Za-z]*[ \t]*\n")
_CLOSING = re.compile(r"\s*```\s*$")
_MAX_OPENING = 24  # "```json\n" and some whitespace: past this the reply is not one opening with a fence


class Unfence:
    """Feed a reply's text (``feed``), then ``finish``: the text with an opening code fence (and its closing fence,
    at the end) taken off; any other text passes as it comes."""

    def __init__(self) -> None:
        self._head = ""  # the reply's opening, held until it is known to be a fence or not
        self._deciding = True
        self._fenced = False
        self._tail = ""  # in a fenced reply, text that may be the closing fence

    def feed(self, text: str) -> str:
        if self._deciding:
            self._head += text
            match = _OPENING.match(self._head)
            if match:
                self._deciding, self._fenced = False, True
                text, self._head = self._head[match.end() :], ""
            elif self._could_open(self._head):
                return ""
            else:
                self._deciding = False
                text, self._head = self._head, ""
        if not self._fenced:
            return text
        text = self._tail + text
        held = re.search(r"[\s`]*$", text).start()  # trailing backticks and space: perhaps the closing fence
        self._tail = text[held:]
        return text[:held]

    def finish(self) -> str:
        if self._deciding:
            self._deciding = False
            return self._head
        rest, self._tail = self._tail, ""
        return "" if _CLOSING.fullmatch(rest) or not rest.strip() else rest

    @staticmethod
    def _could_open(head: str) -> bool:
        """Whether ``head`` may still become a fence's opening line (space, then up to three backticks and a
        language name)."""
        return len(head) <= _MAX_OPENING and re.fullmatch(r"\s*(`{1,3}[A-Za-z]*[ \t]*)?", head) is not None
