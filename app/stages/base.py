"""The narrow interfaces of the model stages, and the typed values they pass along.

The conversation (``app.voice``) depends on these alone: it never imports a model library,
so it can be driven in tests by scripted stand-ins (``tests/fakes.py``). The real
backends live beside this module (``vad``, ``asr``, ``llm``, ``tts``, ``tts_coqui``) and are
loaded once, for all sessions, by ``registry``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)

# one chat message: {"role": ..., "content": ...}; an assistant turn that called tools also carries
# "tool_calls" (``ToolCall.as_openai`` each), and a tool's result ("role": "tool") its "tool_call_id"
Message = dict[str, Any]


# ---------------------------------------------------------------- VAD
@dataclass(frozen=True)
class VadEvent:
    """``sample`` indexes the 16 kHz input stream where speech began ("start") or ended ("end")."""

    kind: Literal["start", "end"]
    sample: int


@dataclass(frozen=True)
class VadConfig:
    threshold: float = 0.5
    neg_threshold: float = 0.35
    min_speech_ms: int = 96  # shorter bursts (a click, a cough onset) do not start speech
    min_silence_ms: int = 300  # silence that ends a speech segment; endpointing may wait longer


class VoiceActivity(Protocol):
    """One session's streaming VAD: feed 16 kHz audio, get speech start/end events."""

    speaking: bool

    @property
    def speech_pending(self) -> bool:
        """Speech-like audio has begun but is not yet long enough to count as a start."""
        ...

    @property
    def trailing_silence(self) -> bool:
        """Speaking, but the latest windows were quiet: the speech may be ending (hangover)."""
        ...

    @property
    def silence_start(self) -> int | None:
        """In the hangover: the stream sample where the quiet began (the speech end, if it stays quiet)."""
        ...

    @property
    def quiet_start(self) -> int | None:
        """Speaking, but the latest windows were not speech enough to start one: where they began (at or before
        ``silence_start``; the earliest sign the speech may be ending)."""
        ...

    def feed(self, samples: np.ndarray) -> list[VadEvent]: ...


# ---------------------------------------------------------------- ASR
@dataclass(frozen=True)
class Transcription:
    text: str
    audio_seconds: float
    wall_seconds: float
    no_speech_probability: float = 0.0
    language: str = ""  # the language decoded with (given, or detected when the call asked for "")


class SpeechRecognizer(Protocol):
    languages: list[str]  # what a session may ask for: ["en"] for an English-only model; "" means detect

    def transcribe(
        self, audio: np.ndarray, *, wait: bool = True, context: str = "", language: str | None = None
    ) -> Transcription | None:
        """Transcribe 16 kHz float32 mono audio (blocking: call it off the event loop).

        ``wait=False`` returns None instead of queueing behind another call (partials are
        worth less than a final), and may give up (None) for a call that comes to wait for it.
        ``context`` is the text said just before this audio.
        ``language`` is one of ``languages`` ("" = detect); None = the recognizer's default.
        """
        ...


# ---------------------------------------------------------------- end of turn
class TurnDetector(Protocol):
    def complete_probability(self, audio: np.ndarray) -> float:
        """P(the user has finished their turn), from 16 kHz audio ending where their speech paused (blocking)."""
        ...


# ---------------------------------------------------------------- LLM
@dataclass(frozen=True)
class GenerationSettings:
    """How a reply is decoded, as OpenAI/vLLM request fields.

    Each field is the setting ``llm_<field>`` (``app.config.Settings``; the conversation policy's row may set its
    default, ``app.policy``): ``from_settings`` reads them by that one name, so a new sampling field is this field,
    its setting, and the backend that sends it.
    """

    max_tokens: int = 120
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    seed: int | None = None  # (None: each reply draws its own; only sampling, temperature > 0, reads it)

    @classmethod
    def from_settings(cls, settings: Any) -> GenerationSettings:
        """The fields from their settings (``settings.llm_max_tokens``, ``settings.llm_temperature``, ...)."""
        return cls(**{field.name: getattr(settings, f"llm_{field.name}") for field in fields(cls)})

    def sampling(self) -> dict[str, float]:
        """The request's sampling fields: temperature and top_p always, the others only where they do something
        (a server that lacks one, DRY say, is not sent it)."""
        chosen: dict[str, float] = {"temperature": self.temperature, "top_p": self.top_p}
        for each in fields(self):
            if each.name not in (*chosen, "max_tokens") and getattr(self, each.name) != each.default:
                chosen[each.name] = getattr(self, each.name)
        if not self.temperature:
            chosen.pop("seed", None)  # greedy: nothing to seed
        return chosen


@dataclass(frozen=True)
class ToolCall:
    """A function call the LLM wrote. ``arguments`` is JSON text as the model wrote it (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSpec:
    """The functions one reply may call, as OpenAI's Chat Completions takes them.

    ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}`` each (may be empty:
    the conversation holds earlier calls, and none may be made now). ``choice``: ``none``, ``auto``,
    ``required`` or ``{"type": "function", "function": {"name": ...}}``. ``parallel``: several calls in one reply.
    """

    tools: tuple[dict[str, Any], ...] = ()
    choice: str | dict[str, Any] = "auto"
    parallel: bool = False


class TurnEndVerdict:
    """The LLM's probability that the user's words end their turn, to come from a speculative reply's own prefill.

    The utterance tracker offers one with the words (``TailText``); a reply that can read it at the words' end in
    its prompt takes it (``take``, with that position: ``LocalScheduling.turn_end_position``) and sets it with its
    first token, else the tracker asks the LLM apart (``end_of_turn_probability``). Why: asked apart, the verdict's
    prefill of the words and the reply's ran side by side on the same cores, and the reply's first token came
    ~28 ms later (bundled model, 2 cores; app/bench/results/turn_flow.md).
    """

    def __init__(self) -> None:
        self.position: int | None = None  # where the taking reply reads it (None: not taken)
        self._result: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()

    @property
    def taken(self) -> bool:
        return self.position is not None

    def take(self, position: int) -> None:
        self.position = position

    def set(self, probability: float | None) -> None:
        """The verdict (None: the reply could not read it); only the first counts."""
        if not self._result.done():
            self._result.set_result(probability)

    async def wait(self) -> float | None:
        return await self._result


@dataclass(frozen=True)
class StandAlone:
    """The user's words without the conversation (``ReplyRequest.alone``): a small model answers a question that
    stands alone better without earlier exchanges, and a follow-up only with them (``app.policy``). Chosen where
    the conversation makes the words less likely than ``min_gain_nats`` (-inf: never for that), or where, with
    tools, the words alone make a call and with the conversation do not."""

    messages: list[Message]
    min_gain_nats: float
    on_weighed: Callable[[float | None], None] | None = None


# The optional parts of a ``ReplyRequest``; a backend's ``ChatLLM.features`` says which it carries out.
ReplyFeature = Literal["tools", "alone", "turn_end", "earlier_replies"]


@dataclass(frozen=True)
class ReplyRequest:
    """Everything one reply asks of the LLM. Each optional field is a feature of its own; they compose (a reply
    may weigh the conversation, read the turn-end verdict, call tools and avoid its earlier replies at once).

    ``tools``: the functions the reply may call (None: text only); the stream then also yields ``ToolCall`` values.
    ``alone``: the user's words without the conversation; the reply is written from whichever prompt the LLM
    finds fits the words (``StandAlone``), both prefilled at once and the other aborted at its first token.
    ``turn_end``: a verdict taken for this reply (``TurnEndVerdict.take``): set from the reply's own prefill
    with its first token (None if it never gets there).
    ``earlier_replies``: the conversation's earlier replies, shown in ``messages`` or not, for a sampler with DRY
    to read as text not to say again.
    """

    messages: list[Message]
    request_id: str
    sampling: GenerationSettings = field(default_factory=GenerationSettings)
    tools: ToolSpec | None = None
    alone: StandAlone | None = None
    turn_end: TurnEndVerdict | None = None
    earlier_replies: Sequence[str] = ()

    def features(self) -> frozenset[ReplyFeature]:
        """The optional fields this request uses."""
        used = {
            "tools": self.tools is not None,
            "alone": self.alone is not None,
            "turn_end": self.turn_end is not None,
            "earlier_replies": bool(self.earlier_replies),
        }
        return frozenset(name for name, on in used.items() if on)  # type: ignore[misc]

    def within(self, supported: frozenset[ReplyFeature]) -> ReplyRequest:
        """This request without the features a backend does not carry out: a verdict it cannot read is set to None
        (the tracker then asks the LLM apart), the words are not weighed (the conversation is kept, and the
        weighing told None), and tools are dropped with a warning (the reply is text only)."""
        dropped = self.features() - supported
        if not dropped:
            return self
        if "turn_end" in dropped and self.turn_end is not None:
            self.turn_end.set(None)
        if "alone" in dropped and self.alone is not None and self.alone.on_weighed is not None:
            self.alone.on_weighed(None)
        if "tools" in dropped and self.tools is not None and self.tools.tools:
            log.warning("the LLM backend does not call tools; request %s is text only", self.request_id)
        cleared = {"tools": None, "alone": None, "turn_end": None, "earlier_replies": ()}
        return replace(self, **{name: cleared[name] for name in dropped})


class ChatLLM(Protocol):
    """The one interface the voice app uses to reach an LLM: a reply streamed from one ``ReplyRequest``, with abort.

    The in-process engine also schedules its requests beside the voice models: that is a capability
    apart (``LocalScheduling``, found with ``scheduling_of``), so remote backends implement only this.
    """

    name: str
    context_tokens: int | None  # prompt + reply tokens the model takes; None when unknown (a remote server)
    features: frozenset[ReplyFeature]  # the request's optional fields this backend carries out

    def count_tokens(self, messages: list[Message]) -> int | None:
        """The prompt's length in the model's tokens, or None without a tokenizer here."""
        ...

    def stream(self, request: ReplyRequest) -> AsyncIterator[str | ToolCall]:
        """Yield the reply's text piece by piece, then each call it made (``ToolCall``, its arguments whole: only
        with ``request.tools``); closing the iterator aborts the request. An empty string says the model wrote
        something not to be said (a call it is writing): nothing to speak, but a sign that it is alive, which the
        reply's wait for its first words counts (``app.voice.llm_wait``). Fields outside ``features`` are ignored:
        callers pass ``request.within(llm.features)`` (``open_reply``)."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def health(self) -> tuple[bool, str]:
        """Can it answer now? (``/healthz`` reports this; False makes the server say 503.)"""
        ...

    def close(self) -> None: ...


def open_reply(llm: ChatLLM, request: ReplyRequest) -> AsyncIterator[str | ToolCall]:
    """The reply to ``request`` from ``llm``, with the features it does not carry out dropped (``within``)."""
    return llm.stream(request.within(llm.features))


@runtime_checkable
class LocalScheduling(Protocol):
    """An LLM that runs on this machine's cores, beside speech recognition and synthesis: the voice app
    tells it which request may wait, and when to leave cores to the others. Only the in-process engine
    has it; elsewhere (a remote server, plain transformers) the voice app skips these calls."""

    def pause(self, request_id: str, max_s: float) -> None:
        """Generate no more of ``request_id`` for at most ``max_s`` seconds, until ``resume`` (while its first
        spoken piece is synthesized on every core)."""
        ...

    def resume(self, request_id: str) -> None: ...

    def yield_to_others(self, request_id: str, max_s: float) -> None:
        """For at most ``max_s`` seconds, generate ``request_id`` only when no other request needs the LLM
        (its listener has seconds of audio still to hear)."""
        ...

    def set_urgent_first_tokens(self, n: int) -> None:
        """Decode the first ``n`` tokens of a lone request on every core (the server's solo mode)."""
        ...

    def core_lent(self) -> AbstractContextManager[None]:
        """While open, another model (the end-of-turn model) runs on one core: the LLM steps on the others."""
        ...

    def idle(self) -> bool:
        """No request of any conversation is in the LLM now: work that may turn out unneeded (a warm-up for a
        prompt that only some replies use) takes no cores from anyone."""
        ...

    async def warm(
        self, messages: list[Message], tools: ToolSpec | None = None, *, score_words: bool = False
    ) -> float | None:
        """Compute (and cache) the KV of ``messages`` as the start of a later prompt (its prefix cache); ``tools``:
        the later request's, which change how the prompt is rendered; ``score_words``: also the scores of the last
        user message's words that a request weighing them (``ReplyRequest.alone``) reads, and return their mean
        log-probability a token (None without ``score_words``, or where they could not be scored)."""
        ...

    async def end_of_turn_probability(self, messages: list[Message], user_text: str) -> float | None:
        """How likely the user's turn ends right after ``user_text`` (said after ``messages``): the probability
        the LLM gives its chat template's end-of-turn token there. None when the template has no such token.

        One short prefill: the prompt is the reply's, but for its last few tokens (the prefix cache holds the rest).
        """
        ...

    def turn_end_position(self, messages: list[Message], tools: ToolSpec | None = None) -> int | None:
        """Where the reply's own prompt for ``messages`` (rendered with ``tools``) gives ``end_of_turn_probability``
        of its last (user) message's words: the index of the token after the words bare of their final punctuation,
        when the reply's prompt starts with the tokens the verdict's prompt has; None where it does not."""
        ...


def scheduling_of(llm: ChatLLM) -> LocalScheduling | None:
    """The LLM's ``LocalScheduling``, or None where it has none (the caller then skips the work)."""
    return llm if isinstance(llm, LocalScheduling) else None


# ---------------------------------------------------------------- TTS
class Synthesizer(Protocol):
    sample_rate: int
    voices: list[str]  # names a session may choose (``config.voice``); the first is the default

    def voice_for(self, language: str) -> str | None:
        """The voice that speaks ``language`` (a Whisper code), or None when none does."""
        ...

    def synthesize(
        self, text: str, voice: str | None = None, *, urgent: bool = False, deadline: float | None = None
    ) -> Iterator[np.ndarray]:
        """Yield float32 mono audio chunks at ``sample_rate`` for ``text`` in ``voice`` (None: the default).

        ``urgent``: the listener is waiting for this audio (a reply's first piece, with the LLM paused):
        it may use more cores than a later piece, which is synthesized beside the LLM.
        ``deadline``: when the listener runs out of audio without this piece (``time.monotonic()``
        scale; None: now). Calls waiting for the same model go in deadline order
        (``app.stages.scheduling.DeadlineLock``).

        Blocking; run it off the event loop.
        """
        ...


class VoiceStages(Protocol):
    """What one conversation needs from the loaded models (``registry.Models`` is the real one)."""

    asr: SpeechRecognizer
    llm: ChatLLM
    tts: Synthesizer
    turn: TurnDetector | None  # the end-of-turn model, when one is configured
    solo: bool  # one session is open: the speed-ups that slow several sessions apply (the server sets it)

    def vad_stream(self, config: VadConfig) -> VoiceActivity:
        """A fresh VAD state for one input stream (the model itself is shared)."""
        ...
