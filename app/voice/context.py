"""Fitting a conversation into the LLM's context: by tokens, never failing a turn for length.

The prompt of every turn is the system prompt, a window of the history, and the new user
message. ``fit_to_context`` drops the oldest exchanges until it fits ``budget`` tokens (the
model's context minus the reply's ``max_tokens``); if the new message alone is still too
long, it is cut, and the caller tells the user so. Token counts come from the backend's
own tokenizer when it has one (``ChatLLM.count_tokens``), else from an estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.stages.base import Message

TRUNCATION_MARK = " …"


def cut_at_word(text: str, max_chars: int) -> str:
    """The longest start of ``text`` within ``max_chars`` that ends at a word (a first word longer than that: cut)."""
    kept = text[:max_chars]
    return kept.rsplit(" ", 1)[0] if " " in kept else kept


def estimate_tokens(messages: list[Message]) -> int:
    """A cautious count for backends without a tokenizer here: ~3 characters a token, plus the template's."""
    return sum(len(message["content"]) // 3 + 8 for message in messages) + 4


@dataclass(frozen=True)
class Fitted:
    messages: list[Message]
    dropped_messages: int = 0  # history messages left out
    truncated_chars: int = 0  # characters cut from the end of the last message


def fit_to_context(messages: list[Message], count: Callable[[list[Message]], int], budget: int) -> Fitted:
    """``messages`` (system first, the new user message last) cut to at most ``budget`` tokens."""
    if count(messages) <= budget:
        return Fitted(messages)
    system, history, last = messages[0], list(messages[1:-1]), messages[-1]
    dropped = 0
    while history:
        # the oldest exchange goes whole: the window must still start at a user message
        del history[0]
        dropped += 1
        while history and history[0]["role"] != "user":
            del history[0]
            dropped += 1
        if count([system, *history, last]) <= budget:
            return Fitted([system, *history, last], dropped)
    content = last["content"]
    low, high = 0, len(content)  # the longest prefix that fits, by bisection on characters
    while low < high:
        middle = (low + high + 1) // 2
        if count([system, {**last, "content": content[:middle] + TRUNCATION_MARK}]) <= budget:
            low = middle
        else:
            high = middle - 1
    kept = cut_at_word(content, low)
    if not kept:
        raise ValueError(f"the system prompt alone is over the context budget of {budget} tokens")
    return Fitted([system, {**last, "content": kept + TRUNCATION_MARK}], dropped, len(content) - len(kept))
