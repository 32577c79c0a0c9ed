"""Scripted stand-ins for the model stages, a manual clock, and a driver for one conversation.

No model is loaded and no thread is started: blocking work runs inline, time moves only
when the test feeds audio (20 ms a frame) or advances the clock, so every turn-taking rule
can be checked exactly and the same way on any machine.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from harness import ScriptedLLM

from app import protocol
from app.config import Settings
from app.stages.base import ToolCall, Transcription, VadConfig
from app.stages.vad import VadStream
from app.voice.session import VoiceSession

RATE = 16_000
FRAME_S = 0.02


class UnsizedLLM:
    """An LLM of unknown context size (a remote server): a prompt is not fitted (``History.prompt``)."""

    context_tokens = None


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def run_inline(work):
    """Blocking model work, run at once on the loop (the fakes never block)."""
    return work()


class EnergyVadModel:
    """A VAD model whose speech probability is 1 for a loud window and 0 for a quiet one."""

    def probability(self, window_with_context, state):
        window = window_with_context[-512:]
        return (1.0 if float(np.sqrt(np.mean(window**2))) > 0.05 else 0.0), state


class ScriptedASR:
    """Hears whatever the test says it hears: ``text`` for the final (tail) transcript, ``partial`` for partials."""

    languages = ["en", "de", ""]

    def __init__(self, text: str = "", partial: str | None = None) -> None:
        self.languages_asked: list[str | None] = []
        self.text = text
        self.partial = partial
        self.calls: list[bool] = []  # the ``wait`` flag of each call (False: a partial)

    def transcribe(self, audio, *, wait=True, context="", language=None):
        self.calls.append(wait)
        self.languages_asked.append(language)
        text = self.text if wait or self.partial is None else self.partial
        return Transcription(text, len(audio) / RATE, 0.0, language="de" if language == "" else (language or "en"))


class WordTTS:
    """A quarter of a second of tone per word, so the played share of a reply maps to its words.

    Voices: "tone" speaks English, "other-tone" German; ``spoken`` records (voice, text), ``urgent``
    whether each was asked for urgently, ``deadlines`` the deadline each was asked with.
    """

    sample_rate = RATE
    voices = ["tone", "other-tone"]
    seconds_per_word = 0.25

    def __init__(self) -> None:
        self.spoken: list[tuple[str | None, str]] = []
        self.urgent: list[bool] = []
        self.deadlines: list[float | None] = []
        self.lead_quiet_s = 0.0  # near-silence before each piece's first word (Piper's is ~50 ms)

    def voice_for(self, language):
        return {"en": "tone", "de": "other-tone"}.get(language)

    def synthesize(self, text, voice=None, *, urgent=False, deadline=None):
        self.spoken.append((voice, text))
        self.urgent.append(urgent)
        self.deadlines.append(deadline)
        samples = int(len(text.split()) * self.seconds_per_word * RATE)
        quiet = np.full(int(self.lead_quiet_s * RATE), 0.005, np.float32)
        yield np.concatenate([quiet, np.full(samples, 0.1, np.float32)])


class ScriptedTurnModel:
    """An end-of-turn model that says ``probability`` (or raises, when it is an exception)."""

    def __init__(self, probability) -> None:
        self.probability = probability
        self.heard_seconds: list[float] = []

    def complete_probability(self, audio):
        self.heard_seconds.append(len(audio) / RATE)
        if isinstance(self.probability, Exception):
            raise self.probability
        return self.probability


class CoreOnlyLLM:
    """A ``ChatLLM`` without ``LocalScheduling`` (as a remote server is): the scripted one's core, and nothing more."""

    features = frozenset()

    def __init__(self, scripted: ScriptedLLM) -> None:
        self.name, self.context_tokens = scripted.name, scripted.context_tokens
        self.count_tokens, self.stream, self.abort = scripted.count_tokens, scripted.stream, scripted.abort
        self.health, self.close = scripted.health, scripted.close


class ToolScriptedLLM(ScriptedLLM):
    """A ``ScriptedLLM`` that also calls tools: each request with ``tools`` writes the next of ``rounds`` (text pieces
    and ``ToolCall`` values), the last one again once they run out; a request without (text only) writes ``pieces``.
    ``specs`` records each request's ``ToolSpec``; ``calls`` every request's messages, as ``ScriptedLLM`` does."""

    features = ScriptedLLM.features | {"tools"}

    def __init__(self, rounds: list[list[str | ToolCall]], pieces: list[str] | None = None) -> None:
        super().__init__(pieces or ["Plain text."])
        self.rounds = rounds
        self.specs: list = []

    async def stream(self, request):
        if request.tools is None:
            async for piece in super().stream(request):
                yield piece
            return
        self.specs.append(request.tools)
        self.calls.append([dict(m) for m in request.messages])
        self.request_ids.append(request.request_id)
        try:
            for event in self.rounds[min(len(self.specs), len(self.rounds)) - 1]:
                await asyncio.sleep(0)
                yield event
        finally:
            self.closed.append(request.request_id)


def server_tools():
    """Server-side tools as an operator registers them (``tool_entry_point="fakes:server_tools"``)."""

    def weather(arguments):
        return {"city": arguments.get("city"), "celsius": 21}

    async def broken(arguments):
        raise RuntimeError("the sensor is offline")

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return [
        {"name": "get_weather", "description": "The weather in a city", "parameters": city, "run": weather},
        {"name": "get_humidity", "run": broken},
    ]


class StandInReply:
    """What the turn-taking units (barge-in, continued turns) see of a ``Reply``; records what they do to it.

    ``heard_s``: how much of it the client has played, whenever asked; ``log``: "hold", "release", "cancel" in order.
    """

    def __init__(self, turn_id: int = 1, user_text: str = "", *, commit: float = 0.0, heard_s: float = 0.0) -> None:
        self.turn_id, self.user_text, self.commit = turn_id, user_text, commit
        self.playback = SimpleNamespace(played_s=lambda now: heard_s)
        self.playing = True
        self.log: list[str] = []

    def active(self) -> bool:
        return self.playing

    def hold(self) -> None:
        self.log.append("hold")

    async def release(self) -> None:
        self.log.append("release")

    async def cancel(self) -> None:
        self.log.append("cancel")
        self.playing = False


class FakeStages:
    def __init__(self, asr: ScriptedASR, llm: ScriptedLLM | CoreOnlyLLM, turn: ScriptedTurnModel | None = None) -> None:
        self.asr, self.llm, self.tts, self.turn = asr, llm, WordTTS(), turn
        self.solo = False

    def vad_stream(self, config: VadConfig) -> VadStream:
        return VadStream(EnergyVadModel(), config)

    def close(self) -> None:
        pass


class Conversation:
    """One ``VoiceSession`` on fake stages; records every event and the reply audio it sends.

    ``llm_scheduling=False`` gives the session the LLM's core alone (``CoreOnlyLLM``); ``llm`` still records it.
    """

    def __init__(
        self,
        asr_text: str = "",
        llm_pieces: list[str] | None = None,
        turn_probability=None,
        text_probability=None,
        llm_scheduling: bool = True,
        llm: ScriptedLLM | None = None,
        client_tool_results: str = "wait",
        skills=None,
        **settings,
    ) -> None:
        self.clock = ManualClock()
        self.asr = ScriptedASR(asr_text)
        self.llm = llm or ScriptedLLM(llm_pieces if llm_pieces is not None else ["Paris is the capital of France."])
        self.llm.text_turn_probability = text_probability
        self.events: list[protocol.ServerMessage] = []
        self.audio_s = 0.0
        self.metrics: list[protocol.TurnMetrics] = []
        self.session = VoiceSession(
            FakeStages(
                self.asr,
                self.llm if llm_scheduling else CoreOnlyLLM(self.llm),
                None if turn_probability is None else ScriptedTurnModel(turn_probability),
            ),
            Settings(**settings),
            self._send_json,
            self._send_bytes,
            clock=self.clock,
            run_blocking=run_inline,
            client_tool_results=client_tool_results,
            skills=skills,
        )
        self.session.on_turn_metrics = self.metrics.append

    async def _send_json(self, message) -> None:
        self.events.append(protocol.parse_server_message(protocol.encode(message)))

    async def _send_bytes(self, data: bytes) -> None:
        self.audio_s += len(data) / 2 / RATE

    async def settle(self) -> None:
        """Let every task that can make progress do so (the fakes never wait on anything real)."""
        for _ in range(30):
            await asyncio.sleep(0)

    async def feed(self, seconds: float, level: float) -> None:
        for _ in range(round(seconds / FRAME_S)):
            self.clock.advance(FRAME_S)
            await self.session.feed_audio(np.full(int(FRAME_S * RATE), level, np.float32))
            await self.settle()

    async def speak(self, seconds: float, text: str | None = None) -> None:
        """The user speaks for ``seconds``; ASR will hear ``text`` (when given)."""
        if text is not None:
            self.asr.text = text
        await self.feed(seconds, 0.3)

    async def silence(self, seconds: float) -> None:
        await self.feed(seconds, 0.0)

    async def silence_until(self, predicate, limit_s: float = 5.0) -> float:
        """Feed silence until ``predicate()``; returns the seconds fed (fails past ``limit_s``)."""
        fed = 0.0
        while not predicate():
            assert fed < limit_s, f"nothing happened in {limit_s} s of silence"
            await self.feed(FRAME_S, 0.0)
            fed += FRAME_S
        return fed

    async def type(self, text: str) -> None:
        await self.session.handle(protocol.UserText(text=text))
        await self.settle()

    def of(self, kind: type) -> list:
        return [event for event in self.events if isinstance(event, kind)]

    def finals(self) -> list[protocol.Transcript]:
        return [event for event in self.of(protocol.Transcript) if event.final]
