"""What a turn is answered with: its prompt, fitted to the model, and the ``Reply`` that speaks the answer.

The session (``app.voice.session``) decides when a reply starts, is held, released or
stopped; this is how one is made: from the settings (read at each turn, so a live ``tune``
applies to the next), the client's preferences (system prompt, voice) and the turn's language.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from app import protocol
from app.config import Settings
from app.policy import dated, instructed
from app.skills.base import ServerTool
from app.stages.base import GenerationSettings, Message, ToolSpec, TurnEndVerdict, VoiceStages, scheduling_of
from app.voice.context import Fitted
from app.voice.history import History
from app.voice.language import reply_in
from app.voice.llm_wait import UNAVAILABLE_WORDS
from app.voice.prefs import Preferences
from app.voice.reply import Reply, ReplyOptions, ReplyWiring
from app.voice.runaway import speech_budget_s
from app.voice.tool_rounds import ReplyTools
from app.voice.tools import ClientResults, PendingCalls, SessionTools, ToolRunner
from app.voice.turn_state import TurnState
from app.voice.warmup import WarmPrefix

OnMetrics = Callable[[protocol.TurnMetrics], None]


@dataclass(frozen=True)
class Weighing:
    """What a reply starts on (``ReplyFactory.weigh``): ``messages``, and ``alone`` where the reply still weighs the
    words itself (``Reply.start``); ``gain``: the gain the choice was made on before the reply (None: not made)."""

    messages: list[Message]
    alone: list[Message] | None = None
    gain: float | None = None
    acts_only: bool = False  # ``alone`` goes with the reply only to be chosen where, alone, the words make a call


def weigh_heard(
    related: list[Message],
    alone: list[Message] | None,
    heard_gain: float | None,
    *,
    threshold: float,
    margin: float,
    undecided_both: bool = True,
) -> Weighing:
    """``ReplyFactory.weigh`` with its settings given: ``heard_gain`` chooses one prompt where it is ``margin`` or more
    from ``threshold`` (under it: ``alone``), else the reply weighs both (``undecided_both``) or keeps ``related``."""
    if alone is None:
        return Weighing(related)
    if heard_gain is None or abs(heard_gain - threshold) < margin:
        return Weighing(related, alone) if undecided_both else Weighing(related)
    return Weighing(alone if heard_gain < threshold else related, gain=heard_gain)


@dataclass(frozen=True)
class ToolSetup:
    """How a session's replies come by their tools, fixed at its start: ``server_tools``, the operator's and the
    skills' (which a session that declares none may call); ``pending_calls``: where the client's tool results are
    awaited; ``client_results``: whether a reply waits for them ("wait") or ends at its calls ("next_response": the
    Realtime API's way); ``instructions``: what the skills add to the system prompt while their tools are the ones
    offered (an MCP server's prompt). Together because the factory only hands them on."""

    server_tools: tuple[ServerTool, ...] = ()
    pending_calls: PendingCalls = field(default_factory=PendingCalls)
    client_results: ClientResults = "wait"
    instructions: str = ""


class ReplyFactory:
    def __init__(
        self,
        models: VoiceStages,
        state: TurnState,
        history: History,
        prefs: Preferences,
        wiring: ReplyWiring,
        *,
        session_id: str,
        tools: ToolSetup | None = None,
        today: Callable[[], datetime.date] = datetime.date.today,
    ) -> None:
        """``state``: the session's settings and the turn's language, read at each reply (a live ``tune`` applies to
        the next); ``wiring``: what each reply is wired to; ``tools``: how they come by their tools (None: no server
        tools, and a reply waits for the client's results).
        """
        self._models, self._state, self._history, self._prefs = models, state, history, prefs
        self._wiring, self._session_id = wiring, session_id
        tools = tools or ToolSetup()
        self._today, self._server_tools = today, tools.server_tools
        self._request_ids = itertools.count(1)  # unique per LLM request, even for a re-speculation
        self._pending_calls = tools.pending_calls
        self._client_results: ClientResults = tools.client_results
        self._instructions = tools.instructions

    @property
    def settings(self) -> Settings:
        return self._state.settings

    def prompt(self, user_text: str | None, *, related: bool = True) -> Fitted:
        """The messages that answer ``user_text``: the system prompt (asking for the turn's language) and the history
        (None: the history alone, which ends with the results of the assistant's calls; ``related`` False:
        without the history, see ``alone_prompt``)."""
        settings, language = self.settings, self._state.language
        return self._history.prompt(
            reply_in(self.system_prompt(), language),
            user_text,
            self._models.llm,
            context_tokens=settings.llm_context_tokens,
            reply_tokens=settings.llm_max_tokens,
            related=related,
            language=language,
        )

    def messages_for(self, user_text: str) -> list[Message]:
        """``prompt``'s messages (the LLM's end-of-turn verdict is asked with them)."""
        return self.prompt(user_text).messages

    def upcoming_prefix(self) -> list[Message]:
        """What the next turn's prompt starts with: the system prompt and the history."""
        return self._history.upcoming_prefix(self.system_prompt())

    def system_prompt(self) -> str:
        """The session's system prompt, with today's date where it says ``{date}`` (``app.policy``): the date, not the
        time, so the prompt the prefix cache holds changes once a day, not once a minute (the time is a tool's); and
        what the skills add to it where theirs are the tools offered (the client declared none)."""
        prefs = self._prefs.current
        own_tools = bool(prefs.tools) or not self._server_tools
        return instructed(dated(prefs.system_prompt, self._today()), "" if own_tools else self._instructions)

    def alone_prompt(self, user_text: str, related: list[Message]) -> list[Message] | None:
        """``user_text`` without the conversation (but what the system prompt recalls of it), for the reply to be
        written from where the LLM finds the words stand alone (``ReplyRequest.alone``); None when it will not weigh
        them: ``history_relevance_nats`` is 0, the LLM is not on this machine, or the prompt is the same as
        ``related`` (``prompt``'s messages for the words, which the caller has made already).

        Why: SmolLM2-135M shown any earlier exchange answers fewer questions right than asked each alone (one
        exchange costs as much as sixteen messages), yet a follow-up ("And Spain?") needs it; the model's own
        log-probabilities tell the two apart, in any language (``app.policy``).
        """
        if not self.settings.history_relevance_nats or scheduling_of(self._models.llm) is None:
            return None
        alone = self.prompt(user_text, related=False)
        if alone.truncated_chars or alone.messages == related:
            return None
        return alone.messages

    def weigh(
        self, related: list[Message], alone: list[Message] | None, heard_gain: float | None, *, spoken: bool
    ) -> Weighing:
        """The prompt a reply starts on: ``related`` (the conversation and the words) where ``alone`` is None (no
        weighing, ``alone_prompt``); else the one ``heard_gain`` chooses (the gain of the words heard so far,
        ``PrefixWarmup.heard_gain``) where it is ``history_relevance_margin_nats`` or more from the threshold; else
        both, for the reply to weigh all the words (``Reply.start``), but for a ``spoken`` turn with
        ``history_relevance_spoken`` "heard": it keeps the conversation (the default before the weighing).

        Why: a reply started on both prompts prefills the words twice at the pause (the first token ~100 ms later on
        two cores); the words heard while the user spoke nearly always choose as all of them do (``app.policy``).
        """
        settings = self.settings
        threshold, margin = settings.history_relevance_nats, settings.history_relevance_margin_nats
        both = not spoken or settings.history_relevance_spoken == "both"
        weighing = weigh_heard(related, alone, heard_gain, threshold=threshold, margin=margin, undecided_both=both)
        if alone is not None and weighing.alone is None and weighing.messages is related and self.tool_spec():
            # a request acts where it stands alone: once one reply in the history was not a call, the 0.5B default
            # brain shaped every later request like it ("Sure, here's a timer: 1. Open the timer app"); asked
            # alone, it made the call (app/bench/results/default_brain.md)
            return Weighing(related, alone, weighing.gain, acts_only=True)
        return weighing

    def take_turn_end(self, verdict: TurnEndVerdict | None, messages: list[Message]) -> TurnEndVerdict | None:
        """``verdict`` taken, for the reply to ``messages`` to read from its prefill, where that reply can: an LLM on
        this machine whose reply prompt (with the reply's tools) continues the verdict's
        (``LocalScheduling.turn_end_position``); None otherwise (the tracker then asks the LLM apart)."""
        scheduling = scheduling_of(self._models.llm)
        if verdict is None or scheduling is None:
            return None
        position = scheduling.turn_end_position(messages, self.tool_spec())
        if position is None:
            return None
        verdict.take(position)
        return verdict

    def new(self, turn_id: int, user_text: str, *, script: str | None = None) -> Reply:
        """A reply to ``user_text`` (``script``: the words it says, written by the server, not the LLM)."""
        settings, language = self.settings, self._state.language
        budget_s = speech_budget_s(user_text, language, settings.reply_speech_s, settings.reply_long_speech_s)
        sampling = GenerationSettings.from_settings(settings)
        if budget_s > settings.reply_speech_s:  # room in tokens for what the budget lets it say (~4 characters each)
            sampling = dataclasses.replace(sampling, max_tokens=max(sampling.max_tokens, int(budget_s * 4.5)))
        options = ReplyOptions(
            sampling=sampling,
            first_clause_chars=settings.first_clause_chars,
            first_piece_words=settings.first_piece_words,
            # the server's solo mode (``registry.set_open_sessions``) turns it on while one session is open
            first_piece_priority=settings.first_piece_priority or self._models.solo,
            yield_ahead_s=settings.llm_yield_ahead_s,
            min_gain_nats=settings.history_relevance_nats,
            earlier_replies=self._history.earlier_replies(),
            voice=self._prefs.voice_for(language),
            speak=self._prefs.current.reply_audio,
            speech_budget_s=budget_s,
            script=script,
            llm_wait_s=settings.llm_wait_s,
            unavailable_words=UNAVAILABLE_WORDS.get(language or "en"),
        )
        request_id = f"{self._session_id}-{turn_id}-{next(self._request_ids)}"
        reply = Reply(turn_id, user_text, self._wiring, request_id=request_id, options=options, tools=self._tools())
        asked = self._history.asked(user_text, language)
        if asked != user_text:
            reply.metrics.asked_in_full = asked
            reply.metrics.history_left_out = self._history.follow_ups == "in_full_alone"
        return reply

    def session_tools(self) -> SessionTools:
        """What the session's replies may call now: the client's tools, else the server's."""
        prefs = self._prefs.current
        server = self._server_tools
        return SessionTools(prefs.tools, server, prefs.tool_choice, prefs.parallel_tool_calls)

    def warm_prefix(self) -> WarmPrefix | None:
        """The LLM's prefix-cache prefill, where it has one (read at each use: the LLM may be replaced); with tools,
        the prompt is rendered as a reply's request will render it."""
        scheduling = scheduling_of(self._models.llm)
        if scheduling is None:
            return None
        tools = self.tool_spec()
        return scheduling.warm if tools is None else functools.partial(scheduling.warm, tools=tools)

    def retry_warm_prefix(self) -> WarmPrefix | None:
        """The prefill of the prompt a reply is written again from without tools, where one can be: a skill refuses
        a call the user's words did not ask for (``app.skills.base.unasked``) and the reply is written again without
        tools (``ToolRounds.make``). That prompt's system turn has no tools, so without this warm-up the whole
        conversation missed the prefix cache: 5.8 s before the first word of one such turn with the default brain
        (app/bench/results/default_brain.md, 2026-12-07). Only on idle cores: most replies never need it, and with
        other conversations' requests in the LLM it would slow theirs. None where no call can be refused so (no
        skills: the client's tools, or none) or where the LLM has no prefix cache."""
        scheduling = scheduling_of(self._models.llm)
        tools = self.session_tools()
        if scheduling is None or tools.client or not tools.server:
            return None

        async def warm_when_idle(messages: list[Message]) -> float | None:
            return await scheduling.warm(messages) if scheduling.idle() else None

        return warm_when_idle

    def tool_spec(self) -> ToolSpec | None:
        """The tools the next reply's request has (None: the plain text path)."""
        return self.session_tools().spec(self._history.messages)

    def _tools(self) -> ReplyTools | None:
        """The reply's tools: None without any, in this session or in its history (the plain text path)."""
        tools = self.session_tools()
        spec = tools.spec(self._history.messages)
        if spec is None:
            return None
        if not spec.tools:
            return ReplyTools(spec)
        runner = ToolRunner(
            tools,
            self._pending_calls,
            timeout_s=self.settings.tool_timeout_s,
            clock=self._wiring.clock,
            run_blocking=self._wiring.run_blocking,
            client_results=self._client_results,
        )
        instructions = "" if tools.client else self._instructions  # (in the system prompt: ``system_prompt``)
        return ReplyTools(spec, runner, self.settings.tool_filler, self.settings.tool_rounds, instructions)
