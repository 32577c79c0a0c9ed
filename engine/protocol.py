"""The OpenAI-compatible API's request schema (pydantic), the way vLLM's ``entrypoints/openai/protocol.py`` does it.

Why a schema: every field is typed and bounded in one declaration, so the server checks a
request once, before it reaches the engine, and a bad one is answered with OpenAI's error
JSON naming the field (``validation_error`` turns pydantic's first error into the message
and ``param``). Unknown fields are ignored, as OpenAI clients send many. Bounds guard the
engine as much as the client: a tiny positive temperature (1e-40) used to overflow the
sampler inside the engine loop; seeds must fit a torch generator; stop strings are checked
against the text after every token, so there are few and short ones.
"""

from __future__ import annotations

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

from engine.sampling import MAX_SEED, MIN_TEMPERATURE, SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 200
MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000  # per message, and per completion prompt (a few times any context we serve)


class OpenAIBaseModel(BaseModel):
    # unknown fields are ignored; NaN / inf are not numbers a request may carry
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat completions and completions: OpenAI's, plus vLLM's ``top_k``,
    ``ignore_eos`` and ``stop_token_ids``. Fields OpenAI has and we do not support are
    accepted only at their neutral value."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = None  # 0 (greedy) or [MIN_TEMPERATURE, MAX_TEMPERATURE]; default 1
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # -1 and 0 disable it (vLLM spells "off" as -1)
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    # accepted at their neutral value only
    n: StrictInt | None = None
    best_of: StrictInt | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: Any = None
    top_logprobs: Any = None
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

    @field_validator("n", "best_of")
    @classmethod
    def _only_one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("must be 1 (one choice per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("is not supported (use 0)")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("is not supported")
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

    def to_sampling_params(self, prompt_len: int, context_limit: int) -> SamplingParams:
        """The engine's parameters; without a max_tokens, whatever room the context leaves (the KV
        blocks are taken lazily, so this reserves nothing). Raises ValueError if the engine refuses them."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = max(1, context_limit - prompt_len)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


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
    echo: Any = None
    suffix: Any = None

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
