"""A reply's wait for its LLM, bounded: a backend that fails or keeps silent ends the turn with a notice.

Why: with a remote server (vLLM, a llama.cpp server, ``parley engine serve``) the LLM can be down, restarting or
overloaded; its HTTP client would wait a minute for a word while the user hears nothing. Every event of the reply's
stream (the first included) is waited for at most ``llm_wait_s``; past it, or when the backend raises, the reply
raises ``LLMUnavailable`` and says so (``Reply``: a short sentence aloud, a typed ``llm_unavailable`` error), the
user's words are forgotten as any failed turn's, and the session goes on: the next turn asks the LLM again.
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
    """``stream``'s events, each waited for at most ``wait_s`` (None: as long as it takes); the backend's failure
    or its silence is raised as ``LLMUnavailable``. Closing this closes nothing: the caller closes ``stream``."""
    while True:
        try:
            async with asyncio.timeout(wait_s):  # (no task of its own: the stream runs in the reply's)
                event = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError as exc:
            raise LLMUnavailable(f"no word from the LLM in {wait_s:g} s") from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the backend's own (connection refused, an HTTP error, a dead engine loop)
            raise LLMUnavailable(str(exc) or type(exc).__name__) from exc
        yield event
