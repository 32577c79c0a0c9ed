"""The OpenAI-compatible API's request schema (pydantic), the way vLLM's ``entrypoints/openai/protocol.py`` does it.

Why a schema: every field is typed and bounded in one declaration, so the server checks a
request once, before it reaches the engine, and a bad one is answered with OpenAI's error
JSON naming the field (``validation_error`` turns pydantic's first error into the message
and ``param``). Unknown fields are ignored, as OpenAI clients send many. Bounds guard the
engine as much as the client: a tiny positive temperature (1e-40) used to overflow the
sampler inside the engine loop; seeds must fit a torch generator; stop strings are checked
against the text after every token, so there are few and short ones; token ids (stop
tokens, ``logit_bias``) must lie in the vocabulary (``context={"vocab_size": n}``).

Sampling fields a request leaves unset take the model's ``generation_config.json`` values
(``sampling_defaults``; vLLM's ``--generation-config auto``), then neutral ones (temperature 1).

Tools (chat only) and ``response_format`` are checked here for their shape (names, a named
``tool_choice`` that names a tool, a ``tool`` message's ``tool_call_id``); what they do to the
prompt, the grammar and the reply is ``tool_plan`` and ``tool_parser`` beside this module, over the
grammars of ``engine/structured_output/``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.sampling import (
    MAX_DRY_ALLOWED_LENGTH,
    MAX_DRY_BASE,
    MAX_DRY_MULTIPLIER,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_TEMPERATURE,
    SamplingParams,
)
from engine.structured_output.grammar import schema_grammar

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 200
MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000  # per message, and per completion prompt (a few times any context we serve)
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 8  # n: each choice is an engine request of its own
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 20
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # in one assistant message of the history
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers")  # unset: the engine's
# the request fields that take the model's generation_config.json values when unset, and their neutral values
DEFAULTED_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class OpenAIBaseModel(BaseModel):
    # unknown fields are ignored; NaN / inf are not numbers a request may carry
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (a value matching ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' needs a 'json_schema' object with its 'schema'")
        return self

    def grammar(self) -> str | None:
        """The llguidance grammar the reply must follow (None: plain text)."""
        if self.type == "json_object":
            return schema_grammar({"type": "object"})
        if self.type == "json_schema" and self.json_schema is not None:
            return schema_grammar(self.json_schema.schema_ or {})
        return None


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat completions and completions: OpenAI's, plus vLLM's ``top_k``,
    ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos`` and ``stop_token_ids``
    (bounded as vLLM, or tighter), and llama.cpp's DRY (``dry_*``, off unless ``dry_multiplier``
    > 0). Fields OpenAI has and we do not support are accepted only at their neutral value."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = None  # 0 (greedy) or [MIN_TEMPERATURE, MAX_TEMPERATURE]; default 1
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # -1 and 0 disable it (vLLM spells "off" as -1)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # token id (a string in JSON) -> bias added to its logit
    logit_bias: dict[StrictStr, StrictFloat] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    dry_multiplier: StrictFloat | None = Field(default=None, ge=0.0, le=MAX_DRY_MULTIPLIER)
    dry_base: StrictFloat | None = Field(default=None, gt=1.0, le=MAX_DRY_BASE)
    dry_allowed_length: StrictInt | None = Field(default=None, ge=1, le=MAX_DRY_ALLOWED_LENGTH)
    dry_sequence_breakers: list[StrictStr] | None = Field(default=None, max_length=MAX_DRY_BREAKERS)
    response_format: ResponseFormat | None = None
    # accepted at their neutral value only
    best_of: StrictInt | None = None
    functions: Any = None  # the deprecated form of tools

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and v != 0 and not MIN_TEMPERATURE <= v <= MAX_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(not s for s in v):
            raise ValueError("strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"strings may be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("best_of")
    @classmethod
    def _only_one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("must be 1 (ask for several choices with n)")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None:
            _check_token_ids(v, info)
        return v

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _dry_sequence_breakers(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not 1 <= len(b) <= MAX_DRY_BREAKER_CHARS for b in v):
            raise ValueError(f"strings must have 1 to {MAX_DRY_BREAKER_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        if v is None:
            return None
        try:
            ids = [int(k) for k in v]
        except ValueError:
            raise ValueError("keys must be token ids (integers)") from None
        _check_token_ids(ids, info)
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in v.values()):
            raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return v

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if v:
            raise ValueError("is not supported (send 'tools')")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to report with each token (None: no logprobs at all)."""
        return None

    def to_sampling_params(
        self,
        prompt_len: int,
        context_limit: int,
        defaults: Mapping[str, float | int] | None = None,
        grammar: str | None = None,
        skip_special_tokens: bool = True,
    ) -> SamplingParams:
        """The engine's parameters; without a max_tokens, whatever room the context leaves (the KV
        blocks are taken lazily, so this reserves nothing). Unset ``DEFAULTED_FIELDS`` take
        ``defaults`` (see ``sampling_defaults``), then their neutral values. ``grammar`` and
        ``skip_special_tokens`` are the tool plan's (``engine.openai_api.tool_plan``). Raises ValueError if
        the engine refuses them."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = max(1, context_limit - prompt_len, self.min_tokens or 0)
        defaults = defaults or {}
        chosen = {
            name: value if (value := getattr(self, name)) is not None else defaults.get(name, neutral)
            for name, neutral in DEFAULTED_FIELDS.items()
        }
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(chosen["temperature"]),
            top_p=float(chosen["top_p"]),
            top_k=max(0, int(chosen["top_k"])),  # -1 is vLLM's "off"
            min_p=float(chosen["min_p"]),
            repetition_penalty=float(chosen["repetition_penalty"]),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens or 0,
            logprobs=self.num_logprobs,
            **{name: value for name in DRY_FIELDS if (value := getattr(self, name)) is not None},
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            grammar=grammar,
            skip_special_tokens=skip_special_tokens,
        )


def sampling_defaults(found: Mapping[str, float | int]) -> dict[str, float | int]:
    """The model's generation_config values the engine can use as request defaults (see
    ``engine.weights.generation_defaults``); a value the engine would refuse is logged and left out,
    so that a bad file does not turn every request into an error."""
    usable: dict[str, float | int] = {}
    for name, value in found.items():
        if name not in DEFAULTED_FIELDS:
            continue
        try:
            SamplingParams(**{name: max(0, int(value)) if name == "top_k" else value})
        except (TypeError, ValueError) as e:
            log.warning("generation_config.json: ignoring %s=%r (%s)", name, value, e)
            continue
        usable[name] = value
    return usable


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of a request with several: a given seed is shifted by the
    index (as vLLM), so the choices differ and each stays reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))


def _check_token_ids(ids: list[int], info: ValidationInfo) -> None:
    vocab = (info.context or {}).get("vocab_size")
    if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab})" if vocab is not None else "token ids must be >= 0")


class FunctionDefinition(OpenAIBaseModel):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: no arguments)
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.fullmatch(v):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return v

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: StrictStr


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIBaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCallMessage(OpenAIBaseModel):
    """A call an earlier assistant turn made (sent back in the history)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    # text, or OpenAI content parts of type "text" (joined); None only for an assistant turn
    content: str | None = Field(default=None, validate_default=True)
    tool_calls: list[ToolCallMessage] | None = Field(default=None, max_length=MAX_TOOL_CALLS)  # assistant
    tool_call_id: StrictStr | None = None  # tool: the call this message answers
    name: StrictStr | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"must be one of {', '.join(CHAT_ROLES)}, got {v!r}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") == "assistant":
            return None
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("must hold text parts only")
            v = "".join(p["text"] for p in v)
        if not isinstance(v, str):
            raise ValueError("must be a string or a list of text parts")
        if len(v) > MAX_CONTENT_CHARS:
            raise ValueError(f"may be at most {MAX_CONTENT_CHARS} characters")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("belongs to a 'tool' message")
        return v

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the 'tool_call_id' of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message carries 'tool_calls'")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; default: auto with tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError("must have distinct function names")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or ()]
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names the function {v.function.name!r}, which is not among 'tools'")
        if v == "required" and not names:
            raise ValueError("'required' needs 'tools'")
        return v

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs 'logprobs': true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty list")
        if len(v) > MAX_MESSAGES:
            raise ValueError(f"may hold at most {MAX_MESSAGES} messages")
        return v


class CompletionRequest(SamplingRequest):
    """``prompt``: a string or one list of token ids (a batch of one is unwrapped; larger batches are
    refused). Token ids are checked against ``context={"vocab_size": n}`` when given."""

    prompt: str | list[int]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: Any = None
    suffix: Any = None
    tools: Any = None  # a chat feature

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            if len(v) > MAX_CONTENT_CHARS:
                raise ValueError(f"may be at most {MAX_CONTENT_CHARS} characters")
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            vocab = (info.context or {}).get("vocab_size")
            if vocab is not None and any(not 0 <= t < vocab for t in v):
                raise ValueError(f"token ids must be in [0, {vocab})")
            return v
        raise ValueError("must be a string or one list of token ids (batches are not supported)")

    @field_validator("echo", "suffix", "tools")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("is not supported")
        return v


def _param(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(e: ValidationError) -> tuple[str, str | None]:
    """The first error of a failed validation as (message, param), e.g.
    ("'top_p': Input should be less than or equal to 1", "top_p")."""
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    name = f"'{param}'" if param else "request"
    if err["type"] == "missing":
        return f"{name} is required", param
    if err["type"] == "value_error":
        return f"{name} {err['ctx']['error']}", param
    return f"{name}: {err['msg']}", param
