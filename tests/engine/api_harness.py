"""An ASGI app served by a real uvicorn for a test (the OpenAI SDK and httpx talk to it over loopback)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serve_app(app):
    """``app`` on a real uvicorn on a free loopback port, for the test's duration; yields its base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
