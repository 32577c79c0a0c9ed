"""Turning a stream of LLM text into speakable pieces."""

from __future__ import annotations

import re

# Latin-script punctuation ends a sentence before a space; CJK full-width marks need none.
_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*(?=\s)|[。！？]+[」』）\"']*|\n+")
_CLAUSE_END = re.compile(r"[,;:—–](?=\s)|[，、；：]")
_ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "st.", "vs.", "e.g.", "i.e.", "etc.", "no.", "jr.", "sr.", "prof."}
# Words that start a new phrase: conjunctions, relative words and prepositions ("... is | that they",
# "... famous | for its").
_JOINING_WORDS = frozenset(
    "and but or so that which who because when while with where if than as to "
    "for from about in on at by into like after before during through".split()
)
# Words a piece cut at its word cap does not end on: an article, a possessive or a preposition belongs to the
# word after it ("Today is a | day", "The capital of | France" were said with a falling end); the cap then
# takes one word more.
_LEADING_WORDS = frozenset(
    "a an the my your his her its our their this these those some any no every of to in on at for with from by "
    "about into".split()
)
# The first piece is what the user waits for: the LLM writes it and TTS speaks it before any audio
# starts, so it is short (the setting ``first_piece_words``, this by default); the price is a short first
# sentence said in two pieces. A joining word ends the piece from two words before it (at least 3).
# 4 -> 3 words with the leading words above: one user's heard p50 516 -> 500 ms, four users' 855 -> 710 ms,
# no underruns (app/bench/results/turn_taking.md).
FIRST_PHRASE_MAX_WORDS = 3
# The second piece is written and spoken while the first one plays (about a second of audio), so it
# is at most twice the first: it ends at a clause break once SECOND_PHRASE_CLAUSE_WORDS long, before a
# joining word after first_piece_words, and anywhere at twice first_piece_words
# (underruns: app/bench/results/turn_taking.md).
SECOND_PHRASE_CLAUSE_WORDS = 3
# Later pieces end at sentences, but a run-on sentence (small LLMs write 100-word ones) is cut
# too: speaking it whole would leave the listener in silence while it is written and
# synthesized (an underrun). Cut at a clause break or before a joining word past
# LATER_PHRASE_WORDS, or anywhere at LATER_PHRASE_MAX_WORDS.
LATER_PHRASE_WORDS = 10
LATER_PHRASE_MAX_WORDS = 20
_MARKUP = re.compile(r"[*_#`~>|]+|\[(?:[^\]]*)\]\((?:[^)]*)\)")
_SPACES = re.compile(r"\s+")


def speakable(text: str) -> str:
    """Strip markdown and symbols a voice should not read out."""
    return _SPACES.sub(" ", _MARKUP.sub(" ", text)).strip()


class SentenceSplitter:
    """Accumulates streamed text and releases whole sentences as soon as they end.

    ``first_clause_chars``: while nothing has been released yet, also release at a clause
    break (comma, semicolon, ...) once this many characters are buffered, so the first audio
    starts early on a long opening sentence; and cut a first sentence without one before a
    joining word, or after ``first_piece_words`` words; and cut the second piece, which has only
    the first one's audio to be ready in, after at most twice that. 0 disables all three.
    """

    def __init__(
        self, min_chars: int = 12, first_clause_chars: int = 0, first_piece_words: int = FIRST_PHRASE_MAX_WORDS
    ) -> None:
        self.min_chars = min_chars
        self.first_clause_chars = first_clause_chars
        self.first_piece_words = first_piece_words
        self._buffer = ""
        self._released = 0

    def push(self, delta: str) -> list[str]:
        self._buffer += delta
        pieces: list[str] = []
        while True:
            piece = self._next_piece()
            if piece is None:
                return pieces
            pieces.append(piece)

    def flush(self) -> str | None:
        rest, self._buffer = self._buffer.strip(), ""
        return rest or None

    def forget_last(self, chars: int) -> None:
        """Drop the last ``chars`` characters pushed, as far as they are not released yet (a loop to leave unsaid)."""
        self._buffer = self._buffer[: max(0, len(self._buffer) - chars)]

    def _next_piece(self) -> str | None:
        for match in _SENTENCE_END.finditer(self._buffer):
            candidate = self._buffer[: match.end()].strip()
            if spoken_length(candidate) < self.min_chars:
                continue
            last_word = candidate.rsplit(None, 1)[-1].lower()
            if last_word in _ABBREVIATIONS or re.fullmatch(r"\d{1,2}\.", last_word):
                continue  # "Dr." or a list number, not the end of a sentence
            return self._take(match.end())
        if self._released == 0:
            if self.first_clause_chars and spoken_length(self._buffer) >= self.first_clause_chars:
                most = self.first_piece_words
                return self._phrase(self.min_chars, 0, min(most, max(3, most - 2)), most)
            return None
        if self._released == 1 and self.first_clause_chars:
            most = self.first_piece_words
            return self._phrase(0, SECOND_PHRASE_CLAUSE_WORDS, most + 1, 2 * most)
        return self._phrase(0, LATER_PHRASE_WORDS, LATER_PHRASE_WORDS, LATER_PHRASE_MAX_WORDS)

    def _phrase(self, clause_chars: int, clause_words: int, min_words: int, max_words: int) -> str | None:
        """No sentence end yet: a piece that ends at a clause break (once ``clause_chars`` and
        ``clause_words`` long), else before a joining word ("... is | that they ...") once it has
        ``min_words`` words, or anywhere after ``max_words`` (one more where the last is a leading word, "a")."""
        for match in _CLAUSE_END.finditer(self._buffer):
            piece = self._buffer[: match.end()]
            if spoken_length(piece) >= clause_chars and len(piece.split()) >= clause_words:
                return self._take(match.end())
        spans = [match.span() for match in re.finditer(r"\S+", self._buffer)]
        complete = len(spans) - (not self._buffer[-1:].isspace())  # the last word may still grow
        for index in range(min_words, len(spans)):
            # word ``index`` has begun, so the piece before it is whole: the word cap needs no more
            # (a token sooner than waiting for that word to end); a joining word must be whole
            # ("for", not "format").
            joins = index < complete and self._buffer[slice(*spans[index])].lower() in _JOINING_WORDS
            if joins:
                return self._take(spans[index - 1][1])
            if index >= max_words:
                last = self._buffer[slice(*spans[index - 1])].lower().strip(",;:\"'")
                if index == max_words and last in _LEADING_WORDS:
                    continue  # one word more: the piece ends on the word it leads to
                return self._take(spans[index - 1][1])
        return None

    def _take(self, end: int) -> str:
        piece, self._buffer = self._buffer[:end].strip(), self._buffer[end:]
        self._released += 1
        return piece


# A run of the same few words said again and again ("a big ol' ol' ol' ol'", "the I.Pauli, and the
# I.Pauli, and the I.Pauli"): the bundled SmolLM2-135M falls into such loops inside one run-on
# piece, where a repeated *piece* is never seen (``Reply`` ends a reply at one), and they ran for
# seconds of audio. A unit of up to LOOP_UNIT_MAX_WORDS words said LOOP_TIMES times in a row is a
# loop; a single word needs LOOP_TIMES_ONE_WORD ("no, no, no" and "very, very, very" are speech).
LOOP_UNIT_MAX_WORDS = 8
LOOP_TIMES = 3
LOOP_TIMES_ONE_WORD = 4
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")  # a word, as ``words`` counts them
_TRAILING_MARKS = re.compile(r"[^\w\s]*")
_BREAK_MARK = re.compile(r"[,;:.!?…，、；：。！？]")


def _word_spans(text: str) -> list[tuple[int, str]]:
    """(where each word ends, the word as ``words`` spells it) for every word of ``text``."""
    return [(match.end(), match.group().lower().replace("’", "'")) for match in _WORD.finditer(text)]


def loop_end(text: str) -> int | None:
    """Where a loop in ``text`` should have stopped (after the unit's first time), or None without one.

    Only whole words count (the last may still grow), and a loop of digits is a number ("0.0.0.0").
    Checked at each streamed delta, so only runs ending in the last few words are looked for.
    """
    spans = _word_spans(text)
    if spans and spans[-1][0] == len(text):
        spans.pop()  # the last word may still grow ("ol" -> "olive")
    said = [word for _, word in spans]
    for end in range(max(0, len(said) - LOOP_UNIT_MAX_WORDS), len(said) + 1):
        for unit in range(1, LOOP_UNIT_MAX_WORDS + 1):
            times = LOOP_TIMES_ONE_WORD if unit == 1 else LOOP_TIMES
            start = end - unit * times
            if start < 0:
                break
            if all(said[i] == said[i + unit] for i in range(start, end - unit)):
                if not all(word.isdigit() for word in said[start : start + unit]):
                    return _loop_cut(text, [end for end, _ in spans[start + unit - 1 : start + 2 * unit - 1]])
    return None


def _loop_cut(text: str, word_ends: list[int]) -> int:
    """Where to stop in a loop, given where its unit's first time ends and the unit's next words end:
    at the first of them followed by a comma or full stop ("the I.Pauli, | and the I.Pauli"), else at
    the first; with its marks ("ol'" keeps its apostrophe)."""
    cuts = [_TRAILING_MARKS.match(text, end).end() for end in word_ends]
    for cut, end in zip(cuts, word_ends, strict=True):
        if _BREAK_MARK.search(text, end, cut) and (cut == len(text) or text[cut].isspace()):
            return cut
    return cuts[0]


# Whisper's runaway on a short or padded clip: "Yes. Yes. Yes. Yes. Yes.", "Why is the sky blue? Why is
# the sky blue? Why" (decoded until its token cap). A transcript that *ends* in a unit said again
# (twice; a single word LOOP_TIMES_ONE_WORD times), perhaps with a cut-off start of it once more, is
# kept up to the unit's first time (app/bench/results/asr_window.md).
TRANSCRIPT_LOOP_TIMES = 2
# The token cap can also end the runaway's *second* time: "What is the capital look, France? What is
# the capital look," (a one-user benchmark turn: that trailing comma held the endpoint for the
# unfinished-clause 1200 ms, and the LLM got the question one and a half times). When the transcript
# has more words than its audio can hold (RUNAWAY_WORDS_PER_S: people say about 2.5-4 a second), and
# its last sentence is followed only by its own first RESTART_MIN_WORDS or more words, it ends at that
# sentence. (A person who restarts, "I want to go. I want to ...", said those words in that time, and
# the trailing "to" keeps the endpoint waiting for the rest.)
RESTART_MIN_WORDS = 2
RUNAWAY_WORDS_PER_S = 4.5


def without_trailing_loop(transcript: str, audio_s: float | None = None) -> str:
    """``transcript`` without the repeats it ends in (see TRANSCRIPT_LOOP_TIMES; with the length of
    the audio it was heard in, ``audio_s``, also RESTART_MIN_WORDS); other text unchanged.

    Only a loop that runs to the end counts, so a restart inside a sentence ("I think that I think
    that we should go") and speech people repeat ("no, no, no") stay as they were heard.
    """
    transcript = _without_repeats(transcript)
    if audio_s is not None and len(words(transcript)) > RUNAWAY_WORDS_PER_S * audio_s:
        transcript = _without_cut_off_repeat(transcript)
    return transcript


def _without_cut_off_repeat(transcript: str) -> str:
    """``transcript`` up to its last sentence when only the start of that sentence follows it."""
    ends = [match.end() for match in _SENTENCE_END.finditer(transcript)]
    if not ends:
        return transcript
    before = ends[-2] if len(ends) > 1 else 0
    sentence, after = words(transcript[before : ends[-1]]), words(transcript[ends[-1] :])
    if RESTART_MIN_WORDS <= len(after) < len(sentence) and sentence[: len(after)] == after:
        return transcript[: ends[-1]].strip()
    return transcript


def _without_repeats(transcript: str) -> str:
    spans = _word_spans(transcript)
    said = [word for _, word in spans]
    for unit in range(1, LOOP_UNIT_MAX_WORDS + 1):
        times = LOOP_TIMES_ONE_WORD if unit == 1 else TRANSCRIPT_LOOP_TIMES
        start = len(said) - unit  # the loop's first word: as far back as the words repeat with this period
        while start > 0 and said[start - 1] == said[start - 1 + unit]:
            start -= 1
        if start < 0 or len(said) - start < unit * times or all(word.isdigit() for word in said[start:]):
            continue  # (a run of digits is a number: "1 2 1 2 1 2")
        # end the first time at its last comma or full stop ("Why is the sky blue?"), else after it
        ends = [end for end, _ in spans[start : start + unit]]
        cuts = [_TRAILING_MARKS.match(transcript, end).end() for end in ends]
        marked = [cut for cut, end in zip(cuts, ends, strict=True) if _BREAK_MARK.search(transcript, end, cut)]
        return transcript[: (marked or cuts)[-1]].strip()
    return transcript


def text_after(text: str, said: str) -> str:
    """What ``text`` adds to ``said`` when it starts with it (a continued turn's new words), else all of ``text``."""
    return text[len(said) :].strip() if said and text.startswith(said) else text


def spoken_length(text: str) -> int:
    """Length in Latin-letter equivalents: a CJK character says about as much as three letters."""
    return sum(3 if ord(char) >= 0x2E80 else 1 for char in text)


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, in any script ("spät", "ciudad"; a run of CJK is one word)."""
    return _WORD.findall(text.lower().replace("’", "'"))
