"""`parley bench quality`'s scoring: answers matched, defects found, figures summed and printed.

Each function takes text and the question set's ``Ask``s only (no server), so the tests check
them on hand-written transcripts (tests/bench/test_bench_quality.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from app import protocol
from app.bench.quality_set import QUESTIONS, SCORED, Ask
from app.voice.text import words
from engine.metrics import percentile

COPY_JACCARD = 0.8  # word-set overlap at which two replies are the same reply
COPY_OPENING_WORDS = 8  # or: the same first words
SHORT_WORDS = 3  # a reply under this many words is short (but to a thanks or goodbye)

_UNITS = {
    name: value
    for value, name in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    name: 10 * value for value, name in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)
}


# ------------------------------------------------------------------ matching
def _read_number(tokens: list[str], start: int) -> tuple[int, int]:
    """The number written in words from ``tokens[start]`` ("twenty four", "one hundred and five"), and where it ends."""
    value, index = 0, start
    while index < len(tokens):
        token, below_100 = tokens[index], value % 100
        after_tens = below_100 >= 20 and below_100 % 10 == 0  # "twenty | four"
        after_hundreds = value >= 100 and below_100 == 0  # "one hundred | five"
        if token in _UNITS and (index == start or after_tens or after_hundreds):
            value += _UNITS[token]
        elif token in _TENS and (index == start or after_hundreds):
            value += _TENS[token]
        elif token == "hundred" and value < 100:
            value = max(value, 1) * 100
        elif not (token == "and" and after_hundreds and _is_number_word(tokens[index + 1 : index + 2])):
            break
        index += 1
    return value, index


def _is_number_word(tokens: list[str]) -> bool:
    return bool(tokens) and (tokens[0] in _UNITS or tokens[0] in _TENS or tokens[0] == "hundred")


def normalize(text: str) -> list[str]:
    """Lower-case words without punctuation, numbers in digits ("Twenty-four hours" -> ["24", "hours"])."""
    tokens, out, index = words(text), [], 0
    while index < len(tokens):
        if _is_number_word(tokens[index:]):
            value, index = _read_number(tokens, index)
            out.append(str(value))
        else:
            out.append(tokens[index])
            index += 1
    return out


def _same_word(said: str, answer: str) -> bool:
    """``said`` is ``answer``, or its plural ("eggs" for "egg"); a number only as itself."""
    return said == answer or (not answer.isdigit() and said in (answer + "s", answer + "es"))


def mentions(text: str, answers: tuple[str, ...]) -> bool:
    """``text`` contains one of ``answers`` as whole words (case-insensitive, numbers as digits or words)."""
    said = normalize(text)
    for answer in answers:
        wanted = normalize(answer)
        for start in range(len(said) - len(wanted) + 1):
            if wanted and all(_same_word(s, w) for s, w in zip(said[start : start + len(wanted)], wanted, strict=True)):
                return True
    return False


def near_copy(reply: str, earlier: str) -> bool:
    """The same reply again: word sets overlapping by COPY_JACCARD, or the same first COPY_OPENING_WORDS words."""
    a, b = words(reply), words(earlier)
    if not a or not b:
        return False
    overlap = len(set(a) & set(b)) / len(set(a) | set(b))
    opening = COPY_OPENING_WORDS
    return overlap >= COPY_JACCARD or (min(len(a), len(b)) >= opening and a[:opening] == b[:opening])


def repeats_cut_reply(reply: str, cut: str) -> bool:
    """``reply`` says again a reply that was cut short: a near copy, or it opens with the cut reply's
    first words (all of them when it was cut before COPY_OPENING_WORDS, if at least SHORT_WORDS)."""
    opening = words(cut)[:COPY_OPENING_WORDS]
    return near_copy(reply, cut) or (len(opening) >= SHORT_WORDS and words(reply)[: len(opening)] == opening)


def answers_earlier(reply: str, ask: Ask, earlier: list[Ask]) -> int | None:
    """Which of the ``earlier`` questions (their index) ``reply`` answers instead of ``ask``; None if it does not.

    Only when the reply lacks the right answer, and never by a word the question itself says. The
    earlier questions are facts and follow-ups: a name the user told may well be said again."""
    if mentions(reply, ask.answers):
        return None
    for index in range(len(earlier) - 1, -1, -1):
        before = earlier[index]
        if before.kind not in QUESTIONS or before.answers == ask.answers or mentions(ask.text, before.answers):
            continue
        if mentions(reply, before.answers):
            return index
    return None


def is_short(reply: str, ask: Ask) -> bool:
    return ask.kind != "closing" and len(words(reply)) < SHORT_WORDS


# ------------------------------------------------------------------ records and scores
@dataclass
class TurnRecord:
    """One typed turn, its reply as the server ended it, and its scores (``score_conversation``)."""

    conversation: int | None  # None: asked alone
    turn: int
    ask: Ask
    reply: str
    written: str = ""  # everything the LLM wrote (more than ``reply`` when the reply was cut)
    interrupted: bool = False
    guards: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    history_left_out: bool = False  # the server wrote the reply without the conversation (``history_relevance_nats``)
    history_gain_nats: float | None = None  # what the conversation added to the words, where the server weighed it
    asked_in_full: str | None = None  # an elliptical follow-up as the server asked the LLM it (setting follow_ups)
    right: bool | None = None  # (a question with an answer)
    copy_of: int | None = None  # the earlier turn this reply copies
    answers_turn: int | None = None  # the earlier turn whose question this reply answers instead
    short: bool = False
    repeats_cut_reply: bool | None = None  # (the turn after a cancelled one)

    @property
    def counted(self) -> bool:
        """A whole reply: not a cancelled one (its length and wording are the cancel's)."""
        return self.ask.kind != "interrupt"

    def to_json(self) -> dict:
        row = asdict(self)
        row["ask"] = {"text": self.ask.text, "kind": self.ask.kind, "answers": list(self.ask.answers)}
        return row


def score_turn(record: TurnRecord) -> None:
    """The scores a reply has on its own: right (a question), short."""
    if record.ask.kind in SCORED:
        record.right = mentions(record.reply, record.ask.answers)
    record.short = record.counted and is_short(record.reply, record.ask)


def score_in_conversation(record: TurnRecord, earlier: list[TurnRecord]) -> None:
    """Score a reply of a conversation on its own and against the ``earlier`` turns of it."""
    score_turn(record)
    if record.counted:
        copied = [e.turn for e in earlier if e.counted and near_copy(record.reply, e.reply)]
        record.copy_of = copied[0] if copied else None
    if record.ask.kind in SCORED:
        answered = answers_earlier(record.reply, record.ask, [e.ask for e in earlier])
        record.answers_turn = None if answered is None else earlier[answered].turn
    if earlier and not earlier[-1].counted:
        record.repeats_cut_reply = repeats_cut_reply(record.reply, earlier[-1].written or earlier[-1].reply)


def score_conversation(records: list[TurnRecord]) -> None:
    """Score each reply of one conversation, in order."""
    for index, record in enumerate(records):
        score_in_conversation(record, records[:index])


def describe(record: TurnRecord) -> str:
    """One line: where the turn was, what was typed, what came back, and what is wrong with it."""
    where = "alone" if record.conversation is None else f"c{record.conversation + 1}"
    found = [
        {True: "right", False: "WRONG"}.get(record.right, ""),
        "" if record.copy_of is None else f"copies t{record.copy_of + 1}",
        "" if record.answers_turn is None else f"answers t{record.answers_turn + 1}",
        "short" if record.short else "",
        "repeats the cut reply" if record.repeats_cut_reply else "",
        "cut" if record.interrupted else "",
        *(name.removeprefix("guard_") for name, times in record.guards.items() if times),
        f"error: {record.error}" if record.error else "",
    ]
    reply = record.reply if len(record.reply) <= 90 else record.reply[:87] + "..."
    flags = ", ".join(flag for flag in found if flag)
    return f"{where} t{record.turn + 1:<3}{record.ask.kind:<10}{record.ask.text} -> {reply!r}  [{flags}]"


def _count(records: list[TurnRecord], what: Callable[[TurnRecord], bool]) -> int:
    return sum(1 for record in records if what(record))


def _words_per_reply(records: list[TurnRecord]) -> tuple[float | None, float | None]:
    lengths = [len(words(r.reply)) for r in records if r.counted]
    return (statistics.median(lengths) if lengths else None), percentile(lengths, 90)


def summarize(conversations: list[list[TurnRecord]], alone: list[TurnRecord]) -> dict:
    """The benchmark's figures, all counts or ratios of counts (flat keys, for comparing runs)."""
    talk = [record for conversation in conversations for record in conversation]
    facts = [r for r in talk if r.ask.kind == "fact"]
    alone_facts = {r.ask.text: r for r in alone if r.ask.kind == "fact"}
    paired = [(r, alone_facts[r.ask.text]) for r in facts if r.ask.text in alone_facts]
    scored = [r for r in talk if r.ask.kind in SCORED]
    after_cut = [r for r in talk if r.repeats_cut_reply is not None]
    summary: dict = {
        "conversations": len(conversations),
        "conversation_turns": len(talk),
        "questions_alone": len(alone),
        "facts_right_in_conversation": _count(facts, lambda r: r.right),
        "facts_asked_in_conversation": len(facts),
        "facts_right_alone": _count(list(alone_facts.values()), lambda r: r.right),
        "facts_asked_alone": len(alone_facts),
        "facts_right_alone_wrong_in_conversation": sum(1 for c, a in paired if a.right and not c.right),
        "facts_wrong_alone_right_in_conversation": sum(1 for c, a in paired if c.right and not a.right),
        "user_facts_recalled": _count(talk, lambda r: r.ask.kind == "recall" and r.right),
        "user_facts_asked": _count(talk, lambda r: r.ask.kind == "recall"),
        "follow_ups_right": _count(talk, lambda r: r.ask.kind == "follow_up" and r.right),
        "follow_ups_asked": _count(talk, lambda r: r.ask.kind == "follow_up"),
        "follow_ups_asked_in_full": _count(talk, lambda r: r.ask.kind == "follow_up" and r.asked_in_full is not None),
        "questions_asked_in_full_not_follow_ups": _count(
            talk, lambda r: r.ask.kind != "follow_up" and r.asked_in_full is not None
        ),
        "follow_ups_in_full_right_alone": _count(alone, lambda r: r.ask.kind == "follow_up" and r.right),
        "follow_ups_in_full_asked_alone": _count(alone, lambda r: r.ask.kind == "follow_up"),
        "copied_replies": _count(talk, lambda r: r.copy_of is not None),
        "replies_that_may_copy": _count(talk, lambda r: r.counted and r.turn > 0),
        "answers_to_an_earlier_question": _count(scored, lambda r: r.answers_turn is not None),
        "questions_in_conversation": len(scored),
        "short_replies_in_conversation": _count(talk, lambda r: r.short),
        "short_replies_alone": _count(alone, lambda r: r.short),
        "replies_that_may_be_short_in_conversation": _count(talk, lambda r: r.counted and r.ask.kind != "closing"),
        "cancelled_replies": len(after_cut),
        "cancelled_replies_cut": _count(talk, lambda r: r.ask.kind == "interrupt" and r.interrupted),
        "replies_repeating_the_cancelled_one": _count(after_cut, lambda r: r.repeats_cut_reply),
        "errors": _count(talk + alone, lambda r: r.error is not None),
        **{
            f"{kind}_without_the_conversation": _count(talk, lambda r, k=kind: r.ask.kind == k and r.history_left_out)
            for kind in ("fact", "follow_up", "recall")
        },
    }
    for where, records in (("in_conversation", talk), ("alone", alone)):
        median, p90 = _words_per_reply(records)
        summary[f"words_per_reply_median_{where}"], summary[f"words_per_reply_p90_{where}"] = median, p90
        for name in protocol.GUARD_FIELDS:
            summary[f"{name}_{where}"] = sum(r.guards.get(name, 0) for r in records)
        summary[f"replies_cut_by_a_guard_{where}"] = _count(records, lambda r: any(r.guards.values()))
    return summary


def print_table(summary: dict) -> None:
    def ratio(right: int, asked: int) -> str:
        return f"{right}/{asked} ({100 * right / asked:.0f}%)" if asked else "-"

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    s = summary
    print(
        f"\n{s['conversations']} conversations ({s['conversation_turns']} turns), {s['questions_alone']} questions alone"
    )
    print(f"{'':<44}{'in conversation':>18}{'alone':>18}")
    rows = [
        (
            "facts right",
            ratio(s["facts_right_in_conversation"], s["facts_asked_in_conversation"]),
            ratio(s["facts_right_alone"], s["facts_asked_alone"]),
        ),
        (
            "follow-ups right (alone: asked in full)",
            ratio(s["follow_ups_right"], s["follow_ups_asked"]),
            ratio(s["follow_ups_in_full_right_alone"], s["follow_ups_in_full_asked_alone"]),
        ),
        (
            "replies under three words",
            ratio(s["short_replies_in_conversation"], s["replies_that_may_be_short_in_conversation"]),
            ratio(s["short_replies_alone"], s["questions_alone"]),
        ),
        (
            "words per reply (median / p90)",
            f"{number(s['words_per_reply_median_in_conversation'])} / {number(s['words_per_reply_p90_in_conversation'])}",
            f"{number(s['words_per_reply_median_alone'])} / {number(s['words_per_reply_p90_alone'])}",
        ),
        *(
            (
                f"reply guard fired: {name.removeprefix('guard_')}",
                str(s[f"{name}_in_conversation"]),
                str(s[f"{name}_alone"]),
            )
            for name in protocol.GUARD_FIELDS
        ),
        (
            "replies cut by a guard",
            str(s["replies_cut_by_a_guard_in_conversation"]),
            str(s["replies_cut_by_a_guard_alone"]),
        ),
    ]
    for label, in_conversation, alone in rows:
        print(f"{label:<44}{in_conversation:>18}{alone:>18}")
    print(
        f"facts right alone but wrong in conversation {s['facts_right_alone_wrong_in_conversation']}, "
        f"the other way round {s['facts_wrong_alone_right_in_conversation']}"
    )
    print(f"user facts recalled {ratio(s['user_facts_recalled'], s['user_facts_asked'])}")
    print(
        f"follow-ups the server asked in full (follow_ups) {ratio(s['follow_ups_asked_in_full'], s['follow_ups_asked'])}"
        f", other turns it rewrote {s['questions_asked_in_full_not_follow_ups']}"
    )
    print(
        "answered without the conversation (history_relevance_nats): "
        f"facts {ratio(s['fact_without_the_conversation'], s['facts_asked_in_conversation'])}, "
        f"follow-ups {ratio(s['follow_up_without_the_conversation'], s['follow_ups_asked'])}, "
        f"user facts asked back {ratio(s['recall_without_the_conversation'], s['user_facts_asked'])}"
    )
    print(f"copied replies {ratio(s['copied_replies'], s['replies_that_may_copy'])}")
    print(
        f"answers to an earlier question {ratio(s['answers_to_an_earlier_question'], s['questions_in_conversation'])}"
    )
    print(
        f"cancelled replies cut {s['cancelled_replies_cut']}/{s['cancelled_replies']}, next reply repeating the "
        f"cancelled one {s['replies_repeating_the_cancelled_one']}/{s['cancelled_replies']}"
    )
    if s["errors"]:
        print(f"warning: {s['errors']} turns failed (see the JSON)")
