"""A reply's rounds of calls: what it may call (``ReplyTools``), and what each round does to it (``ToolRounds``): its
calls made (never while the reply is held back: the turn may not be this one), a filler phrase to fill their
wait, and then the next round's request, the skills' own words said as the answer, or the end of the reply.

Its own unit so that how a reply is streamed (``app.voice.reply``: the LLM's text -> pieces -> TTS -> audio) reads
apart from what its rounds of calls do to it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from app import protocol
from app.skills.base import CANNOT_DO
from app.stages.base import Message, ToolCall, ToolSpec
from app.voice.pieces import Piece
from app.voice.reply_text import ReplyText
from app.voice.runaway import PromptEcho, SpeechBudget
from app.voice.text import speakable
from app.voice.tools import (
    MAX_TOOL_ROUNDS,
    ToolRunner,
    calls_message,
    failed_round,
    next_round,
    spoken_results,
    unasked_round,
)

log = logging.getLogger(__name__)

# How much the answer to calls that all failed may say: that it could not be done, in a sentence or two (the 0.5B
# default brain read an MCP server's whole validation error aloud, 17.5 s, in `parley bench quality`'s spoken run).
FAILED_CALLS_SPEECH_S = 6.0


@dataclass(frozen=True)
class ReplyTools:
    """What a reply may call (``spec``), who runs the calls (``runner``), what fills the wait (``filler``), and
    what the tools' servers added to the system prompt (``instructions``: never to be said back)."""

    spec: ToolSpec
    runner: ToolRunner | None = None  # None: earlier calls are in the prompt, no new one can be made
    filler: str = ""
    rounds: int = MAX_TOOL_ROUNDS  # rounds of calls; the LLM's text after the last one is an answer only
    instructions: str = ""


class CallingReply(Protocol):
    """What the rounds read and write of the reply (``app.voice.reply.Reply``), each at its use."""

    turn_id: int
    request_id: str  # (each round after calls is another request)
    metrics: protocol.TurnMetrics
    written: ReplyText

    async def emit(self, item: protocol.ServerMessage | bytes) -> None: ...

    async def write(self, text: str, round_start: int) -> str: ...

    async def wait_released(self) -> None: ...


class ToolRounds:
    """The rounds of one reply's production; its spoken pieces go to ``pieces``, and what they said to ``said``.

    ``spec``: the tools the next round's request has (None: none); ``made``: the rounds of calls made so far.
    """

    def __init__(
        self,
        reply: CallingReply,
        tools: ReplyTools | None,
        pieces: asyncio.Queue[Piece | None],
        said: list[str],
        budget: SpeechBudget,
    ) -> None:
        self._reply, self._tools, self._pieces, self._said = reply, tools, pieces, said
        self._budget = budget
        self.spec = tools.spec if tools is not None else None
        self.made = 0
        self._rewritten = False  # a round was written again without tools (``without_tools``)
        self._round_parts = self._round_said = 0  # where the round being written began: the reply's parts, ``said``
        self._opening: list[str] = []  # what a round written again was said to open with
        self._failed = False  # a round's calls all failed

    def begin(self) -> bool:
        """A request is about to be written; whether it is the reply's first (only that one weighs the user's words
        alone)."""
        self._round_parts, self._round_said = len(self._reply.written.parts), len(self._said)
        return self.made == 0 and not self._rewritten

    @property
    def echo(self) -> PromptEcho | None:
        """The tools' instructions, to be found if the reply says them back (``runaway.PromptEcho``)."""
        return PromptEcho(self._tools.instructions) if self._tools is not None and self._tools.instructions else None

    def take_opening(self) -> list[str]:
        """The pieces a round written again without tools already said: not said twice if it opens with them."""
        opening, self._opening = self._opening, []
        return opening

    @property
    def can_call(self) -> bool:
        """Whether calls can be made at all (else earlier calls are only in the prompt)."""
        return self._tools is not None and self._tools.runner is not None

    def to_make(self, calls: list[ToolCall]) -> list[ToolCall]:
        """Of a round's ``calls``, those to make: none in an answer-only round."""
        if calls and self.spec is not None and self.spec.choice == "none":
            log.info("turn %s: %d calls in an answer-only round are not made", self._reply.turn_id, len(calls))
            return []
        return calls

    async def make(self, messages: list[Message], calls: list[ToolCall]) -> list[Message] | None:
        """Make a round's ``calls`` (written on ``messages``): the messages the next round is written from, or None
        when the reply ends at them."""
        assert self._tools is not None
        self.made += 1
        answered = await self._call(messages, calls)
        if answered is None or self.spec is None:
            return None  # the calls' results come in a later response
        results = answered[-len(calls) :]
        if unasked_round(results):
            self._reply.written.take_back(1 + len(calls))  # not made, as far as the history goes
            self.spec = None  # written again, without tools
            self._next_request()
            return messages
        if await self._say_results(results):
            return None  # the skills said what they did: no LLM round to write it again
        if failed_round(results):
            self._failed = True
            self._budget.tighten(FAILED_CALLS_SPEECH_S)
        self.spec = next_round(self.spec, self.made, self._tools.rounds)
        self._next_request()
        return answered

    def without_tools(self) -> bool:
        """The round talked about its tools instead of calling one or answering (``app.voice.tool_talk``): where
        tools were offered and nothing was said before the round, it is written again without them (its text is
        dropped; what it said, its first words, is not said again if the new text opens with it) and True; False
        where the reply ends as it is."""
        if self.spec is None or self._round_said > 0:
            return False
        del self._reply.written.parts[self._round_parts :]
        self._opening = self._said[self._round_said :]
        if not self._opening:
            self._reply.metrics.llm_first_piece_ms = None  # (the cut was no piece)
        self.spec, self._rewritten = None, True
        self._next_request("w")
        return True

    def _next_request(self, kind: str = "") -> None:
        reply = self._reply
        reply.request_id = f"{reply.request_id.split('~')[0]}~{self.made}{kind}"

    async def _call(self, messages: list[Message], calls: list[ToolCall]) -> list[Message] | None:
        """Run a round's calls; the conversation to write the answer from, or None when the reply ends at them."""
        assert self._tools is not None and self._tools.runner is not None
        reply, runner = self._reply, self._tools.runner
        await reply.wait_released()  # a held-back reply runs no tool: the turn may not be this one
        round_text = reply.written.calls_made(self._said)
        called = calls_message(round_text, calls)
        reply.metrics.tool_calls = (reply.metrics.tool_calls or 0) + len(calls)
        if self._tools.filler and runner.waits_for(calls) and not speakable(round_text):
            self._pieces.put_nowait(Piece(self._tools.filler, filler=True))
        result = await runner.run(reply.turn_id, calls, reply.emit)
        reply.metrics.tool_ms = (reply.metrics.tool_ms or 0.0) + result.tool_s * 1000
        reply.written.tool_messages += [called, *(result.messages or ())]
        if result.messages is None:
            return None
        return [*messages, called, *result.messages]

    async def finish(self) -> None:
        """The reply's rounds are over: one whose calls failed and that then said nothing says it could not do it
        (the 0.5B default brain wrote nothing after a conversion's error, and the user heard silence)."""
        if self._failed and not self._said:
            await self._speak_answer(CANNOT_DO)

    async def _speak_answer(self, words: str) -> None:
        """``words`` written and said as the reply's answer."""
        await self._reply.write(words, len(self._reply.written.parts))
        self._said.append(words)
        self._pieces.put_nowait(Piece(words, answer=True))

    async def _say_results(self, results: list[Message]) -> bool:
        """Speak the results' own words when every call said what it did (a skill's ``say``: "Timer set for 10
        minutes."), as the reply's answer; False (nothing done) when any did not (an error, another server's tool)."""
        words = spoken_results(results)
        if words is None:
            return False
        await self._speak_answer(words)
        self._reply.written.answered_by_tools = True
        return True
