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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

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

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 200
MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000  # per message, and per completion prompt (a few times any context we serve)
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 8  # n: each choice is an engine request of its own
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 20
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers")  # unset: the engine's
# the request fields that take the model's generation_config.json values when unset, and their neutral values
DEFAULTED_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class OpenAIBaseModel(BaseModel):
    # unknown fields are ignored; NaN / inf are not numbers a request may carry
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


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
    # accepted at their neutral value only
    best_of: StrictInt | None = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None

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

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("is not supported (no tools / function calling)")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, dict) and v.get("type") == "text"):
            raise ValueError("must be {'type': 'text'} (only text responses are supported)")
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
        self, prompt_len: int, context_limit: int, defaults: Mapping[str, float | int] | None = None
    ) -> SamplingParams:
        """The engine's parameters; without a max_tokens, whatever room the context leaves (the KV
        blocks are taken lazily, so this reserves nothing). Unset ``DEFAULTED_FIELDS`` take
        ``defaults`` (see ``sampling_defaults``), then their neutral values. Raises ValueError if
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


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    # text, or OpenAI content parts of type "text" (joined); None only for an assistant turn
    content: str | None = Field(default=None, validate_default=True)

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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

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

    def chat(self) -> list[dict[str, str]]:
        """The conversation for the chat template (``developer`` is the template's ``system``)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""} for m in self.messages
        ]


class CompletionRequest(SamplingRequest):
    """``prompt``: a string or one list of token ids (a batch of one is unwrapped; larger batches are
    refused). Token ids are checked against ``context={"vocab_size": n}`` when given."""

    prompt: str | list[int]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: Any = None
    suffix: Any = None

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

    @field_validator("echo", "suffix")
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
