"""engine/benchmarks/serving.py (`parley bench engine --peer vllm`) without models: the streamed client against a
scripted OpenAI server on a real socket, a server that dies, the vLLM check, the ratios and the report."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.benchmarks import serving
from engine.benchmarks.peer import Req


class ScriptedServer:
    """Streams ``max_tokens`` one-token chunks per /v1/completions request, ``gap_s`` apart, then its usage; keeps
    the bodies it got and the most requests it had in flight at once. ``together``: hold each request until that
    many have arrived (at most 30 s), so requests sent at once are all in flight on a machine of any speed."""

    def __init__(self, gap_s: float = 0.01, together: int = 1) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.most_in_flight = 0
        lock = threading.Lock()
        gate = threading.Barrier(together)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                try:
                    gate.wait(timeout=30)
                except threading.BrokenBarrierError:
                    pass  # they did not come together: most_in_flight says so
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(gap_s)
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                with lock:
                    outer.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    server = ScriptedServer()
    yield server
    server.close()


def test_a_batch_is_sent_at_once_and_counted_from_the_servers_usage():
    scripted = ScriptedServer(together=8)
    side = serving.Server("scripted", scripted.url)
    reqs = [Req([1, 2, 3 + i], 12) for i in range(8)]
    batch = side.batch(reqs)
    assert scripted.most_in_flight == 8
    assert batch.tokens == 96 and len(batch.ttfts_s) == 8
    assert 0 < batch.ttft_p50_s < batch.wall_s
    assert batch.tok_s == pytest.approx(96 / batch.wall_s)
    body = scripted.bodies[0]
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
    assert body["prompt"][:2] == [1, 2] and body["model"] == serving.SERVED_NAME
    scripted.close()


def test_measure_alternates_sides_and_leaves_the_warm_up_out(scripted):
    a, b = serving.Server("a", scripted.url), serving.Server("b", scripted.url)
    work = {1: [[Req([1], 4)] for _ in range(3)], 2: [[Req([1], 4), Req([2], 4)] for _ in range(3)]}
    figures = serving.measure([a, b], work, progress=lambda _: None)
    assert sorted(figures) == ["a|1", "a|2", "b|1", "b|2"]
    assert len(figures["a|2"]["tok_s"]["values"]) == 2  # three batches, the first a warm-up
    assert len(scripted.bodies) == 2 * (3 + 6)
    r = serving.ratios(figures, [1, 2], "a", "b")
    assert set(r) == {"1", "2"} and r["2"]["throughput"] > 0


def test_a_server_that_dies_stops_the_run_with_its_log(tmp_path):
    log = tmp_path / "dead.log"
    log.write_text("loading\nIllegal instruction (core dumped)\n")
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    process.wait()
    side = serving.Server("vllm", "http://127.0.0.1:9", process=process, log_path=log)
    with pytest.raises(RuntimeError, match=r"(?s)vllm exited \(code 3\).*Illegal instruction"):
        side.batch([Req([1], 2)])
    with pytest.raises(RuntimeError, match="exited while starting"):
        side.wait_ready(5)


def test_an_unreachable_server_is_an_error_not_a_wait():
    side = serving.Server("vllm", "http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="vllm: ConnectError"):
        side.batch([Req([1], 2)])
    assert time.monotonic() - t0 < 10


def test_a_python_without_vllm_is_named():
    assert serving.vllm_missing(sys.executable) == f"{sys.executable} has no vllm module"
    assert "does not run" in serving.vllm_missing("/nonexistent/python")


def test_the_report_shows_every_side_and_the_skip():
    stat = {"min": 1.0, "median": 2.0, "max": 3.0, "values": [1.0, 2.0, 3.0]}
    r = {
        "model": "bundled",
        "threads": 2,
        "reps": 3,
        "max_tokens": 64,
        "concurrency": [1, 8],
        "sides": {"parley engine serve": "serve ...", "in-process": "no HTTP"},
        "vllm_skipped": "no vLLM given",
        "figures": {
            f"{s}|{c}": {"tok_s": stat, "ttft_p50_s": stat}
            for s in ("parley engine serve", "in-process")
            for c in (1, 8)
        },
        "vs_in_process": {"1": {"throughput": 0.9, "ttft": 1.1}},
    }
    text = serving.report(r)
    assert "vllm: skipped: no vLLM given" in text and "8 at once" in text
    assert "served / in-process" in text and "0.90x" in text


def test_the_cli_sends_each_peer_to_its_benchmark():
    from app.cli import _peer

    assert _peer(["--peer", "vllm", "--quick"]) == "vllm"
    assert _peer(["--peer=vllm"]) == "vllm"
    assert _peer(["--peer-url", "http://x"]) == "llama-cpp"
    assert _peer(["--peer", "llama-cpp"]) == "llama-cpp"
    assert _peer(["--quick"]) is None
