"""The server tool of ``parley bench voice --tools``: every reply calls it, and it takes a known time.

Why a fixed time: the figure to report is the voice latency of a turn with a call, from the end
of the user's speech to the first audio of the answer, with the tool's own share stated apart
(``TurnMetrics.tool_ms``); a tool that sleeps ``PARLEY_BENCH_TOOL_MS`` (200 ms, a quick local
lookup) makes that share the same in every run.
"""

from __future__ import annotations

import asyncio
import os

TOOL_MS_VARIABLE = "PARLEY_BENCH_TOOL_MS"
DEFAULT_TOOL_MS = 200.0


def tools() -> list[dict]:
    """``tool_entry_point = "app.bench.tools:tools"``."""

    async def lookup(arguments: dict) -> dict:
        await asyncio.sleep(float(os.environ.get(TOOL_MS_VARIABLE, DEFAULT_TOOL_MS)) / 1000)
        return {"topic": arguments.get("topic"), "answer": "It is sunny and 21 degrees, and the shop opens at nine."}

    topic = {
        "type": "object",
        "properties": {"topic": {"type": "string", "maxLength": 40}},
        "required": ["topic"],
        "additionalProperties": False,
    }
    return [{"name": "look_up", "description": "Look up a fact for the user", "parameters": topic, "run": lookup}]
