"""A reply that is no longer speech, whatever its shape, and a reply too long to listen to.

The loop and repeat guards (``app.voice.pieces``) catch words said again. They missed this one, from the bundled
model on a misheard question: "This guy is a 2018-2020-10-01-12-12-20-20-21-20-22-23-24-…", 32 s of spoken numbers
with a 6 s stall (no space, so the sentence splitter held it until the token cap; digits are exempt from the loop
guard, since "0.0.0.0" is a number). So three shapes are checked on the text written so far, none of them a word
list (they hold in any language):

* an unbroken run: ``MAX_UNBROKEN_CHARS`` characters with no space (no word of a spoken language is that long; a
  URL or a hash is not for the ear either);
* counting: more than ``MAX_NUMBER_RUN`` numbers in a row with no word between them ("count to ten" is ten);
* repetition that is not word for word: the text compresses like Whisper's own hallucination test
  (``zlib`` ratio above ``MAX_COMPRESSION_RATIO`` once ``COMPRESSION_MIN_CHARS`` long; 2.4 is faster-whisper's
  ``compression_ratio_threshold``);
* data: a JSON object's key opening (``{"name":``), an array's first string (``["error",``) or a code fence
  (```` ``` ````), which no sentence holds. The default brain, served by vLLM, wrote a call then the next tool's
  schema (``, {"name": "set_timer", "arguments": {"type": "object", ...``), and the schema had spaces, few numbers
  and no repetition: it was read aloud; after a failed conversion it wrote its error back as a fenced JSON list.

* echo: ``ECHO_MIN_WORDS`` words in a row of the tools' servers' instructions (``PromptEcho``).

Each gives where the speakable text should end (``runaway_at``): before the run or data, or past the tenth
number.

The length budget (``SpeechBudget``): a voice reply past about 15 s loses its listener (a pancake recipe took 30 s,
simple questions 15-24 s with the bundled model), so a reply ends at the first sentence end after the budget, or
at the next piece past ``BUDGET_OVERRUN`` times it.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

MAX_UNBROKEN_CHARS = 40
MAX_NUMBER_RUN = 12
MAX_COMPRESSION_RATIO = 2.4
ECHO_MIN_WORDS = 10  # of the system prompt in a row: its instructions said back (the date alone is 5-6 words)
COMPRESSION_MIN_CHARS = 200
# Piper's bundled joe voice says 16-19 characters a second (measured on four answers of 14-19 words: 16.9 on
# average; 3.2 words a second); the budget is counted in characters, steadier than words.
SPOKEN_CHARS_PER_S = 16.0
BUDGET_OVERRUN = 1.25
# An English request for a long answer gets the long budget (``reply_long_speech_s``). A word list, so English only
# and named so (``asks_for_long_reply_en``); other languages keep the short budget. A recipe is not on it: said
# whole it took 30 s, and a listener asks for the next step.
_LONG_REQUEST_EN = re.compile(
    r"\b(stor(y|ies)|in (great |more |full )?detail|detailed|step by step|at length|everything about|long|essay|"
    r"poem|all (of )?the (steps|details))\b",
    re.IGNORECASE,
)

_UNBROKEN = re.compile(rf"\S{{{MAX_UNBROKEN_CHARS + 1},}}")
# a JSON object's first key ({"name":), an array's first string (["error",), or a code fence (```json)
_DATA = re.compile(r'[{\[]\s*"[^"\n]{1,64}"\s*[:,]|```')
# a number, and what may sit between two numbers of a run: separators, not words
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_BETWEEN_NUMBERS = re.compile(r"[\s,;:/\-–—+=.()]*")
_SENTENCE_END = re.compile(r"[.!?…。！？][\"')\]]*$")


@dataclass(frozen=True)
class Runaway:
    """Where the speakable text ends (``at``, a character offset of the text checked) and which shape ran away."""

    at: int
    shape: str  # "unbroken", "counting", "repetitive", "data" or "echo"


def runaway_at(text: str, echo: PromptEcho | None = None) -> Runaway | None:
    """The first runaway in ``text`` (a reply's text so far), or None while it is still speech; ``echo``: the
    prompt's instructions, said back."""
    checks = (_unbroken(text), _counting(text), _repetitive(text), _data(text), echo.at(text) if echo else None)
    found = [r for r in checks if r is not None]
    return min(found, key=lambda r: r.at) if found else None


_WORD = re.compile(r"\w+(?:'\w+)?")


class PromptEcho:
    """Instructions a reply was written under, to find them said back: a run of ``ECHO_MIN_WORDS`` of their words
    in a row, which no answer needs. The default brain, its call refused and the reply written without tools, read
    an MCP server's instructions aloud ("To control the home, call its tools. For a device, pass its name and its
    domain; ...", 8 s) to a misheard "on the kitchen lights". Only the servers' instructions: a system prompt an
    operator or a client writes may hold facts that an answer quotes."""

    def __init__(self, instructions: str) -> None:
        words = [w.lower() for w in _WORD.findall(instructions)]
        self._runs = {tuple(words[i : i + ECHO_MIN_WORDS]) for i in range(len(words) - ECHO_MIN_WORDS + 1)}

    def at(self, text: str) -> Runaway | None:
        if not self._runs:
            return None
        words = list(_WORD.finditer(text))
        for i in range(len(words) - ECHO_MIN_WORDS + 1):
            if tuple(w[0].lower() for w in words[i : i + ECHO_MIN_WORDS]) in self._runs:
                return Runaway(words[i].start(), "echo")
        return None


def _unbroken(text: str) -> Runaway | None:
    match = _UNBROKEN.search(text)
    return Runaway(match.start(), "unbroken") if match else None


def _data(text: str) -> Runaway | None:
    match = _DATA.search(text)
    return Runaway(match.start(), "data") if match else None


def _counting(text: str) -> Runaway | None:
    run, last_end = 0, -1
    for match in _NUMBER.finditer(text):
        joined = last_end >= 0 and _BETWEEN_NUMBERS.fullmatch(text, last_end, match.start()) is not None
        run = run + 1 if joined else 1
        if run > MAX_NUMBER_RUN:
            return Runaway(last_end, "counting")  # the numbers up to here are said
        last_end = match.end()
    return None


def _repetitive(text: str) -> Runaway | None:
    if len(text) < COMPRESSION_MIN_CHARS:
        return None
    data = text.encode()
    if len(data) / len(zlib.compress(data)) <= MAX_COMPRESSION_RATIO:
        return None
    # where it began to repeat: the shortest prefix that already compresses past the threshold, less its tail
    for end in range(COMPRESSION_MIN_CHARS, len(text) + 1, 20):
        head = text[:end].encode()
        if len(head) / len(zlib.compress(head)) > MAX_COMPRESSION_RATIO:
            return Runaway(max(0, end - COMPRESSION_MIN_CHARS // 2), "repetitive")
    return Runaway(len(text), "repetitive")


def asks_for_long_reply_en(words: str) -> bool:
    """The user asked, in English, for something long (a story, in detail, step by step)."""
    return _LONG_REQUEST_EN.search(words) is not None


def speech_budget_s(words: str, language: str | None, short_s: float, long_s: float) -> float:
    """How long the reply to ``words`` may speak."""
    long = (language or "").startswith("en") and asks_for_long_reply_en(words)
    return max(short_s, long_s) if long else short_s


def ends_sentence(piece: str) -> bool:
    return _SENTENCE_END.search(piece.rstrip()) is not None


class SpeechBudget:
    """How much a reply may say: ``seconds`` of speech (None: no bound), counted in characters spoken.

    A piece that ends a sentence past the budget is the last; a piece that would take the reply past
    ``BUDGET_OVERRUN`` times it is not said (a hard bound: a run-on sentence never ends on its own)."""

    def __init__(self, seconds: float | None) -> None:
        self._chars = None if seconds is None else seconds * SPOKEN_CHARS_PER_S
        self._spoken = 0

    def tighten(self, seconds: float) -> None:
        """At most about ``seconds`` more of speech from here on (a bound already tighter stays)."""
        limit = self._spoken + seconds * SPOKEN_CHARS_PER_S
        self._chars = limit if self._chars is None else min(self._chars, limit)

    def admit(self, piece: str) -> tuple[bool, bool]:
        """(say ``piece``, stop after it): counts it as said when it is said."""
        if self._chars is None:
            return True, False
        after = self._spoken + len(piece) + 1
        if after > self._chars * BUDGET_OVERRUN and self._spoken > 0:
            return False, True
        self._spoken = after
        return True, after >= self._chars and ends_sentence(piece)
