"""OpenAI-compatible HTTP API over the async engine: chat completions (SSE or not), completions, models, metrics.

Why here and this shape: the voice app (and anything else) can then use the in-process
engine or any OpenAI-compatible server (vLLM, TGI, SGLang, several ``parley engine serve``)
through one client. Requests are validated against the schema of ``engine/protocol.py``
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.metrics import EngineCollector
from engine.outputs import RequestOutput
from engine.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, validation_error
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25


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

    def sampling_params(req: SamplingRequest, prompt_len: int) -> SamplingParams:
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
            return req.to_sampling_params(prompt_len, context_limit())
        except ValueError as e:
            raise APIError(str(e)) from e

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
        req = await read_body(request, ChatCompletionRequest)
        try:
            prompt = engine.apply_chat_template(req.chat())
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e
        params = sampling_params(req, len(prompt))
        return await _generate(request, "chat", prompt, params, req.stream, req.include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_body(request, CompletionRequest, {"vocab_size": len(tokenizer)})
        prompt = req.prompt
        ids = list(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        params = sampling_params(req, len(ids))
        return await _generate(request, "text", ids, params, req.stream, req.include_usage)

    async def _generate(
        request: Request, kind: str, prompt: list[int], params: SamplingParams, stream: bool, include_usage: bool
    ):
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        fmt = _Formatter(kind, request_id, model_name, int(time.time()))
        gen = engine.generate(prompt, params, request_id=request_id)
        watcher = asyncio.create_task(_abort_on_disconnect(request, engine, request_id))
        try:
            first = await _next(gen)
        except BaseException:
            watcher.cancel()
            engine.abort(request_id)
            await gen.aclose()
            raise
        if first is None or (first.finished and first.finish_reason == "error" and not first.token_ids_delta):
            # Failed before any token; the engine says why: a request it can never serve (e.g. the KV
            # cache can never hold it) is a client error, a failure inside the engine a server error.
            watcher.cancel()
            await gen.aclose()
            message = first.error if first is not None and first.error else "the request produced no output"
            internal = first is not None and first.error_type == "internal"
            raise APIError(message, 500 if internal else 400)
        if stream:
            events = _sse(gen, first, fmt, include_usage, engine, request_id, watcher)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            text, usage, reason, error = await _collect(gen, first)
        finally:
            watcher.cancel()
            engine.abort(request_id)  # no-op when it finished; frees blocks if we were cancelled
        if error is not None and reason == "error":
            raise APIError(error, 500)
        return JSONResponse(fmt.full(text, reason, usage), headers={"X-Request-Id": request_id})

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


async def _abort_on_disconnect(request: Request, engine, request_id: str) -> None:
    """Abort the engine request as soon as the HTTP client goes away (polls; cancelled when done)."""
    while True:
        await asyncio.sleep(_DISCONNECT_POLL_S)
        if await request.is_disconnected():
            log.info("client disconnected: aborting %s", request_id)
            engine.abort(request_id)
            return


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
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


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return {"stop": "stop", "length": "length"}.get(out.finish_reason or "", out.finish_reason)


async def _collect(
    gen: AsyncIterator[RequestOutput], first: RequestOutput
) -> tuple[str, _Usage, str | None, str | None]:
    usage = _Usage()
    parts: list[str] = []
    out: RequestOutput | None = first
    last = first
    while out is not None:
        usage.add(out)
        parts.append(out.text_delta)
        last = out
        if out.finished:
            break
        out = await _next(gen)
    return "".join(parts), usage, _finish_reason(last), last.error


class _Formatter:
    """Builds OpenAI response objects for chat (``chat.completion``) or text (``text_completion``)."""

    def __init__(self, kind: str, request_id: str, model: str, created: int) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = created

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, reason: str | None, usage: _Usage) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": reason}])
        body["usage"] = usage.as_dict()
        return body

    def chunk(self, text: str | None, reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict[str, str] = {}
            if role:
                delta["role"] = "assistant"
            if text:
                delta["content"] = text
            return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": reason}])
        return self._envelope("text_completion", [{"index": 0, "text": text or "", "finish_reason": reason}])

    def usage_chunk(self, usage: _Usage) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage.as_dict()
        return body


def _data(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _sse(
    gen: AsyncIterator[RequestOutput],
    first: RequestOutput,
    fmt: _Formatter,
    include_usage: bool,
    engine,
    request_id: str,
    watcher: asyncio.Task,
) -> AsyncIterator[bytes]:
    """SSE events: a role chunk, one chunk per output, the finish chunk, optional usage, ``[DONE]``.

    Whatever ends this generator early (client gone: the server cancels it or closes it)
    reaches the ``finally`` below, which aborts the engine request.
    """
    usage = _Usage()
    finished = False
    try:
        if fmt.kind == "chat":
            yield _data(fmt.chunk(None, None, role=True))
        out: RequestOutput | None = first
        while out is not None:
            usage.add(out)
            if out.finished:
                finished = True
                if out.finish_reason == "error":
                    if out.text_delta:
                        yield _data(fmt.chunk(out.text_delta, None))
                    yield _data(APIError(out.error or "generation failed", 500).body())
                    break
                yield _data(fmt.chunk(out.text_delta, _finish_reason(out)))
                break
            if out.text_delta:
                yield _data(fmt.chunk(out.text_delta, None))
            out = await _next(gen)
        if include_usage:
            yield _data(fmt.usage_chunk(usage))
        yield _data("[DONE]")
    finally:
        watcher.cancel()
        if not finished:
            engine.abort(request_id)
        with contextlib.suppress(BaseException):
            await gen.aclose()
