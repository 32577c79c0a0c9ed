"""From a step's logits to what a request's stream yields: tokens, prompt scores and ``RequestOutput`` s.

Why a module of its own: the engine loop (``engine.llm_engine``) owns the order of a step and the
bookkeeping around it (scheduler, KV blocks, counters); what is done with the logits once the forward
has run (sample each row with its grammar and logprobs, score the prompt tokens asked for) and the
shape of the records handed out are plain functions of their inputs, kept here where they can be
read (and failed on purpose: ``tests/engine/test_engine_faults.py``) apart from the loop.
"""

from __future__ import annotations

import logging

import torch

from engine.outputs import RequestOutput, TokenLogprobs
from engine.prompt_scores import PromptScoreCache
from engine.request import Request
from engine.request_state import lazy_trigger
from engine.sampling import SamplerRow, position_logprobs, sample, token_logprobs
from engine.structured_output.grammar import GrammarCompiler

log = logging.getLogger(__name__)


def sample_tokens(
    logits, sample_ids: list[str], rows: list[SamplerRow], vocab_size: int, grammars: GrammarCompiler
) -> tuple[dict[str, int], dict[str, str], dict[str, TokenLogprobs]]:
    """One token per sampling request (with its logprobs if asked), or an error for the requests whose row failed.

    ``rows[i]`` is request ``sample_ids[i]``'s and ``logits[i]`` its logits. The batch is sampled at once;
    if that raises, each row is sampled alone so only the failing requests get an error (a seeded row's
    draw may then differ from an undisturbed run: its generator advanced in the failed attempt). A token
    id outside the vocabulary is an error too: it would fail the next step's embedding lookup for the
    whole batch. A row's lazy grammar starts at its trigger (``grammars`` compiles it), and a row's
    grammar accepts its token or fails the request.
    """
    sampled: dict[str, int] = {}
    errors: dict[str, str] = {}
    logprobs: dict[str, TokenLogprobs] = {}
    if not sample_ids:
        return sampled, errors, logprobs
    try:
        tokens, errs = sample(logits, rows)
    except Exception:
        log.exception("sampling a batch of %d failed; sampling its rows one by one", len(rows))
        tokens, errs = [], []
        for i, row in enumerate(rows):
            try:
                t, e = sample(logits[i : i + 1], [row])
                tokens.append(t[0])
                errs.append(e[0])
            except Exception as e:
                log.exception("sampling failed for request %s", sample_ids[i])
                tokens.append(-1)
                errs.append(f"sampling failed: {type(e).__name__}: {e}")
    for rid, row, tok, err in zip(sample_ids, rows, tokens, errs, strict=True):
        if err is None and not 0 <= tok < vocab_size:
            err = f"sampled token id {tok} is outside the vocabulary [0, {vocab_size})"
        if err is None and row.grammar is None and lazy_trigger(row, tok):
            row.grammar = grammars.state(row.params.lazy_grammar.grammar)
        if err is None and row.grammar is not None:
            err = row.grammar.accept(tok)
        if err is None:
            sampled[rid] = int(tok)
        else:
            errors[rid] = err
    if any(row.params.logprobs is not None for row in rows):
        tokens = [sampled.get(rid, -1) for rid in sample_ids]
        try:
            found = token_logprobs(logits, rows, tokens)
        except Exception as e:  # the requests that asked fail; the others keep their tokens
            log.exception("computing logprobs failed")
            found = [None] * len(rows)
            for rid, row in zip(sample_ids, rows, strict=True):
                if row.params.logprobs is not None and rid in sampled:
                    del sampled[rid]
                    errors[rid] = f"computing logprobs failed: {type(e).__name__}: {e}"
        logprobs = {rid: lp for rid, lp in zip(sample_ids, found, strict=True) if lp is not None}
    return sampled, errors, logprobs


def score_prompts(
    requests: list[Request], rows: list[tuple[str, int]], logits, prompt_scores: PromptScoreCache
) -> None:
    """Append to each request the log-probability, from the raw logits, of the prompt token after each scored
    position (``requests[i]`` is row ``i``'s request; rows in position order per request:
    ``engine.step_inputs.prepare_inputs``), and keep it in ``prompt_scores`` for a later prompt."""
    targets = torch.tensor([req.prompt_token_ids[p + 1] for req, (_, p) in zip(requests, rows, strict=True)])
    logprobs = logits.float().log_softmax(-1)
    found = logprobs.gather(1, targets.to(logits.device)[:, None])[:, 0].tolist()
    for row, (req, (_, position), logprob) in enumerate(zip(requests, rows, found, strict=True)):
        req.prompt_logprobs.append(logprob)
        if req.score_keys:  # kept for a later prompt with the same tokens (``engine.prompt_scores``)
            prompt_scores.store(req.score_keys[position + 1], logprob)
        if req.params.prompt_logits_read:
            req.prompt_top_logprobs.append(
                position_logprobs(logprobs[row], req.prompt_token_ids[position + 1], req.params)
            )


def request_output(
    req: Request, text: str, new_token_ids: list[int], finished: bool, logprobs: TokenLogprobs | None = None
) -> RequestOutput:
    """A request's output for the tokens one step gave it (``text``: theirs, after the stop strings)."""
    first = bool(new_token_ids) and len(req.output_token_ids) == len(new_token_ids)  # the prompt is computed by then
    return RequestOutput(
        request_id=req.request_id,
        text_delta=text,
        token_ids_delta=tuple(new_token_ids),
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        error=req.error,
        error_type="internal" if req.error else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        arrival_time=req.arrival_time,
        first_token_time=req.first_token_time,
        logprobs=None if req.params.logprobs is None else ((logprobs,) if logprobs and new_token_ids else ()),
        # once, with the first token
        prompt_logprobs=tuple(req.prompt_logprobs) if req.params.prompt_logprobs_from is not None and first else None,
        prompt_top_logprobs=tuple(req.prompt_top_logprobs) if req.params.prompt_logits_read and first else None,
    )


def final_output(
    req: Request, reason: str, error: str | None = None, text: str = "", error_type: str | None = None
) -> RequestOutput:
    """The last output of a request the engine ends itself (aborted, rejected, failed); ``error_type``
    defaults to "internal" when there is an error."""
    return RequestOutput(
        request_id=req.request_id,
        text_delta=text,
        token_ids_delta=(),
        finished=True,
        finish_reason=reason,
        error=error,
        error_type=error_type or ("internal" if error else None),
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        arrival_time=req.arrival_time,
        first_token_time=req.first_token_time,
    )
