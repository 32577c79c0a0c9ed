"""What a reply has written, round by round: its text (``parts``, as sent to the client), the calls it made with
their results (``tool_messages``, for the history), and where its answer begins (the text after the last round of
calls; what was said before the calls is kept with them).

Its own unit so that the rules of what a reply *is* (what the page shows, what the history keeps, what of it
was heard) read in one place, apart from how it is produced (``app.voice.reply``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.stages.base import Message


@dataclass
class ReplyText:
    parts: list[str] = field(default_factory=list)
    tool_messages: list[Message] = field(default_factory=list)  # each round of calls and its results
    answered_by_tools: bool = False  # the answer is the calls' own words (a skill's ``say``)
    spoken_before_answer: str = ""  # the pieces said before the answer (by the rounds of calls), joined
    _answer_from: int = 0  # parts from here on are the answer
    _said_before_answer: int = 0

    @property
    def text(self) -> str:
        return "".join(self.parts).strip()

    @property
    def answer(self) -> str:
        """The text written after the last round of calls (all of it in a reply without calls)."""
        return "".join(self.parts[self._answer_from :]).strip()

    def heard_answer(self, heard: str) -> str:
        """Of what the user ``heard``, the answer's words: what was said before the calls is kept with them."""
        if not self.tool_messages:
            return heard
        before = self.spoken_before_answer
        return heard[len(before) :].strip() if heard.startswith(before) else ""

    def joined(self, delta: str, round_start: int) -> str:
        """``delta`` as the text goes on: a round's first words after what was said before its calls get a space."""
        if len(self.parts) == round_start and self.parts and not self.parts[-1][-1:].isspace():
            return " " + delta.lstrip()
        return delta

    def calls_made(self, said: list[str]) -> str:
        """A round of calls is made after ``said``: what this round wrote before them (the calls' message's text);
        from here on the parts are the answer."""
        round_text = "".join(self.parts[self._answer_from :]).strip()
        self._answer_from, self._said_before_answer = len(self.parts), len(said)
        self.spoken_before_answer = " ".join(said)
        return round_text

    def take_back(self, messages: int) -> None:
        """The last round's call message and results are not kept (its calls were not asked for)."""
        del self.tool_messages[-messages:]

    def keep_said(self, said: list[str]) -> None:
        """A guard cut the reply: its text is what was said (the page and the history get it)."""
        before, answer = said[: self._said_before_answer], said[self._said_before_answer :]
        self.parts = [" ".join(before) + (" " if before else ""), " ".join(answer)]
        self._answer_from = 1
