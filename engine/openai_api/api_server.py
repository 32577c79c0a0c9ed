"""OpenAI-compatible HTTP API over the async engine: chat completions (SSE or not), completions, models, metrics.

Why here and this shape: the voice app (and anything else) can then use the in-process
engine or any OpenAI-compatible server (vLLM, TGI, SGLang, several ``parley engine serve``)
through one client. Requests are validated against the schema of ``engine/openai_api/protocol.py``
before they reach the engine and answered with OpenAI's error JSON (400 for bad input,
including a request the KV cache can never hold). A client that goes away aborts its
engine request at once, streamed or not, so its KV blocks are freed (``/metrics`` shows
it in ``parley_engine_requests_aborted_total``; see ``engine/metrics.py``).

With an ``api_key`` every route but ``/healthz`` needs ``Authorization: Bearer <key>``
(401 in OpenAI's error shape otherwise). A request whose prompt plus ``max_tokens`` does
not fit the model's context (``max_model_len``) is refused with a 400 that gives both
numbers, as OpenAI does; ``max_tokens`` is never silently shortened (without one, the
request may use whatever room the context leaves). Chat messages are tokenized by
``engine.apply_chat_template``, which keeps every message's content plain text
(``engine/chat.py``). A request that fails inside the engine (its step's forward, its
sampling) ends with a 500 (or an error event in a stream); ``/healthz`` answers 503 with
the reason while the engine loop is down.

Tools: the chat template names the model's call format (``engine/structured_output/formats.py``, logged at
start); ``engine/openai_api/tool_plan.py`` turns a request's ``tools`` / ``tool_choice`` /
``response_format`` into the prompt, a grammar and a parser, and a reply with calls comes back
as ``message.tool_calls`` (streamed: ``delta.tool_calls``, the first with index, id, type and
name, then argument fragments) with ``finish_reason: "tool_calls"``. A grammar is compiled
off the event loop before the request reaches the engine; one that cannot be built is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.metrics import EngineCollector
from engine.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    choice_params,
    sampling_defaults,
    validation_error,
)
from engine.openai_api.tool_parser import CallDelta, ParsedDelta, ToolCallParser, parse_reply
from engine.openai_api.tool_plan import PlanError, plan_chat
from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampling import SamplingParams
from engine.structured_output.formats import ToolFormat, detect_format

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (vLLM's choice)


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, type_: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ if status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# --- the app ---------------------------------------------------------------------------------


def create_app(engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The HTTP API for one loaded ``AsyncLLMEngine`` serving the model called ``model_name``.

    ``api_key``: when set, every route except ``/healthz`` requires ``Authorization: Bearer <api_key>``.
    """
    app = FastAPI(title="Parley engine", version="0.1.0")
    app.state.engine = engine
    app.state.model_name = model_name
    created = int(time.time())
    tokenizer = engine.tokenizer
    defaults = sampling_defaults(getattr(engine.engine, "generation_defaults", {}))
    if defaults:
        log.info("unset request fields default to the model's generation_config.json: %s", defaults)
    token_text = functools.lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id]))
    tool_format = detect_format(tokenizer)
    log.info("tool calls: the chat template speaks the %r format", tool_format.name)
    if api_key:
        # plain ASGI, not @app.middleware: BaseHTTPMiddleware wraps `receive`, and the endpoints' client
        # disconnect detection (which aborts the engine request) would no longer see the disconnect
        app.add_middleware(_BearerAuth, expected=f"Bearer {api_key}".encode())

    def context_limit() -> int:
        stats = engine.stats()
        limit = getattr(engine.engine, "max_model_len", None) or 1 << 30
        pool = stats.get("kv_blocks_total", 0) * engine.config.block_size
        return min(limit, pool) if pool else limit

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).response()

    async def read_body(request: Request, schema: type[SamplingRequest], context: dict | None = None):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        model = body.get("model")
        if isinstance(model, str) and model != model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {model_name!r}", 404, "model")
        try:
            return schema.model_validate(body, context=context)
        except ValidationError as e:
            message, param = validation_error(e)
            raise APIError(message, param=param) from None

    def sampling_params(
        req: SamplingRequest, prompt_len: int, grammar: str | None = None, skip_special_tokens: bool = True
    ) -> SamplingParams:
        max_len = getattr(engine.engine, "max_model_len", None)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_len is not None and prompt_len >= max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, the prompt has {prompt_len} "
                "tokens, which leaves no room for a completion. Please shorten the prompt.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        if max_len is not None and asked is not None and prompt_len + asked > max_len:
            field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion). "
                f"Please reduce the prompt or {field} (at most {max_len - prompt_len} here).",
                param=field,
            )
        try:
            return req.to_sampling_params(prompt_len, context_limit(), defaults, grammar, skip_special_tokens)
        except ValueError as e:
            raise APIError(str(e)) from e

    async def check_grammar(grammar: str | None, param: str | None) -> None:
        if grammar is None:
            return
        try:
            await engine.check_grammar(grammar)
        except ValueError as e:
            raise APIError(f"cannot build a grammar from '{param}': {e}", param=param) from e

    # --- informational endpoints -------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if not engine.is_running():
            reason = getattr(engine, "down_reason", lambda: None)() or "engine loop is not running"
            return JSONResponse({"status": "error", "detail": reason}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "parley",
            "max_model_len": getattr(engine.engine, "max_model_len", None),
        }
        return JSONResponse({"object": "list", "data": [card]})

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine.stats, model_name=model_name))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # --- generation ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_body(request, ChatCompletionRequest, {"vocab_size": len(tokenizer)})
        try:
            plan = plan_chat(req, tool_format, tokenizer)
        except PlanError as e:
            raise APIError(str(e), param=e.param) from e
        try:
            prompt = engine.apply_chat_template(plan.messages, tools=plan.tools)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e
        await check_grammar(plan.grammar, plan.grammar_param)
        params = sampling_params(req, len(prompt), plan.grammar, plan.skip_special_tokens)
        if plan.lazy_grammar is not None:
            params = dataclasses.replace(params, lazy_grammar=plan.lazy_grammar)
        return await _generate(request, "chat", prompt, params, req, plan.tool_format)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_body(request, CompletionRequest, {"vocab_size": len(tokenizer)})
        prompt = req.prompt
        ids = list(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        grammar = req.response_format.grammar() if req.response_format is not None else None
        await check_grammar(grammar, "response_format")
        params = sampling_params(req, len(ids), grammar)
        return await _generate(request, "text", ids, params, req)

    async def _generate(
        request: Request,
        kind: str,
        prompt: list[int],
        params: SamplingParams,
        req: SamplingRequest,
        tool_format: ToolFormat | None = None,
    ):
        """Run the request's ``n`` choices, each an engine request of its own (the later ones find the
        prompt's blocks in the prefix cache), and answer with all of them, streamed or not. With a
        ``tool_format`` each choice's reply is parsed for calls."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        fmt = _Formatter(
            kind, request_id, model_name, int(time.time()), token_text, params.logprobs is not None, tool_format
        )
        n = req.num_choices
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        gens = [engine.generate(prompt, choice_params(params, i), request_id=rid) for i, rid in enumerate(ids)]
        watcher = asyncio.create_task(_abort_on_disconnect(request, engine, ids))

        async def give_up() -> None:
            watcher.cancel()
            for rid in ids:
                engine.abort(rid)
            for gen in gens:
                with contextlib.suppress(BaseException):
                    await gen.aclose()

        firsts_task = [asyncio.ensure_future(_next(gen)) for gen in gens]
        try:
            firsts = list(await asyncio.gather(*firsts_task))
        except BaseException:
            for task in firsts_task:
                task.cancel()
            await asyncio.gather(*firsts_task, return_exceptions=True)
            await give_up()
            raise
        failed = [
            f for f in firsts if f is None or (f.finished and f.finish_reason == "error" and not f.token_ids_delta)
        ]
        if failed:
            # Failed before any token; the engine says why: a request it can never serve (e.g. the KV
            # cache can never hold it) is a client error, a failure inside the engine a server error.
            await give_up()
            first = failed[0]
            message = first.error if first is not None and first.error else "the request produced no output"
            internal = first is not None and first.error_type == "internal"
            raise APIError(message, 500 if internal else 400)
        outputs = _merged(gens, firsts)
        if req.stream:
            events = _sse(outputs, n, fmt, req.include_usage, engine, ids, watcher)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        choices = [_Choice(i) for i in range(n)]
        usage = _Usage()
        try:
            async for i, out in outputs:
                usage.add(out, first_choice=i == 0)
                choices[i].add(out)
        finally:
            await outputs.aclose()
            watcher.cancel()
            for rid in ids:
                engine.abort(rid)  # no-op when it finished; frees blocks if we were cancelled
        error = next((c.error for c in choices if c.reason == "error" and c.error is not None), None)
        if error is not None:
            raise APIError(error, 500)
        return JSONResponse(fmt.full(choices, usage), headers={"X-Request-Id": request_id})

    return app


class _BearerAuth:
    """ASGI middleware: every HTTP route but /healthz needs ``Authorization: <expected>`` (401 otherwise)."""

    def __init__(self, app, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/healthz":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401)
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _next(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _abort_on_disconnect(request: Request, engine, request_ids: list[str]) -> None:
    """Abort the engine requests as soon as the HTTP client goes away (polls; cancelled when done)."""
    while True:
        await asyncio.sleep(_DISCONNECT_POLL_S)
        if await request.is_disconnected():
            log.info("client disconnected: aborting %s", ", ".join(request_ids))
            for rid in request_ids:
                engine.abort(rid)
            return


async def _merged(
    gens: list[AsyncGenerator[RequestOutput, None]], firsts: list[RequestOutput]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of the choices' streams as they come, as (choice index, output), up to each one's
    last; an exception in a stream is raised here. Closing this closes every stream (aborting the
    unfinished ones)."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput], out: RequestOutput | None) -> None:
        try:
            while out is not None:
                await queue.put((i, out))
                if out.finished:
                    break
                out = await _next(gen)
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    pumps = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts, strict=True))]
    try:
        open_streams = len(gens)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for gen in gens:
            with contextlib.suppress(BaseException):
                await gen.aclose()


@dataclass
class _Usage:
    """Token counts of a response: the prompt once (as the first choice saw it), every choice's output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput, first_choice: bool = True) -> None:
        if first_choice:
            self.prompt_tokens = out.num_prompt_tokens
            self.cached_tokens = out.num_cached_tokens
        self.completion_tokens += len(out.token_ids_delta)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class _Choice:
    """One choice of a non-streamed response, gathered from its outputs."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.text_delta)
        self.logprobs += out.logprobs or ()
        if out.finished:
            self.reason = _finish_reason(out)
            self.error = out.error

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return {"stop": "stop", "length": "length"}.get(out.finish_reason or "", out.finish_reason)


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)  # JSON has no -inf


class _Formatter:
    """Builds OpenAI response objects for chat (``chat.completion``) or text (``text_completion``).

    With logprobs, a chat choice carries ``logprobs.content``: per token its text, logprob, UTF-8
    bytes and ``top_logprobs``; a text choice the legacy ``tokens`` / ``token_logprobs`` /
    ``top_logprobs`` / ``text_offset`` lists. A token's text is its own decoding, as vLLM does.
    With a ``tool_format``, a chat reply is split into content and ``tool_calls``.
    """

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        created: int,
        token_text: Callable[[int], str],
        logprobs: bool,
        tool_format: ToolFormat | None = None,
    ) -> None:
        self.kind = kind
        self.tool_format = tool_format
        self.id = request_id
        self.model = model
        self.created = created
        self.token_text = token_text
        self.want_logprobs = logprobs
        self._offsets: dict[int, int] = {}  # text_offset reached per choice (text completions)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def logprobs(self, index: int, entries: Sequence[TokenLogprobs]) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for e in entries:
            tokens.append(self.token_text(e.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [
                {self.token_text(t): _logprob(v) for t, v in ((e.token_id, e.logprob), *e.top)} for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprobs) -> dict:
        def one(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode())}

        return one(e.token_id, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]}

    def _chat_choice(self, c: _Choice) -> dict:
        message: dict = {"role": "assistant", "content": c.text}
        reason = c.reason
        if self.tool_format is not None:
            reply = parse_reply(self.tool_format, c.text)
            message["content"] = reply.content
            if reply.calls:
                message["tool_calls"] = [call.as_openai() for call in reply.calls]
                reason = _with_calls(reason)
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.index, c.logprobs),
            "finish_reason": reason,
        }

    def full(self, choices: list[_Choice], usage: _Usage) -> dict:
        if self.kind == "chat":
            body = self._envelope("chat.completion", [self._chat_choice(c) for c in choices])
        else:
            body = self._envelope(
                "text_completion",
                [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": self.logprobs(c.index, c.logprobs),
                        "finish_reason": c.reason,
                    }
                    for c in choices
                ],
            )
        body["usage"] = usage.as_dict()
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        role: bool = False,
        logprobs: Sequence[TokenLogprobs] = (),
        calls: Sequence[CallDelta] = (),
    ) -> dict:
        lp = self.logprobs(index, logprobs) if logprobs else None
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [_call_delta(c) for c in calls]
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [{"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}]
        )

    def usage_chunk(self, usage: _Usage) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage.as_dict()
        return body


def _with_calls(reason: str | None) -> str | None:
    """A reply that made calls and stopped by itself finishes with ``tool_calls`` (as OpenAI and vLLM)."""
    return "tool_calls" if reason == "stop" else reason


def _call_delta(d: CallDelta) -> dict:
    if d.name is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}


class _ReplyStream:
    """One streamed choice's reply: its text deltas as content, or content and call deltas with a tool format."""

    def __init__(self, tool_format: ToolFormat | None) -> None:
        self.parser = ToolCallParser(tool_format) if tool_format is not None else None

    def delta(self, out: RequestOutput) -> ParsedDelta:
        if self.parser is None:
            return ParsedDelta(out.text_delta)
        delta = self.parser.feed(out.text_delta)
        if out.finished:
            rest = self.parser.finish()
            delta.content += rest.content
            delta.calls += rest.calls
        return delta

    def finish_reason(self, out: RequestOutput) -> str | None:
        reason = _finish_reason(out)
        return _with_calls(reason) if self.parser is not None and self.parser.num_calls else reason


def _data(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _sse(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    n: int,
    fmt: _Formatter,
    include_usage: bool,
    engine,
    request_ids: list[str],
    watcher: asyncio.Task,
) -> AsyncIterator[bytes]:
    """SSE events: a role chunk per choice, one chunk per output with text (or logprobs), each choice's
    finish chunk, optional usage, ``[DONE]``.

    Whatever ends this generator early (client gone: the server cancels it or closes it)
    reaches the ``finally`` below, which aborts the engine requests.
    """
    usage = _Usage()
    replies = [_ReplyStream(fmt.tool_format) for _ in range(n)]
    try:
        if fmt.kind == "chat":
            for i in range(n):
                yield _data(fmt.chunk(i, None, None, role=True))
        async for i, out in outputs:
            usage.add(out, first_choice=i == 0)
            logprobs = out.logprobs or ()
            delta = replies[i].delta(out)
            if out.finished and out.finish_reason == "error":
                if delta or logprobs:
                    yield _data(fmt.chunk(i, delta.content, None, logprobs=logprobs, calls=delta.calls))
                yield _data(APIError(out.error or "generation failed", 500).body())
                break
            if out.finished and delta.calls:  # the last fragments, then the finish alone
                yield _data(fmt.chunk(i, delta.content, None, logprobs=logprobs, calls=delta.calls))
                yield _data(fmt.chunk(i, None, replies[i].finish_reason(out)))
            elif out.finished:
                yield _data(fmt.chunk(i, delta.content, replies[i].finish_reason(out), logprobs=logprobs))
            elif delta or logprobs:
                yield _data(fmt.chunk(i, delta.content, None, logprobs=logprobs, calls=delta.calls))
        if include_usage:
            yield _data(fmt.usage_chunk(usage))
        yield _data("[DONE]")
    finally:
        watcher.cancel()
        for rid in request_ids:
            engine.abort(rid)  # no-op for the finished ones
        with contextlib.suppress(BaseException):
            await outputs.aclose()
