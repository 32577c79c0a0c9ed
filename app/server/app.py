"""The HTTP front: the web page at ``/``, ``/healthz``, ``/metrics``; voice sessions at ``/ws`` (``ws.py``)
and, in the OpenAI Realtime API, at ``/v1/realtime`` (the ``realtime`` package); with ``wyoming_port``, the
Wyoming protocol on its own TCP port (the ``wyoming`` package)."""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from app.config import Settings
from app.server.access import AccessPolicy, HostGuard
from app.server.admission import Admission
from app.server.metrics import VoiceMetrics
from app.server.realtime import serve_realtime
from app.server.skills import ServerSkills
from app.server.ws import serve_voice
from app.server.wyoming import WyomingDoor
from app.stages.registry import Models, load_models
from app.voice.tools import load_server_tools

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def freeze_startup_heap() -> None:
    """Leave what is loaded by now (models, libraries) out of garbage collection.

    It lives as long as the server: a full collection that walks it all stalls the event loop for hundreds of
    ms. Collected first, so no garbage is frozen with it (that collection is itself ~0.1 s on a loaded process,
    which is why the test suite, starting hundreds of apps in one process, skips this).
    """
    gc.collect()
    gc.freeze()


def create_app(settings: Settings, models: Models | None = None) -> FastAPI:
    """Build the app; models load in the lifespan (before the first request) unless given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server_tools = load_server_tools(settings.tool_entry_point)  # a broken entry point fails the start
        if server_tools:
            print(f"server tools: {', '.join(tool.name for tool in server_tools)}", flush=True)
        if app.state.models is None:
            app.state.models = await asyncio.to_thread(load_models, settings, lambda line: print(line, flush=True))
        for line in await skills.start():
            print(line, flush=True)
        await skills.warm_first_prompt(app.state.models.llm, settings)
        for warning in app.state.access.startup_warnings():
            print(f"WARNING: {warning}", flush=True)
        admission.size_cap()  # the models now hold their memory: what is left is the sessions'
        if wyoming is not None:
            print(await wyoming.start(), flush=True)
        freeze_startup_heap()
        how = "max_sessions" if settings.max_sessions else "by CPU cores and free memory; set max_sessions to change"
        print(f"sessions at once: {admission.max_sessions} ({how})", flush=True)
        scheme = "https" if settings.ssl_certfile else "http"
        print(f"parley ready on {scheme}://{settings.host}:{settings.port}", flush=True)
        yield
        gc.unfreeze()
        if wyoming is not None:
            await wyoming.stop()
        for session in list(app.state.sessions):
            await session.close()
        await skills.stop()
        app.state.models.close()

    app = FastAPI(title="Parley", lifespan=lifespan)
    app.state.models = models
    app.state.sessions = {}  # each open VoiceSession -> its Connection
    app.state.access = access = AccessPolicy(settings)
    app.state.admission = admission = Admission(settings, on_memory_pressure=lambda: _release_llm_cache(app))
    app.state.metrics = VoiceMetrics(admission)
    skills = ServerSkills(settings)  # a bad skills or mcp_servers setting fails here, before any model loads
    app.state.skills = skills.skills
    app.state.wyoming = wyoming = WyomingDoor(app.state, settings) if settings.wyoming_port is not None else None
    app.add_middleware(HostGuard, policy=access)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    if WEB_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        page = WEB_DIR / "index.html"
        if not page.is_file():
            return JSONResponse({"error": "web page not installed"}, status_code=404)
        return FileResponse(page)

    @app.get("/healthz")
    async def healthz():
        """Ready to answer? 503 while the LLM backend cannot (engine loop down, remote server unreachable), and
        ``degraded`` names it: the dependencies that are down (the models in this process are loaded or it would
        not serve; the LLM may be another server's)."""
        llm = app.state.models.llm
        healthy, detail = await llm.health()
        body = {
            "status": "ok" if healthy else "unavailable",
            "degraded": [] if healthy else ["llm"],
            "sessions": len(app.state.sessions),
            "llm": llm.name,
            "llm_status": detail,
            "auth_required": access.key_required(),
            "accepting_sessions": healthy and admission.check(len(app.state.sessions)) is None,
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        if not access.key_ok(request.headers, request.query_params):
            return JSONResponse({"error": "api key required"}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        app.state.metrics.attach_llm(app.state.models.llm)
        body = app.state.metrics.render(len(app.state.sessions))
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.websocket("/ws")
    async def voice(websocket: WebSocket):
        await serve_voice(websocket, app.state, settings)

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        await serve_realtime(websocket, app.state, settings)

    return app


# The page talks only to its own origin: scripts, styles, the worklet and the WebSocket come
# from here, nothing may frame it, and no referrer leaks to elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self'; script-src 'self'; style-src 'self'; "
        "img-src 'self' data:; media-src 'self' blob:; worker-src 'self' blob:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _release_llm_cache(app: FastAPI) -> None:
    """Memory pressure: let the LLM drop what it can rebuild (the engine's cached prefixes)."""
    llm = app.state.models.llm if app.state.models is not None else None
    release = getattr(llm, "release_cache", None)
    if release is not None:
        release()
