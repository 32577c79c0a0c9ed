"""One LLM request's text cut into the pieces a reply speaks (``Piece``), with the guards that end a reply saying itself again.

Two guards, both for small models (the bundled SmolLM2-135M loops: "I'm not today. I'm not today.", or a
120-token run-on repeating one clause, 30 s of the same words for the listener):

* a loop inside the text (``app.voice.text.loop_end``): its first time is said, not the rest;
* a piece of at least ``REPEAT_MIN_WORDS`` words said again word for word: it is not said.

Either ends the reply; the ``Reply`` counts which one did (``TurnMetrics.guard_*``).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.voice.text import SentenceSplitter, loop_end, words

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
    """Text deltas in, pieces to speak out. ``said``: the reply's pieces so far (every round's), appended to."""

    def __init__(self, said: list[str], *, first_clause_chars: int, first_piece_words: int) -> None:
        self._splitter = SentenceSplitter(first_clause_chars=first_clause_chars, first_piece_words=first_piece_words)
        self._said = said
        self._written = ""
        self.repeated = False  # a piece was said again
        self.looping = False  # a few words were said again and again

    @property
    def stopped(self) -> bool:
        """A guard cut the text: nothing after it is spoken."""
        return self.repeated or self.looping

    def push(self, delta: str) -> list[str]:
        """The pieces ``delta`` completes (up to a guard)."""
        before = len(self._written)
        self._written += delta
        loop_at = loop_end(self._written)
        if loop_at is not None:  # say the loop's first time, not the rest
            self.looping = True
            self._splitter.forget_last(max(0, before - loop_at))
            delta = delta[: max(0, loop_at - before)]
        return self._keep(self._splitter.push(delta))

    def flush(self) -> list[str]:
        """The last piece, at the text's end (none after a repeat)."""
        if self.repeated:
            return []
        rest = self._splitter.flush()
        return self._keep([rest] if rest else [])

    def _keep(self, pieces: list[str]) -> list[str]:
        kept = []
        for piece in pieces:
            if repeats(piece, self._said):
                self.repeated = True
                break
            self._said.append(piece)
            kept.append(piece)
        return kept
