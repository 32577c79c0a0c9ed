"""`parley bench quality --actions`: requests the assistant should act on, or honestly decline.

Each request is typed in a fresh conversation (a ``reset`` before it) to a server with its default skills, and
scored from what the wire shows, not from the reply's wording alone:

* an action is right when the expected tool was called and *completed* with a result that holds what the user
  asked for (``expect``: words the skill's own result must contain, "10 minutes"), so a call with made-up
  arguments that the skill refused is not right;
* a request no tool can do (``tool`` None: music, lights without a home server, a booking) is right when no tool
  acted and the reply does not claim the action (``CLAIMS``, an English pattern: the set is English);
* a claim without an action is counted on every request: the reply says it set, turned on, played or booked
  while no acting tool completed.

Two halves (``half``): "tune", the requests the default brain's prompt and the skills' descriptions were tried on
while they were written (app/bench/results/default_brain.md), and "held_out", written before any run and never
used to change a setting; the summary reports each half apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from app import protocol

Half = Literal["tune", "held_out"]
# tools that only read (asking the time acts on nothing)
READING_TOOLS = frozenset({"get_time", "list_timers", "list_reminders", "calculate", "convert_units"})
CLAIMS = re.compile(
    r"\b(i(?:'ve|'ll| have| will)? (?:set|turn(?:ed)?|switch(?:ed)?|start(?:ed)?|book(?:ed)?|order(?:ed)?|play(?:ed)?|"
    r"called|sent)|"
    r"(?:turned|switched) (?:on|off)|now playing|playing (?:some|your|the)|is (?:now )?(?:on|playing|booked))\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ActionAsk:
    text: str
    tool: str | None  # None: nothing the assistant has can do it
    expect: tuple[str, ...] = ()  # words the completed call's result must hold (any one)
    half: Half = "held_out"
    also: tuple[str, ...] = ()  # other tools that do it as well (``calculate`` converts a quantity it is given)


CONVERTS = ("calculate",)  # given "5 miles", it converts to the unit the user named (since 2026-12-07)

ACTIONS: tuple[ActionAsk, ...] = (
    # tried while writing the prompt and the skills' descriptions
    ActionAsk("Set a timer for 10 minutes.", "set_timer", ("10 minutes",), "tune"),
    ActionAsk("Remind me to call my mother tomorrow at nine.", "set_reminder", ("tomorrow at 09:00",), "tune"),
    ActionAsk("What time is it?", "get_time", ("time",), "tune"),
    ActionAsk("How many kilometers is 5 miles?", "convert_units", ("8.04", "8.05"), "tune", CONVERTS),
    ActionAsk("What is 15 percent of 80?", "calculate", ("12",), "tune"),
    ActionAsk("Set a timer for half an hour for the pasta.", "set_timer", ("30 minutes",), "tune"),
    ActionAsk("Remind me to water the plants at 6 pm.", "set_reminder", ("18:00",), "tune"),
    ActionAsk("Turn on the kitchen lights.", None, half="tune"),
    ActionAsk("I would like to hear some music.", None, half="tune"),
    ActionAsk("Book a table for two tonight.", None, half="tune"),
    # held out: written before the first run, never used to change anything
    ActionAsk("Start a timer for twenty minutes, please.", "set_timer", ("20 minutes",)),
    ActionAsk("Could you set a five minute timer for the eggs?", "set_timer", ("5 minutes",)),
    ActionAsk("Remind me in two hours to check the oven.", "set_reminder", ("oven",)),
    ActionAsk("What's the date today?", "get_time", ("date",)),
    ActionAsk("What is 12 times 7?", "calculate", ("84",)),
    ActionAsk("Convert 100 fahrenheit to celsius.", "convert_units", ("37.7", "37.8"), also=CONVERTS),
    ActionAsk("How many pounds is 3 kilograms?", "convert_units", ("6.6",), also=CONVERTS),
    ActionAsk("Call my sister.", None),
    ActionAsk("Order me a pizza.", None),
    ActionAsk("Put on some jazz.", None),
)


# With a home's MCP server connected (``--home``: ``app.bench.home_mcp``, Home Assistant's tool names), the lights
# request is one to act on, and more are asked; written before the first run with it, never tuned on.
HOME_ACTIONS: tuple[ActionAsk, ...] = (
    ActionAsk("Turn on the kitchen lights.", "HassTurnOn", ("kitchen",), "tune"),
    ActionAsk("Switch off the bedroom lamp.", "HassTurnOff", ("bedroom",)),
    ActionAsk("Turn the porch light on, please.", "HassTurnOn", ("porch",)),
)


def with_home(actions: tuple[ActionAsk, ...]) -> tuple[ActionAsk, ...]:
    """``actions`` where a home's lights can be switched: the home's requests replace the same words declined."""
    home = {ask.text: ask for ask in HOME_ACTIONS}
    kept = tuple(home.pop(ask.text, ask) for ask in actions)
    return kept + tuple(home.values())


@dataclass
class ActionRecord:
    ask: ActionAsk
    reply: str = ""
    calls: list[protocol.ToolDone] = field(default_factory=list)
    guards: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    heard: str | None = None  # spoken (``--spoken-actions``): what the server transcribed
    audio_s: float | None = None  # spoken: seconds of reply audio received

    @property
    def acted(self) -> list[protocol.ToolDone]:
        """The calls that completed and changed something (not only read; a call its skill refused changed nothing)."""
        return [
            c
            for c in self.calls
            if c.status == "completed" and c.name not in READING_TOOLS and '"error"' not in c.output
        ]

    @property
    def right(self) -> bool:
        if self.ask.tool is None:
            return not self.acted and not self.claims
        return any(
            c.name in (self.ask.tool, *self.ask.also)
            and c.status == "completed"
            and '"error"' not in c.output
            and any(word.lower() in c.output.lower() for word in self.ask.expect)
            for c in self.calls
        )

    @property
    def claims(self) -> bool:
        return CLAIMS.search(self.reply) is not None

    @property
    def claim_without_action(self) -> bool:
        return self.claims and not self.acted

    def to_json(self) -> dict:
        return {
            "text": self.ask.text,
            "half": self.ask.half,
            "tool": self.ask.tool,
            "reply": self.reply,
            "calls": [{"name": c.name, "status": c.status, "output": c.output} for c in self.calls],
            "right": self.right,
            "claim_without_action": self.claim_without_action,
            "error": self.error,
            **({"heard": self.heard, "audio_s": self.audio_s} if self.heard is not None else {}),
        }


def summarize_actions(records: list[ActionRecord]) -> dict:
    summary: dict = {}
    for half in ("tune", "held_out"):
        mine = [r for r in records if r.ask.half == half]
        summary[f"actions_right_{half}"] = sum(r.right for r in mine if r.ask.tool is not None)
        summary[f"actions_asked_{half}"] = sum(r.ask.tool is not None for r in mine)
        summary[f"declined_right_{half}"] = sum(r.right for r in mine if r.ask.tool is None)
        summary[f"declines_asked_{half}"] = sum(r.ask.tool is None for r in mine)
        summary[f"claims_without_action_{half}"] = sum(r.claim_without_action for r in mine)
    summary["action_errors"] = sum(r.error is not None for r in records)
    spoken = [r.audio_s for r in records if r.audio_s is not None]
    if spoken:
        summary["action_audio_s_max"] = round(max(spoken), 1)
        summary["action_replies_over_20_s_of_audio"] = sum(s > 20 for s in spoken)
    summary["guard_runaway_actions"] = sum(r.guards.get("guard_runaway", 0) for r in records)
    return summary


def describe_action(record: ActionRecord) -> str:
    calls = ", ".join(f"{c.name}:{c.status}" for c in record.calls) or "no call"
    mark = "ok " if record.right else "BAD"
    heard = "" if record.heard is None else f" (heard {record.heard!r}, {record.audio_s:.1f} s of audio)"
    return f"  {mark} [{record.ask.half}] {record.ask.text!r}{heard} -> {calls}; {record.reply[:80]!r}"


def print_actions(summary: dict) -> None:
    print(f"\n{'actions (a fresh conversation each)':<44}{'tune half':>18}{'held-out half':>18}")
    for label, right, asked in (
        ("requests acted on right", "actions_right", "actions_asked"),
        ("impossible requests declined honestly", "declined_right", "declines_asked"),
    ):
        cells = [f"{summary[f'{right}_{h}']}/{summary[f'{asked}_{h}']}" for h in ("tune", "held_out")]
        print(f"{label:<44}{cells[0]:>18}{cells[1]:>18}")
    claims = [str(summary[f"claims_without_action_{h}"]) for h in ("tune", "held_out")]
    print(f"{'replies claiming an action not taken':<44}{claims[0]:>18}{claims[1]:>18}")
    if "action_audio_s_max" in summary:
        print(
            f"spoken: longest reply {summary['action_audio_s_max']} s of audio, "
            f"{summary['action_replies_over_20_s_of_audio']} over 20 s; runaways {summary['guard_runaway_actions']}"
        )
