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
import time

import torch

from engine.chat import ChatIdsCache, check_split_special_tokens
from engine.config import EngineConfig
from engine.engine_stats import EngineCounters, model_info
from engine.kv_cache import KVCacheManager
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput, TokenLogprobs
from engine.prompt_scores import PromptScoreCache, prefix_keys
from engine.request import Request, RequestStatus
from engine.request_state import RequestState, RequestStateBuilder
from engine.sampling import SamplingParams
from engine.scheduler import RequestRejected, Scheduler
from engine.step_outputs import final_output, request_output, sample_tokens, score_prompts
from engine.structured_output.grammar import GrammarCompiler
from engine.weights import generation_defaults, resolve_model

log = logging.getLogger(__name__)


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
        self.chat_ids = ChatIdsCache()  # the last chats rendered (a voice turn renders its prompt more than once)
        self.runner = ModelRunner(config, path, model)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prompt_scores = PromptScoreCache()  # prompt log-probabilities computed, beside the prefix cache
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.step_tokens(), self.runner.max_model_len)
        self.eos_token_ids = _eos_token_ids(path, self.tokenizer, self.runner.model.args.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # the model's generation_config.json sampling values: what the API uses for fields a request leaves unset
        self.generation_defaults = generation_defaults(path)
        # requests with a grammar (tool calls, response_format): the llguidance tokenizer is built on first use
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.model.args.vocab_size, self.eos_token_ids)
        # each new request's checks and per-request state (sampler row, detokenizer)
        self.state_builder = RequestStateBuilder(
            self.tokenizer, self.runner.model.args.vocab_size, self.grammars, self.runner.device, config.seed
        )
        self._states: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []
        self.counters = EngineCounters()
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
        return model_info(self.config, self.runner, self.kv.num_blocks)

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
        return self.chat_ids.ids(self.tokenizer, messages, add_generation_prompt, tools)

    def check_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` now (it is cached for the requests that use it); ValueError says what is wrong.
        Thread-safe: the API calls it off the engine's thread, so a new grammar never stalls a step."""
        self.grammars.matcher(grammar)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def add_request(
        self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None, group: str = ""
    ) -> str:
        """Queue a request. A request that can never fit is finished at once with an error output. ``group``:
        requests one caller adds together to choose between share one (``Request.group``)."""
        params = params or SamplingParams()
        if request_id is None:
            self._next_id += 1
            request_id = f"req-{self._next_id}"
        if request_id in self._states:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, self.tokenize(prompt), params, eos_token_ids=self.eos_token_ids, group=group)
        try:
            grammar = self.state_builder.check(req)  # token ids within the vocabulary, grammars that compile
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
            self._pending.append(final_output(req, "error", str(e), error_type="invalid_request"))
            self.counters.requests_finished_total += 1
            return request_id
        self._states[request_id] = self.state_builder.build(req, grammar)
        self.counters.prompt_tokens_total += req.num_prompt_tokens
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; its stream gets a final 'abort' output."""
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.finish_request(request_id, "abort")
        self.counters.requests_aborted_total += 1
        self._pending.append(final_output(state.request, "abort"))
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

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule(time.monotonic())
        if sched.is_empty:
            return outputs
        try:
            started = time.monotonic()
            sample_ids, logits, score_rows = self.runner.execute(sched)
            if log.isEnabledFor(logging.DEBUG):  # a turn's timeline, step by step (``--log-level debug``)
                log.debug(
                    "step: %.1f ms on %d thread(s), %s%s",
                    (time.monotonic() - started) * 1000,
                    torch.get_num_threads(),
                    ", ".join(f"{c.request_id} {c.start}+{c.num_tokens}" for c in sched.chunks),
                    f", copied {sum(c.num_tokens for c in sched.copies)} slot(s)" if sched.copies else "",
                )
            if score_rows:
                requests = [self.scheduler.requests[rid] for rid, _ in score_rows]
                score_prompts(requests, score_rows, logits[len(sample_ids) :], self.prompt_scores)
                logits = logits[: len(sample_ids)]
        except Exception as e:  # the whole step failed: fail its requests, keep the loop going
            log.exception("model forward failed; failing the %d request(s) of this step", len(sched.chunks))
            outputs += self._fail_step(sched, f"model forward failed: {type(e).__name__}: {e}")
            return outputs
        finally:
            # the blocks this step copied from go back now (its copies ran before its forward, in stream order on a
            # GPU), not at the next step: an engine left idle held one, counted as used (a one-step request's end)
            self.scheduler.kv.end_copies()
        rows = [self._states[i].row for i in sample_ids]
        vocab = self.runner.model.args.vocab_size
        sampled, errors, logprobs = sample_tokens(logits, sample_ids, rows, vocab, self.grammars)
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
                outputs.append(self._failed(req, f"output processing failed: {type(e).__name__}: {e}"))
        self.counters.generated(n_new, now)
        return outputs

    def _output(
        self, state: RequestState, new_token_ids: list[int], finished: bool, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Detokenize a request's new tokens, apply its stop strings, and build its output."""
        req = state.request
        text, stopped = state.text(new_token_ids, finished)
        if stopped and not finished:
            self.scheduler.finish_request(req.request_id, "stop")
            finished = True
        out = request_output(req, text, new_token_ids, finished, logprobs)
        if finished:
            del self._states[req.request_id]
            self.counters.requests_finished_total += 1
        return out

    def _fail_step(self, sched, message: str) -> list[RequestOutput]:
        """Finish every request of a failed step with ``message``; forget the prefix-cache blocks it was filling."""
        outputs = []
        for chunk in sched.chunks:
            req = self.scheduler.requests.get(chunk.request_id)
            if req is None:
                continue
            self.kv.uncache_from(req.request_id, chunk.start // self.config.block_size)
            self.scheduler.finish_request(req.request_id, "error", message)
            outputs.append(self._failed(req, message))
        return outputs

    def _failed(self, req, message: str) -> RequestOutput:
        """The output of ``req``, finished in the scheduler with an error: its state dropped and it counted."""
        self._states.pop(req.request_id, None)
        self.counters.requests_finished_total += 1
        return final_output(req, "error", message)

    def reset(self, message: str) -> list[RequestOutput]:
        """Fail every open request (queued outputs dropped), free all KV blocks, forget every cached prefix.

        For a caller whose step loop broke outside the per-request and per-step handling:
        the engine's state may be half updated, so nothing of it is trusted afterwards.
        """
        outputs = []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.finish_request(rid, "error", message)
            if req is not None:
                outputs.append(self._failed(req, message))
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
        figures = self.counters.figures(time.monotonic())
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_total": self.kv.num_blocks,
            "prefix_cache_hit_rate": self.kv.prefix_cache_hit_rate,
            **figures,  # the generation rate and the totals
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
