"""The immutable record a request's stream yields, shared by the sync and async fronts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the most likely tokens' (best first), from the raw logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)
    # the log-probabilities of the token ids the request named, whatever their rank
    # (``SamplingParams.prompt_logprobs_token_ids``), in the order named
    named: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One increment of a request: new text/tokens since the last output, and the final state.

    ``first_token_time`` is the ``time.monotonic()`` at which the first token was sampled
    (TTFT = first_token_time - arrival_time); ``num_cached_tokens`` is the prefix-cache hit.
    ``finish_reason == "error"`` comes with ``error`` (why) and ``error_type``. ``logprobs`` holds one
    entry per token of ``token_ids_delta`` when the request asked for them (``SamplingParams.logprobs``).
    """

    request_id: str
    text_delta: str
    token_ids_delta: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # with an error: "invalid_request" (the request can never be served: a client error) or "internal"
    error_type: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # with ``SamplingParams.prompt_logprobs_from``: the log-probability of each prompt token from there on (to
    # ``prompt_logprobs_to``), in the output that brings the first token
    prompt_logprobs: tuple[float, ...] | None = None
    # with ``SamplingParams.prompt_top_logprobs`` or ``prompt_logprobs_token_ids``: for each of those prompt tokens,
    # its log-probability with the likeliest tokens' and the named tokens' at its position
    prompt_top_logprobs: tuple[TokenLogprobs, ...] | None = None
