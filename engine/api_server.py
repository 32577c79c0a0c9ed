"""OpenAI-compatible HTTP API over the async engine: chat completions (SSE or not), completions, models, metrics.

Why here and this shape: the voice app (and anything else) can then use the in-process
engine or any OpenAI-compatible server (vLLM, TGI, SGLang, several ``parley engine serve``)
through one client. Requests are validated before they reach the engine and answered
with OpenAI's error JSON (400 for bad input, including a request the KV cache can never
hold). A client that goes away aborts its engine request at once, streamed or not, so
its KV blocks are freed (``/metrics`` shows it in ``parley_requests_aborted_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.outputs import RequestOutput
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_STOP_STRINGS = 16
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


# --- request parsing ---------------------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise APIError(f"'{name}' must be a number", param=name)
    if not lo <= value <= hi:
        raise APIError(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(f"'{name}' must be an integer", param=name)
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s for s in stop):
        raise APIError("'stop' strings must be non-empty", param="stop")
    return tuple(stop)


def parse_sampling(body: dict, prompt_len: int, context_limit: int) -> SamplingParams:
    """Map OpenAI sampling fields (plus vLLM's ``top_k``, ``ignore_eos``, ``stop_token_ids``) to SamplingParams."""
    for name in ("n", "best_of"):
        n = _integer(body, name)
        if n is not None and n != 1:
            raise APIError(f"only '{name}': 1 is supported", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise APIError(f"'{name}' is not supported (use 0)", param=name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise APIError("'logprobs' is not supported", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise APIError("tools / function calling is not supported", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError("only response_format {'type': 'text'} is supported", param="response_format")

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise APIError("'top_p' must be greater than 0", param="top_p")
    top_k = _integer(body, "top_k")
    if top_k is None or top_k == -1:  # vLLM spells "disabled" as -1
        top_k = 0
    if top_k < 0:
        raise APIError("'top_k' must be -1, 0 (disabled) or positive", param="top_k")
    seed = _integer(body, "seed")

    max_tokens = _integer(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _integer(body, "max_tokens"), "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'{name}' must be at least 1, got {max_tokens}", param=name)
    if max_tokens is None:
        # Whatever room the context and the KV pool leave (blocks are taken lazily, so this reserves nothing).
        max_tokens = max(1, context_limit - prompt_len)

    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError("'ignore_eos' must be a boolean", param="ignore_eos")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=_stop_strings(body),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=ignore_eos,
        )
    except ValueError as e:
        raise APIError(str(e)) from e


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise APIError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        text = "" if m.get("content") is None and role == "assistant" else _message_text(i, m.get("content"))
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


# --- the app ---------------------------------------------------------------------------------


def create_app(engine, model_name: str) -> FastAPI:
    """The HTTP API for one loaded ``AsyncLLMEngine`` serving the model called ``model_name``."""
    app = FastAPI(title="Parley engine", version="0.1.0")
    app.state.engine = engine
    app.state.model_name = model_name
    created = int(time.time())
    tokenizer = engine.tokenizer

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

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {model_name!r}", 404, "model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError("'stream' must be a boolean", param="stream")
        return body

    def stream_flags(body: dict) -> tuple[bool, bool]:
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError("'stream_options' must be an object", param="stream_options")
        return body.get("stream", False), bool(opts.get("include_usage", False))

    # --- informational endpoints -------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if not engine.is_running():
            return JSONResponse({"status": "error", "detail": "engine loop is not running"}, status_code=503)
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

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine.stats(), model_name), media_type="text/plain; version=0.0.4")

    # --- generation ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        messages = parse_messages(body)
        try:
            prompt = engine.apply_chat_template(messages)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e
        stream, include_usage = stream_flags(body)
        params = parse_sampling(body, len(prompt), context_limit())
        return await _generate(request, "chat", prompt, params, stream, include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("'prompt' must not be empty", param="prompt")
            ids = list(tokenizer(prompt)["input_ids"])
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
            vocab = len(tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(f"'prompt' token ids must be in [0, {vocab})", param="prompt")
        elif prompt is None:
            raise APIError("'prompt' is required", param="prompt")
        else:
            raise APIError("'prompt' must be a string or one list of token ids (batches are not supported)", "prompt")
        if body.get("echo") or body.get("suffix"):
            raise APIError("'echo' and 'suffix' are not supported", param="echo")
        stream, include_usage = stream_flags(body)
        params = parse_sampling(body, len(ids), context_limit())
        return await _generate(request, "text", ids, params, stream, include_usage)

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
            # Failed before any token; the engine says why (e.g. the KV cache can never hold it): a client error.
            watcher.cancel()
            await gen.aclose()
            raise APIError(first.error if first is not None and first.error else "the request produced no output")
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


# --- metrics -----------------------------------------------------------------------------------

# stats key -> (metric name, type, help)
_METRICS = [
    ("running", "parley_num_requests_running", "gauge", "Requests in the running batch."),
    ("waiting", "parley_num_requests_waiting", "gauge", "Requests waiting to be scheduled (new or preempted)."),
    ("kv_blocks_used", "parley_kv_blocks_used", "gauge", "KV cache blocks held by requests."),
    ("kv_blocks_total", "parley_kv_blocks_total", "gauge", "KV cache blocks in the pool."),
    ("prefix_cache_hit_rate", "parley_prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache."),
    ("generation_tokens_per_s", "parley_generation_tokens_per_s", "gauge", "Generated tokens/s, last 5 s."),
    ("prompt_tokens_total", "parley_prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
    ("generation_tokens_total", "parley_generation_tokens_total", "counter", "Generated tokens."),
    ("requests_finished_total", "parley_requests_finished_total", "counter", "Requests finished (any reason)."),
    ("requests_aborted_total", "parley_requests_aborted_total", "counter", "Requests aborted (client gone, abort)."),
    ("num_preemptions_total", "parley_num_preemptions_total", "counter", "Requests preempted for lack of KV blocks."),
]


def prometheus_text(stats: dict, model_name: str) -> str:
    """The engine's stats in Prometheus text exposition format (one sample per metric, labelled by model)."""
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{escaped}"}}'
    lines = []
    for key, name, kind, help_ in _METRICS:
        if key not in stats:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{label} {float(stats[key]):g}"]
    used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
    if used is not None and total:
        name = "parley_kv_cache_usage_ratio"
        lines += [
            f"# HELP {name} Fraction of KV blocks in use.",
            f"# TYPE {name} gauge",
            f"{name}{label} {used / total:g}",
        ]
    return "\n".join(lines) + "\n"
