"""What a client's ``session.update`` and ``response.create`` ask of Parley, checked on the typed events.

Pure functions: they read the SDK's models (``schema``), the configuration so far, the server's
settings and the models' voices and languages, and say what changes; the inbound half applies it
to the state and the session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from openai.types.realtime import RealtimeAudioConfigOutput, RealtimeResponseCreateParams, ResponseCreateEvent
from openai.types.realtime.audio_transcription import AudioTranscription
from openai.types.realtime.realtime_audio_input_turn_detection import SemanticVad, ServerVad
from pydantic import BaseModel, ValidationError

from app import protocol
from app.config import Settings
from app.server.realtime.core import MAX_ID_CHARS, MAX_METADATA_CHARS, MAX_METADATA_KEYS, RealtimeError, unsupported
from app.server.realtime.schema import AudioConfig, AudioInput, RealtimeSession, bounded, check_format, tool_refusals
from app.server.realtime.state import RealtimeConfig, ResponseParams, TurnDetection

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})
# semantic_vad eagerness -> (endpoint silence, silence after words that end mid-clause), in ms
EAGERNESS_MS = {"high": (250, 700), "low": (800, 2500)}

_READ_ONLY_SESSION_KEYS = frozenset({"object", "id", "expires_at", "client_secret"})  # echoes of session.created
_BETA_HINTS = {  # beta-API session fields, and where the GA API puts them
    "modalities": "session.output_modalities",
    "voice": "session.audio.output.voice",
    "input_audio_format": "session.audio.input.format",
    "output_audio_format": "session.audio.output.format",
    "input_audio_transcription": "session.audio.input.transcription",
    "input_audio_noise_reduction": "session.audio.input.noise_reduction",
    "turn_detection": "session.audio.input.turn_detection",
    "max_response_output_tokens": "session.max_output_tokens",
}


@dataclass
class SessionChange:
    """A ``session.update``, checked: the configuration it leaves, the session preferences it changes
    (``protocol.SessionConfig`` fields), whether it set turn detection, and what it asked that was
    refused (the rest still applies)."""

    config: RealtimeConfig
    prefs: dict[str, Any]
    turn_detection_set: bool
    errors: list[RealtimeError]


def session_change(session: RealtimeSession, current: RealtimeConfig, settings: Settings, models) -> SessionChange:
    """``session`` applied to a copy of ``current``; ``models`` gives the voices and languages there are."""
    config = replace(current)
    prefs: dict[str, Any] = {}
    refused = tool_refusals("session", session.tools, session.tool_choice, session.prompt)
    errors = refused + _unknown_keys(session.model_extra or {})
    if session.model is not None:
        config.model = session.model[:MAX_ID_CHARS]
    if not refused:
        _collect(errors, _apply_tools, session, config, prefs)
    _collect(errors, _apply_instructions, session.instructions, settings, config, prefs)
    _collect(errors, _apply_modality, session.output_modalities, config)
    if session.include is not None:
        config.include = frozenset(v for v in session.include if v.startswith("parley."))
    audio = session.audio or AudioConfig()
    audio_in, audio_out = audio.input or AudioInput(), audio.output or RealtimeAudioConfigOutput()
    _collect(errors, check_format, audio_in.format, "session.audio.input.format")
    _collect(errors, check_format, audio_out.format, "session.audio.output.format")
    if "transcription" in audio_in.model_fields_set:
        _collect(errors, _apply_transcription, audio_in.transcription, list(models.asr.languages), config, prefs)
    _collect(errors, _apply_voice, audio_out.voice, list(models.tts.voices), config, prefs)
    if audio_out.speed is not None and abs(audio_out.speed - 1.0) > 1e-6:
        errors.append(unsupported("session.audio.output.speed", "a speed other than 1.0"))
    turn_detection_set = False
    if "turn_detection" in audio_in.model_fields_set:
        try:
            config.turn_detection = turn_detection(audio_in.turn_detection, config.turn_detection, settings)
            turn_detection_set = True
            if config.turn_detection is not None:
                prefs["barge_in"] = config.turn_detection.interrupt_response
        except RealtimeError as error:
            errors.append(error)
    return SessionChange(config, prefs, turn_detection_set, errors)


def _collect(errors: list[RealtimeError], apply: Callable[..., None], *args: Any) -> None:
    """``apply(*args)``; its error joins ``errors`` (the rest of a session.update still applies)."""
    try:
        apply(*args)
    except RealtimeError as error:
        errors.append(error)


def _unknown_keys(extra: dict[str, Any]) -> list[RealtimeError]:
    """Fields the SDK's model let through: beta-API names get a hint, echoes of ``session.created`` pass."""
    errors = []
    for key in extra:
        if key in _BETA_HINTS:
            errors.append(
                RealtimeError(
                    "unknown_parameter",
                    f"unknown parameter 'session.{key}': this server speaks the GA Realtime API "
                    f"(use {_BETA_HINTS[key]})",
                    f"session.{key}",
                )
            )
        elif key not in _READ_ONLY_SESSION_KEYS:
            errors.append(
                RealtimeError("unknown_parameter", f"unknown parameter 'session.{key}'", f"session.{key[:60]}")
            )
    return errors


def _apply_tools(session: RealtimeSession, config: RealtimeConfig, prefs: dict) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``: all three apply, or none (one error for all)."""
    tools = config.tools
    if session.tools is not None:
        tools = tuple(function_tools(session.tools, "session.tools"))
    choice = tool_choice(session.tool_choice, tools, "session.tool_choice")
    if session.tools is not None:
        config.tools = tools
        prefs["tools"] = list(tools)
    if choice is not None:
        config.tool_choice = prefs["tool_choice"] = choice
    if session.parallel_tool_calls is not None:
        config.parallel_tool_calls = prefs["parallel_tool_calls"] = session.parallel_tool_calls


def function_tools(tools: list, param: str) -> list[protocol.FunctionTool]:
    """Realtime function tools as Parley's (``protocol.FunctionTool``): named, with an object schema."""
    if len(tools) > protocol.MAX_TOOLS:
        raise RealtimeError("array_above_max_length", f"at most {protocol.MAX_TOOLS} tools", param)
    out = []
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not tool.name:
            raise RealtimeError(
                "missing_required_parameter", f"missing required parameter: '{where}.name'", f"{where}.name"
            )
        parameters = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RealtimeError(
                "invalid_type", f"'{where}.parameters' must be a JSON schema object", f"{where}.parameters"
            )
        try:
            out.append(protocol.FunctionTool(name=tool.name, description=tool.description or "", parameters=parameters))
        except ValidationError as exc:
            field = str(exc.errors()[0]["loc"][0])
            raise RealtimeError(
                "invalid_value", f"'{where}.{field}': {exc.errors()[0]['msg']}", f"{where}.{field}"
            ) from None
    names = [tool.name for tool in out]
    if len(set(names)) != len(names):
        raise RealtimeError("invalid_value", f"'{param}' must have distinct names", param)
    return out


def tool_choice(value: Any, tools: tuple[protocol.FunctionTool, ...], param: str) -> protocol.ToolChoice | None:
    """A Realtime ``tool_choice`` as Parley's; a named function must be among ``tools`` (when the client has any:
    else the server's tools may serve it, which the session checks)."""
    if value is None or isinstance(value, str):
        return value
    if tools and value.name not in {tool.name for tool in tools}:
        raise RealtimeError("invalid_value", f"'{param}' names {value.name!r}, which is not among the tools", param)
    return protocol.NamedFunction(name=value.name)


def _modality(value: list[str] | None, param: str) -> str | None:
    if value is None:
        return None
    if not value:
        raise RealtimeError("invalid_value", f"'{param}' must be ['audio'] or ['text']", param)
    return "audio" if "audio" in value else "text"  # ["audio", "text"] is the beta default: audio + transcript


def _apply_instructions(text: str | None, settings: Settings, config: RealtimeConfig, prefs: dict) -> None:
    if bounded(text, "session.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS) is not None:
        config.instructions = text.strip() or settings.system_prompt  # "" restores the default
        prefs["system_prompt"] = config.instructions


def _apply_modality(modalities: list[str] | None, config: RealtimeConfig) -> None:
    config.modality = _modality(modalities, "session.output_modalities") or config.modality


def _apply_transcription(
    value: AudioTranscription | None, languages: list[str], config: RealtimeConfig, prefs: dict
) -> None:
    config.transcription = value is not None
    if value is None:
        return
    if value.model:
        config.transcription_model = value.model[:MAX_ID_CHARS]  # echoed; Parley's own Whisper transcribes
    language = bounded(value.language, "session.audio.input.transcription.language", 16)
    if language is not None:
        if language not in languages:
            raise RealtimeError(
                "invalid_value",
                f"the speech model does not take language {language!r}; it takes {languages}",
                "session.audio.input.transcription.language",
            )
        config.language = prefs["language"] = language


def _apply_voice(voice: str | BaseModel | None, voices: list[str], config: RealtimeConfig, prefs: dict) -> None:
    if voice is None:
        return
    value = voice if isinstance(voice, str) else voice.id  # a string or {"id": ...}
    if value in voices:
        config.voice = prefs["voice"] = value
    elif value not in OPENAI_VOICES:  # an OpenAI voice name keeps Parley's voice (clients send one by default)
        raise RealtimeError("invalid_value", f"no voice {value[:60]!r}; voices: {voices}", "session.audio.output.voice")


# ---------------------------------------------------------------- turn detection
def turn_detection(
    value: ServerVad | SemanticVad | bool | None, current: TurnDetection | None, settings: Settings
) -> TurnDetection | None:
    """The client's ``turn_detection`` over the current one (None: manual turns)."""
    param = "session.audio.input.turn_detection"
    if value is None or value is False:  # pipecat writes "turn detection off" as false
        return None
    if value.create_response is False:
        raise unsupported(f"{param}.create_response", "create_response false (Parley answers each detected turn)")
    if getattr(value, "idle_timeout_ms", None) is not None:
        raise unsupported(f"{param}.idle_timeout_ms", "idle_timeout_ms")
    detection = replace(current or TurnDetection.default(settings), type=value.type)
    if isinstance(value, ServerVad):
        if value.threshold is not None:
            if not 0.0 < value.threshold < 1.0:
                raise RealtimeError("invalid_value", "threshold must be between 0 and 1", f"{param}.threshold")
            detection.threshold = value.threshold
        if value.silence_duration_ms is not None:
            if not 100 <= value.silence_duration_ms <= 3000:
                raise RealtimeError(
                    "invalid_value", "silence_duration_ms must be 100..3000", f"{param}.silence_duration_ms"
                )
            detection.silence_duration_ms = value.silence_duration_ms
        if value.prefix_padding_ms is not None:
            detection.prefix_padding_ms = value.prefix_padding_ms  # echoed only: Parley keeps 300 ms of pre-roll
    else:
        detection.eagerness = value.eagerness or "auto"
    if value.interrupt_response is not None:
        detection.interrupt_response = value.interrupt_response
    return detection


def turn_settings(detection: TurnDetection | None, settings: Settings) -> dict[str, float]:
    """The session's VAD and endpoint settings (``VoiceSession.tune``) for ``detection``; none for manual turns."""
    if detection is None:
        return {}
    if detection.type == "semantic_vad":
        silence, unfinished = EAGERNESS_MS.get(
            detection.eagerness, (settings.endpoint_silence_ms, settings.endpoint_unfinished_silence_ms)
        )
        return {"endpoint_silence_ms": silence, "endpoint_unfinished_silence_ms": unfinished}
    return {
        "vad_threshold": detection.threshold,
        "endpoint_silence_ms": detection.silence_duration_ms,
        "endpoint_unfinished_silence_ms": max(detection.silence_duration_ms, settings.endpoint_unfinished_silence_ms),
    }


# ---------------------------------------------------------------- response.create
def response_params(event: ResponseCreateEvent, config: RealtimeConfig) -> ResponseParams:
    """What a ``response.create`` asks of its one response (over the session's ``config``); ``RealtimeError`` for
    what Parley refuses."""
    spec = event.response or RealtimeResponseCreateParams()
    errors = tool_refusals("response", spec.tools, spec.tool_choice, spec.prompt)
    if errors:
        raise errors[0]
    if spec.conversation not in (None, "auto"):
        raise unsupported("response.conversation", "responses outside the conversation (conversation 'none')")
    if spec.input is not None:
        raise unsupported("response.input", "a custom response input")
    if spec.audio is not None and spec.audio.output is not None:
        check_format(spec.audio.output.format, "response.audio.output.format")
    metadata = spec.metadata
    if metadata is not None and (
        len(metadata) > MAX_METADATA_KEYS
        or any(len(k) > 64 or len(v) > MAX_METADATA_CHARS for k, v in metadata.items())
    ):
        raise RealtimeError(
            "invalid_value",
            f"metadata holds at most {MAX_METADATA_KEYS} string pairs (values up to {MAX_METADATA_CHARS})",
            "response.metadata",
        )
    tools = function_tools(spec.tools, "response.tools") if spec.tools is not None else None
    return ResponseParams(
        modality=_modality(spec.output_modalities, "response.output_modalities"),
        metadata=metadata,
        instructions=bounded(spec.instructions, "response.instructions", protocol.MAX_SYSTEM_PROMPT_CHARS),
        tools=tools,
        tool_choice=tool_choice(spec.tool_choice, tuple(tools or config.tools), "response.tool_choice"),
    )
