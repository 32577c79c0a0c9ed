"""The assistant's side of a turn: chat messages in, reply events and audio out.

A ``Reply`` streams LLM deltas through the clause splitter into TTS and sends the audio in
short chunks, all overlapped: the first clause is spoken while the LLM still writes the
rest. A reply can be *speculative*: produced before the user's turn is committed, with
everything it would send held back until ``release()``; if the user goes on speaking the
session cancels it and nothing was ever sent. Cancelling closes the LLM stream, which
aborts the request and frees its KV cache.

With tools (``app.voice.tools``) a reply is written in rounds: the LLM's text is spoken as it
comes, its calls are run (never while the reply is held back: the turn may not be this one),
and their results go back to the LLM, which writes the answer, spoken in the same reply. A
filler phrase may fill the wait; it is spoken only, never part of the reply's text. What a
round of calls does to the reply is ``app.voice.tool_rounds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app import protocol
from app.stages.base import (
    GenerationSettings,
    Message,
    ReplyRequest,
    StandAlone,
    ToolCall,
    ToolSpec,
    TurnEndVerdict,
    VoiceStages,
    open_reply,
    scheduling_of,
)
from app.voice.clock import Clock, RunBlocking
from app.voice.llm_wait import LLMUnavailable, bounded
from app.voice.pieces import Guard, Piece, PieceCutter
from app.voice.playback import ReplyPlayback
from app.voice.reply_audio import ReplyAudio
from app.voice.reply_text import ReplyText
from app.voice.runaway import SpeechBudget
from app.voice.text import FIRST_PHRASE_MAX_WORDS
from app.voice.tool_rounds import ReplyTools, ToolRounds
from app.voice.tool_talk import tool_talk_pattern

log = logging.getLogger(__name__)

# A reply's text runs far ahead of its speech (120 tokens written in a few seconds are 20 s of
# audio), and with several users each of its decode steps slows a reply whose listener hears
# nothing yet (a bigger batch, and cores shared with ASR and Piper). So once a reply has more than
# ``yield_ahead_s`` (the setting ``llm_yield_ahead_s``) of audio still to play, its LLM request
# yields to the others for the excess: it is stepped only when no other request needs a step. That
# leaves this much audio for its next piece to be written and synthesized in, with four users on 2 cores
# (figures: app/bench/results/turn_flow.md).
YIELD_AHEAD_S = 3.0
SendJson = Callable[[protocol.ServerMessage], Awaitable[None]]
SendBytes = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True)
class ReplyOptions:
    """How one reply is written and spoken, fixed at its start (from the settings and the client's preferences).

    ``sampling``: how the LLM decodes it; ``first_clause_chars``/``first_piece_words``: where its first piece is cut;
    ``first_piece_priority``: the LLM waits while the first piece is synthesized; ``yield_ahead_s``: audio ahead
    past which its LLM steps let others go first; ``min_gain_nats``: the words are answered alone where the
    conversation makes them less likely than this (``history_relevance_nats``: 0, the conversation always goes);
    ``earlier_replies``: the conversation's, for the LLM's DRY; ``voice``: the TTS voice (None: the default);
    ``speak``: False for a text-only reply (the client's ``reply_audio``); ``speech_budget_s``: about how long it may
    speak (``app.voice.runaway.SpeechBudget``; None: no bound); ``script``: the words to say, the server's own (a
    timer rang), in place of the LLM's; ``llm_wait_s``: the longest wait for each LLM request's first words (None:
    no bound); ``unavailable_words``: what is said when the LLM fails or keeps silent past it (None: only typed).
    """

    sampling: GenerationSettings = field(default_factory=GenerationSettings)
    first_clause_chars: int = 0
    first_piece_words: int = FIRST_PHRASE_MAX_WORDS
    first_piece_priority: bool = False
    yield_ahead_s: float = YIELD_AHEAD_S
    min_gain_nats: float = 0.0
    earlier_replies: Sequence[str] = ()
    voice: str | None = None
    speak: bool = True
    speech_budget_s: float | None = None
    script: str | None = None
    llm_wait_s: float | None = None
    unavailable_words: str | None = None


class ReplyListener(Protocol):
    """Who is told how a reply ended (the session)."""

    def reply_complete(self, reply: Reply) -> None:
        """Produced to its end and released: recorded before the client hears it is done."""
        ...

    def reply_failed(self, reply: Reply) -> None: ...

    def turn_metrics(self, metrics: protocol.TurnMetrics) -> None:
        """The turn's figures, once final."""
        ...


@dataclass(frozen=True)
class ReplyWiring:
    """What every reply of a session is wired to: the models (their LLM and TTS looked up by each reply: they may be
    replaced), the client, time, and who hears how it ended."""

    models: VoiceStages
    send_json: SendJson
    send_bytes: SendBytes
    clock: Clock
    run_blocking: RunBlocking
    listener: ReplyListener


class Reply:
    def __init__(
        self,
        turn_id: int,
        user_text: str,
        wiring: ReplyWiring,
        *,
        request_id: str,
        options: ReplyOptions | None = None,
        tools: ReplyTools | None = None,
    ) -> None:
        self.turn_id = turn_id
        self.user_text = user_text
        self.request_id = request_id
        self.options = options or ReplyOptions()
        self._llm, self._tts = wiring.models.llm, wiring.models.tts
        self.playback = ReplyPlayback(self._tts.sample_rate)
        self.metrics = protocol.TurnMetrics()
        self.released, self.finished = False, False  # finished: produced to the end (not cancelled, not failed)
        self.written = ReplyText()
        self.speech_end = 0.0  # wall time the user's speech ended (start of voice-to-voice)
        self.commit = 0.0  # wall time the turn was committed (0 while speculative)
        self._wiring = wiring
        self._scheduling = scheduling_of(self._llm)  # None: the LLM is not on our cores, nothing to pause or yield
        self._turn_end: TurnEndVerdict | None = None  # the end-of-turn verdict this reply reads (``start``)
        self._alone_acts_only = False
        self._clock, self._run = wiring.clock, wiring.run_blocking
        self._tools = tools
        self.speaks = self.options.speak
        self._held: list[protocol.ServerMessage | bytes] = []
        self._released = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._produce_started = 0.0
        self._produced_at: float | None = None

    def timed(self, *, speech_end: float, commit: float = 0.0, **figures) -> None:
        """When the user's speech ended and the turn was committed (0: not yet, a speculation), and the turn's
        figures so far (``TurnMetrics`` fields: the utterance's, ``speculative``, ...)."""
        self.speech_end, self.commit = speech_end, commit
        if figures:
            self.metrics = self.metrics.model_copy(update=figures)

    @property
    def text(self) -> str:
        return self.written.text

    @property
    def producing(self) -> bool:
        return self._task is not None and not self._task.done()

    def active(self) -> bool:
        """Still being produced, or still playing at the client."""
        return self.producing or self.playback.playing(self._clock.now())

    def heard_text(self, now: float) -> str:
        """What the user has had of the reply by ``now``: the audio played, or all the text sent when it is not spoken."""
        if not self.speaks:
            return self.text if self.released else ""
        return self.playback.heard_text(now)

    def start(
        self,
        messages: list[Message],
        *,
        released: bool,
        alone: list[Message] | None = None,
        alone_acts_only: bool = False,
        turn_end: TurnEndVerdict | None = None,
        weighed: float | None = None,
    ) -> None:
        """Produce the reply to ``messages``; ``alone``: the user's words without the conversation, answered instead
        when the LLM finds the words stand alone (``history_relevance_nats``; the first round);
        ``turn_end``: the end-of-turn verdict this (speculative) reply reads from its prefill, taken for it
        (``ReplyFactory.take_turn_end``); it is set with the first token, or to None if the reply never gets there;
        ``weighed``: the gain on which ``messages`` were chosen before the reply (``ReplyFactory.weigh``), reported;
        ``alone_acts_only``: ``alone`` is chosen only where, alone, the words make a call (their gain is not asked)."""
        self._turn_end, self._alone_acts_only = turn_end, alone_acts_only
        if weighed is not None:
            self.metrics.history_weighed_early = True
            self._on_weighed(weighed)
        self.released = released
        if released:
            self._released.set()
        self._task = asyncio.create_task(self._produce(messages, alone), name=f"turn-{self.turn_id}")

    async def wait_released(self) -> None:
        """Until the reply may send (at once where it is not held back)."""
        await self._released.wait()

    def hold(self) -> None:
        """Send nothing more for now (the user may be going on with their turn); ``release`` resumes."""
        self.released = False
        self._released.clear()

    async def release(self) -> None:
        """Send what a speculation held back, and everything it produces from now on."""
        self.released = True
        self._released.set()
        if self.finished:
            self._wiring.listener.reply_complete(self)  # recorded before the client hears it is done
        held, self._held = self._held, []
        for item in held:
            await self.emit(item)

    async def cancel(self) -> None:
        if self._task is not None:
            await cancel_task(self._task)
        self._turn_end_unread()

    def _turn_end_unread(self) -> None:
        """The reply will not read the end-of-turn verdict it took: the utterance tracker is told None."""
        turn_end, self._turn_end = self._turn_end, None
        if turn_end is not None:
            turn_end.set(None)

    def final_metrics(self) -> protocol.TurnMetrics:
        # RTF from the turn commit (or, for a speculation, from when its production began)
        began = min(self.commit, self._produce_started) if self.commit else self._produce_started
        metrics = self.playback.figures(self.metrics, (self._produced_at or self._clock.now()) - began)
        self._wiring.listener.turn_metrics(metrics)
        return metrics

    # ------------------------------------------------------------------ production
    def _on_weighed(self, gain: float | None) -> None:
        self.metrics.history_gain_nats = gain
        self.metrics.history_left_out = gain is not None and gain < self.options.min_gain_nats
        if self.metrics.history_left_out:
            log.info(
                "turn %s: the words stand alone (%.2f nats); answered without the conversation", self.turn_id, gain
            )

    async def emit(self, item: protocol.ServerMessage | bytes) -> None:
        """Send now if released, else hold it back (speculation). How a call settled is always sent: its call was
        (calls run only while the reply is released), and the client waits for it."""
        if not self.released and not isinstance(item, protocol.ToolDone):
            self._held.append(item)
            return
        if isinstance(item, bytes):
            now = self._clock.now()
            if self.playback.started_at is None:
                self.metrics.voice_to_voice_ms = (now - self.speech_end) * 1000
            self.playback.on_send(len(item) // 2, now)
            await self._wiring.send_bytes(item)
            return
        if isinstance(item, protocol.TurnDone):
            item = item.model_copy(update={"metrics": self.final_metrics()})
        await self._wiring.send_json(item)

    async def _produce(self, messages: list[Message], alone: list[Message] | None = None) -> None:
        """LLM tokens -> clauses/sentences -> TTS -> audio, all overlapped; with tools, round after round."""
        pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
        speaker = asyncio.create_task(
            ReplyAudio(self, self._tts, self._scheduling, self._clock, self._run).speak(pieces),
            name=f"tts-{self.turn_id}",
        )
        self._produce_started = self._clock.now()
        said: list[str] = []
        budget = SpeechBudget(self.options.speech_budget_s)
        rounds = ToolRounds(self, self._tools, pieces, said, budget)
        try:
            while True:
                first = rounds.begin()  # (only the first request weighs the words alone)
                calls, stop = await self._write(
                    messages, rounds, pieces, said, budget, answer=rounds.made > 0, alone=alone if first else None
                )
                if stop == "tool_talk" and rounds.without_tools():
                    continue
                calls = rounds.to_make(calls)
                if not calls or stop or not rounds.can_call:
                    break
                messages = await rounds.make(messages, calls)
                if messages is None:
                    break
            await rounds.finish()
            if stop:
                self.written.keep_said(said)
                count_guard(self.metrics, stop)
            pieces.put_nowait(None)
            await speaker
            self._produced_at = self._clock.now()
            self.finished = True
            if self.released:  # recorded before the client hears it is done (and may answer its calls)
                self._wiring.listener.reply_complete(self)
            await self.emit(protocol.TurnDone(turn_id=self.turn_id, text=self.text))
        except asyncio.CancelledError:
            raise
        except LLMUnavailable as exc:  # said aloud, where nothing of the reply was (``app.voice.llm_wait``)
            log.warning("turn %s: the LLM did not answer: %s", self.turn_id, exc)
            self._wiring.listener.reply_failed(self)
            if not said and self.options.unavailable_words:
                pieces.put_nowait(Piece(self.options.unavailable_words, filler=True))  # (spoken, never the reply's)
                pieces.put_nowait(None)
                await speaker
            await self.emit(
                protocol.Error(
                    code="llm_unavailable", message=f"the language model did not answer: {exc}", turn_id=self.turn_id
                )
            )
        except Exception as exc:  # one failed turn must not end the conversation
            log.exception("turn %s failed", self.turn_id)
            self._wiring.listener.reply_failed(self)
            await self.emit(
                protocol.Error(code="turn_failed", message=f"could not answer: {exc}", turn_id=self.turn_id)
            )
        finally:
            self._turn_end_unread()
            await cancel_task(speaker)

    def _request(self, messages: list[Message], spec: ToolSpec | None, alone: list[Message] | None) -> ReplyRequest:
        """One round's LLM request: the first round also weighs ``alone`` (where the policy weighs the words) and reads
        the end-of-turn verdict this reply took; the backend carries out what it can (``open_reply``)."""
        first = not self.written.tool_messages  # (the first round: no calls made yet)
        weighed = None
        if alone is not None and self._alone_acts_only:
            weighed = StandAlone(alone, float("-inf"))  # chosen only where, alone, the words make a call
        elif alone is not None and self.options.min_gain_nats:
            weighed = StandAlone(alone, self.options.min_gain_nats, self._on_weighed)
        return ReplyRequest(
            messages,
            self.request_id,
            self.options.sampling,
            tools=spec,
            alone=weighed,
            turn_end=self._turn_end if first else None,
            earlier_replies=self.options.earlier_replies,
        )

    async def _write(
        self,
        messages: list[Message],
        rounds: ToolRounds,
        pieces: asyncio.Queue,
        said: list[str],
        budget: SpeechBudget,
        *,
        answer: bool,
        alone: list[Message] | None = None,
    ) -> tuple[list[ToolCall], Guard | None]:
        """One LLM request: its text spoken piece by piece, its calls returned; and the guard that cut it, if one did
        (``app.voice.pieces``)."""
        options, spec = self.options, rounds.spec
        cutter = PieceCutter(
            said,
            first_clause_chars=options.first_clause_chars,
            first_piece_words=options.first_piece_words,
            budget=budget,
            tools=tool_talk_pattern(spec),
            opening=rounds.take_opening(),
            echo=rounds.echo,
        )
        if options.script is not None:
            stream = _said(options.script)
        else:
            stream = open_reply(self._llm, self._request(messages, spec, alone))
        round_start = len(self.written.parts)
        calls: list[ToolCall] = []
        # (bounded while the user has heard nothing of the reply: a later round waits behind what is still playing)
        events = bounded(stream, None if said else self.options.llm_wait_s)
        try:
            async for event in events:
                if self.metrics.llm_ttft_ms is None:
                    self.metrics.llm_ttft_ms = (self._clock.now() - self._produce_started) * 1000
                if isinstance(event, ToolCall):
                    calls.append(event)
                    continue
                if not event:  # a call being written: alive, nothing to say
                    continue
                delta = await self.write(event, round_start)
                self._queue(cutter, cutter.push(delta), pieces, answer)
                if cutter.stopped:
                    log.info("turn %s: the reply ends here (guard: %s)", self.turn_id, cutter.stop)
                    break
        finally:
            await events.aclose()
            await stream.aclose()  # aborts the LLM request if we stopped early
        self._queue(cutter, cutter.flush(), pieces, answer)
        return calls, cutter.ended(called=bool(calls))

    def _queue(self, cutter: PieceCutter, cut: list[str], pieces: asyncio.Queue, answer: bool) -> None:
        """The pieces cut, to be spoken; the first one (or a guard) is when the LLM's first piece came."""
        if (cut or cutter.stopped) and self.metrics.llm_first_piece_ms is None:
            self.metrics.llm_first_piece_ms = (self._clock.now() - self._produce_started) * 1000
        for piece in cut:
            pieces.put_nowait(Piece(piece, answer=answer))

    async def write(self, text: str, round_start: int) -> str:
        """``text`` written: kept with the reply's and sent to the client; returned as kept (a round's first words
        spaced from what was said before its calls, ``ReplyText.joined``)."""
        delta = self.written.joined(text, round_start)
        self.written.parts.append(delta)
        await self.emit(protocol.AssistantText(turn_id=self.turn_id, delta=delta))
        return delta

    def runs_dry_at(self, now: float) -> float:
        """When the listener runs out of audio: what was sent has played, and what is held back after it."""
        held_s = sum(len(item) // 2 for item in self._held if isinstance(item, bytes)) / self._tts.sample_rate
        return self.playback.runs_dry_at(now) + held_s


def count_guard(metrics: protocol.TurnMetrics, guard: Guard) -> None:
    """Which guard cut the reply, as per-turn counts (``TurnMetrics.guard_*``): how often the LLM needed one."""
    field = f"guard_{'runaway' if guard == 'tool_talk' else guard}"  # (talk about a tool is no longer speech)
    setattr(metrics, field, (getattr(metrics, field) or 0) + 1)


async def cancel_task(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has finished unwinding (its own errors are not ours)."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def _said(words: str) -> AsyncIterator[str]:
    """A script as the LLM's stream would give it."""
    yield words
