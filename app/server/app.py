"""The HTTP/WebSocket front: the web page at ``/``, voice sessions at ``/ws``, ``/healthz``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.websockets import WebSocketState

from app import protocol
from app.config import Settings
from app.server.metrics import VoiceMetrics
from app.stages.registry import Models, load_models
from app.voice.session import VoiceSession

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
        await websocket.accept()
        if len(app.state.sessions) >= settings.max_sessions:
            await websocket.send_text(
                protocol.encode(protocol.Error(code="overloaded", message="too many sessions; try later", fatal=True))
            )
            await websocket.close(code=1013)
            return
        send_lock = asyncio.Lock()

        async def send_json(message) -> None:
            if websocket.client_state != WebSocketState.CONNECTED:
                return
            async with send_lock:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await websocket.send_text(protocol.encode(message))

        async def send_bytes(data: bytes) -> None:
            if websocket.client_state != WebSocketState.CONNECTED:
                return
            async with send_lock:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await websocket.send_bytes(data)

        session = VoiceSession(app.state.models, settings, send_json, send_bytes)
        session.on_turn_metrics = app.state.metrics.observe_turn
        app.state.sessions.add(session)
        try:
            await session.start()
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes") is not None:
                    await session.handle_audio(message["bytes"])
                elif message.get("text") is not None:
                    await session.handle_text(message["text"])
        except WebSocketDisconnect:
            pass
        except Exception:
            log.exception("session %s failed", session.session_id)
            await send_json(protocol.Error(code="internal", message="internal server error", fatal=True))
        finally:
            app.state.sessions.discard(session)
            await session.close()
            with contextlib.suppress(Exception):
                await websocket.close()

    return app
