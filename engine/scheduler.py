"""Continuous-batching policy (no compute, no tensors): who runs this step and with how many tokens.

Why a separate policy object: it can be tested on the CPU with fake model outputs, and the
same loop serves every backend. Each step hands out a token budget: running requests first
(decodes, and the rest of chunked prefills), then waiting prefills, chunked to fit the
budget. When the KV pool runs dry the newest running request is preempted (its blocks
freed; it is recomputed later, mostly from the prefix cache) instead of failing. A paused
running request (``Request.paused_until``) is skipped: it keeps its blocks and its place. A
yielding one (``Request.yields_until``) is skipped only while another request needs a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager, KVCopy
from engine.request import Request, RequestStatus


class RequestRejected(ValueError):
    """A request that can never be served with this engine's limits."""


@dataclass
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request to run this step."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: bool  # the chunk reaches the last known token, so the step yields a new token
    generated: int = 0  # output tokens the request had before this step
    group: str = ""  # ``Request.group_key``: chunks of one group are one caller's ("": the request's own)
    # positions [a, b) of this chunk whose logits score the prompt's next token (``prompt_logprobs_from``)
    scores: tuple[int, int] = (0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    copies: list[KVCopy] = field(default_factory=list)  # K/V a new request starts from, copied before the forward

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RequestUpdate:
    """What a step did to one request: tokens appended, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- admission -------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise RequestRejected when ``req`` could not be served even alone."""
        n = req.num_prompt_tokens
        if n == 0:
            raise RequestRejected("prompt is empty")
        total = n + req.params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        need = -(-total // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) needs {need} KV blocks of "
                f"{self.kv.block_size} tokens, the whole cache has {self.kv.num_blocks}"
            )

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.check(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self, now: float) -> bool:
        """A step now would compute something (unfinished requests that are not all paused)."""
        return bool(self.waiting) or any(not req.paused(now) for req in self.running)

    def next_resume(self) -> float | None:
        """When the earliest pause of a running request ends (None: none is paused)."""
        return min((req.paused_until for req in self.running if req.paused_until), default=None)

    # --- the step ---------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """This step's chunks; running requests paused at ``now`` (monotonic seconds) are left out, and
        so are yielding ones while a request that is neither waits or runs."""
        self.kv.end_copies()  # the last step's copies are done
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        contended = bool(self.waiting) or any(not (r.paused(now) or r.yielding(now)) for r in self.running)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.paused(now) or (contended and req.yielding(now)):
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req itself was preempted, and it was the last one
            scheduled.append((req, n))
            budget -= n
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            # Keep a block of headroom per running request, so admitting this one does not
            # force a preemption on the very next decode step (which would thrash).
            if not self.kv.allocate_slots(req, n, hits, reserve=len(self.running), num_hit_tokens=num_hit):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # count the lookup once, on first admission
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        for req, n in scheduled:
            start = req.num_computed_tokens
            out.chunks.append(
                ScheduledChunk(
                    request_id=req.request_id,
                    token_ids=req.token_at(start, start + n),
                    start=start,
                    block_ids=self.kv.block_ids(req.request_id),
                    sample=start + n == req.num_tokens,
                    generated=len(req.output_token_ids),
                    group=req.group_key,
                    scores=_scored_positions(req, start, n),
                )
            )
        out.copies = self.kv.take_copies()
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        errors: dict[str, str] | None = None,
        now: float | None = None,
    ) -> list[RequestUpdate]:
        """Advance computed-token counts, append sampled tokens, finish requests that stop."""
        errors = errors or {}
        updates: list[RequestUpdate] = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.is_finished:
                continue
            req.num_computed_tokens += chunk.num_tokens
            if not chunk.sample:
                continue
            err = errors.get(req.request_id)
            if err is not None:
                self.finish_request(req.request_id, "error", err)
                updates.append(RequestUpdate(req, [], True))
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            if req.first_token_time is None and now is not None:
                req.first_token_time = now
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish_request(req.request_id, reason)
            updates.append(RequestUpdate(req, [token], reason is not None))
        return updates

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish_request(self, request_id: str, reason: str, error: str | None = None) -> Request | None:
        """Finish (or abort) a request now: it leaves the queues and its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req, keep_tail=reason != "error")  # after a failed step its K/V are not trusted
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        return req


def _scored_positions(req: Request, start: int, n: int) -> tuple[int, int]:
    """Positions [a, b) of tokens [start, start + n) whose logits give a prompt token's log-probability that
    ``req`` asked for (``SamplingParams.prompt_logprobs_from``) and does not have yet (a preempted request
    computes its prompt again); (0, 0) when none."""
    first = req.params.prompt_logprobs_from
    if first is None:
        return (0, 0)
    a = max(start, first - 1 + len(req.prompt_logprobs))
    b = min(start + n, req.scored_to - 1)
    return (a, b) if a < b else (0, 0)
