"""What a test may ask of Whisper: the words of a sentence, give or take one.

Whisper on int8 CPU can hear one word of a clear sentence differently ("weather" as "wother",
a "the" dropped), and Piper's voice is sampled afresh on every call, so a test that compares a
transcript word for word fails on some machines and not others. These checks say the sentence
was heard: every expected word in order but at most ``slack`` of them, and nothing much added.
"""

from difflib import SequenceMatcher

from app.voice.text import words


def heard_as(transcript: str, expected: str, *, slack: int = 1) -> bool:
    """True when ``transcript`` holds ``expected``'s words in order, but for up to ``slack`` of them."""
    said, wanted = words(transcript), words(expected)
    matched = sum(block.size for block in SequenceMatcher(a=wanted, b=said, autojunk=False).get_matching_blocks())
    return matched >= len(wanted) - slack and len(said) <= len(wanted) + slack
