"""What a test may ask of Whisper: the words of a sentence, give or take one.

Whisper on int8 CPU can hear one word of a clear sentence differently ("weather" as "wother",
a "the" dropped), and Piper's voice is sampled afresh on every call, so a test that compares a
transcript word for word fails on some machines and not others. These checks say the sentence
was heard: every expected word in order but at most ``slack`` of them, and nothing much added.
Contractions count as the words they stand for ("The weather's sunny today" was heard for "The
weather is sunny today" in CI).
"""

import re
from difflib import SequenceMatcher

from app.voice.text import words

_CONTRACTIONS = (
    (re.compile(r"\bcan['’]t\b", re.I), "can not"),
    (re.compile(r"\bwon['’]t\b", re.I), "will not"),
    (re.compile(r"(?<=\w)['’]s\b", re.I), " is"),
    (re.compile(r"(?<=\w)['’]re\b", re.I), " are"),
    (re.compile(r"(?<=\w)['’]ll\b", re.I), " will"),
    (re.compile(r"(?<=\w)n['’]t\b", re.I), " not"),
    (re.compile(r"(?<=\w)['’]m\b", re.I), " am"),
)


def _expanded(text: str) -> list[str]:
    """``text``'s words, contractions as the words they stand for ("weather's" -> "weather is"; a possessive's "s"
    too, on both sides alike)."""
    for pattern, words_for in _CONTRACTIONS:
        text = pattern.sub(words_for, text)
    return words(text)


def heard_as(transcript: str, expected: str, *, slack: int = 1) -> bool:
    """True when ``transcript`` holds ``expected``'s words in order, but for up to ``slack`` of them."""
    said, wanted = _expanded(transcript), _expanded(expected)
    matched = sum(block.size for block in SequenceMatcher(a=wanted, b=said, autojunk=False).get_matching_blocks())
    return matched >= len(wanted) - slack and len(said) <= len(wanted) + slack
