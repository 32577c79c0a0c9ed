"""All settings of the voice app in one model: defaults < TOML file < PARLEY_* environment < CLI flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from app.policy import POLICIES as CONVERSATION_POLICIES
from app.policy import FollowUps, HistoryReplies, policy_for

POLICY_DEFAULT = "(the conversation policy's row may set another default: llm_policy)"


class _Models(BaseModel):
    """The models, their devices and how the LLM decodes (the policy's fields): a part of ``Settings``."""

    # ASR
    asr_model: str = Field(
        "bundled",
        description="'bundled' (tiny.en), 'bundled-multilingual' (Whisper base) or a CTranslate2 Whisper directory",
    )
    asr_language: str = Field(
        "en",
        max_length=3,
        pattern=r"^[a-z]*$",
        description="default speech language, a Whisper code ('de'); '' = detect per utterance (multilingual models)",
    )
    asr_device: str = "cpu"
    asr_compute_type: str = "int8"
    asr_beam_size: int = Field(1, ge=1, le=10)
    asr_threads: int = Field(2, ge=1)

    # LLM
    llm_backend: Literal["engine", "transformers", "openai"] = "engine"
    llm_model: str = Field(
        "auto",
        description="'auto' (Qwen2.5-Coder-0.5B-Instruct when the set-up fetched it, else the bundled model), "
        "'bundled' (SmolLM2-135M-Instruct: small and fast, no tools), 'qwen2.5-coder-0.5b', 'qwen2.5-coder-1.5b' "
        "(fetched by `python -m engine.mirrors fetch NAME`), a model dir, or a GGUF file (llama.cpp, Ollama, LM Studio)",
    )
    llm_url: str | None = Field(None, description="OpenAI-compatible base URL (e.g. http://host:8001/v1)")
    llm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with native bf16, else float32"
    )
    llm_quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="auto: int8 on the CPU (faster decode, with bf16 or fp32 activations alike); on CUDA int8 where "
        "`parley doctor --gpu` measured it faster than bf16 on this card, else none",
    )
    llm_int8_method: Literal[
        "auto", "int8pack", "ao", "bitsandbytes", "weight_only", "w8a8", "torchao_weight_only", "torchao_w8a8"
    ] = Field(
        "auto",
        description="int8 kernel: auto = on CUDA the doctor's pick, else w8a8 (Triton + int8 tensor cores), else "
        "bitsandbytes LLM.int8; int8pack on the CPU",
    )
    llm_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="CUDA: share of GPU memory the engine may use (sizes its KV pool)"
    )
    llm_cuda_graphs: bool = Field(True, description="CUDA: capture decode steps as CUDA graphs (off: eager)")
    llm_device: str = "cpu"
    # One thread each for the engine's decode and Piper (ASR keeps 2): libraries on every core fight
    # (app/bench/results/turn_taking.md).
    llm_threads: int | None = Field(1, ge=1, description="engine CPU threads (empty: torch's choice)")
    llm_prefill_threads: int | None = Field(
        None, ge=1, description="engine CPU threads for prompt prefill (empty: every core); decode uses llm_threads"
    )
    llm_prefill_threads_first_tokens: int = Field(
        0, ge=0, description="a reply's first N tokens also decode on llm_prefill_threads (12: its first piece)"
    )
    llm_yield_ahead_s: float = Field(
        3.0,
        ge=0.0,
        le=60.0,
        description="a reply with more audio than this still to play lets other replies' LLM steps go first (0: never)",
    )
    llm_context_tokens: int | None = Field(
        None, ge=256, description="prompt + reply tokens per turn (empty: the model's own context length)"
    )
    llm_wait_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="longest wait for the first words of each LLM request: past it, or when the LLM fails, the turn "
        "is given up and the user told so aloud (a remote server down, slow or restarting)",
    )

    # The conversation policy: what the LLM sees each turn and how a reply is decoded. The policy's row
    # (app/policy.py) changes the defaults of some of these for its model; a setting given wins over the row.
    llm_policy: str = Field(
        "auto",
        description="the row of app/policy.py the settings below default to: auto = the one for what llm_model "
        f"is (its architecture, size and chat template), or one of: {', '.join(CONVERSATION_POLICIES)}",
    )
    # short and near SmolLM2's training prompt: longer "voice style" instructions made it answer in broken French
    system_prompt: str = Field(
        "You are a helpful AI assistant named Parley. Keep your answers short.",
        min_length=1,
        description=POLICY_DEFAULT,
    )
    max_history_messages: int = Field(
        16, ge=0, description="messages of the conversation sent back each turn " + POLICY_DEFAULT
    )
    history_replies: HistoryReplies = Field(
        "all",
        description="of the model's own earlier replies in them: all, the last one, or none " + POLICY_DEFAULT,
    )
    recalled_user_statements: int = Field(
        0,
        ge=0,
        le=16,
        description="the user's earlier statements (not questions) recalled in the system prompt, 0: none "
        + POLICY_DEFAULT,
    )
    follow_ups: FollowUps = Field(
        "as_said",
        description="an English elliptical follow-up ('And Spain?' after 'What is the capital of Italy?'): "
        "as_said, or asked as the question it stands for ('What is the capital of Spain?') with the "
        "conversation (in_full) or without it (in_full_alone); the history keeps the words as said " + POLICY_DEFAULT,
    )
    history_relevance_nats: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="the conversation is sent only with words it makes at least this much likelier "
        "(mean nats a token, by the LLM on this machine), 0: always " + POLICY_DEFAULT,
    )
    history_relevance_margin_nats: float = Field(
        0.3,
        ge=0.0,
        le=10.0,
        description="a spoken reply starts on the one prompt the words heard so far choose when their gain is at "
        "least this far from history_relevance_nats (weighed while the user spoke); nearer, see "
        "history_relevance_spoken",
    )
    history_relevance_spoken: Literal["heard", "both"] = Field(
        "heard",
        description="a spoken turn whose words heard so far did not choose (too few heard, or too near "
        "history_relevance_nats): 'heard' keeps the conversation, so its reply starts as soon as an unweighed one; "
        "'both' starts the reply on both prompts to weigh all the words (its first token ~100 ms later on two "
        "cores). Typed turns always weigh all their words",
    )
    # how a reply is decoded: each llm_<name> is the request field <name> (app.stages.base.GenerationSettings)
    llm_max_tokens: int = Field(120, ge=1, le=4096, description=POLICY_DEFAULT)
    llm_temperature: float = Field(0.0, ge=0.0, le=2.0, description="0: greedy " + POLICY_DEFAULT)
    llm_top_p: float = Field(1.0, gt=0.0, le=1.0, description=POLICY_DEFAULT)
    llm_min_p: float = Field(0.0, ge=0.0, le=1.0, description=POLICY_DEFAULT)
    llm_repetition_penalty: float = Field(
        1.0, gt=0.0, le=2.0, description="on prompt and reply tokens, 1: off " + POLICY_DEFAULT
    )
    llm_presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="on reply tokens, 0: off " + POLICY_DEFAULT)
    llm_frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="on reply tokens, 0: off " + POLICY_DEFAULT)
    llm_dry_multiplier: float = Field(
        0.0, ge=0.0, le=5.0, description="DRY repeat penalty (engine backend), 0: off " + POLICY_DEFAULT
    )
    llm_seed: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="sampling seed of every reply (with llm_temperature > 0: a conversation's replies reproducible, "
        "as `parley bench quality --seeds` runs them); empty: each reply draws its own",
    )

    # TTS
    tts_backend: Literal["piper", "coqui"] = Field("piper", description="coqui needs the [coqui] extra (GPU image)")
    tts_threads: int | None = Field(1, ge=1, description="Piper CPU threads (empty: all cores)")
    tts_first_piece_threads: int | None = Field(
        None,
        ge=1,
        description="Piper CPU threads for a reply's first piece with first_piece_priority (empty: all cores)",
    )
    tts_voice: str = Field("bundled", description="'bundled' (en_US joe medium) or a Piper .onnx path")
    tts_voices: dict[str, str] = Field(
        default_factory=dict,
        description='a Piper voice per language, JSON: {"de": "/voices/de_DE-thorsten-medium.onnx"}',
    )


class _TurnTaking(BaseModel):
    """The VAD, the endpoint, the reply's pace and Whisper's window: a part of ``Settings`` (README, Settings)."""

    # VAD / turn-taking
    vad_threshold: float = Field(0.5, gt=0.0, lt=1.0)
    endpoint_silence_ms: int = Field(400, ge=100, le=3000, description="silence that ends a finished sentence")
    endpoint_unfinished_silence_ms: int = Field(
        1200, ge=100, le=5000, description="silence that ends a turn whose words end mid-clause"
    )
    pause_ms: int = Field(96, ge=64, le=1000, description="silence after which the speech is paused")
    tail_start_ms: int = Field(
        32,
        ge=32,
        le=1000,
        description="while one session is open (solo_speedups): quiet (VAD windows under vad_threshold) after "
        "which the tail is transcribed, before the pause is confirmed (at most pause_ms; quiet that turns back "
        "into speech wastes one transcription); with several sessions the pause starts it",
    )
    partial_interval_ms: int = Field(400, ge=100, description="how often partial transcripts are made")
    speculative_reply: bool = Field(True, description="start the reply during the endpoint silence")
    llm_warm_while_speaking: bool = Field(
        True,
        description="prefill the prompt with the user's words so far at each partial transcript, so the "
        "reply's prompt adds only the last words (engine backend)",
    )
    turn_model: Literal["smart-turn-v3", "none"] = Field(
        "smart-turn-v3", description="end-of-turn model heard at each pause ('none': the words alone)"
    )
    endpoint_complete_silence_ms: int = Field(
        200, ge=50, le=3000, description="silence that ends a turn the end-of-turn model is sure is complete"
    )
    turn_text_signal: bool = Field(
        True,
        description="at each pause, ask the LLM how likely the words end the turn and combine it with the "
        "end-of-turn model's P (in-process engine only)",
    )
    turn_text_wait_ms: int = Field(
        400,
        ge=0,
        le=3000,
        description="the silence up to which the endpoint waits for that verdict (after it: the other cues decide)",
    )
    turn_complete_threshold: float = Field(0.5, ge=0, le=1, description="P(complete) at or above which a turn is over")
    turn_incomplete_threshold: float = Field(
        0.2, ge=0, le=1, description="P(complete) below which the endpoint waits as long as mid-clause"
    )
    barge_in_ms: int = Field(400, ge=0, description="speech this long interrupts a reply (a cough does not)")
    barge_in_confirm: bool = Field(
        True, description="hear the words before interrupting: 'mm-hmm', 'yeah', 'right' do not stop a reply"
    )
    continuation_ms: int = Field(
        1500,
        ge=0,
        le=5000,
        description="speech starting this soon after a turn was committed, before its reply was heard, "
        "continues that turn: the reply is withdrawn and the whole is answered (0: never)",
    )
    continuation_heard_ms: int = Field(
        500, ge=0, le=5000, description="a reply heard longer than this is not withdrawn; speech over it is a new turn"
    )
    reply_speech_s: float = Field(
        15.0,
        ge=3,
        le=600,
        description="a reply ends at the first sentence end after about this much speech (app/voice/runaway.py)",
    )
    reply_long_speech_s: float = Field(
        60.0,
        ge=3,
        le=600,
        description="the same, when the user asked for something long (a story, in detail: English only)",
    )
    first_clause_chars: int = Field(16, ge=0, description="speak the first clause once this long (0: sentences)")
    first_piece_words: int = Field(
        3,  # as app.voice.text.FIRST_PHRASE_MAX_WORDS, where the figures are
        ge=2,
        le=30,
        description="a reply's first piece is cut after this many words when no clause or sentence ends sooner",
    )
    first_piece_priority: bool = Field(
        False,
        description="pause the LLM request while its first piece is synthesized on tts_first_piece_threads, "
        "with any number of sessions (solo_speedups does it while one is open; slower for four users: "
        "app/bench/results/turn_flow.md)",
    )
    solo_speedups: bool = Field(
        True,
        description="while one session is open: first_piece_priority, a reply's first 12 tokens on "
        "the LLM's prefill threads, and the tail transcribed after tail_start_ms of quiet (with several "
        "sessions all three slow everyone)",
    )
    asr_window_s: float = Field(6.0, ge=1.0, le=30.0, description="Whisper window; 30 = standard, slower")
    min_speech_ms: int = Field(96, ge=0)
    max_utterance_s: float = Field(30.0, gt=0)


class _ToolsAndSkills(BaseModel):
    """Function calling and the assistant's own abilities: a part of ``Settings``."""

    # Tools (function calling: README, Tools)
    tool_timeout_s: float = Field(
        10.0, gt=0, le=300, description="a call with no result this long fails (the LLM reads so) and the reply goes on"
    )
    tool_filler: str = Field(
        "",
        max_length=200,
        description="said while a call is pending when the reply has said nothing yet, e.g. 'One moment.' "
        "(spoken only: the LLM never reads it; empty: silence)",
    )
    tool_entry_point: str | None = Field(
        None,
        description="server-side tools for sessions that declare none: 'module:function', a function that "
        "returns the tools (README, Tools)",
    )
    tool_choice: Literal["auto", "required", "none"] = Field(
        "auto", description="how replies use the server-side tools (a session's config sets its own)"
    )
    tool_rounds: int = Field(
        3, ge=1, le=5, description="rounds of calls a reply may make before it must answer " + POLICY_DEFAULT
    )
    # Skills: the assistant's own abilities, tools for sessions that declare none (README, Skills)
    skills: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["clock", "timers", "reminders", "calculator"],
        description="the built-in skills on (comma-separated; empty: none): clock, timers, reminders, calculator",
    )
    data_dir: str = Field(
        "", description="where the server keeps what must survive a restart (reminders); empty: ~/.local/share/parley"
    )
    mcp_servers: str = Field(
        "",
        max_length=20000,
        description="Model Context Protocol servers whose tools the LLM may call: a JSON list (README, Skills)",
    )


class _Serving(BaseModel):
    """Where the server listens, who may talk to it, and how much: a part of ``Settings``."""

    # Where it listens
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # Access (see README "Safe on a LAN")
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="web origins besides the server's own whose pages may open /ws ('*': any, not recommended)",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host header names accepted besides localhost, IP addresses and this machine's name ('*': any)",
    )
    api_key: str | None = Field(
        None, min_length=16, description="when set, /ws, /metrics and the engine API need it (Bearer or ?key=)"
    )
    ssl_certfile: str | None = Field(None, description="TLS certificate (PEM): serve https/wss")
    ssl_keyfile: str | None = Field(None, description="TLS private key (PEM)")
    wyoming_port: int | None = Field(
        None, ge=0, le=65535, description="also serve the Wyoming protocol (Home Assistant) on this TCP port (0: any)"
    )
    wyoming_host: str = Field("127.0.0.1", description="where the Wyoming door listens (it has no API key: see README)")

    # Limits
    max_sessions: int | None = Field(
        None,
        ge=1,
        description="sessions at once (default: 2 per CPU core, fewer if free memory holds fewer at 32 MiB a "
        "session; the latency breaker guards the rest; measure yours with `parley bench load`)",
    )
    send_timeout_s: float = Field(20.0, gt=0, description="a client that reads nothing this long is disconnected")
    idle_timeout_s: float = Field(300.0, gt=0, description="a session with no audio and no text this long is closed")
    idle_evict_s: float = Field(
        30.0,
        gt=0,
        description="while all sessions are in use, one with no audio, no text and no reply playing this long "
        "is closed to let a new user in",
    )
    max_audio_rate: float = Field(2.0, ge=1.0, description="audio faster than this many times real time is dropped")
    breaker_voice_to_voice_ms: float = Field(
        2000.0, gt=0, description="refuse new sessions while recent voice-to-voice p95 is above this"
    )
    breaker_llm_ttft_ms: float = Field(
        1500.0, gt=0, description="refuse new sessions while recent LLM first-token p95 is above this"
    )
    breaker_window_s: float = Field(30.0, gt=0, description="how far back the latency breaker looks")
    memory_red_line: float = Field(
        0.9, gt=0, le=1, description="refuse new sessions when this share of memory (or GPU memory) is in use"
    )


class Settings(_Serving, _ToolsAndSkills, _TurnTaking, _Models, BaseSettings):
    """Every setting, in four groups (its bases, listed last to first: the order ``parley config`` shows them)."""

    model_config = SettingsConfigDict(env_prefix="PARLEY_", extra="forbid")

    @field_validator("allowed_origins", "allowed_hosts", "skills", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A list from a flag or variable is written "a,b" (a TOML file gives a real list)."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _policy_defaults(cls, values: Any, handler: Any) -> Settings:
        """The policy's row gives its settings their defaults, under the values given; ``llm_policy`` names the row.

        The row is applied to the input before validation, so its values are validated as any given value is."""
        settings = handler(values)
        try:
            settings.llm_policy = policy_for(settings.llm_policy, settings.llm_model, settings.llm_backend)
        except ValueError as exc:
            raise ValueError(f"llm_policy: {exc}") from None
        row = CONVERSATION_POLICIES[settings.llm_policy]
        defaults = {name: value for name, value in row.items() if name not in settings.model_fields_set}
        if not defaults:
            return settings
        given = {name: getattr(settings, name) for name in settings.model_fields_set}
        return handler({**given, **defaults, "llm_policy": settings.llm_policy})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = os.environ.get("PARLEY_CONFIG")
        if toml_path:
            if not Path(toml_path).is_file():
                raise FileNotFoundError(f"PARLEY_CONFIG points at {toml_path}, which does not exist")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


def load_settings(**overrides: Any) -> Settings:
    """Settings with CLI overrides (``None`` values mean "flag not given")."""
    return Settings(**{key: value for key, value in overrides.items() if value is not None})
