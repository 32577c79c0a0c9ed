"""Client events, parsed by ``protocol.load_json`` and validated by the ``openai`` package's own models.

Every client event is checked against the SDK's client-event union (``openai.types.realtime``,
strict: no string is taken for a number) before a handler reads it; a failure is an
``invalid_request_error`` whose ``param`` is the field's path. Parley accepts a little more
than the SDK's schema, and says so here, as subclasses of the SDK's models:
``session.type`` may be left out (a realtime session), ``session.include`` may name Parley's
own ``parley.*`` events, ``audio.input.turn_detection`` may be ``false`` (pipecat's "off") or
leave out its ``type`` (server VAD), and ``conversation.item.truncate`` may leave out
``content_index`` (there is one part).

The SDK's models let unknown fields through; which of them matter (beta-API names in
``session``) is the handlers' business. What Parley refuses of a valid event (MCP tools, prompt
templates, audio formats...) is checked on the typed values, with the helpers at the end; a
malformed part of something Parley refuses anyway is reported as that refusal.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Union

from openai.types.realtime import (
    ConversationItemTruncateEvent,
    RealtimeAudioConfig,
    RealtimeAudioConfigInput,
    RealtimeClientEvent,
    RealtimeSessionCreateRequest,
    RealtimeTranscriptionSessionCreateRequest,
    SessionUpdateEvent,
)
from openai.types.realtime.realtime_audio_input_turn_detection import SemanticVad, ServerVad
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from app import protocol
from app.server.realtime.core import MAX_EVENT_CHARS, MAX_ID_CHARS, REALTIME_SAMPLE_RATE, RealtimeError, unsupported


# ---------------------------------------------------------------- what Parley accepts beyond the SDK's schema
class ServerVadTurns(ServerVad):
    type: Literal["server_vad"] = "server_vad"  # server VAD unless the client names another


class AudioInput(RealtimeAudioConfigInput):
    turn_detection: ServerVadTurns | SemanticVad | Literal[False] | None = None  # false: off (pipecat)


class AudioConfig(RealtimeAudioConfig):
    input: AudioInput | None = None


class RealtimeSession(RealtimeSessionCreateRequest):
    type: Literal["realtime"] = "realtime"
    audio: AudioConfig | None = None
    include: list[str] | None = None  # the SDK's values, and Parley's own "parley.*" events


class SessionUpdate(SessionUpdateEvent):
    session: RealtimeSession | RealtimeTranscriptionSessionCreateRequest


class ItemTruncate(ConversationItemTruncateEvent):
    content_index: int = 0


_PARLEY_MODELS = {SessionUpdateEvent: SessionUpdate, ConversationItemTruncateEvent: ItemTruncate}
_SDK_EVENTS = typing.get_args(typing.get_args(RealtimeClientEvent)[0])
_EVENTS: TypeAdapter[Any] = TypeAdapter(
    Annotated[Union[tuple(_PARLEY_MODELS.get(c, c) for c in _SDK_EVENTS)], Field(discriminator="type")]  # noqa: UP007
)


# ---------------------------------------------------------------- parsing
def load_event(raw: str) -> dict[str, Any]:
    """One client event as JSON: an object with a string ``type`` (``protocol.load_json``: bounded)."""
    if len(raw) > MAX_EVENT_CHARS:
        raise RealtimeError("event_too_large", f"event over {MAX_EVENT_CHARS} characters")
    try:
        data = protocol.load_json(raw)
    except protocol.ProtocolError as error:
        raise RealtimeError("invalid_json", error.event.message) from None
    if not isinstance(data, dict):
        raise RealtimeError("invalid_event", "an event must be a JSON object")
    if not isinstance(data.get("type"), str):
        raise RealtimeError("missing_required_parameter", "an event needs a string 'type'", "type")
    return data


def event_id(data: dict[str, Any]) -> str | None:
    """The client's ``event_id``, which every error about its event carries back (when it is a sane one)."""
    value = data.get("event_id")
    return value if isinstance(value, str) and len(value) <= MAX_ID_CHARS else None


def validate_event(data: dict[str, Any]) -> BaseModel:
    """The event as the SDK's (or Parley's extended) model; ``RealtimeError`` naming the field if it is not one."""
    try:
        return _EVENTS.validate_python(data, strict=True)
    except ValidationError as exc:
        raise _invalid(exc.errors(include_url=False), data) from None


# ---------------------------------------------------------------- validation errors
# A union the SDK does not discriminate for pydantic (items, formats, tools, voices...) fails in
# every member; the error to report is the one in the member the client meant: the one whose
# "type" and "role" match what it wrote, and among those the one with the fewest errors.
_TAGS = ("type", "role")


def _walk(error: dict, data: Any) -> tuple[list[str | int], list[tuple]]:
    """The field path of ``error`` in the client's JSON, and the union members (as ``loc`` prefixes) it went through."""
    loc, path, members, value = error["loc"], [], [], data
    for index, part in enumerate(loc):
        last = index == len(loc) - 1
        if (
            isinstance(value, dict)
            and isinstance(part, str)
            and (part in value or (last and error["type"] == "missing"))
        ):
            path.append(part)
            value = value.get(part)
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            path.append(part)
            value = value[part]
        else:
            members.append(loc[: index + 1])  # a member's name (the model, or "str", "literal[...]")
    return path, members


def _tag(error: dict, members: list[tuple]) -> bool:
    """A "type" or "role" right under a union member, missing or not the value the client wrote."""
    loc = error["loc"]
    return (
        bool(members) and loc[:-1] == members[-1] and loc[-1] in _TAGS and error["type"] in ("literal_error", "missing")
    )


def _param(path: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _invalid(errors: list[dict], data: dict[str, Any]) -> RealtimeError:
    if errors[0]["type"] == "union_tag_invalid":
        return RealtimeError("unknown_event_type", f"unknown client event type {data['type'][:60]!r}", "type")
    walked = [(error, *_walk(error, data)) for error in errors]
    counts: dict[tuple, int] = {}  # errors per member
    misfits: dict[tuple, int] = {}  # per member: its tags that do not match, or the whole value of another kind
    for error, _, members in walked:
        for member in members:
            counts[member] = counts.get(member, 0) + 1
        if members and (error["loc"] == members[-1] or _tag(error, members)):
            misfits[members[-1]] = misfits.get(members[-1], 0) + 1

    def rank(entry: tuple) -> list[int]:
        error, _, members = entry
        key = [score for m in members for score in (misfits.get(m, 0), counts[m])]
        return [*key, 0 if _tag(error, members) else 1]

    error, path, members = min(walked, key=rank)
    param = _param(path)
    refusal = _refusal(path, data)
    if refusal is not None:
        return refusal
    if error["type"] == "missing":
        return RealtimeError("missing_required_parameter", f"missing required parameter: '{param}'", param)
    if error["type"] == "literal_error":
        expected = [error["ctx"]["expected"]]
        if _tag(error, members):  # the member's tag: what every member of that union would take
            expected = [e["ctx"]["expected"] for e, p, m in walked if p == path and _tag(e, m) and "ctx" in e]
        shown = repr(error["input"])[:60]
        return RealtimeError(
            "invalid_value", f"'{param}' is {shown}; expected {' or '.join(dict.fromkeys(expected))}", param
        )
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return RealtimeError("invalid_type", f"'{param}' must be an object", param)
    code = "invalid_type" if error["type"].endswith("_type") else "invalid_value"
    return RealtimeError(code, f"'{param}': {error['msg']}", param)


def _refusal(path: list[str | int], data: dict[str, Any]) -> RealtimeError | None:
    """A malformed part of a feature Parley refuses anyway: the refusal, which is the news."""
    if path[:1] in (["session"], ["response"]) and path[1:2] in (["tools"], ["tool_choice"], ["prompt"]):
        refusals = tool_refusals(str(path[0]), **{str(path[1]): _at(data, path[:2])})
        if refusals:
            return refusals[0]
    for index in range(1, len(path)):
        if path[index] == "format" and path[index - 1] in ("input", "output"):
            spec = _at(data, path[: index + 1])
            return format_refusal(spec if isinstance(spec, dict) else {}, _param(path[: index + 1]))
    return None


def _at(data: Any, path: list[str | int]) -> Any:
    for part in path:
        data = data[part]
    return data


# ---------------------------------------------------------------- what Parley refuses of a valid event
def tool_refusals(prefix: str, tools: Any = None, tool_choice: Any = None, prompt: Any = None) -> list[RealtimeError]:
    """What Parley refuses of tools (in ``session`` or ``response``): MCP servers and prompt templates. Function
    tools are served (``configure.function_tools``)."""
    errors = []
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if _field(tool, "type") == "mcp":
            errors.append(unsupported(f"{prefix}.tools[{index}].type", "MCP tools"))
    if _field(tool_choice, "type") == "mcp":
        errors.append(unsupported(f"{prefix}.tool_choice", "an MCP tool_choice"))
    if prompt is not None:
        errors.append(unsupported(f"{prefix}.prompt", "prompt templates"))
    return errors


def _field(value: Any, name: str) -> Any:
    """A field of a typed model or of the raw JSON (a refusal is checked on either)."""
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def check_format(audio_format: BaseModel | None, param: str) -> None:
    """24 kHz PCM, the one format Parley speaks (the SDK's models also take G.711 and other rates)."""
    if audio_format is not None:
        refusal = format_refusal(audio_format.model_dump(exclude_none=True), param)
        if refusal is not None:
            raise refusal


def format_refusal(spec: dict[str, Any], param: str) -> RealtimeError | None:
    """None for 24 kHz PCM (the format's fields as sent: ``type``, ``rate``), else the refusal."""
    kind, rate = spec.get("type", "audio/pcm"), spec.get("rate", REALTIME_SAMPLE_RATE)
    if kind == "audio/pcm" and rate == REALTIME_SAMPLE_RATE:
        return None
    return RealtimeError(
        "unsupported_audio_format",
        f"only audio/pcm at {REALTIME_SAMPLE_RATE} Hz is supported, not {str(kind)[:40]!r} at {str(rate)[:12]}",
        param,
    )


def bounded(value: str | None, param: str, max_chars: int) -> str | None:
    """A string field within Parley's bound (the SDK sets none)."""
    if value is not None and len(value) > max_chars:
        raise RealtimeError(
            "string_above_max_length", f"'{param}' is {len(value)} characters; at most {max_chars}", param
        )
    return value
