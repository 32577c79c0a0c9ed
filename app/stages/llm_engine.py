"""The in-process Parley engine behind the voice app's one LLM interface (``ChatLLM.stream(ReplyRequest)``).

Every feature of a ``ReplyRequest`` composes in one engine request (two, when the words are weighed):

* the prompt is rendered as the engine's OpenAI API renders it (``engine.openai_api.tool_plan``): with
  ``tools`` it holds the template's tools, a forced call is decoded under a grammar, and the reply is parsed
  for calls in the model's own format;
* ``earlier_replies`` reach the sampler's DRY as text read before the prompt (``dry_context``);
* ``turn_end`` and ``alone`` are read from the prompt's own prefill (``prompt_logprobs_*``): the verdict at the
  words' end, the words' mean log-probability in each prompt. The two prompts start together and the one not
  chosen is aborted at its first token (its KV blocks freed before the next step).

How a prompt is rendered (with tools: the API's plan) is ``app.stages.llm_prompt``; where prompts are read (the
end-of-turn token, the words' span) is the template's business: ``PromptMarks``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from app.stages.base import Message, ReplyFeature, ReplyRequest, StandAlone, ToolCall, ToolSpec
from app.stages.llm_prompt import PromptRenderer, Rendered
from engine.config import EngineConfig

log = logging.getLogger(__name__)

SENTENCE_ENDS = frozenset(".?!。？！…")
# A forced call (a grammar) may need more tokens than a spoken reply: its JSON is cut short at the reply's cap.
FORCED_CALL_MIN_TOKENS = 256
DRY_REPLY_CHARS = 4096  # of an earlier reply, DRY reads this much at most (a spoken reply is a few hundred)


def _ends_a_sentence(token_text: str) -> bool:
    """A token that is only a sentence's final punctuation ("." "?" "!" "。", with or without spaces)."""
    stripped = token_text.strip()
    return bool(stripped) and all(char in SENTENCE_ENDS for char in stripped)


def acts(prompt: Rendered, first) -> bool:
    """The reply's first token opens a call (its prompt has tools whose calls a model writes bare)."""
    lazy = prompt.lazy_grammar
    return lazy is not None and bool(first.token_ids_delta) and first.token_ids_delta[0] in lazy.openers


_CALL_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


def called_name(outputs: list) -> str | None:
    """The name a call written so far gives (its closing quote written), or None."""
    match = _CALL_NAME.search("".join(output.text_delta for output in outputs))
    return match.group(1) if match else None


def declared_names(tools: ToolSpec | None) -> set[str]:
    return {tool.get("function", {}).get("name") for tool in tools.tools} if tools is not None else set()


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass(frozen=True)
class Window:
    """The prompt positions a request scores: ``start``..``end`` (exclusive); ``top``: with the likeliest tokens
    and ``named`` ones at each (the turn-end verdict needs its position's distribution)."""

    start: int
    end: int
    top: bool = False
    named: tuple[int, ...] = ()

    def params(self) -> dict:
        from engine.sampling import MAX_LOGPROBS

        fields = {"prompt_logprobs_from": self.start, "prompt_logprobs_to": self.end}
        if self.top:
            fields |= {"prompt_top_logprobs": MAX_LOGPROBS, "prompt_logprobs_token_ids": self.named}
        return fields

    def mean(self, output, span: tuple[int, int]) -> float | None:
        """The mean log-probability of the ``span`` (first token, count) from a request's first output."""
        offset = span[0] - self.start
        scores = output.prompt_logprobs
        if output.error or not scores or len(scores) < offset + span[1]:
            return None
        return sum(scores[offset : offset + span[1]]) / span[1]


class PromptMarks:
    """Where a chat template's prompts are read: its end-of-turn token, the user's words, the verdict's prompt, and the
    positions a request scores for the verdict and the weighing (``window``), read back from its first output."""

    def __init__(self, engine, render) -> None:
        self._engine, self._render = engine, render

    @functools.cached_property
    def turn_end(self) -> tuple[int, int] | None:
        """The chat template's end-of-turn token (``<|im_end|>`` in ChatML), and how many tokens the template
        puts after a user message counting from it; None when it ends a user message with no special token.

        Found as the first special token of what the template appends to any user message alike.
        """
        special = {int(i) for i in self._engine.tokenizer.added_tokens_encoder.values()}
        renderings = [
            self._engine.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False)
            for text in ("Hello", "What time is it")
        ]
        suffix = []
        for a, b in zip(reversed(renderings[0]), reversed(renderings[1]), strict=False):
            if a != b:
                break
            suffix.insert(0, a)
        firsts = [index for index, token in enumerate(suffix) if token in special]
        return (suffix[firsts[0]], len(suffix) - firsts[0]) if firsts else None

    def words_span(self, messages: list[Message], tools: ToolSpec | None = None) -> tuple[int, int] | None:
        """Where the last (user) message's words are in the prompt of ``messages``: (first token, how many); None
        when the template puts no end-of-turn token after a user message, or renders the words apart."""
        if self.turn_end is None or not messages or messages[-1].get("role") != "user":
            return None
        content = messages[-1].get("content")
        if not isinstance(content, str) or not content.strip():
            return None
        _, after = self.turn_end

        def ids(text: str) -> list[int]:
            said = [*messages[:-1], {"role": "user", "content": text}]
            return self._render(said, tools, add_generation_prompt=False).ids

        words, empty = ids(content), ids("")
        start, end = len(empty) - after, len(words) - after
        if start < 1 or end <= start or words[:start] != empty[:start]:
            return None
        return start, end - start

    def verdict_prompt(
        self, messages: list[Message], user_text: str, tools: ToolSpec | None = None
    ) -> list[int] | None:
        """The verdict's prompt: ``messages`` and the user's message holding ``user_text`` bare of its final
        punctuation, left open (cut before the end-of-turn token); None without that token or words."""
        text = user_text.strip().rstrip(".?!…。？！ ")
        if self.turn_end is None or not text:
            return None
        token, after = self.turn_end
        said = [*messages, {"role": "user", "content": text}]
        ids = self._render(said, tools, add_generation_prompt=False).ids
        cut = len(ids) - after
        if cut <= 0 or ids[cut] != token:
            return None
        return ids[:cut]

    def verdict_position(self, messages: list[Message], tools: ToolSpec | None = None) -> int | None:
        """Where the reply's prompt for ``messages`` reads the verdict (``LocalScheduling.turn_end_position``)."""
        if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), str):
            return None
        bare = self.verdict_prompt(messages[:-1], messages[-1]["content"], tools)
        if bare is None:
            return None
        reply = self._render(messages, tools).ids
        return len(bare) if len(reply) > len(bare) and reply[: len(bare)] == bare else None

    def probability(self, end_logprob: float, top: tuple[tuple[int, float], ...]) -> float:
        """P(end of turn) at the words' end: the end-of-turn token's, and the likeliest sentence ends' (``top``)."""
        token, _ = self.turn_end
        decode = self._engine.tokenizer.decode
        ends = [lp for t, lp in top if t != token and _ends_a_sentence(decode([t]))]
        return min(1.0, math.exp(end_logprob) + sum(math.exp(lp) for lp in ends))

    def window(self, span: tuple[int, int] | None, position: int | None) -> Window | None:
        """The positions a prompt scores: its words' ``span`` (weighing) and the verdict's ``position``."""
        named = (self.turn_end[0],) if position is not None else ()
        ranges = ([(span[0], span[0] + span[1])] if span else []) + ([(position, position + 1)] if named else [])
        if not ranges:
            return None
        return Window(min(r[0] for r in ranges), max(r[1] for r in ranges), top=bool(named), named=named)

    def verdict(self, first, window: Window, position: int) -> float | None:
        """P(end of turn) read at ``position`` from the reply's first output (its prompt's scores)."""
        scored = first.prompt_top_logprobs
        offset = position - window.start
        if first.error or not scored or len(scored) <= offset:
            return None
        there = scored[offset]
        return self.probability(there.named[0][1], there.top)


class EngineChatLLM:
    """The in-process Parley engine (continuous batching, paged KV cache with prefix reuse).

    The one backend with ``LocalScheduling``: it shares this machine's cores with the voice models.
    """

    name = "engine"
    features: frozenset[ReplyFeature] = frozenset({"tools", "alone", "turn_end", "earlier_replies"})

    def __init__(self, config: EngineConfig) -> None:
        from engine import AsyncLLMEngine

        self.engine = AsyncLLMEngine(config)
        self.description = self.engine.engine.describe()  # the kernels in use, for the start-up line
        self.context_tokens: int | None = self.engine.engine.max_model_len
        self.prompts = PromptRenderer(self.engine)
        self.render, self.tool_plan, self.prepare_tools = (
            self.prompts.render,
            self.prompts.tool_plan,
            self.prompts.prepare_tools,
        )
        self.marks = PromptMarks(self.engine, self.render)
        self._engine_ids: dict[str, str] = {}  # a reply's request id -> the engine's (the chosen of two prompts)
        # an earlier reply's token ids, for DRY: each is read again at every later turn (kept for its first
        # DRY_REPLY_CHARS: a Realtime client's assistant message may be far longer than a reply)
        self._reply_token_ids = functools.lru_cache(maxsize=256)(self._token_ids)

    def _token_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, messages: list[Message]) -> int:
        return len(self.engine.apply_chat_template(messages))

    def _params(self, request: ReplyRequest, rendered: Rendered, window: Window | None):
        """The request's sampling: its settings, DRY reading ``earlier_replies`` too (``dry_context``), a forced
        call's grammar, and the prompt positions it scores.

        Why DRY reads the earlier replies: the conversation policy shows SmolLM2-135M only its last reply
        (``app.policy``) and a turn may be answered without the conversation; the model then said again a reply it
        had said turns before. The newest replies first, to ``MAX_DRY_CONTEXT_TOKENS`` in all. DRY applies with
        tools too: a call's quotes and colons are sequence breakers, so a name copied from the schema in the prompt
        matches only within itself (a penalty from its third token on), and a forced call's grammar keeps names
        exact (``tests/stages/test_llm_tools.py``).
        """
        from engine import SamplingParams
        from engine.sampling import MAX_DRY_CONTEXT_TOKENS

        settings = request.sampling
        context: list[tuple[int, ...]] = []
        if settings.dry_multiplier:
            room = MAX_DRY_CONTEXT_TOKENS
            for text in reversed(request.earlier_replies):
                ids = self._reply_token_ids(text[:DRY_REPLY_CHARS])[:room]
                room -= len(ids)
                context.append(ids)
                if room <= 0:
                    break
        max_tokens = settings.max_tokens
        if rendered.grammar is not None or rendered.lazy_grammar is not None:  # (a call's JSON is not spoken)
            max_tokens = max(max_tokens, FORCED_CALL_MIN_TOKENS)
        return SamplingParams(
            max_tokens=max_tokens,
            **settings.sampling(),
            dry_context=context[::-1],
            grammar=rendered.grammar,
            lazy_grammar=rendered.lazy_grammar,
            logit_bias=dict.fromkeys(rendered.banned, -100.0),
            skip_special_tokens=rendered.skip_special_tokens,
            **(window.params() if window is not None else {}),
        )

    # ------------------------------------------------------------------ the reply
    async def stream(self, request: ReplyRequest) -> AsyncIterator[str | ToolCall]:
        """The reply's text, then its calls (with ``tools``): decoded as ``parley engine serve`` does; a call whose
        arguments are not JSON is dropped (logged)."""
        from engine.openai_api.tool_parser import ParsedDelta, ReplyAssembler, ToolCallParser

        rendered = self.render(request.messages, request.tools)
        if rendered.grammar is not None:
            await self.engine.check_grammar(rendered.grammar)
        parser = ToolCallParser(rendered.tool_format) if rendered.tool_format is not None else None
        calls = ReplyAssembler()
        async for output in self._chosen(request, rendered):
            if parser is None:
                delta = ParsedDelta(output.text_delta)
            else:
                delta = parser.feed(output.text_delta)
                if output.finished:
                    rest = parser.finish()
                    delta = ParsedDelta(delta.content + rest.content, delta.calls + rest.calls)
            yield delta.content  # "" while a call is written (``ChatLLM.stream``)
            calls.add(ParsedDelta(calls=delta.calls))
        for call in calls.reply().calls:
            if is_json(call.arguments):
                yield ToolCall(call.id, call.name, call.arguments)
            else:
                log.warning("the LLM called %s with arguments that are not JSON; the call is dropped", call.name)

    async def _chosen(self, request: ReplyRequest, rendered: Rendered) -> AsyncIterator:
        """The outputs of the request that writes the reply: the one prompt's, or of the two (``alone``) the one the
        words choose. The verdict (``turn_end``) and the weighing are read from the first outputs."""
        verdict, alone = request.turn_end, request.alone
        position = verdict.position if verdict is not None else None
        if verdict is not None and (position is None or self.marks.turn_end is None):
            verdict.set(None)
            verdict, position = None, None
        spans = None
        weighs = alone is not None and alone.min_gain_nats > float("-inf")  # (-inf: alone only where it acts)
        if weighs:
            spans = (
                self.marks.words_span(request.messages, request.tools),
                self.marks.words_span(alone.messages, request.tools),
            )
            if None in spans:
                if alone.on_weighed is not None:
                    alone.on_weighed(None)
                alone, spans, weighs = None, None, False
        windows = [self.marks.window(spans[0] if spans else None, position)]
        prompts = [rendered]
        if alone is not None:  # (the words are scored, one row of logits a token, only where they are weighed)
            windows.append(self.marks.window(spans[1] if spans else None, None))
            prompts.append(self.render(alone.messages, request.tools))
        ids = [request.request_id, f"{request.request_id}-alone"][: len(prompts)]
        requests = [
            (prompt.ids, self._params(request, prompt, window), engine_id)
            for prompt, window, engine_id in zip(prompts, windows, ids, strict=True)
        ]
        early: list[list] = [[] for _ in prompts]  # each request's outputs until the one to follow is chosen
        chosen: int | None = None
        naming = False  # the words alone open a call and the conversation does not: which one waits for its name
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
                        if not all(early):
                            continue
                        if not naming:
                            firsts = [outs[0] for outs in early]
                            if verdict is not None:
                                verdict.set(self.marks.verdict(firsts[0], windows[0], position))
                            chosen = self._choose(firsts, windows, spans, alone) if weighs else 0
                            # a request acts where it stands alone: once its call's name is written, if it is a tool
                            # ("What is my sister's name?" alone calls a made-up tool: the conversation answers it;
                            # app/bench/results/default_brain.md, 6)
                            if alone is not None and chosen == 0 and acts(prompts[1], firsts[1]):
                                naming = not acts(prompts[0], firsts[0])
                                chosen = None if naming else 0
                        if naming:
                            name = called_name(early[1])
                            if name is None and not any(out.finished for outs in early for out in outs):
                                continue
                            chosen = 1 if name in declared_names(request.tools) else 0
                        if len(prompts) > 1:
                            self.engine.abort(ids[1 - chosen])  # frees its KV blocks before the next step
                            self._engine_ids[request.request_id] = ids[chosen]
                    for out in early[chosen] if early[chosen] else [output]:
                        yield out
                        if out.finished:
                            return
                    early = [[] for _ in prompts]
        finally:
            if verdict is not None:
                verdict.set(None)  # (no-op once set) the reply failed or was stopped before its first token
            self._engine_ids.pop(request.request_id, None)

    @staticmethod
    def _choose(firsts: list, windows: list[Window], spans, alone: StandAlone) -> int:
        """0: the prompt with the conversation, 1: the words alone (their first outputs hold the words' scores)."""
        means = [window.mean(first, span) for first, window, span in zip(firsts, windows, spans, strict=True)]
        gain = None if None in means else means[0] - means[1]
        if alone.on_weighed is not None:
            alone.on_weighed(gain)
        return 1 if gain is not None and gain < alone.min_gain_nats else 0

    async def _outputs(self, prompt: list[int], params, request_id: str) -> AsyncIterator:
        """A one-prompt request's outputs; an engine error raises, and closing aborts the request."""
        outputs = self.engine.generate(prompt, params, request_id=request_id)
        try:
            async for output in outputs:
                if output.error:
                    raise RuntimeError(f"LLM engine: {output.error}")
                yield output
        finally:
            await outputs.aclose()  # aborts the request (and frees its KV blocks) if unfinished

    # ------------------------------------------------------------------ LocalScheduling
    def abort(self, request_id: str) -> None:
        self.engine.abort(self._engine_id(request_id))

    def pause(self, request_id: str, max_s: float) -> None:
        self.engine.pause(self._engine_id(request_id), max_s)

    def resume(self, request_id: str) -> None:
        self.engine.resume(self._engine_id(request_id))

    def yield_to_others(self, request_id: str, max_s: float) -> None:
        self.engine.yield_to_others(self._engine_id(request_id), max_s)

    def _engine_id(self, request_id: str) -> str:
        """The engine's request that answers the reply ``request_id`` (another when the words alone were chosen)."""
        return self._engine_ids.get(request_id, request_id)

    def set_urgent_first_tokens(self, n: int) -> None:
        """How many first tokens of a lone reply decode on every core (the server's solo mode)."""
        self.engine.set_prefill_threads_first_tokens(n)

    def core_lent(self) -> AbstractContextManager[None]:
        return self.engine.core_lent()

    def idle(self) -> bool:
        return self.engine.requests_in_flight() == 0

    async def warm(
        self, messages: list[Message], tools: ToolSpec | None = None, *, score_words: bool = False
    ) -> float | None:
        """Prefill ``messages`` (no generation prompt: the next prompt continues them) for one token, so
        their full KV blocks are in the prefix cache when the next turn's prompt arrives; rendered as a request with
        ``tools`` renders them. ``score_words``: also score the last (user) message's words, for a request weighing
        them to find them scored (``engine.prompt_scores``); their mean log-probability a token is returned (None
        without ``score_words`` or where they could not be scored)."""
        from engine import SamplingParams

        span = self.marks.words_span(messages, tools) if score_words else None
        prompt = self.render(messages, tools, add_generation_prompt=False).ids
        window = Window(span[0], span[0] + span[1]) if span is not None else None
        params = SamplingParams(max_tokens=1, **(window.params() if window is not None else {}))
        first = None
        async for output in self._outputs(prompt, params, f"warm-{uuid.uuid4().hex}"):
            first = first or output
        return None if window is None or first is None else window.mean(first, span)

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
        A speculative reply reads the same from its own prefill instead (``ReplyRequest.turn_end``).
        """
        from engine import SamplingParams
        from engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

        ids = self.marks.verdict_prompt(messages, user_text)
        if ids is None:
            return None
        token, _ = self.marks.turn_end
        params = SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS, logit_bias={token: MAX_LOGIT_BIAS})
        first = None
        async with contextlib.aclosing(self._outputs(ids, params, f"turn-end-{uuid.uuid4().hex}")) as outputs:
            async for output in outputs:
                first = first or (output.logprobs[0] if output.logprobs else None)
        if first is None:
            return None
        return self.marks.probability(first.logprob, first.top)

    def turn_end_position(self, messages: list[Message], tools: ToolSpec | None = None) -> int | None:
        return self.marks.verdict_position(messages, tools)

    # ------------------------------------------------------------------ the rest
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
