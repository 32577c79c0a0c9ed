"""The one interface the voice app uses to reach an LLM: an async text stream with abort.

Backends: the in-process Parley engine (default), plain transformers ``generate`` (a
reference), and any OpenAI-compatible server. Stopping iteration (or ``abort``) ends the
generation and frees its resources.

Tools (``ToolCalling.stream_tools``): the engine plans the request as its OpenAI API does
(``engine.tools.plan``: the template's tools, a grammar for forced calls, the family's call
parser); a remote server gets ``tools`` and ``tool_choice`` and its streamed ``tool_calls``
are put back together. Transformers replies are text only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager

from app.stages.base import (
    ChatLLM,
    GenerationSettings,
    Message,
    StandAlone,
    ToolCall,
    ToolSpec,
    TurnEndVerdict,
)
from engine.config import EngineConfig

log = logging.getLogger(__name__)

HEALTH_TTL_S = 5.0
SENTENCE_ENDS = frozenset(".?!。？！…")
# A forced call (a grammar) may need more tokens than a spoken reply: its JSON is cut short at the reply's cap.
FORCED_CALL_MIN_TOKENS = 256
DRY_REPLY_CHARS = 4096  # of an earlier reply, DRY reads this much at most (a spoken reply is a few hundred)

__all__ = ["ChatLLM", "EngineChatLLM", "GenerationSettings", "Message", "OpenAIChatLLM", "TransformersChatLLM"]


def _ends_a_sentence(token_text: str) -> bool:
    """A token that is only a sentence's final punctuation ("." "?" "!" "。", with or without spaces)."""
    stripped = token_text.strip()
    return bool(stripped) and all(char in SENTENCE_ENDS for char in stripped)


def _mean_of_words(first, span: tuple[int, int]) -> float | None:
    """The mean log-probability of the words at ``span`` (first token, count), from a request's first output
    (its ``prompt_logprobs`` start at the span's first token); None where it has none."""
    if not first.prompt_logprobs or len(first.prompt_logprobs) < span[1]:
        return None
    return sum(first.prompt_logprobs[: span[1]]) / span[1]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class TransformersChatLLM:
    """Reference backend: transformers ``generate`` on a thread, one request at a time."""

    name = "transformers"

    def __init__(self, model: str = "bundled", dtype: str = "bfloat16", settings: GenerationSettings | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engine.weights import resolve_model

        path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        self.settings = settings or GenerationSettings()
        self.context_tokens: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._lock = threading.Lock()
        self._cancel: dict[str, threading.Event] = {}

    def count_tokens(self, messages: list[Message]) -> int:
        from engine.chat import chat_token_ids

        return len(chat_token_ids(self.tokenizer, messages))

    async def stream(
        self,
        messages: list[Message],
        request_id: str,
        *,
        earlier_replies: Sequence[str] = (),  # noqa: ARG002 (no DRY here)
    ) -> AsyncIterator[str]:
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        cancel = self._cancel.setdefault(request_id, threading.Event())

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):  # noqa: ARG002
                return cancel.is_set()

        import torch

        from engine.chat import chat_token_ids

        # what users say is plain text inside the template, never a role marker (as in the engine)
        ids = torch.tensor([chat_token_ids(self.tokenizer, messages)])
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
        sampling = (
            {"do_sample": True, "temperature": self.settings.temperature, "top_p": self.settings.top_p}
            if self.settings.temperature > 0
            else {"do_sample": False}
        )

        def run() -> None:
            import torch

            with self._lock, torch.inference_mode():
                try:
                    self.model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=self.settings.max_tokens,
                        streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([_Cancelled()]),
                        pad_token_id=self.tokenizer.eos_token_id,
                        **sampling,
                    )
                except Exception:
                    streamer.end()
                    raise

        loop = asyncio.get_running_loop()
        worker = loop.run_in_executor(None, run)
        iterator = iter(streamer)
        try:
            while True:
                piece = await loop.run_in_executor(None, next, iterator, None)
                if piece is None:
                    break
                if piece:
                    yield piece
            await worker
        finally:
            cancel.set()
            self._cancel.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        event = self._cancel.get(request_id)
        if event:
            event.set()

    async def health(self) -> tuple[bool, str]:
        return True, "loaded"

    def close(self) -> None:
        for event in self._cancel.values():
            event.set()


class EngineChatLLM:
    """The in-process Parley engine (continuous batching, paged KV cache with prefix reuse).

    The one backend with ``LocalScheduling``: it shares this machine's cores with the voice models.
    """

    name = "engine"

    def __init__(self, config: EngineConfig, settings: GenerationSettings | None = None) -> None:
        from engine import AsyncLLMEngine

        self.engine = AsyncLLMEngine(config)
        self.description = self.engine.engine.describe()  # the kernels in use, for the start-up line
        self.settings = settings or GenerationSettings()
        self.context_tokens: int | None = self.engine.engine.max_model_len
        self._engine_ids: dict[str, str] = {}  # a reply's request id -> the engine's (``stream_weighed``)
        # an earlier reply's token ids, for DRY (``_reply_params``): each is read again at every later turn (kept for
        # its first DRY_REPLY_CHARS: a Realtime client's assistant message may be far longer than a reply)
        self._reply_token_ids = functools.lru_cache(maxsize=256)(self._token_ids)

    def _token_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, messages: list[Message]) -> int:
        return len(self.engine.apply_chat_template(messages))

    async def stream(
        self, messages: list[Message], request_id: str, *, earlier_replies: Sequence[str] = ()
    ) -> AsyncIterator[str]:
        params = self._reply_params(earlier_replies)
        async for delta in self._text(self.engine.apply_chat_template(messages), params, request_id):
            yield delta

    def _reply_params(self, earlier_replies: Sequence[str], **scoring):
        """A reply's sampling: the settings', with DRY reading ``earlier_replies`` too (``dry_context``), and ``scoring``
        (the prompt positions it scores).

        Why: DRY reads the prompt, but the conversation policy shows SmolLM2-135M only its last reply (``app.policy``)
        and a turn may be answered without the conversation; the model then said again a reply it had said turns
        before (bench quality: its stock "I'm sorry for any misunderstanding, but as a helpful AI ..." to a
        statement and to the question about it). The newest replies first, to ``MAX_DRY_CONTEXT_TOKENS`` in all
        (a Realtime client may put long assistant messages in the conversation).
        """
        from engine import SamplingParams
        from engine.sampling import MAX_DRY_CONTEXT_TOKENS

        context: list[tuple[int, ...]] = []
        if self.settings.dry_multiplier:
            room = MAX_DRY_CONTEXT_TOKENS
            for text in reversed(earlier_replies):
                ids = self._reply_token_ids(text[:DRY_REPLY_CHARS])[:room]
                room -= len(ids)
                context.append(ids)
                if room <= 0:
                    break
        return SamplingParams(
            max_tokens=self.settings.max_tokens, **self.settings.sampling(), dry_context=context[::-1], **scoring
        )

    async def stream_tools(
        self, messages: list[Message], request_id: str, tools: ToolSpec
    ) -> AsyncIterator[str | ToolCall]:
        """The reply's text, then its calls: planned, decoded (under a grammar for a forced call) and parsed as
        ``parley engine serve`` does (``engine.tools``); a call whose arguments are not JSON is dropped (logged)."""
        from engine import SamplingParams
        from engine.tools.parser import ParsedDelta, ReplyAssembler, ToolCallParser

        plan = self.tool_plan(messages, tools)
        prompt = self.engine.apply_chat_template(plan.messages, tools=plan.tools)
        max_tokens = self.settings.max_tokens
        if plan.grammar is not None:
            await self.engine.check_grammar(plan.grammar)
            max_tokens = max(max_tokens, FORCED_CALL_MIN_TOKENS)
        # not DRY: a call copies the names of its arguments from the schema in the prompt, which DRY penalizes
        sampling = {name: value for name, value in self.settings.sampling().items() if name != "dry_multiplier"}
        params = SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            grammar=plan.grammar,
            skip_special_tokens=plan.skip_special_tokens,
        )
        parser = ToolCallParser(plan.tool_format) if plan.tool_format is not None else None
        calls = ReplyAssembler()
        async for output in self._outputs(prompt, params, request_id):
            if parser is None:
                delta = ParsedDelta(output.text_delta)
            else:
                delta = parser.feed(output.text_delta)
                if output.finished:
                    rest = parser.finish()
                    delta = ParsedDelta(delta.content + rest.content, delta.calls + rest.calls)
            if delta.content:
                yield delta.content
            calls.add(ParsedDelta(calls=delta.calls))
        for call in calls.reply().calls:
            if _is_json(call.arguments):
                yield ToolCall(call.id, call.name, call.arguments)
            else:
                log.warning("the LLM called %s with arguments that are not JSON; the call is dropped", call.name)

    def tool_plan(self, messages: list[Message], tools: ToolSpec):
        """What a request with ``tools`` needs (``engine.tools.plan.ChatPlan``): the template's conversation and
        tools, the grammar, the call format. ValueError for a conversation or tools the engine's API would refuse."""
        from pydantic import ValidationError

        from engine.protocol import ChatCompletionRequest, validation_error
        from engine.tools.plan import plan_chat

        body = {"messages": messages, "tools": list(tools.tools) or None, "parallel_tool_calls": tools.parallel}
        if tools.tools:
            body["tool_choice"] = tools.choice
        try:
            request = ChatCompletionRequest.model_validate(body, context={"vocab_size": len(self.engine.tokenizer)})
        except ValidationError as e:
            raise ValueError(validation_error(e)[0]) from None
        return plan_chat(request, self._tool_format, self.engine.tokenizer)

    @functools.cached_property
    def _tool_format(self):
        from engine.tools.formats import detect_format

        return detect_format(self.engine.tokenizer)

    async def _text(self, prompt: list[int], params, request_id: str) -> AsyncIterator[str]:
        """The request's text deltas; an engine error raises, and closing aborts the request."""
        async for output in self._outputs(prompt, params, request_id):
            if output.text_delta:
                yield output.text_delta

    async def _outputs(self, prompt: list[int], params, request_id: str) -> AsyncIterator:
        """The request's outputs; an engine error raises, and closing aborts the request."""
        outputs = self.engine.generate(prompt, params, request_id=request_id)
        try:
            async for output in outputs:
                if output.error:
                    raise RuntimeError(f"LLM engine: {output.error}")
                yield output
        finally:
            await outputs.aclose()  # aborts the request (and frees its KV blocks) if unfinished

    def abort(self, request_id: str) -> None:
        self.engine.abort(self._engine_id(request_id))

    def pause(self, request_id: str, max_s: float) -> None:
        self.engine.pause(self._engine_id(request_id), max_s)

    def resume(self, request_id: str) -> None:
        self.engine.resume(self._engine_id(request_id))

    def yield_to_others(self, request_id: str, max_s: float) -> None:
        self.engine.yield_to_others(self._engine_id(request_id), max_s)

    def _engine_id(self, request_id: str) -> str:
        """The engine's request that answers the reply ``request_id`` (another when ``stream_weighed`` chose it)."""
        return self._engine_ids.get(request_id, request_id)

    def set_urgent_first_tokens(self, n: int) -> None:
        """How many first tokens of a lone reply decode on every core (the server's solo mode)."""
        self.engine.set_prefill_threads_first_tokens(n)

    def core_lent(self) -> AbstractContextManager[None]:
        return self.engine.core_lent()

    async def warm(
        self, messages: list[Message], tools: ToolSpec | None = None, *, score_words: bool = False
    ) -> float | None:
        """Prefill ``messages`` (no generation prompt: the next prompt continues them) for one token, so
        their full KV blocks are in the prefix cache when the next turn's prompt arrives; rendered as a request with
        ``tools`` renders them (the tools in the template or a system note, earlier calls as the format writes them).
        ``score_words``: also score the last (user) message's words, for ``stream_weighed`` to find them scored
        (``engine.prompt_scores``): the words it would otherwise compute again; their mean log-probability a token is
        returned (None without ``score_words`` or where they could not be scored)."""
        from engine import SamplingParams

        span = self._words_span(messages) if score_words and tools is None else None
        if tools is None:
            prompt = self.engine.apply_chat_template(messages, add_generation_prompt=False)
        else:
            plan = self.tool_plan(messages, tools)
            prompt = self.engine.apply_chat_template(plan.messages, add_generation_prompt=False, tools=plan.tools)
        scored = {} if span is None else {"prompt_logprobs_from": span[0], "prompt_logprobs_to": span[0] + span[1]}
        params = SamplingParams(max_tokens=1, **scored)
        first = None
        async for output in self._outputs(prompt, params, f"warm-{uuid.uuid4().hex}"):
            first = first or output
        return None if span is None or first is None else _mean_of_words(first, span)

    async def end_of_turn_probability(self, messages: list[Message], user_text: str) -> float | None:
        """How likely the user's words end here: P(the template's end-of-turn token) + P(a sentence's end), after
        ``user_text`` without its final punctuation (LiveKit's text turn detector asks the first, of bare words).

        The punctuation goes because Whisper puts it on cut-off audio too ("Turn off." took P(end of turn) from
        2e-7 to 0.5 on the bundled model; "What is the capital of?"); the sentence's end is added because bare
        words that finish a sentence are followed by its punctuation, rarely by the end-of-turn token at once.
        The prompt is the conversation with the user's message left open (the reply's prompt but for its last
        few tokens, so the prefix cache holds nearly all of it); one step reads the log-probabilities from the
        raw logits. The end-of-turn token is forced (a logit bias, which applies after the log-probabilities
        are read) so its own is reported whatever its rank; a sentence's end counts among the 20 likeliest.
        A speculative reply reads the same from its own prefill instead (``stream_reading_turn_end``).
        """
        from engine import SamplingParams
        from engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

        ids = self._turn_end_prompt(messages, user_text)
        if ids is None:
            return None
        token, _ = self._turn_end
        params = SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS, logit_bias={token: MAX_LOGIT_BIAS})
        first = None
        async with contextlib.aclosing(self._outputs(ids, params, f"turn-end-{uuid.uuid4().hex}")) as outputs:
            async for output in outputs:
                first = first or (output.logprobs[0] if output.logprobs else None)
        if first is None:
            return None
        return self._turn_end_probability(first.logprob, first.top)

    def turn_end_position(self, messages: list[Message]) -> int | None:
        if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), str):
            return None
        bare = self._turn_end_prompt(messages[:-1], messages[-1]["content"])
        if bare is None:
            return None
        reply = self.engine.apply_chat_template(messages)
        return len(bare) if len(reply) > len(bare) and reply[: len(bare)] == bare else None

    async def stream_reading_turn_end(
        self, messages: list[Message], request_id: str, verdict: TurnEndVerdict, *, earlier_replies: Sequence[str] = ()
    ) -> AsyncIterator[str]:
        """The reply's prefill scores the token after the words (``prompt_logprobs_from``): its distribution there
        gives ``end_of_turn_probability``'s two terms, the end-of-turn token's log-probability (named, whatever its
        rank) and the 20 likeliest; the position's logits are computed, so the prefix cache serves only what comes
        before it (one token more than a plain reply computes)."""
        from engine.sampling import MAX_LOGPROBS

        position = verdict.position
        if position is None or self._turn_end is None:
            verdict.set(None)
            async for delta in self.stream(messages, request_id, earlier_replies=earlier_replies):
                yield delta
            return
        token, _ = self._turn_end
        params = self._reply_params(
            earlier_replies,
            prompt_logprobs_from=position,
            prompt_logprobs_to=position + 1,
            prompt_top_logprobs=MAX_LOGPROBS,
            prompt_logprobs_token_ids=(token,),
        )
        try:
            async for output in self._outputs(self.engine.apply_chat_template(messages), params, request_id):
                if output.prompt_top_logprobs:
                    there = output.prompt_top_logprobs[0]
                    verdict.set(self._turn_end_probability(there.named[0][1], there.top))
                if output.text_delta:
                    yield output.text_delta
        finally:
            verdict.set(None)  # (no-op once set) the reply failed or was stopped before its first token

    def _turn_end_prompt(self, messages: list[Message], user_text: str) -> list[int] | None:
        """The verdict's prompt: ``messages`` and the user's message holding ``user_text`` bare of its final
        punctuation, left open (cut before the end-of-turn token); None without that token or words."""
        text = user_text.strip().rstrip(".?!…。？！ ")
        if self._turn_end is None or not text:
            return None
        token, after = self._turn_end
        ids = self.engine.apply_chat_template(
            [*messages, {"role": "user", "content": text}], add_generation_prompt=False
        )
        cut = len(ids) - after
        if cut <= 0 or ids[cut] != token:
            return None
        return ids[:cut]

    def _turn_end_probability(self, end_logprob: float, top: tuple[tuple[int, float], ...]) -> float:
        """P(end of turn) at the words' end: the end-of-turn token's, and the likeliest sentence ends' (``top``)."""
        token, _ = self._turn_end
        decode = self.engine.tokenizer.decode
        ends = [lp for t, lp in top if t != token and _ends_a_sentence(decode([t]))]
        return min(1.0, math.exp(end_logprob) + sum(math.exp(lp) for lp in ends))

    async def stream_weighed(
        self, messages: list[Message], alone: StandAlone, request_id: str, *, earlier_replies: Sequence[str] = ()
    ) -> AsyncIterator[str]:
        """The reply to ``messages``, or to ``alone.messages`` where the conversation does not make the user's
        words ``alone.min_gain_nats`` a token likelier (``LocalScheduling.stream_weighed``).

        Both requests start together (``generate_many``); each scores the words from its own prefill
        (``prompt_logprobs_from``/``_to``: the prefix cache serves what comes before them, and the words too where
        the warm-up scored them while the user spoke, ``warm(score_words=True)``), so the scores come with the
        first tokens, and the request
        not chosen is aborted then: one decode step of it is all the choice costs. Its ``request_id`` stays the
        reply's for ``pause``, ``resume`` and the rest (``_engine_id``). Any failure to score keeps the
        conversation; the chosen request failing fails the reply, as ``stream`` does.
        """
        spans = [self._words_span(messages), self._words_span(alone.messages)]
        if spans[0] is None or spans[1] is None:
            if alone.on_weighed is not None:
                alone.on_weighed(None)
            async for delta in self.stream(messages, request_id, earlier_replies=earlier_replies):
                yield delta
            return
        ids = [request_id, f"{request_id}-alone"]
        requests = [
            (
                self.engine.apply_chat_template(prompt),
                self._reply_params(earlier_replies, prompt_logprobs_from=span[0], prompt_logprobs_to=span[0] + span[1]),
                engine_id,
            )
            for prompt, span, engine_id in zip((messages, alone.messages), spans, ids, strict=True)
        ]
        early: list[list] = [[], []]  # each request's outputs until both have their first (the scores)
        chosen: int | None = None
        try:
            async with contextlib.aclosing(self.engine.generate_many(requests)) as outputs:
                async for index, output in outputs:
                    if chosen is not None and index != chosen:
                        continue  # the last outputs of the one not chosen (aborted)
                    if output.error and (index == 0 or chosen == 1):
                        raise RuntimeError(f"LLM engine: {output.error}")
                    if chosen is None:
                        early[index].append(output)
                        if output.error:
                            log.warning("scoring the words alone failed (%s); the conversation is kept", output.error)
                        if not early[0] or not early[1]:
                            continue
                        chosen = self._choose([early[0][0], early[1][0]], spans, alone)
                        self.engine.abort(ids[1 - chosen])  # frees its KV blocks before the next step
                        self._engine_ids[request_id] = ids[chosen]
                    for out in early[chosen] if early[chosen] else [output]:
                        if out.text_delta:
                            yield out.text_delta
                        if out.finished:
                            return
                    early = [[], []]
        finally:
            self._engine_ids.pop(request_id, None)

    @staticmethod
    def _choose(firsts: list, spans: list[tuple[int, int]], alone: StandAlone) -> int:
        """0: the prompt with the conversation, 1: the words alone (their first outputs hold the words' scores)."""
        means = [
            None if first.error else _mean_of_words(first, span) for first, span in zip(firsts, spans, strict=True)
        ]
        gain = None if means[0] is None or means[1] is None else means[0] - means[1]
        if alone.on_weighed is not None:
            alone.on_weighed(gain)
        return 1 if gain is not None and gain < alone.min_gain_nats else 0

    def _words_span(self, messages: list[Message]) -> tuple[int, int] | None:
        """Where the last (user) message's words are in the prompt of ``messages``: (first token, how many); None
        when the template puts no end-of-turn token after a user message, or renders the words apart."""
        if self._turn_end is None or not messages or messages[-1].get("role") != "user":
            return None
        content = messages[-1].get("content")
        if not isinstance(content, str) or not content.strip():
            return None
        _, after = self._turn_end

        def render(text: str) -> list[int]:
            return self.engine.apply_chat_template(
                [*messages[:-1], {"role": "user", "content": text}], add_generation_prompt=False
            )

        ids, empty = render(content), render("")
        start, end = len(empty) - after, len(ids) - after
        if start < 1 or end <= start or ids[:start] != empty[:start]:
            return None
        return start, end - start

    @functools.cached_property
    def _turn_end(self) -> tuple[int, int] | None:
        """The chat template's end-of-turn token (``<|im_end|>`` in ChatML), and how many tokens the template
        puts after a user message counting from it; None when it ends a user message with no special token.

        Found as the first special token of what the template appends to any user message alike.
        """
        special = {int(i) for i in self.engine.tokenizer.added_tokens_encoder.values()}
        renderings = [
            self.engine.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False)
            for text in ("Hello", "What time is it")
        ]
        suffix = []
        for a, b in zip(reversed(renderings[0]), reversed(renderings[1]), strict=False):
            if a != b:
                break
            suffix.insert(0, a)
        firsts = [index for index, token in enumerate(suffix) if token in special]
        return (suffix[firsts[0]], len(suffix) - firsts[0]) if firsts else None

    def stats(self) -> dict:
        return self.engine.stats()

    async def health(self) -> tuple[bool, str]:
        if self.engine.is_running():
            return True, "engine running"
        return False, "engine loop not running"

    def release_cache(self) -> None:
        """Memory pressure: drop the prefix cache's unused blocks (they are rebuilt on demand)."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def close(self) -> None:
        self.engine.shutdown()


# OpenAI's own sampling fields; the others a policy may set (min_p, repetition_penalty, DRY) are extensions that vLLM,
# llama.cpp's server and ``parley engine serve`` take and a strict server (``transformers serve``) refuses
OPENAI_SAMPLING_FIELDS = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty"})


class OpenAIChatLLM:
    """Any OpenAI-compatible server (vLLM, TGI, SGLang, ``parley engine serve``) over streamed SSE.

    Closing the stream closes the HTTP response, which such servers treat as an abort. Sampling fields beyond
    OpenAI's are sent until the server refuses one by name; from then on only OpenAI's are (logged once).
    """

    name = "openai"

    def __init__(self, base_url: str, model: str | None = None, settings: GenerationSettings | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.settings = settings or GenerationSettings()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
        self.model = model if model and model != "bundled" else None
        self.context_tokens: int | None = None  # the server's own; llm_context_tokens sets a bound
        self._health: tuple[float, tuple[bool, str]] | None = None
        self._extensions_refused = False

    async def _model_name(self) -> str:
        if self.model is None:
            response = await self._client.get(self.base_url + "/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self.model

    def count_tokens(self, messages: list[Message]) -> None:
        return None  # no tokenizer here: the session estimates

    async def stream(
        self,
        messages: list[Message],
        request_id: str,
        *,
        earlier_replies: Sequence[str] = (),  # noqa: ARG002 (an OpenAI server takes no DRY context)
    ) -> AsyncIterator[str]:
        async for delta in self._deltas(messages, request_id, {}):
            content = delta.get("content")
            if content:
                yield content

    async def stream_tools(
        self, messages: list[Message], request_id: str, tools: ToolSpec
    ) -> AsyncIterator[str | ToolCall]:
        """The server's text deltas, then its ``tool_calls`` put together (each call's first delta has its index, id
        and name, the next ones fragments of its arguments)."""
        extra: dict = {}
        if tools.tools:
            extra = {"tools": list(tools.tools), "tool_choice": tools.choice, "parallel_tool_calls": tools.parallel}
        calls: dict[int, dict[str, str]] = {}
        async for delta in self._deltas(messages, request_id, extra):
            if delta.get("content"):
                yield delta["content"]
            for piece in delta.get("tool_calls") or ():
                call = calls.setdefault(int(piece.get("index", len(calls))), {"id": "", "name": "", "arguments": ""})
                function = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments") or ""
        for index in sorted(calls):
            call = calls[index]
            yield ToolCall(call["id"] or f"call_{uuid.uuid4().hex[:24]}", call["name"], call["arguments"] or "{}")

    async def _deltas(self, messages: list[Message], request_id: str, extra: dict) -> AsyncIterator[dict]:
        """The ``delta`` of each streamed choice (``extra``: more request fields); an error answer raises."""
        sampling = self.settings.sampling()
        if self._extensions_refused:
            sampling = {name: value for name, value in sampling.items() if name in OPENAI_SAMPLING_FIELDS}
        extensions = [name for name in sampling if name not in OPENAI_SAMPLING_FIELDS]
        body = {
            "model": await self._model_name(),
            "messages": messages,
            "stream": True,
            "max_tokens": self.settings.max_tokens,
            **sampling,
            **extra,
        }
        async with self._client.stream(
            "POST", self.base_url + "/chat/completions", json=body, headers={"X-Request-Id": request_id}
        ) as response:
            if response.status_code == 200:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"LLM server error: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        yield choice.get("delta") or {}
                return
            detail = (await response.aread()).decode(errors="replace")[:300]
        refused = [name for name in extensions if name in detail]
        if response.status_code not in (400, 422) or not refused:
            raise RuntimeError(f"LLM server answered {response.status_code}: {detail}")
        log.warning("%s refused %s: only OpenAI's sampling fields are sent from now on", self.base_url, refused)
        self._extensions_refused = True
        async for delta in self._deltas(messages, request_id, extra):  # the same request without them
            yield delta

    def abort(self, request_id: str) -> None:
        pass  # closing the stream (the session does) is the abort

    async def health(self) -> tuple[bool, str]:
        """Asks the server's ``/models`` at most every ``HEALTH_TTL_S`` (health checks must not load it)."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < HEALTH_TTL_S:
            return self._health[1]
        try:
            response = await self._client.get(self.base_url + "/models", timeout=2.0)
            verdict = (response.status_code == 200, f"{self.base_url} answered {response.status_code}")
        except Exception as exc:  # any failure to reach it is the answer
            verdict = (False, f"{self.base_url} unreachable: {type(exc).__name__}")
        self._health = (now, verdict)
        return verdict

    def close(self) -> None:
        pass
