"""``ServerProcess``: a benchmark's server keeps its state (reminders) in a folder of its own, gone when it stops."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from app.bench.launcher import ServerProcess

# ServerProcess is kept from model-free runs (it starts `parley`); this one starts a stand-in, in the models run
pytestmark = pytest.mark.models

# A stand-in server: takes --host/--port like parley, answers /healthz, and writes down where its data would go.
SERVER = """
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
out = sys.argv[1]
with open(out, "w") as f:
    f.write(os.environ.get("PARLEY_DATA_DIR", ""))
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), Ok).serve_forever()
"""


def _run(tmp_path: Path, args: list[str]) -> tuple[str, bool]:
    seen = tmp_path / "data-dir.txt"
    server = ServerProcess([str(seen), *args], tmp_path / "server.log", program=[sys.executable, "-c", SERVER])
    try:
        data_dir = seen.read_text()
        existed = bool(data_dir) and os.path.isdir(data_dir)
    finally:
        server.stop()
    return data_dir, existed


def test_a_bench_server_keeps_its_data_apart_and_removes_it(tmp_path: Path) -> None:
    data_dir, existed = _run(tmp_path, [])
    assert existed, "the server was given a data folder of its own"
    assert not data_dir.startswith(str(Path.home() / ".local")), data_dir
    assert data_dir != os.environ.get("PARLEY_DATA_DIR"), "not the one the whole test run shares"
    assert not os.path.exists(data_dir), "removed when the server stopped"


def test_a_data_dir_given_is_the_servers_own(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    data_dir, _ = _run(tmp_path, ["--data-dir", str(mine)])
    assert data_dir == os.environ.get("PARLEY_DATA_DIR", ""), "no folder of the launcher's: the args name one"
    assert mine.is_dir(), "never removed by the launcher"
