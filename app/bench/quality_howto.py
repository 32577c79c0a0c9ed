"""`parley bench quality`: how-to requests, each typed in a fresh conversation: answered, and for the ear.

A how-to is where a small model writes a page: a recipe as a numbered list with bold headings, read aloud for
30 s (a pancake recipe did, before replies had a speech budget). Each request is scored from what the wire shows:

* ``on_topic``: the reply names at least one thing any answer to it would (``expect``, whole words, as the
  conversations' answers are matched): an answer, not a decline or a change of subject;
* ``markup``: the reply holds what a page has and speech has not: list numbering or bullets at a line's start,
  markdown emphasis or headings, a code fence (the system prompt asks for none);
* its length: seconds of speech (from its length, as the rest of the benchmark counts them) and whether the
  length guard ended it (a reply past its speech budget ends at a sentence);
* a call to a tool: none of these asks for one.

All of them were written before the first run with them and none has been used to change a setting (the whole set
is held out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from app import protocol
from app.bench.quality_score import mentions
from app.voice.runaway import SPOKEN_CHARS_PER_S

PAGE_MARKUP = re.compile(r"(?m)^\s*(?:\d+[.)]|[-*•])\s|\*\*|__|^\s*#{1,6}\s|```")


@dataclass(frozen=True)
class HowTo:
    text: str
    expect: tuple[str, ...]  # any one of them, said, makes it an answer


HOW_TOS: tuple[HowTo, ...] = (
    HowTo("How do I make pancakes?", ("flour", "egg", "eggs", "milk", "batter", "pan")),
    HowTo("How do I boil an egg?", ("water", "minutes", "boil", "boiling", "pot", "saucepan")),
    HowTo("How do I make a cup of tea?", ("water", "kettle", "tea bag", "teabag", "boil", "steep", "brew")),
    HowTo("How can I fall asleep faster?", ("bed", "screen", "screens", "light", "relax", "breathing", "caffeine")),
    HowTo("How do I change a flat tire?", ("jack", "spare", "wheel", "lug", "nuts", "bolts")),
    HowTo("How do I tie a tie?", ("knot", "loop", "wide end", "narrow end", "neck", "collar")),
    HowTo("How do I clean a cast iron pan?", ("water", "oil", "soap", "dry", "salt", "scrub")),
    HowTo("How do I plant tomato seeds?", ("soil", "water", "pot", "sun", "sunlight", "deep")),
    HowTo("How do I restart my wifi router?", ("button", "unplug", "power", "plug", "seconds", "cable")),
    HowTo("How do I cook rice?", ("water", "cup", "cups", "boil", "simmer", "cover", "minutes")),
)


@dataclass
class HowToRecord:
    ask: HowTo
    reply: str = ""
    calls: list[protocol.ToolDone] = field(default_factory=list)
    guards: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def on_topic(self) -> bool:
        return mentions(self.reply, self.ask.expect)

    @property
    def markup(self) -> bool:
        return PAGE_MARKUP.search(self.reply) is not None

    @property
    def speech_s(self) -> float:
        return len(self.reply) / SPOKEN_CHARS_PER_S

    def to_json(self) -> dict:
        return {
            "text": self.ask.text,
            "reply": self.reply,
            "on_topic": self.on_topic,
            "markup": self.markup,
            "speech_s": round(self.speech_s, 1),
            "calls": [{"name": c.name, "status": c.status} for c in self.calls],
            "guards": {name: n for name, n in self.guards.items() if n},
            "error": self.error,
        }


def summarize_how_tos(records: list[HowToRecord]) -> dict:
    seconds = sorted(r.speech_s for r in records)
    at = lambda q: seconds[min(len(seconds) - 1, int(q * len(seconds)))]  # noqa: E731
    return {
        "how_tos_on_topic": sum(r.on_topic for r in records),
        "how_tos_asked": len(records),
        "how_tos_with_markup": sum(r.markup for r in records),
        "how_tos_speech_s_p50": round(at(0.5), 1) if seconds else None,
        "how_tos_speech_s_p90": round(at(0.9), 1) if seconds else None,
        "how_tos_over_20_s": sum(s > 20 for s in seconds),
        "how_tos_ended_by_length_guard": sum(bool(r.guards.get("guard_length")) for r in records),
        "how_tos_with_a_call": sum(bool(r.calls) for r in records),
        "how_to_errors": sum(r.error is not None for r in records),
    }


def describe_how_to(record: HowToRecord) -> str:
    mark = "ok " if record.on_topic and not record.markup else "BAD"
    notes = [f"{record.speech_s:.1f} s"] + ["markup"] * record.markup + [c.name for c in record.calls]
    return f"  {mark} {record.ask.text!r} ({', '.join(notes)}) -> {record.reply[:80]!r}"


def print_how_tos(summary: dict) -> None:
    print(
        f"\nhow-to requests (a fresh conversation each): answered {summary['how_tos_on_topic']}/"
        f"{summary['how_tos_asked']}, with page markup {summary['how_tos_with_markup']}, speech p50 / p90 "
        f"{summary['how_tos_speech_s_p50']} / {summary['how_tos_speech_s_p90']} s, over 20 s "
        f"{summary['how_tos_over_20_s']}, ended by the length guard {summary['how_tos_ended_by_length_guard']}, "
        f"made a call {summary['how_tos_with_a_call']}"
    )
