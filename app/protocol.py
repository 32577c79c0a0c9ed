"""The voice-session wire protocol, in one place.

One WebSocket per conversation at ``/ws``.

Client -> server
  * binary frames: microphone audio, mono PCM16 little-endian, at the sample rate
    declared in ``start`` (16 kHz when no ``start`` is sent). Each frame must hold
    whole samples and be at most ``MAX_AUDIO_FRAME_BYTES``.
  * text frames: one JSON object each, see ``ClientMessage``.

Server -> client
  * binary frames: reply audio, mono PCM16 little-endian at ``Ready.output_sample_rate``.
  * text frames: one JSON object each, see ``ServerMessage``.

Every error is reported as an ``Error`` event; the session stays open unless the
error says ``fatal``.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
INPUT_SAMPLE_RATE = 16_000
MAX_AUDIO_FRAME_BYTES = 64 * 1024  # ~2 s of 16 kHz PCM16; a browser sends 20-100 ms
MAX_TEXT_FRAME_BYTES = 64 * 1024  # a config with tools' JSON schemas, a tool's result
MIN_INPUT_SAMPLE_RATE = 8_000
MAX_INPUT_SAMPLE_RATE = 96_000
MAX_USER_TEXT_CHARS = 2_000
MAX_TOOLS = 32
MAX_TOOL_OUTPUT_CHARS = 4_000  # a tool's result as the LLM reads it; longer ones are cut (``app.voice.tools``)
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- client -> server
class Start(_Message):
    """Optional first message: declares the microphone's sample rate."""

    type: Literal["start"] = "start"
    sample_rate: int = Field(INPUT_SAMPLE_RATE, ge=MIN_INPUT_SAMPLE_RATE, le=MAX_INPUT_SAMPLE_RATE)


class UserText(_Message):
    """A typed user turn (no audio), answered like a spoken one."""

    type: Literal["text"] = "text"
    text: str = Field(min_length=1, max_length=MAX_USER_TEXT_CHARS)


class Reset(_Message):
    """Forget the conversation history and cancel any reply in progress."""

    type: Literal["reset"] = "reset"


class Playback(_Message):
    """Client report of how much reply audio it has actually played (for barge-in)."""

    type: Literal["playback"] = "playback"
    turn_id: int = Field(ge=0)
    played_ms: float = Field(ge=0)


class Cancel(_Message):
    """Stop the reply now (like a barge-in, without speaking); the history keeps what was heard."""

    type: Literal["cancel"] = "cancel"


class ToolResult(_Message):
    """The result of the call ``call_id`` (a ``tool_call`` event that ran on the client); the reply goes on with it.

    ``output`` is text for the LLM (JSON, say); it is cut to ``MAX_TOOL_OUTPUT_CHARS``.
    """

    type: Literal["tool_result"] = "tool_result"
    call_id: str = Field(min_length=1, max_length=64)
    output: str


MAX_SYSTEM_PROMPT_CHARS = 2_000


class FunctionTool(_Message):
    """A function the assistant may call (the Realtime API's shape): ``parameters`` is a JSON schema of its arguments."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str = Field("", max_length=1_000)
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})


class NamedFunction(_Message):
    """A ``tool_choice`` that forces a call of the function ``name``."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME_PATTERN)


ToolChoice = Literal["auto", "none", "required"] | NamedFunction


class SessionConfig(_Message):
    """Per-conversation preferences; each field given replaces the current value, the others stay.

    ``language`` is the ASR language ("" = detect it), ``barge_in`` whether speaking over a
    reply interrupts it, ``half_duplex`` whether the microphone is ignored while a reply plays
    (loudspeakers without echo cancellation). ``tools``: functions the client runs when the
    assistant calls them (``tool_call`` event, ``tool_result`` message; ``[]`` declares none);
    ``tool_choice``: ``auto`` (the model decides), ``none``, ``required`` (the reply is a call) or
    one named function; ``parallel_tool_calls``: several calls in one reply; ``reply_audio`` whether
    replies are spoken (false: text only, no speech synthesis; ``assistant_text`` and ``turn_done`` come as usual).
    """

    type: Literal["config"] = "config"
    system_prompt: str | None = Field(None, min_length=1, max_length=MAX_SYSTEM_PROMPT_CHARS)
    voice: str | None = Field(None, min_length=1, max_length=200)
    language: str | None = Field(None, max_length=16, pattern=r"^[a-z]{0,3}(-[A-Za-z]{2,4})?$")
    barge_in: bool | None = None
    half_duplex: bool | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reply_audio: bool | None = None


ClientMessage = Annotated[
    Start | UserText | Reset | Playback | Cancel | SessionConfig | ToolResult, Field(discriminator="type")
]
ClientMessageType = Start | UserText | Reset | Playback | Cancel | SessionConfig | ToolResult
_client_adapter: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)


# ---------------------------------------------------------------- server -> client
class Ready(_Message):
    """Sent once on connect and again after each ``start``."""

    type: Literal["ready"] = "ready"
    protocol: int = PROTOCOL_VERSION
    input_sample_rate: int
    output_sample_rate: int
    voices: list[str] = Field(default_factory=list)  # what ``config.voice`` may name
    languages: list[str] = Field(default_factory=list)  # what ``config.language`` may name ("" = detect)


class SpeechStarted(_Message):
    type: Literal["speech_started"] = "speech_started"


class SpeechStopped(_Message):
    type: Literal["speech_stopped"] = "speech_stopped"


class SpeechDropped(_Message):
    """The speech since ``speech_started`` is not a turn, and nothing will answer it: no words were heard in it
    (noise, a cough), only a filler ("um"), or a backchannel said over a reply ("yeah": the reply goes on).

    Partial transcripts it was shown by (``turn_id``) are void. Where the speech went on with a committed
    turn, that turn's final transcript follows again: its words stand as committed.
    Why: without it a client could only guess, by a timeout, that a "thinking" state or a partial will never end.
    """

    type: Literal["speech_dropped"] = "speech_dropped"
    turn_id: int
    reason: Literal["no_words", "filler", "backchannel"]
    heard: str = ""  # the words heard in it ("" for no_words)


class Transcript(_Message):
    """What the user said; ``final`` is false for partials while they speak."""

    type: Literal["transcript"] = "transcript"
    turn_id: int
    text: str
    final: bool
    language: str | None = None  # on a spoken final: the language it was heard in (detected when set to "")


class AssistantText(_Message):
    """A piece of the assistant's reply, as the LLM streams it."""

    type: Literal["assistant_text"] = "assistant_text"
    turn_id: int
    delta: str


class AudioStart(_Message):
    """Binary reply audio for ``turn_id`` follows."""

    type: Literal["audio_start"] = "audio_start"
    turn_id: int
    sample_rate: int


class Interrupt(_Message):
    """Barge-in: stop playing the reply of ``turn_id`` now and drop its queued audio."""

    type: Literal["interrupt"] = "interrupt"
    turn_id: int


class TurnContinued(_Message):
    """The user went on speaking right after ``turn_id`` was committed, before its reply was heard.

    That reply is withdrawn: stop playing it and drop its text. The turn is open again: its
    transcripts (now the whole of what was said) and then its reply follow as usual, under the
    same ``turn_id``. Humans do this at a mid-sentence pause ("I want to visit Paris ... and
    London"); answering only the first half would cut them off.
    """

    type: Literal["turn_continued"] = "turn_continued"
    turn_id: int


class CallTool(_Message):
    """The assistant calls the function ``name`` with ``arguments`` (JSON text) in its reply to ``turn_id``.

    ``runs_on`` "client": one of the client's tools; answer with a ``tool_result`` naming ``call_id``
    (the reply waits, at most the server's ``tool_timeout_s``). "server": a tool of the server's own,
    shown for the transcript; its ``tool_done`` follows.
    """

    type: Literal["tool_call"] = "tool_call"
    turn_id: int
    call_id: str
    name: str
    arguments: str
    runs_on: Literal["client", "server"] = "client"


class ToolDone(_Message):
    """The call ``call_id`` is settled: ``completed`` (``output`` is what the LLM reads), ``timeout`` (no result in
    time: the LLM reads that it failed, and the reply goes on), ``failed`` (a server tool raised) or ``cancelled``
    (a barge-in or ``cancel`` stopped the reply; a later ``tool_result`` for it is refused)."""

    type: Literal["tool_done"] = "tool_done"
    turn_id: int
    call_id: str
    name: str
    status: Literal["completed", "timeout", "failed", "cancelled"]
    output: str = ""


class ConfigApplied(_Message):
    """The session's preferences after a ``config`` message (and what they are by default)."""

    type: Literal["config_applied"] = "config_applied"
    system_prompt: str
    voice: str
    language: str
    barge_in: bool
    half_duplex: bool
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = False
    reply_audio: bool = True


class TurnMetrics(BaseModel):
    """Per-turn figures, the one vocabulary of the server, its clients, the page and the benchmarks.

    Latencies are in milliseconds (names end in ``_ms``); a figure a turn did not reach (an
    interrupted reply has no RTF) is ``None`` and left out of the JSON. Definitions:
    ``voice_to_voice_ms`` is from the end of the user's speech (as the server's VAD placed
    it) to the first reply audio sent; the stage figures split it.
    """

    model_config = ConfigDict(extra="ignore")

    endpoint_ms: float | None = Field(None, description="end of speech to turn committed")
    asr_final_ms: float | None = Field(None, description="turn committed to final transcript ready")
    asr_compute_ms: float | None = Field(None, description="Whisper time for the final transcript")
    turn_detect_ms: float | None = Field(None, description="end-of-turn model time at the last pause")
    turn_probability: float | None = Field(None, description="the end-of-turn model's P(turn complete)")
    turn_text_probability: float | None = Field(None, description="the LLM's P(the user's words end there)")
    turn_text_ms: float | None = Field(None, description="what the LLM's end-of-turn verdict took")
    llm_ttft_ms: float | None = Field(None, description="LLM request to first token")
    llm_first_piece_ms: float | None = Field(None, description="LLM request to the first spoken piece written")
    tts_first_audio_ms: float | None = Field(None, description="first clause to its audio")
    voice_to_voice_ms: float | None = Field(None, description="end of speech to first reply audio sent")
    reply_audio_s: float | None = Field(None, description="seconds of reply audio sent")
    rtf: float | None = Field(None, description="reply audio seconds per wall second spent producing it")
    underruns: int = Field(0, description="reply audio chunks sent after the previous ones would have played")
    underrun_s: float | None = Field(
        None, description="silence heard mid-reply while late audio was awaited (all underruns together)"
    )
    history_gain_nats: float | None = Field(
        None,
        description="how much likelier (nats a token) the conversation made the user's words; under "
        "history_relevance_nats the reply was written without it",
    )
    history_left_out: bool = Field(
        False,
        description="the reply was written without the conversation (it gained less, or a follow-up was asked in "
        "full alone)",
    )
    asked_in_full: str | None = Field(
        None, description="the user's elliptical follow-up as the LLM was asked it, in full (setting follow_ups)"
    )
    history_weighed_early: bool = Field(
        False,
        description="history_gain_nats is that of the words heard while the user spoke (the reply started on one prompt)",
    )
    speculative: bool = Field(False, description="the reply was started before the endpoint and released")
    barge_in: bool = Field(False, description="the user interrupted the reply")
    # The reply guards (``app.voice.reply``): how often each cut this turn's reply short. Absent when none did.
    guard_repeat: int | None = Field(
        None, description="times the reply was ended where a piece of 3 or more words was said again"
    )
    guard_loop: int | None = Field(None, description="times the reply was cut at a few words said again and again")
    guard_runaway: int | None = Field(
        None,
        description="times the reply was cut where its text stopped being speech (no spaces, counting, repetition, data)",
    )
    guard_length: int | None = Field(
        None, description="times the reply ended at a sentence once its speech budget was spent"
    )
    # Tool calls (``app.voice.tools``): absent in a turn that made none.
    tool_calls: int | None = Field(None, description="function calls the reply made")
    tool_ms: float | None = Field(None, description="the tools' own time: calls sent to their last result")
    answer_ms: float | None = Field(
        None, description="end of speech to the first audio of the answer written after the tools' results"
    )

    def present(self) -> dict[str, float]:
        """The figures this turn has, as plain numbers (for logs, tables and histograms)."""
        return {key: float(value) for key, value in self.model_dump(exclude_none=True).items()}


LATENCY_FIELDS = tuple(name for name in TurnMetrics.model_fields if name.endswith("_ms"))
GUARD_FIELDS = tuple(name for name in TurnMetrics.model_fields if name.startswith("guard_"))


class TurnDone(_Message):
    """The reply of ``turn_id`` is complete (or was cut short: ``interrupted``)."""

    type: Literal["turn_done"] = "turn_done"
    turn_id: int
    text: str
    interrupted: bool = False
    metrics: TurnMetrics = Field(default_factory=TurnMetrics)


class Notice(_Message):
    """Something the user should know that is not an error (``truncated``: a message was cut to fit)."""

    type: Literal["notice"] = "notice"
    turn_id: int | None = None
    code: str
    message: str


class Error(_Message):
    """Something went wrong; ``fatal`` errors are followed by the server closing the connection.

    ``retry_after_s`` comes with ``overloaded``: when trying again may succeed. ``turn_id`` names the turn an error
    ended (``turn_failed``, ``llm_unavailable``): such a turn has no ``turn_done``.
    """

    type: Literal["error"] = "error"
    code: str
    message: str
    turn_id: int | None = None
    fatal: bool = False
    retry_after_s: float | None = None


ServerMessage = Annotated[
    Ready
    | SpeechStarted
    | SpeechStopped
    | SpeechDropped
    | Transcript
    | AssistantText
    | AudioStart
    | Interrupt
    | TurnContinued
    | TurnDone
    | CallTool
    | ToolDone
    | ConfigApplied
    | Notice
    | Error,
    Field(discriminator="type"),
]
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


class ProtocolError(Exception):
    """Bad client input; carries the ``Error`` event to send back."""

    def __init__(self, code: str, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.event = Error(code=code, message=message, fatal=fatal)


_CLIENT_TYPES = frozenset({"start", "text", "reset", "playback", "cancel", "config", "tool_result"})
MAX_JSON_DEPTH = 16  # client messages are flat objects but for tools' JSON schemas; deeper nesting is never valid
MAX_NUMBER_CHARS = 32  # no field needs more digits; Python would parse 4300-digit integers


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"number with {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text) if len(text) <= MAX_NUMBER_CHARS else math.inf
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:20]}")
    return value


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def _json_depth(raw: str) -> int:
    """Deepest nesting of arrays/objects, counted outside strings, before the parser recurses into it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in raw:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_json(raw: str):
    """``json.loads`` bounded in depth and number size, with NaN/Infinity refused (``ProtocolError`` ``bad_json``).

    Every JSON a client sends (``/ws`` and ``/v1/realtime``) goes through this one parser."""
    # counting brackets first keeps the exact scan off large flat messages (base64 audio)
    if raw.count("[") + raw.count("{") > MAX_JSON_DEPTH and _json_depth(raw) > MAX_JSON_DEPTH:
        raise ProtocolError("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"message is not valid JSON: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("bad_json", f"message is not acceptable JSON: {exc}") from None


def parse_client_text(raw: str) -> ClientMessageType:
    """Validate one JSON text frame from the client."""
    if len(raw.encode("utf-8", "replace")) > MAX_TEXT_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"text frame over {MAX_TEXT_FRAME_BYTES} bytes")
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ProtocolError("bad_message", "message must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _CLIENT_TYPES:
        shown = repr(kind)[:40] if isinstance(kind, str | None) else f"a JSON {type(kind).__name__}"
        raise ProtocolError("unknown_type", f"unknown message type: {shown} (expected one of {sorted(_CLIENT_TYPES)})")
    try:
        return _client_adapter.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "message"
        raise ProtocolError("bad_message", f"invalid {kind!r} message: {where}: {first['msg']}") from None


def check_audio_frame(data: bytes) -> None:
    """Reject binary frames that cannot be PCM16 audio of a sane size."""
    if len(data) > MAX_AUDIO_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"audio frame of {len(data)} bytes is over {MAX_AUDIO_FRAME_BYTES}")
    if len(data) % 2:
        raise ProtocolError("bad_audio", "audio frame must hold whole PCM16 samples (even byte count)")


def encode(message: _Message) -> str:
    return message.model_dump_json(exclude_none=True)


def parse_server_message(raw: str | bytes | dict) -> ServerMessage:
    """Decode one JSON event from the server into its typed message (for Python clients).

    Raises ``ValueError`` for anything that is not a known server event, so a client never
    reads a misspelled field by accident.
    """
    data = json.loads(raw) if isinstance(raw, str | bytes) else raw
    try:
        return _server_adapter.validate_python(data)
    except ValidationError as exc:
        raise ValueError(f"not a server event: {exc.errors()[0]['msg']}") from None
