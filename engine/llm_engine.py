"""The engine core loop, synchronous: step() = schedule -> run model -> sample -> update.

Why: one place owns the order of a step and the per-request output state (detokenizer,
seeded generator), so the async front only has to move requests and outputs across a
thread boundary. Not thread-safe: drive it from one thread (AsyncLLMEngine does).

Failures are contained where they happen: a failure that belongs to one request
(sampling its row, a token id outside the vocabulary, detokenizing, a stop-string check)
finishes that request with an error output and frees its KV blocks; a failed model
forward fails the requests of that step (their blocks freed, and the prefix-cache
entries that step would have filled forgotten, since their K/V may be half written) and
the next step runs as usual. ``reset`` fails everything still open, for a caller whose
loop broke anyway (``AsyncLLMEngine`` restarts its thread after it).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.chat import chat_token_ids, check_split_special_tokens
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput, TokenLogprobs
from engine.prompt_scores import PromptScoreCache, prefix_keys
from engine.request import Request, RequestStatus
from engine.sampling import SamplerRow, SamplingParams, make_generator, position_logprobs, sample, token_logprobs
from engine.scheduler import RequestRejected, Scheduler
from engine.structured_output.grammar import GrammarCompiler, GrammarState
from engine.weights import generation_defaults, resolve_model

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 5.0
_BREAKER_SETS_KEPT = 16  # distinct DRY sequence-breaker sets whose token ids are remembered


@dataclass
class _RequestState:
    request: Request
    detok: IncrementalDetokenizer
    row: SamplerRow


def _eos_token_ids(path, tokenizer, config_ids: tuple[int, ...]) -> tuple[int, ...]:
    """End-of-sequence ids as transformers' generate uses them (generation_config first), plus the tokenizer's."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path), local_files_only=True).eos_token_id
        ids += gen if isinstance(gen, list) else ([] if gen is None else [gen])
    except OSError:  # no generation_config.json
        pass
    ids += list(config_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model: LlamaModel | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        check_split_special_tokens(self.tokenizer)  # chat contents are tokenized as plain text (engine/chat.py)
        self.runner = ModelRunner(config, path, model)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prompt_scores = PromptScoreCache()  # prompt log-probabilities computed, beside the prefix cache
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.runner.max_model_len
        )
        self.eos_token_ids = _eos_token_ids(path, self.tokenizer, self.runner.model.args.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # the model's generation_config.json sampling values: what the API uses for fields a request leaves unset
        self.generation_defaults = generation_defaults(path)
        # requests with a grammar (tool calls, response_format): the llguidance tokenizer is built on first use
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.model.args.vocab_size, self.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._token_texts: list[str] | None = None  # each token's own text, decoded once (DRY breakers)
        self._breaker_ids: dict[tuple[str, ...], frozenset[int]] = {}
        self._states: dict[str, _RequestState] = {}
        self._pending: list[RequestOutput] = []
        self._rate: deque[tuple[float, int]] = deque()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_aborted_total = 0
        self.requests_finished_total = 0
        self._next_id = 0

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def model(self) -> LlamaModel:
        """The loaded model, to share with another engine: ``LLMEngine(config, model=eng.model)``."""
        return self.runner.model

    def describe(self) -> str:
        """One start-up line: model, device, precision, the linear kernel in use, CUDA graphs, KV pool."""
        return self.runner.describe()

    @property
    def linear_kernel(self) -> str:
        """The kernel the layer linears run (dense, onednn-packed, int8pack, ao, bitsandbytes, int4pack)."""
        return self.runner.model.linear_kernel

    def model_info(self) -> dict:
        """What was loaded and how: precision, kernels and memory (fixed once the engine is built)."""
        runner = self.runner
        model = runner.model
        return {
            "architecture": model.args.architecture,
            "dtype": str(runner.dtype).removeprefix("torch."),  # of weights and activations (16-bit when quantized)
            "device": str(runner.device),
            "quantization": self.config.quantization,
            "int8_method": self.config.int8_method,
            "linear_kernel": model.linear_kernel,
            "quant_info": dict(model.quant_info) if model.quant_info else None,
            "fused_kernels": runner.fused_kernels,
            "cuda_graphs": runner.cuda_graphs_note,
            "packed_linears": runner.num_packed_linears,
            "weight_bytes": model.weight_bytes(),
            "linear_weight_bytes": model.linear_weight_bytes(),
            "kv_cache_bytes": runner.kv_cache_bytes,
            "kv_blocks_total": self.kv.num_blocks,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
        }

    def perplexity(self, prompt: str | list[int]) -> float:
        """Perplexity of a text (or token ids) under this engine's model (quantized or not), in one prefill
        on a private KV buffer: the engine's cache, prefix blocks and requests are not touched."""
        return self.runner.perplexity(self.tokenize(prompt))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (for cold-cache measurements). Only while no request holds KV
        blocks; returns whether it did."""
        if not self.kv.reset_prefix_cache():
            return False
        self.prompt_scores.clear()
        return True

    # --- requests --------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a chat in the model's own template, each message's content tokenized as plain
        text (special-token text in a message never becomes a special token; see engine/chat.py).
        ``tools``: OpenAI tool definitions, for a template that renders them."""
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt, tools)

    def check_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` now (it is cached for the requests that use it); ValueError says what is wrong.
        Thread-safe: the API calls it off the engine's thread, so a new grammar never stalls a step."""
        self.grammars.matcher(grammar)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Queue a request. A request that can never fit is finished at once with an error output."""
        params = params or SamplingParams()
        if request_id is None:
            self._next_id += 1
            request_id = f"req-{self._next_id}"
        if request_id in self._states:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, self.tokenize(prompt), params, eos_token_ids=self.eos_token_ids)
        try:
            vocab = self.runner.model.args.vocab_size
            bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:  # it would fail the embedding lookup of a whole batch
                raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
            named = (
                *params.stop_token_ids,
                *(t for t, _ in params.logit_bias),
                *params.prompt_logprobs_token_ids,
                *(t for seq in params.dry_context for t in seq),
            )
            bad = next((t for t in named if t >= vocab), None)
            if bad is not None:  # (a dry_context token following a repeat would be penalized: an index past the row)
                raise RequestRejected(
                    f"token id {bad} (stop_token_ids, logit_bias, prompt_logprobs_token_ids, dry_context) is outside "
                    f"the vocabulary [0, {vocab})"
                )
            grammar = self._grammar_state(params.grammar)
            if params.lazy_grammar is not None:
                self._grammar_state(params.lazy_grammar.grammar)  # compiled now: a bad one fails the request here
            if (
                params.prompt_logprobs_from is not None
                and self.kv.enable_prefix_caching
                and not params.prompt_logits_read
            ):
                req.score_keys = prefix_keys(req.prompt_token_ids)
                first = params.prompt_logprobs_from
                req.prompt_logprobs = self.prompt_scores.lookup(req.score_keys[: req.scored_to], first)
            self.scheduler.add_request(req)
        except RequestRejected as e:
            self._pending.append(self._final(req, "error", str(e), error_type="invalid_request"))
            self.requests_finished_total += 1
            return request_id
        stops = params.stop_token_ids + (() if params.ignore_eos else req.eos_token_ids)
        row = SamplerRow(
            params,
            make_generator(params, self.runner.device, self._rng.getrandbits(63)),
            req.prompt_token_ids,
            req.output_token_ids,
            stop_token_ids=tuple(dict.fromkeys(stops)),
            dry_breakers=self._dry_breakers(params.dry_sequence_breakers) if params.dry else frozenset(),
            grammar=grammar,
        )
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        self._states[request_id] = _RequestState(req, detok, row)
        self.prompt_tokens_total += req.num_prompt_tokens
        return request_id

    @staticmethod
    def _lazy_trigger(row, token: int) -> bool:
        """``token`` starts the row's lazy grammar: a trigger anywhere, or an opener as the reply's first token."""
        lazy = row.params.lazy_grammar
        if lazy is None:
            return False
        return token in lazy.triggers or (not row.output_token_ids and token in lazy.openers)

    def _grammar_state(self, grammar: str | None) -> GrammarState | None:
        if grammar is None:
            return None
        try:
            return self.grammars.state(grammar)
        except ValueError as e:
            raise RequestRejected(f"invalid grammar: {e}") from e

    def _dry_breakers(self, breakers: tuple[str, ...]) -> frozenset[int]:
        """Ids of the tokens whose text holds one of ``breakers`` (DRY does not match across them).
        The vocabulary is decoded once (~1 s for 49k tokens, on the first DRY request)."""
        found = self._breaker_ids.get(breakers)
        if found is None:
            if self._token_texts is None:
                self._token_texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
            found = frozenset(i for i, text in enumerate(self._token_texts) if any(b in text for b in breakers))
            if len(self._breaker_ids) >= _BREAKER_SETS_KEPT:
                self._breaker_ids.clear()
            self._breaker_ids[breakers] = found
        return found

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; its stream gets a final 'abort' output."""
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.finish_request(request_id, "abort")
        self.requests_aborted_total += 1
        self._pending.append(self._final(state.request, "abort"))
        return True

    def pause(self, request_id: str, max_s: float) -> bool:
        """Step no further tokens of a running request for at most ``max_s`` seconds (``resume`` ends it
        sooner); it keeps its KV blocks. Why: a voice reply's text runs ahead of its speech, and while its
        first piece is synthesized the cores are better spent on that. Returns whether it was running."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return False
        req.paused_until = time.monotonic() + max(0.0, max_s)
        return True

    def resume(self, request_id: str) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            req.paused_until = 0.0

    def yield_to_others(self, request_id: str, max_s: float) -> bool:
        """For at most ``max_s`` seconds, step a running request only when no other request needs a step.
        Why: a voice reply whose listener has seconds of audio still to hear gains nothing from its next
        tokens now, while each of its steps slows another reply whose listener hears nothing yet (the
        batch is bigger, and the cores are shared with ASR and TTS). Returns whether it was running."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return False
        req.yields_until = time.monotonic() + max(0.0, max_s)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """A step now would do something (outputs to hand out, or requests that are not all paused)."""
        return bool(self._pending) or self.scheduler.has_work(time.monotonic())

    def seconds_to_resume(self) -> float | None:
        """How long until a paused request may run again (None: none is paused)."""
        resume = self.scheduler.next_resume()
        return None if resume is None else max(0.0, resume - time.monotonic())

    def _final(
        self, req: Request, reason: str, error: str | None = None, text: str = "", error_type: str | None = None
    ) -> RequestOutput:
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

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(time.monotonic())
        if sched.is_empty:
            return outputs
        try:
            sample_ids, logits, score_rows = self.runner.execute(sched)
            if score_rows:
                self._score_prompts(score_rows, logits[len(sample_ids) :])
                logits = logits[: len(sample_ids)]
        except Exception as e:  # the whole step failed: fail its requests, keep the loop going
            log.exception("model forward failed; failing the %d request(s) of this step", len(sched.chunks))
            outputs += self._fail_step(sched, f"model forward failed: {type(e).__name__}: {e}")
            return outputs
        sampled, errors, logprobs = self._sample(sample_ids, logits)
        now = time.monotonic()
        updates = self.scheduler.update_from_output(sched, sampled, errors, now=now)
        n_new = 0
        for u in updates:
            req = u.request
            state = self._states.get(req.request_id)
            if state is None:
                continue
            n_new += len(u.new_token_ids)
            try:
                outputs.append(self._output(state, u.new_token_ids, u.finished, logprobs.get(req.request_id)))
            except Exception as e:  # detokenizing / stop strings of this request: fail it alone
                log.exception("request %s failed after its step", req.request_id)
                self.scheduler.finish_request(req.request_id, "error", f"{type(e).__name__}: {e}")
                self._states.pop(req.request_id, None)
                self.requests_finished_total += 1
                outputs.append(self._final(req, "error", f"output processing failed: {type(e).__name__}: {e}"))
        self.generation_tokens_total += n_new
        if n_new:
            self._rate.append((now, n_new))
        return outputs

    def _output(
        self, state: _RequestState, new_token_ids: list[int], finished: bool, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Detokenize a request's new tokens, apply its stop strings, and build its output."""
        req = state.request
        shown = new_token_ids
        if finished and shown and not req.params.skip_special_tokens and shown[-1] in state.row.stop_token_ids:
            shown = shown[:-1]  # the stop token ends the text; kept special tokens would show it
        text, stopped = state.detok.add(shown, finished)
        if stopped and not finished:
            self.scheduler.finish_request(req.request_id, "stop")
            finished = True
        out = RequestOutput(
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
            # once, with the first token (the prompt is computed by then)
            prompt_logprobs=tuple(req.prompt_logprobs)
            if req.params.prompt_logprobs_from is not None
            and new_token_ids
            and len(req.output_token_ids) == len(new_token_ids)
            else None,
            prompt_top_logprobs=tuple(req.prompt_top_logprobs)
            if req.params.prompt_logits_read and new_token_ids and len(req.output_token_ids) == len(new_token_ids)
            else None,
        )
        if finished:
            del self._states[req.request_id]
            self.requests_finished_total += 1
        return out

    def _score_prompts(self, rows: list[tuple[str, int]], logits) -> None:
        """Append to each request the log-probability, from the raw logits, of the prompt token after each scored
        position (rows in position order per request: ``engine.step_inputs.prepare_inputs``)."""
        requests = [self.scheduler.requests[rid] for rid, _ in rows]
        targets = torch.tensor([req.prompt_token_ids[p + 1] for req, (_, p) in zip(requests, rows, strict=True)])
        logprobs = logits.float().log_softmax(-1)
        found = logprobs.gather(1, targets.to(logits.device)[:, None])[:, 0].tolist()
        for row, (req, (_, position), logprob) in enumerate(zip(requests, rows, found, strict=True)):
            req.prompt_logprobs.append(logprob)
            if req.score_keys:  # kept for a later prompt with the same tokens (``engine.prompt_scores``)
                self.prompt_scores.store(req.score_keys[position + 1], logprob)
            if req.params.prompt_logits_read:
                req.prompt_top_logprobs.append(
                    position_logprobs(logprobs[row], req.prompt_token_ids[position + 1], req.params)
                )

    def _sample(self, sample_ids: list[str], logits) -> tuple[dict[str, int], dict[str, str], dict[str, TokenLogprobs]]:
        """One token per sampling request (with its logprobs if asked), or an error for the requests whose row failed.

        The batch is sampled at once; if that raises, each row is sampled alone so only the
        failing requests get an error (a seeded row's draw may then differ from an undisturbed
        run: its generator advanced in the failed attempt). A token id outside the vocabulary
        is an error too: it would fail the next step's embedding lookup for the whole batch.
        """
        sampled: dict[str, int] = {}
        errors: dict[str, str] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        if not sample_ids:
            return sampled, errors, logprobs
        rows = [self._states[i].row for i in sample_ids]
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
        vocab = self.runner.model.args.vocab_size
        for rid, row, tok, err in zip(sample_ids, rows, tokens, errs, strict=True):
            if err is None and not 0 <= tok < vocab:
                err = f"sampled token id {tok} is outside the vocabulary [0, {vocab})"
            if err is None and row.grammar is None and self._lazy_trigger(row, tok):
                row.grammar = self.grammars.state(row.params.lazy_grammar.grammar)
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

    def _fail_step(self, sched, message: str) -> list[RequestOutput]:
        """Finish every request of a failed step with ``message``; forget the prefix-cache blocks it was filling."""
        outputs = []
        for chunk in sched.chunks:
            req = self.scheduler.requests.get(chunk.request_id)
            if req is None:
                continue
            self.kv.uncache_from(req.request_id, chunk.start // self.config.block_size)
            self.scheduler.finish_request(req.request_id, "error", message)
            self._states.pop(req.request_id, None)
            self.requests_finished_total += 1
            outputs.append(self._final(req, "error", message))
        return outputs

    def reset(self, message: str) -> list[RequestOutput]:
        """Fail every open request (queued outputs dropped), free all KV blocks, forget every cached prefix.

        For a caller whose step loop broke outside the per-request and per-step handling:
        the engine's state may be half updated, so nothing of it is trusted afterwards.
        """
        outputs = []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.finish_request(rid, "error", message)
            self._states.pop(rid, None)
            if req is not None:
                self.requests_finished_total += 1
                outputs.append(self._final(req, "error", message))
        self._states.clear()
        self._pending = []
        self.kv.reset()
        self.prompt_scores.clear()
        return outputs

    # --- metrics -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Current figures (requests, KV blocks, rates), counters since start, and the linear kernel's name.

        ``engine.metrics.EngineCollector`` turns this dict into Prometheus metrics.
        """
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > _RATE_WINDOW_S:
            self._rate.popleft()
        tokens = sum(n for _, n in self._rate)
        span = now - self._rate[0][0] if self._rate else 0.0
        rate = tokens / max(span, 1e-3) if len(self._rate) > 1 else 0.0
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_total": self.kv.num_blocks,
            "prefix_cache_hit_rate": self.kv.prefix_cache_hit_rate,
            "generation_tokens_per_s": rate,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "requests_aborted_total": self.requests_aborted_total,
            "requests_finished_total": self.requests_finished_total,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "linear_kernel": self.runner.model.linear_kernel,
        }

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Convenience for scripts and tests: run prompts to completion, return output token ids."""
        ids = [self.add_request(None, p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.token_ids_delta)
        return [out[i] for i in ids]
