"""The engine's internal record of one request, shared by the scheduler and the KV cache manager."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.outputs import TokenLogprobs
from engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token state of one request. ``num_computed_tokens`` counts tokens whose K/V are in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # any of these ends the request unless ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 = not scheduled yet
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    # monotonic time until which a running request is not stepped (``LLMEngine.pause``); 0 = never paused
    paused_until: float = 0.0
    # monotonic time until which it is stepped only when no other request needs a step
    # (``LLMEngine.yield_to_others``); 0 = never
    yields_until: float = 0.0
    # log-probabilities of prompt tokens [params.prompt_logprobs_from, ...), filled as the prefill computes them
    # (or found already computed: ``engine.prompt_scores``)
    prompt_logprobs: list[float] = field(default_factory=list)
    # beside it, where the request reads the scored positions' distributions (``SamplingParams.prompt_top_logprobs``)
    prompt_top_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with prompt_logprobs_from: ``engine.prompt_scores.prefix_keys`` of the prompt, to keep each score under
    score_keys: list[int] = field(default_factory=list)
    # hashes of the full blocks of all_token_ids, grown lazily by the KV cache manager
    block_hashes: list[int] = field(default_factory=list)
    # the requests one caller added together to decide between (a voice reply's prompt with the conversation and
    # its words alone) share a group: for the CPU threads a step gets they are one request; "": its own
    group: str = ""

    @property
    def group_key(self) -> str:
        return self.group or self.request_id

    @property
    def computed_from(self) -> int:
        """The prompt tokens before this index may come from the prefix cache; from it on they are computed
        (the last token always is: its logits give the first output token), and so are those whose logits
        score a prompt token not scored yet (``prompt_logprobs_from``)."""
        first = self.params.prompt_logprobs_from
        last = self.num_tokens - 1
        if first is None or first + len(self.prompt_logprobs) >= self.scored_to:
            return last
        return min(last, max(0, first - 1 + len(self.prompt_logprobs)))

    @property
    def scored_to(self) -> int:
        """The end (exclusive) of the prompt tokens scored (``SamplingParams.prompt_logprobs_to``)."""
        end = self.params.prompt_logprobs_to
        return self.num_prompt_tokens if end is None else min(end, self.num_prompt_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def paused(self, now: float) -> bool:
        return self.paused_until > now

    def yielding(self, now: float) -> bool:
        return self.yields_until > now

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
