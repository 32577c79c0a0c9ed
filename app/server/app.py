"""The HTTP front: the web page at ``/``, ``/healthz``, ``/metrics``; voice sessions at ``/ws`` (``ws.py``)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from app.config import Settings
from app.server.metrics import VoiceMetrics
from app.server.ws import serve_voice
from app.stages.registry import Models, load_models

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def create_app(settings: Settings, models: Models | None = None) -> FastAPI:
    """Build the app; models load in the lifespan (before the first request) unless given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.models is None:
            app.state.models = await asyncio.to_thread(load_models, settings, lambda line: print(line, flush=True))
        print(f"parley ready on http://{settings.host}:{settings.port}", flush=True)
        yield
        for session in list(app.state.sessions):
            await session.close()
        app.state.models.close()

    app = FastAPI(title="Parley", lifespan=lifespan)
    app.state.models = models
    app.state.sessions = set()
    app.state.metrics = VoiceMetrics()

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
        return {"status": "ok", "sessions": len(app.state.sessions), "llm": app.state.models.llm.name}

    @app.get("/metrics")
    async def metrics():
        llm = app.state.models.llm
        stats = llm.stats() if hasattr(llm, "stats") else None
        body = app.state.metrics.render(len(app.state.sessions), stats)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.websocket("/ws")
    async def voice(websocket: WebSocket):
        await serve_voice(websocket, app.state, settings)

    return app
