"""The one interface the voice app uses to reach an LLM: a reply streamed from one ``ReplyRequest``, with abort.

Backends: the in-process Parley engine (default, ``app.stages.llm_engine``: every feature of a request), plain
transformers ``generate`` (a reference: text only), and any OpenAI-compatible server (tools: it gets ``tools`` and
``tool_choice``, and its streamed ``tool_calls`` are put back together). Each says which of a request's optional
features it carries out (``ChatLLM.features``). Stopping iteration (or ``abort``) ends the generation and frees its
resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from app.stages.base import ChatLLM, GenerationSettings, Message, ReplyFeature, ReplyRequest, ToolCall, ToolSpec
from app.stages.code_fence import Unfence
from app.stages.control_tokens import neutralize_messages, neutralize_tools
from app.stages.llm_engine import EngineChatLLM, is_json
from engine.weights import is_local_model_name

log = logging.getLogger(__name__)

HEALTH_TTL_S = 5.0
REWARM_POLL_S = 2.0  # how often a lost remote server is asked whether it is back

__all__ = ["ChatLLM", "EngineChatLLM", "GenerationSettings", "Message", "OpenAIChatLLM", "TransformersChatLLM"]


class TransformersChatLLM:
    """Reference backend: transformers ``generate`` on a thread, one request at a time."""

    name = "transformers"
    features: frozenset[ReplyFeature] = frozenset()

    def __init__(self, model: str = "bundled", dtype: str = "bfloat16"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engine.weights import resolve_model

        path = resolve_model(model, float32_weights=True)  # transformers reads the folder's weights
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        self.context_tokens: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._lock = threading.Lock()
        self._cancel: dict[str, threading.Event] = {}

    def count_tokens(self, messages: list[Message]) -> int:
        from engine.chat import chat_token_ids

        return len(chat_token_ids(self.tokenizer, messages))

    async def stream(self, request: ReplyRequest) -> AsyncIterator[str | ToolCall]:
        """The reply's text (temperature and top_p of its sampling; the rest of a request is not carried out)."""
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        request_id, settings = request.request_id, request.sampling
        cancel = self._cancel.setdefault(request_id, threading.Event())

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):  # noqa: ARG002
                return cancel.is_set()

        import torch

        from engine.chat import chat_token_ids

        # what users say is plain text inside the template, never a role marker (as in the engine)
        ids = torch.tensor([chat_token_ids(self.tokenizer, request.messages)])
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
        sampling = (
            {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p}
            if settings.temperature > 0
            else {"do_sample": False}
        )

        def run() -> None:
            import torch

            with self._lock, torch.inference_mode():
                try:
                    self.model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=settings.max_tokens,
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


# OpenAI's own sampling fields; the others a policy may set (min_p, repetition_penalty, DRY) are extensions that vLLM,
# llama.cpp's server and ``parley engine serve`` take and a strict server (``transformers serve``) refuses
OPENAI_SAMPLING_FIELDS = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed"})


class OpenAIChatLLM:
    """Any OpenAI-compatible server (vLLM, TGI, SGLang, ``parley engine serve``) over streamed SSE.

    Closing the stream closes the HTTP response, which such servers treat as an abort. Sampling fields beyond
    OpenAI's are sent until the server refuses one by name; from then on only OpenAI's are (logged once). A server
    that refuses ``tool_choice: "auto"`` (vLLM started without ``--enable-auto-tool-choice``: every turn with the
    skills on failed) gets the request again without tools, and so do its later "auto" requests (logged once,
    with the flags to start it with); "required" and named calls are still sent. What was learnt so is forgotten
    when the server cannot be reached (a restart may bring other flags or another model), and the prompt warmed
    at start (``warm_prefix``) is warmed again as soon as it answers.
    """

    name = "openai"
    features: frozenset[ReplyFeature] = frozenset({"tools"})

    def __init__(self, base_url: str, model: str | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
        # "auto", "bundled" or a mirrored name mean this install's model: the server's id is asked (``_model_name``)
        self.model = model if model and not is_local_model_name(model) else None
        self.context_tokens: int | None = None  # the server's own; llm_context_tokens sets a bound
        self._health: tuple[float, tuple[bool, str]] | None = None
        self._extensions_refused = False
        self._auto_tools_refused = False
        self._card: dict | None = None  # the served model's /models entry, once asked
        self._warm_prompt: tuple[list[Message], ToolSpec | None] | None = None  # warm_prefix's, warmed again later
        self._rewarm: asyncio.Task | None = None  # waiting for a lost server to come back, to warm it

    async def _model_name(self) -> str:
        """The served model's id (``model``, else the server's first), asked once with its context length: vLLM's
        and ``parley engine serve``'s ``/models`` cards give ``max_model_len``, which then bounds the prompt
        (``context_tokens``). A server without ``/models`` is fine when the model is named."""
        if self._card is None:
            try:
                response = await self._client.get(self.base_url + "/models")
                response.raise_for_status()
                cards = response.json().get("data") or []
            except Exception:
                if self.model is None:
                    raise
                cards = []
            card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
            self._card = card
            if self.model is None:
                self.model = card["id"]
            limit = card.get("max_model_len")
            if isinstance(limit, int) and limit > 0:
                self.context_tokens = limit
                log.info("%s serves %s with a context of %d tokens", self.base_url, self.model, limit)
        return self.model

    async def _card_or_none(self) -> dict:
        """The served model's ``/models`` card ({} where the server gives none); asked once."""
        try:
            await self._model_name()
        except Exception:
            return {}  # the request itself will say what is wrong
        return self._card or {}

    def count_tokens(self, messages: list[Message]) -> None:
        return None  # no tokenizer here: the session estimates

    async def stream(self, request: ReplyRequest) -> AsyncIterator[str | ToolCall]:
        """The server's text deltas, then its ``tool_calls`` put together (each call's first delta has its index, id
        and name, the next ones fragments of its arguments).

        With tools, the text is also read for calls the server's own parser left in it: vLLM's hermes parser takes
        only tagged calls, and Qwen2.5-Coder-0.5B (the default brain) writes its calls as bare JSON, which reached
        the user as spoken JSON. Such a call (tagged, or a JSON object naming a tool that opens the reply) is
        read as the in-process engine reads it (``engine.openai_api.tool_parser``, Hermes), also inside a markdown
        code fence (``app.stages.code_fence``); other text streams through as it comes. Every delta that says
        nothing (a call's, held or from the server's parser) is an empty string: the reply's wait for its first
        words counts it (``app.voice.llm_wait``), so a call written slowly is not a silent server."""
        from engine.openai_api.tool_parser import ParsedDelta, ReplyAssembler, ToolCallParser
        from engine.structured_output.formats import HERMES

        extra: dict = {}
        tools = request.tools
        if tools is not None and tools.tools and not (tools.choice == "auto" and self._auto_tools_refused):
            extra = {"tools": list(tools.tools), "tool_choice": tools.choice, "parallel_tool_calls": tools.parallel}
        calls: dict[int, dict[str, str]] = {}
        # Parley's own server has read its text with this same parser already: read again, a model without tools in
        # its template (SmolLM2) echoing a call's JSON as its answer made new calls
        ours = extra and (self._card or await self._card_or_none()).get("owned_by") == "parley"
        text_parser = ToolCallParser(HERMES) if extra and not ours else None
        unfence = Unfence()  # a call in a markdown code fence, as the default brain wrote it through vLLM
        in_text = ReplyAssembler()
        async for delta in self._deltas(request, extra):
            said = ""
            if delta.get("content"):
                if text_parser is None:
                    said = delta["content"]
                else:
                    parsed = text_parser.feed(unfence.feed(delta["content"]))
                    said = parsed.content
                    in_text.add(ParsedDelta(calls=parsed.calls))
            yield said  # "" while a call is written: the server is alive (``ChatLLM.stream``)
            for piece in delta.get("tool_calls") or ():
                call = calls.setdefault(int(piece.get("index", len(calls))), {"id": "", "name": "", "arguments": ""})
                function = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments") or ""
        if text_parser is not None:
            last = text_parser.feed(unfence.finish())
            rest = text_parser.finish()
            rest = ParsedDelta(last.content + rest.content, last.calls + rest.calls)
            if rest.content:
                yield rest.content
            in_text.add(ParsedDelta(calls=rest.calls))
        for index in sorted(calls):
            call = calls[index]
            yield ToolCall(call["id"] or f"call_{uuid.uuid4().hex[:24]}", call["name"], call["arguments"] or "{}")
        for found in in_text.reply().calls:
            if is_json(found.arguments):
                yield ToolCall(found.id, found.name, found.arguments)
            else:
                log.warning("the LLM wrote a call to %s whose arguments are not JSON; the call is dropped", found.name)

    async def _deltas(self, request: ReplyRequest, extra: dict) -> AsyncIterator[dict]:
        """The ``delta`` of each streamed choice (``extra``: more request fields); an error answer raises."""
        import httpx

        sampling = request.sampling.sampling()
        if self._extensions_refused:
            sampling = {name: value for name, value in sampling.items() if name in OPENAI_SAMPLING_FIELDS}
        extensions = [name for name in sampling if name not in OPENAI_SAMPLING_FIELDS]
        if "tools" in extra:
            extra = {**extra, "tools": neutralize_tools(extra["tools"])}
        body = {
            "model": await self._model_name(),
            # the server renders the template and parses special tokens in it: the user's words must stay words
            "messages": neutralize_messages(request.messages),
            "stream": True,
            "max_tokens": request.sampling.max_tokens,
            **sampling,
            **extra,
        }
        try:
            async with self._client.stream(
                "POST", self.base_url + "/chat/completions", json=body, headers={"X-Request-Id": request.request_id}
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
        except httpx.TransportError:
            self._forget_server()  # what answers next may be another server, or this one started with other flags
            raise
        lowered = detail.lower()
        if (
            response.status_code == 400
            and extra.get("tool_choice") == "auto"
            and "auto" in lowered
            and "choice" in lowered
        ):
            log.warning(
                "%s refused tools with tool_choice auto (%s): replies go without tools until it restarts; for tools, "
                "start vLLM with --enable-auto-tool-choice --tool-call-parser <the model's: hermes for Qwen>",
                self.base_url,
                detail[:120],
            )
            self._auto_tools_refused = True
            async for delta in self._deltas(request, {}):  # the same request without tools
                yield delta
            return
        refused = [name for name in extensions if name in detail]
        if response.status_code not in (400, 422) or not refused:
            raise RuntimeError(f"LLM server answered {response.status_code}: {detail}")
        log.warning("%s refused %s: only OpenAI's sampling fields are sent from now on", self.base_url, refused)
        self._extensions_refused = True
        async for delta in self._deltas(request, extra):  # the same request without them
            yield delta

    def abort(self, request_id: str) -> None:
        pass  # closing the stream (the session does) is the abort

    def _forget_server(self) -> None:
        """Drop what was learnt of the server (its model card and context, the fields and tool choice it refused):
        it was unreachable, and the one that answers next is asked afresh."""
        self._card = None
        self.context_tokens = None
        self._auto_tools_refused = False
        self._extensions_refused = False
        if self._warm_prompt is not None and (self._rewarm is None or self._rewarm.done()):
            with contextlib.suppress(RuntimeError):  # (no running loop: nothing to warm later)
                self._rewarm = asyncio.get_running_loop().create_task(self._warm_when_back())

    async def warm_prefix(self, messages: list[Message], tools: ToolSpec | None = None) -> None:
        """Ask the server for one token after ``messages`` (rendered with ``tools``), so that a server with a prefix
        cache (vLLM, ``parley engine serve``) holds their KV when the first conversation's prompt starts with them;
        the first request also pays the server's own first-call costs, here rather than in a user's turn. The
        request waits as long as the server takes (a cold 0.5B prefill of ~900 tokens was >10 s on two cores)."""
        self._warm_prompt = (messages, tools)
        request = ReplyRequest(messages, f"warm-{uuid.uuid4().hex}", GenerationSettings(max_tokens=1), tools)
        async for _ in self.stream(request):
            pass

    async def _warm_when_back(self) -> None:
        """After the server was lost: ask ``health`` every ``REWARM_POLL_S`` until it answers, then warm it again
        with the prompt ``warm_prefix`` was given, before a user's turn would have to pay its cold prefill."""
        while True:
            await asyncio.sleep(REWARM_POLL_S)
            healthy, _ = await self.health()
            if healthy:
                break
        try:
            await self.warm_prefix(*self._warm_prompt)
            log.info("%s is back: the first prompt is prefilled again", self.base_url)
        except Exception as exc:  # a warm-up that fails costs only its own time
            log.warning("%s is back but could not be warmed: %s", self.base_url, exc)

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
        if self._rewarm is not None:
            self._rewarm.cancel()
