"""A reply's wait for its LLM, bounded: a backend that fails or keeps silent ends the turn with a notice.

Why: with a remote server (vLLM, a llama.cpp server, ``parley engine serve``) the LLM can be down, restarting or
overloaded; its HTTP client would wait a minute for a word while the user hears nothing. Until something of the
reply is said, the first event of its LLM request (each round's, after tool calls) is waited for at most
``llm_wait_s``; past it, or when the backend raises at any point, the reply raises ``LLMUnavailable`` and says so
(``Reply``: a short sentence aloud where nothing was said yet, a typed ``llm_unavailable`` error), the user's words
are forgotten as any failed turn's, and the session goes on: the next turn asks the LLM again.

Why only then: once a reply speaks, its own LLM request may rightly wait for many seconds (a reply far ahead of its
listener lets the other conversations' steps go first, ``LocalScheduling.yield_to_others``), and a bound there would
cut a healthy reply; a remote server that stalls mid-reply is bounded by its HTTP client's read timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

# Said aloud where the turn's language has words here (a language without: the typed error alone).
UNAVAILABLE_WORDS = {
    "en": "Sorry, I can't think right now. Please try again in a moment.",
    "de": "Entschuldigung, ich kann gerade nicht nachdenken. Bitte versuch es gleich noch einmal.",
}


class LLMUnavailable(Exception):
    """The LLM failed (its error) or kept silent past the wait: this reply is given up."""


async def bounded(stream: AsyncIterator[T], wait_s: float | None) -> AsyncIterator[T]:
    """``stream``'s events, the first waited for at most ``wait_s`` (None: as long as it takes); the backend's
    failure, or its silence before the first, is raised as ``LLMUnavailable``. Closing this closes nothing: the
    caller closes ``stream``."""
    first = True
    while True:
        try:
            async with asyncio.timeout(wait_s if first else None):  # (no task of its own: runs in the reply's)
                event = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError as exc:
            raise LLMUnavailable(f"no word from the LLM in {wait_s:g} s") from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the backend's own (connection refused, an HTTP error, a dead engine loop)
            raise LLMUnavailable(str(exc) or type(exc).__name__) from exc
        first = False
        yield event
