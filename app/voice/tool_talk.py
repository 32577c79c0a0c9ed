"""A reply that talks about its tools instead of using them or answering.

Offered the skills' tools, the 0.5B default brain sometimes writes about them: "How do I tie a tie?" -> "To tie a
tie, you can call the `set_timer` function with the duration as the argument."; "What do I do for a living?" ->
"You can call the `list_timers` function to list the running timers." (three replies of ~80 in one
`parley bench quality` run; "I want to know more about the moon." read its tools' descriptions aloud for 15 s in a
spoken one). A declared tool's name is an identifier for the model's API, never words for a listener: no shape of
speech holds ``set_timer``. So the check is structural, in any language, and no word list: a round's text naming a
declared tool as an identifier (with ``_``, a digit, a dot or an inner capital, as ``get_time`` or ``HassTurnOn``;
a plain-word name such as ``calculate`` only in backticks or before ``(``) is talk about a tool.

What the reply does with it (``app.voice.pieces.PieceCutter``, ``app.voice.tool_rounds.ToolRounds.without_tools``):
nothing from the name on is spoken; a model that announces its call ("I'll use `get_time`." then the call) gets
the call made, so the round waits for one until its text goes on past the sentence that named the tool
(``gone_on``); with no call, the round is written again without tools where nothing of the reply was said yet
(its prompt without tools is kept warm between turns: ``ReplyFactory.retry_warm_prefix``), else the reply ends
where it was (counted as a runaway).
"""

from __future__ import annotations

import re

from app.stages.base import ToolSpec

# the muted text goes on past the sentence that named the tool: no call is coming in its place
_SENTENCE_THEN_MORE = re.compile(r"[.!?…。！？][\"')\]]*\s+\S")
# however a call is coming, the round stops waiting for it past this much muted text
MAX_MUTED_CHARS = 240
_IDENTIFIER = re.compile(r"[_\d.]|[a-z][A-Z]")


def declared_names(spec: ToolSpec | None) -> list[str]:
    """The names of the functions ``spec`` declares (none where there is no spec)."""
    if spec is None:
        return []
    names = (tool.get("function", {}).get("name") for tool in spec.tools if isinstance(tool, dict))
    return [name for name in names if isinstance(name, str) and name]


def tool_talk_pattern(spec: ToolSpec | None) -> re.Pattern[str] | None:
    """What finds a declared tool named in a reply's text (None: no tools are declared)."""
    alternatives = []
    for name in sorted(set(declared_names(spec)), key=len, reverse=True):
        escaped = re.escape(name)
        if _IDENTIFIER.search(name):
            alternatives.append(rf"(?<!\w){escaped}(?!\w)")
        else:
            alternatives.append(rf"`{escaped}`|(?<!\w){escaped}\(")
    return re.compile("|".join(alternatives)) if alternatives else None


def tool_named_at(text: str, pattern: re.Pattern[str] | None) -> int | None:
    """Where ``text`` first names a declared tool (``pattern``: ``tool_talk_pattern``), or None."""
    if pattern is None:
        return None
    match = pattern.search(text)
    return match.start() if match else None


def gone_on(muted: str) -> bool:
    """The text after a tool was named (``muted``) goes on past its sentence, or past ``MAX_MUTED_CHARS``: no call
    is coming in its place."""
    return len(muted) > MAX_MUTED_CHARS or _SENTENCE_THEN_MORE.search(muted) is not None
