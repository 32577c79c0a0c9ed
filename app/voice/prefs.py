"""What a client may change about its own conversation (the ``config`` message), and the voice it hears."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from app import protocol
from app.stages.base import SpeechRecognizer, Synthesizer
from app.voice.language import name as language_name


@dataclass(frozen=True)
class SessionPrefs:
    system_prompt: str
    voice: str
    language: str  # "" = detect it per utterance
    barge_in: bool = True
    half_duplex: bool = False
    tools: tuple[protocol.FunctionTool, ...] = ()  # the client's own (it runs them); none: the server's, if any
    tool_choice: protocol.ToolChoice = "auto"
    parallel_tool_calls: bool = False
    reply_audio: bool = True  # False: replies come as text only (no speech synthesis)


class Preferences:
    """The session's preferences, checked against what this server has, and the voice for each turn."""

    def __init__(
        self,
        system_prompt: str,
        asr: SpeechRecognizer,
        tts: Synthesizer,
        *,
        tool_choice: protocol.ToolChoice = "auto",
        server_tools: tuple[str, ...] = (),
    ) -> None:
        """``server_tools``: the names of the server's tools, which a session that declares none may call."""
        self._asr, self._tts = asr, tts
        self._server_tools = server_tools
        self.current = SessionPrefs(
            system_prompt=system_prompt,
            voice=tts.voices[0] if tts.voices else "default",
            language=asr.languages[0] if asr.languages else "en",
            tool_choice=tool_choice,
        )
        self._voice_chosen = False  # the client named a voice: it answers whatever the language
        self._voiceless_told: set[str] = set()

    def apply(self, message: protocol.SessionConfig) -> protocol.ConfigApplied | protocol.Error:
        """The preferences after ``message``; an unsupported value is an error and changes nothing."""
        voices, languages = self._tts.voices, self._asr.languages
        if message.voice is not None and message.voice not in voices:
            return protocol.Error(code="bad_config", message=f"no voice {message.voice!r}; voices: {voices}")
        if message.language is not None and message.language not in languages:
            return protocol.Error(
                code="bad_config",
                message=f"the speech model does not take language {message.language!r}; it takes {languages}",
            )
        changes = {name: getattr(message, name) for name in message.model_fields_set - {"type"}}
        changes = {name: value for name, value in changes.items() if value is not None}
        if "tools" in changes:
            changes["tools"] = tuple(changes["tools"])
        wanted = replace(self.current, **changes)
        refused = self._tool_choice_refusal(wanted)
        if refused is not None:
            return protocol.Error(code="bad_config", message=refused)
        self._voice_chosen = self._voice_chosen or "voice" in changes
        self.current = wanted
        return protocol.ConfigApplied(**asdict(self.current))

    def _tool_choice_refusal(self, prefs: SessionPrefs) -> str | None:
        """Why ``prefs.tool_choice`` cannot be served with the tools there are (the client's, else the server's)."""
        names = [tool.name for tool in prefs.tools] or list(self._server_tools)
        choice = prefs.tool_choice
        if choice == "required" and not names:
            return "tool_choice 'required' needs tools: declare them in 'tools'"
        if isinstance(choice, protocol.NamedFunction) and choice.name not in names:
            return f"tool_choice names {choice.name!r}, which is not among the tools {names}"
        return None

    def language(self) -> str | None:
        """The language to transcribe in now: the session's ('' = detect)."""
        return self.current.language

    @property
    def fixed_language(self) -> str | None:
        """The session's language when it is set ("" means: detect it per utterance)."""
        return self.current.language or None

    def voice_for(self, language: str | None) -> str:
        """The client's chosen voice, else the one for the turn's language, else the default."""
        if self._voice_chosen or not language:
            return self.current.voice
        return self._tts.voice_for(language) or self.current.voice

    def voiceless_notice(self, language: str | None, turn_id: int) -> protocol.Notice | None:
        """Once per language: there is no voice for it, so the default answers."""
        if not language or self._voice_chosen or self._tts.voice_for(language) is not None:
            return None
        if language in self._voiceless_told:
            return None
        self._voiceless_told.add(language)
        return protocol.Notice(
            turn_id=turn_id,
            code="no_voice",
            message=f"There is no {language_name(language)} voice here; answering with {self.current.voice}. "
            "A server adds one with tts_voices.",
        )
