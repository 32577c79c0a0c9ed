"""One LLM request's text cut into the pieces a reply speaks (``Piece``), with the guards that end a reply saying itself again.

The guards, mostly for small models (the bundled SmolLM2-135M loops: "I'm not today. I'm not today.", or a
120-token run-on repeating one clause, 30 s of the same words for the listener):

* ``loop``: a loop inside the text (``app.voice.text.loop_end``): its first time is said, not the rest;
* ``repeat``: a piece of at least ``REPEAT_MIN_WORDS`` words said again word for word: it is not said;
* ``runaway``: text that is no longer speech, of any shape (``app.voice.runaway.runaway_at``): what came
  before it is said;
* ``length``: the reply's speech budget is spent (``app.voice.runaway.SpeechBudget``): it ends at a sentence;
* ``tool_talk``: the text names a declared tool instead of calling it (``app.voice.tool_talk``): nothing from the
  name on is said, and the round ends once its text goes on without a call.

Each ends the reply; the ``Reply`` counts which one did (``TurnMetrics.guard_*``) and keeps what was said.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal

from app.voice import tool_talk
from app.voice.runaway import PromptEcho, SpeechBudget, runaway_at
from app.voice.text import SentenceSplitter, loop_end, words

log = logging.getLogger(__name__)
Guard = Literal["repeat", "loop", "runaway", "length", "tool_talk"]

REPEAT_MIN_WORDS = 3


@dataclass(frozen=True)
class Piece:
    """Text to speak. ``filler``: said while a tool runs, never written (not the reply's text, nor what was heard).
    ``answer``: written after the tools' results (its first audio is the answer's, ``TurnMetrics.answer_ms``)."""

    text: str
    filler: bool = False
    answer: bool = False


def repeats(piece: str, said: list[str]) -> bool:
    """``piece`` says again, word for word, one of the pieces ``said`` before it (and is long enough to count)."""
    spoken = words(piece)
    return len(spoken) >= REPEAT_MIN_WORDS and any(words(earlier) == spoken for earlier in said)


class PieceCutter:
    """Text deltas in, pieces to speak out. ``said``: the reply's pieces so far (every round's), appended to.
    ``budget``: how much the reply may still say (``runaway.SpeechBudget``; shared by its rounds); ``tools``: the
    declared tools' names as found in text (``tool_talk.tool_talk_pattern``; None: none declared); ``opening``: pieces
    already said (in ``said``) that this text is not to say again if it opens with them (a round written again);
    ``echo``: its prompt's instructions, not to be said back (``runaway.PromptEcho``)."""

    def __init__(
        self,
        said: list[str],
        *,
        first_clause_chars: int,
        first_piece_words: int,
        budget: SpeechBudget | None = None,
        tools: re.Pattern[str] | None = None,
        opening: list[str] | None = None,
        echo: PromptEcho | None = None,
    ) -> None:
        self._splitter = SentenceSplitter(first_clause_chars=first_clause_chars, first_piece_words=first_piece_words)
        self._said = said
        self._budget = budget or SpeechBudget(None)
        self._tools = tools
        self._opening = list(opening or ())
        self._echo = echo
        self._written = ""
        self.stop: Guard | None = None  # which guard ended the text (nothing after it is spoken)
        self.tool_named_at: int | None = None  # where the text named a declared tool (muted from there on)

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def push(self, delta: str) -> list[str]:
        """The pieces ``delta`` completes (up to a guard)."""
        if self.stopped:
            return []
        before = len(self._written)
        self._written += delta
        if self.tool_named_at is not None:
            if tool_talk.gone_on(self._written[self.tool_named_at :]):
                self.stop = "tool_talk"
            return []
        cut = self._cut_at()
        if self.tool_named_at is not None:
            return []
        if cut is not None:  # say what came before it, not the rest
            self._splitter.forget_last(max(0, before - cut))
            delta = delta[: max(0, cut - before)]
        return self._keep(self._splitter.push(delta))

    def flush(self) -> list[str]:
        """The last piece, at the text's end (none after a repeat, once the budget is spent, or after a tool was
        named)."""
        if self.stop in ("repeat", "length") or self.tool_named_at is not None:
            return []
        rest = self._splitter.flush()
        return self._keep([rest] if rest else [])

    def _cut_at(self) -> int | None:
        """Where a loop or a runaway begins in the text written so far (and the guard is set), or None."""
        loop_at = loop_end(self._written)
        if loop_at is not None:
            self.stop = "loop"
            return loop_at
        runaway = runaway_at(self._written, self._echo)
        if runaway is not None:
            self.stop = "runaway"
            log.info("a runaway reply (%s) is cut: %r", runaway.shape, self._written[runaway.at : runaway.at + 60])
            return runaway.at
        named = tool_talk.tool_named_at(self._written, self._tools)
        if named is not None:
            self.tool_named_at = named
            log.info("the reply names a tool: %r", self._written[named : named + 60])
            self._splitter.forget_last(len(self._written))  # nothing of this round not yet said is said
            return named
        return None

    def ended(self, called: bool) -> Guard | None:
        """The guard that ended the round's text, given whether it made calls (``called``): text that named a tool
        and then made a call announced it (not a guard); without a call, it talked about a tool (``tool_talk``)."""
        if self.tool_named_at is not None and self.stop in (None, "tool_talk"):
            return None if called else "tool_talk"
        return self.stop

    def _keep(self, pieces: list[str]) -> list[str]:
        kept = []
        for piece in pieces:
            if self._opening and words(piece) == words(self._opening[0]):
                self._opening.pop(0)  # said already
                continue
            self._opening = []
            if repeats(piece, self._said):
                self.stop = "repeat"
                break
            say, stop = self._budget.admit(piece)
            if say:
                self._said.append(piece)
                kept.append(piece)
            if stop:
                self.stop = self.stop or "length"
                break
        return kept
