"""Turn-taking policy, kept free of models and I/O so it can be tested alone.

* ``PartialStabilizer``: partial transcripts that only grow (LocalAgreement: words two
  hypotheses agree on are fixed, so the page never sees text jump backwards).
* ``looks_unfinished``: the transcript's own cue that the user is mid-sentence.
* ``Endpointer``: how much silence commits a turn, given that cue and the end-of-turn signals
  (the sound: Smart Turn; the words: the LLM's P of its end-of-turn token), combined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.voice.text import words

# Words after which an English sentence is almost never over.
_CONTINUATIONS = frozenset(
    "and or but so because since although though if when while that which who whose whom where "
    "the a an to of for with from in on at by about into than as my your his her our their its "
    "is are was were be been am do does did can could would should will shall may might must "
    "um uh er like i'm i've it's what's there's let's".split()
)
_FILLERS = frozenset("mm mhm hmm hm uh um er ah oh huh mm-hmm uh-huh".split())


def looks_unfinished(text: str, language: str | None = None) -> bool:
    """True when the words so far end mid-clause ("... and", "... the", a trailing comma).

    The word list is English: for another ``language`` only punctuation counts (and the
    end-of-turn model, which hears 23 languages, does the rest).
    """
    stripped = text.strip()
    if not stripped:
        return False
    if stripped.endswith((",", "-", "—", "...", "…", "，", "、")):
        return True
    if language and language != "en":
        return False
    spoken = words(stripped)
    # Whisper ends cut-off audio with a period too ("... Paris and."), so only ? and ! overrule.
    return bool(spoken) and spoken[-1] in _CONTINUATIONS and not stripped.endswith(("?", "!"))


# What a listener says to show they are following, not to take the turn ("mm-hmm", "yeah", "I see").
_BACKCHANNELS = frozenset(
    "mm mhm hmm hm uh um er ah oh huh yeah yep yup yes right okay ok sure alright i see wow cool nice got it "
    "exactly true indeed uh-huh mm-hmm".split()
)


def is_backchannel(text: str) -> bool:
    """A short acknowledgement ("mm-hmm", "yeah", "right", "I see"): said over a reply, it is not an interruption.

    Counted in distinct words: Whisper tiny repeats a short word heard before silence and noise
    ("Yeah Yeah Yeah ..." 14 times for one "yeah" in the benchmark's 20 dB noise).
    """
    spoken = words(text)
    return len(set(spoken)) <= 3 and all(word in _BACKCHANNELS for word in spoken)


def is_filler(text: str) -> bool:
    """A transcript with no content words: noise, "mm", "uh" (never a turn, never a barge-in)."""
    return all(word in _FILLERS for word in words(text))


class PartialStabilizer:
    """Turns successive ASR hypotheses of a growing utterance into monotonically growing text."""

    def __init__(self) -> None:
        self._previous: list[str] = []
        self._shown: list[str] = []

    def update(self, hypothesis: str) -> str | None:
        """Text to show for this hypothesis, or None when it would not grow what is shown.

        Shown are the words two successive hypotheses agree on, never counting the earlier
        one's last word (its audio may have been cut mid-word: "rain|bow").
        """
        tokens = hypothesis.rstrip(".… ").split()  # Whisper's "..." where the audio is cut off
        agreed = 0
        limit = min(len(tokens), len(self._previous) - 1)
        while agreed < limit and _same(tokens[agreed], self._previous[agreed]):
            agreed += 1
        self._previous = tokens
        if agreed <= len(self._shown) or not _prefix_matches(tokens[:agreed], self._shown):
            return None
        self._shown = tokens[:agreed]
        return " ".join(self._shown)


def _same(a: str, b: str) -> bool:
    return words(a) == words(b)


def _prefix_matches(tokens: list[str], prefix: list[str]) -> bool:
    return len(tokens) >= len(prefix) and all(_same(a, b) for a, b in zip(tokens, prefix, strict=False))


@dataclass(frozen=True)
class SignalWeights:
    """How the two end-of-turn signals combine: P(complete) = sigmoid(bias + audio * logit(audio P)
    + text * log10(text P)), fitted on the labelled set of ``parley bench turn-end --fit``.

    The audio P is Smart Turn's; the text P the LLM's (``LocalScheduling.end_of_turn_probability``),
    floored at ``text_floor`` (below it the words are as unfinished as words get). On that set the words
    say far more than the sound: cut out of fluent speech, a mid-clause pause often sounds finished to
    Smart Turn, so the fit leans on the text (accuracies: app/bench/results/turn_end.md).
    """

    bias: float = 2.49
    audio: float = 0.16
    text: float = 1.34
    text_floor: float = 1e-6


def combined_probability(
    audio: float | None, text: float | None, weights: SignalWeights = SignalWeights()
) -> float | None:
    """P(the turn is complete) from both signals; the audio P alone without the text's (an LLM elsewhere)."""
    if text is None:
        return audio
    z = weights.bias + weights.text * math.log10(max(text, weights.text_floor))
    if audio is not None:
        clipped = min(max(audio, 1e-3), 1 - 1e-3)
        z += weights.audio * math.log(clipped / (1 - clipped))
    return 1 / (1 + math.exp(-z))


@dataclass(frozen=True)
class Endpointer:
    """Silence needed to commit a turn, from three cues: the words, the sound of the turn's end, and what the
    LLM expects after the words.

    The words: ending mid-clause ("... and") always waits ``unfinished_silence_ms``. The signals: an
    end-of-turn model's probability that the turn is complete (``complete_probability``, None without a
    model) and the LLM's that the words end there (``text_probability``, None where the LLM runs
    elsewhere), combined (``combined_probability``). Confident it is over (>= ``complete_threshold``):
    commit after ``complete_silence_ms``; confident it is not (< ``incomplete_threshold``): wait as long
    as mid-clause, which also catches an "and" that Whisper heard as "then." (with the sound alone, not
    after a question mark); in between, or with neither signal: ``silence_ms``.
    """

    silence_ms: int = 400
    unfinished_silence_ms: int = 1200
    complete_silence_ms: int = 200
    complete_threshold: float = 0.5
    incomplete_threshold: float = 0.2
    weights: SignalWeights = SignalWeights()

    def sound_matters(
        self, text: str | None, language: str | None = None, text_probability: float | None = None
    ) -> bool:
        """Whether some end-of-turn model verdict would change ``required_silence_ms`` for these words and the
        LLM's P: the rule is monotone in the sound's P, so comparing its two extremes (as clipped) tells."""
        ends = {self.required_silence_ms(text, sound, language, text_probability) for sound in (0.0, 1.0)}
        return len(ends) > 1 or self.required_silence_ms(text, None, language, text_probability) not in ends

    def required_silence_ms(
        self,
        text: str | None,
        complete_probability: float | None = None,
        language: str | None = None,
        text_probability: float | None = None,
    ) -> int:
        if text is not None and looks_unfinished(text, language):
            return self.unfinished_silence_ms
        probability = combined_probability(complete_probability, text_probability, self.weights)
        if probability is None:
            return self.silence_ms
        if probability >= self.complete_threshold:
            return self.complete_silence_ms
        if probability < self.incomplete_threshold:
            # (the sound alone: a question mark is Whisper hearing a finished question; the model misjudged
            # "Can you recommend a good book?" at P 0.02-0.04 in the benchmark. The LLM reads the question.)
            if text_probability is not None or not (text or "").rstrip().endswith("?"):
                return self.unfinished_silence_ms
        return self.silence_ms
