"""The web page in a real browser: Debian chromium driven by Playwright.

The fake microphone is fed from a WAV file (chromium loops it), so the page hears a
real spoken question, the real server answers it, and the page plays the answer.
Recipe: DESIGN.md, "Testing recipes". Never run `playwright install` here: we drive the
system chromium.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import re
import shutil
import threading
import time
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
WEB_DIR = Path(__file__).resolve().parent.parent / "web"
QUESTION = "What is the capital of France?"
TURN_TIMEOUT_MS = 90_000  # a slow 2-core CPU runs ASR, the LLM and TTS for each turn

BASE_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FAKE_MIC_ARGS = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]


@pytest.fixture(scope="module")
def playwright():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        yield pw


@contextlib.contextmanager
def browser_page(
    playwright, profile_dir: Path, args: list[str], permissions: list[str], *, bypass_csp: bool = True, **options
):
    """A persistent-context chromium page that records uncaught page errors and console messages.

    The server's Content-Security-Policy forbids eval, and Playwright's ``wait_for_function``
    with a string is eval: the tests that drive the page through it bypass the CSP, and
    ``test_page_runs_under_the_servers_csp`` checks the page itself under the real policy.
    """
    context = playwright.chromium.launch_persistent_context(
        str(profile_dir),
        executable_path=str(CHROMIUM),
        headless=True,
        args=args,
        permissions=permissions,
        bypass_csp=bypass_csp,
        **{"viewport": {"width": 900, "height": 860}, **options},
    )
    try:
        page = context.pages[0] if context.pages else context.new_page()
        page.page_errors = []  # type: ignore[attr-defined]
        page.console = []  # type: ignore[attr-defined]
        page.on("pageerror", lambda exc: page.page_errors.append(str(exc)))
        page.on("console", lambda msg: page.console.append(f"{msg.type}: {msg.text}"))
        yield page
    finally:
        context.close()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


@pytest.fixture(scope="module")
def question_wav(speech_wav, tmp_path_factory) -> Path:
    """0.5 s silence + the spoken question + 6 s silence, mono PCM16 16 kHz.

    Chromium loops the fake-capture file, so the trailing silence is what separates
    one asking of the question from the next.
    """
    with wave.open(str(speech_wav(QUESTION, sample_rate=16000)), "rb") as src:
        assert (src.getnchannels(), src.getsampwidth()) == (1, 2)
        rate = src.getframerate()
        speech = src.readframes(src.getnframes())
    path = tmp_path_factory.mktemp("browser-audio") / "question.wav"
    with wave.open(str(path), "wb") as dst:
        dst.setnchannels(1)
        dst.setsampwidth(2)
        dst.setframerate(rate)
        dst.writeframes(b"\0\0" * (rate // 2) + speech + b"\0\0" * (rate * 6))
    return path


# ---------------------------------------------------------------- the conversation
RECORD_SENT = """
// Record what the page sends on its WebSocket (JSON messages, and binary frame sizes).
window.__sent = {text: [], binary_sizes: []};
const originalSend = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === 'string') window.__sent.text.push(JSON.parse(data));
  else {
    const n = data.byteLength;
    if (!window.__sent.binary_sizes.includes(n)) window.__sent.binary_sizes.push(n);
  }
  return originalSend.call(this, data);
};
"""


def test_spoken_question_is_transcribed_answered_and_played(
    playwright, live_server, question_wav, output_dir, tmp_path
):
    args = [*BASE_ARGS, *FAKE_MIC_ARGS, f"--use-file-for-fake-audio-capture={question_wav}"]
    timings: dict[str, float] = {}
    with browser_page(playwright, tmp_path / "profile", args, ["microphone"]) as page:
        page.add_init_script(RECORD_SENT)
        page.goto(f"{live_server}/")
        page.wait_for_function("window.parley && window.parley.socketState === 'open'", timeout=30_000)
        assert page.locator("#start").get_attribute("aria-label") == "Start talking"

        t0 = time.monotonic()
        page.click("#start")
        page.wait_for_function("window.parley.micOn === true", timeout=10_000)
        assert page.locator("#start").get_attribute("aria-pressed") == "true"

        # The final transcript: a user bubble that is no longer a growing partial.
        page.wait_for_function(
            """() => [...document.querySelectorAll('#log .msg.user:not(.partial)')].some(el => {
                   const t = el.textContent.toLowerCase();
                   return t.includes('capital') && t.includes('france') && el.dataset.turn;
               })""",
            timeout=TURN_TIMEOUT_MS,
        )
        timings["final_transcript_s"] = time.monotonic() - t0
        # Stop the microphone now: chromium loops the WAV, and a second asking of the
        # question would (rightly) barge in on the reply this test wants to hear.
        page.click("#start")
        page.wait_for_function("window.parley.micOn === false", timeout=10_000)

        turn = page.evaluate(
            """[...document.querySelectorAll('#log .msg.user')]
                 .find(el => /capital/i.test(el.textContent) && /france/i.test(el.textContent)).dataset.turn"""
        )
        user_text = page.locator(f'#log .msg.user[data-turn="{turn}"] .text').inner_text()
        # Word-level match, allowing one slip (the page's echo canceller and noise
        # suppressor sit between the file and the server).
        said = words(user_text)
        assert sum(w in said for w in words(QUESTION)) >= len(words(QUESTION)) - 1, user_text

        # The assistant's answer to that turn appears as text and is played as audio.
        page.wait_for_function(
            f"""() => {{
                const el = document.querySelector('#log .msg.assistant[data-turn="{turn}"] .text');
                return el && el.textContent.trim().length > 0;
            }}""",
            timeout=TURN_TIMEOUT_MS,
        )
        timings["assistant_text_s"] = time.monotonic() - t0
        page.wait_for_function("window.parley.playedSamples > 0", timeout=TURN_TIMEOUT_MS)
        timings["playback_started_s"] = time.monotonic() - t0
        first = page.evaluate("window.parley.playedSamples")
        page.wait_for_timeout(400)
        later = page.evaluate("({played: parley.playedSamples, received: parley.receivedSamples})")
        # Still playing, or already done; either way the counter may only grow and can
        # never pass what was received.
        assert later["played"] >= first > 0
        assert later["played"] <= later["received"]

        # The turn completes: the whole reply is played and the latency is shown.
        page.wait_for_function(
            f"window.parley.events.some(e => e.type === 'turn_done' && e.turn_id === {turn})",
            timeout=TURN_TIMEOUT_MS,
        )
        page.wait_for_function(
            "window.parley.receivedSamples > 0 && window.parley.playedSamples === window.parley.receivedSamples",
            timeout=60_000,
        )
        timings["reply_played_s"] = time.monotonic() - t0
        played = page.evaluate("window.parley.playedSamples")
        rate = page.evaluate(
            f"window.parley.events.find(e => e.type === 'audio_start' && e.turn_id === {turn}).sample_rate"
        )
        metrics = page.evaluate("window.parley.lastMetrics") or {}
        assistant_text = page.locator(f'#log .msg.assistant[data-turn="{turn}"] .text').inner_text()

        if "voice_to_voice_ms" in metrics:
            assert page.locator("#latency").inner_text() == f"reply in {round(metrics['voice_to_voice_ms'])} ms"

        # What the page sent: `start` first, then 20 ms PCM16 frames, and playback reports.
        total_ms = round(played / rate * 1000)
        page.wait_for_function(  # the last report carries the whole reply
            f"window.__sent.text.some(m => m.type === 'playback' && m.turn_id === {turn} && m.played_ms === {total_ms})",
            timeout=2_000,
        )
        sent = page.evaluate("window.__sent")
        assert sent["text"][0] == {"type": "start", "sample_rate": 16000}
        assert sent["binary_sizes"] == [640]
        reports = [m["played_ms"] for m in sent["text"] if m["type"] == "playback" and m["turn_id"] == int(turn)]
        assert len(reports) >= 2 and reports == sorted(reports), reports

        assert page.locator("#error").is_visible() is False, page.locator("#error").inner_text()
        # With the reply played and the mic off, the status line settles back to ready.
        page.wait_for_function("window.parley.state === 'ready'", timeout=5_000)
        assert not page.page_errors, page.page_errors
        page.screenshot(path=str(output_dir / "browser.png"))

    report = {
        "question": user_text,
        "answer": assistant_text,
        "played_samples": played,
        "played_seconds": round(played / rate, 2),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "server_metrics": metrics,
    }
    (output_dir / "browser.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


# ---------------------------------------------------------------- failure states
@pytest.fixture
def page_only_server(tmp_path):
    """Serve the page like the app does (`/` and `/static/`) but with no `/ws` behind it."""
    root = tmp_path / "site"
    root.mkdir()
    shutil.copy(WEB_DIR / "index.html", root / "index.html")
    (root / "static").symlink_to(WEB_DIR, target_is_directory=True)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_server_shows_error_and_keeps_reconnecting(playwright, page_only_server, tmp_path):
    with browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, *FAKE_MIC_ARGS], ["microphone"]) as page:
        page.goto(f"{page_only_server}/")
        error = page.locator("#error")
        error.wait_for(state="visible", timeout=10_000)
        assert "can't reach the parley server" in error.inner_text().lower()
        assert "/ws" in error.inner_text()
        assert page.locator("#conn").get_attribute("data-state") == "reconnecting"
        # It keeps trying on its own, and says so.
        page.wait_for_function("/attempt [2-9]/.test(document.getElementById('error').textContent)", timeout=10_000)
        assert page.locator("#status").inner_text() == "Reconnecting…"
        assert page.locator("#conn").inner_text().startswith("Reconnecting")
        assert not page.page_errors, page.page_errors


# ---------------------------------------------------------------- a scripted server on the page's origin
READY = {
    "type": "ready",
    "protocol": 1,
    "input_sample_rate": 16000,
    "output_sample_rate": 16000,
    "voices": ["joe", "amy"],
    "languages": ["en", ""],
}
DEFAULT_PREFS = {
    "system_prompt": "You are a helpful AI assistant named Parley.",
    "voice": "joe",
    "language": "en",
    "barge_in": True,
    "half_duplex": False,
}
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


class Site:
    """What a scripted site saw: connections, and the JSON messages and audio bytes the page sent."""

    def __init__(self) -> None:
        self.connections = 0
        self.received: list[dict] = []
        self.audio_bytes = 0
        self.prefs = dict(DEFAULT_PREFS)
        self.lock = threading.Lock()

    def messages(self, kind: str) -> list[dict]:
        with self.lock:
            return [m for m in self.received if m.get("type") == kind]

    def converse(self, ws, on_message=None) -> None:
        """Say ready, answer `config` like the server does, record everything until the page leaves."""
        ws.send(json.dumps(READY))
        with contextlib.suppress(Exception):
            for frame in ws:
                if isinstance(frame, bytes):
                    with self.lock:
                        self.audio_bytes += len(frame)
                    continue
                message = json.loads(frame)
                with self.lock:
                    self.received.append(message)
                if message["type"] == "config":
                    self.prefs.update({k: v for k, v in message.items() if k != "type"})
                    ws.send(json.dumps({"type": "config_applied", **self.prefs}))
                if on_message is not None:
                    on_message(ws, message)


@contextlib.contextmanager
def scripted_site(handler, health: dict | None = None):
    """Serve the page (``/``, ``/static/*``, ``/healthz``) and a scripted ``/ws`` from one origin.

    ``handler(ws, site, n)`` runs for the n-th WebSocket connection (1-based). The page only
    ever connects to its own origin, so the scripted server has to serve the page too: the
    ``process_request`` hook answers the plain HTTP requests, and upgrades go to ``handler``.
    """
    from websockets.datastructures import Headers
    from websockets.http11 import Response
    from websockets.sync.server import serve

    site = Site()
    health_body = json.dumps(health or {"status": "ok", "auth_required": False, "accepting_sessions": True}).encode()

    def respond(status: int, body: bytes, content_type: str) -> Response:
        headers = Headers(
            [
                ("Connection", "close"),
                ("Content-Length", str(len(body))),
                ("Content-Type", content_type),
                ("Cache-Control", "no-store"),
            ]
        )
        return Response(status, "OK" if status == 200 else "Not Found", headers, body)

    def process_request(connection, request):
        path = request.path.split("?", 1)[0]
        if path == "/ws" and request.headers.get("Upgrade", "").lower() == "websocket":
            return None  # the WebSocket handshake proceeds
        if path == "/healthz":
            return respond(200, health_body, "application/json")
        if path == "/":
            return respond(200, (WEB_DIR / "index.html").read_bytes(), "text/html; charset=utf-8")
        name = path.removeprefix("/static/")
        file = WEB_DIR / name
        if path.startswith("/static/") and "/" not in name and file.is_file():
            return respond(200, file.read_bytes(), CONTENT_TYPES.get(file.suffix, "application/octet-stream"))
        return respond(404, b"not found", "text/plain")

    def on_connect(ws):
        with site.lock:
            site.connections += 1
            n = site.connections
        handler(ws, site, n)

    with serve(
        on_connect, "127.0.0.1", 0, process_request=process_request, subprotocols=["parley"], compression=None
    ) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.socket.getsockname()[1]}", site
        finally:
            server.shutdown()


def flaky(ws, site, n):
    """The first connection says ready, reports a server error, then drops; later ones stay up."""
    if n == 1:
        ws.send(json.dumps(READY))
        ws.send(json.dumps({"type": "error", "code": "bad_audio", "message": "odd byte count", "fatal": False}))
        time.sleep(1.5)
        ws.close()
        return
    site.converse(ws)


def test_server_error_and_dropped_socket_are_shown_then_recovered(playwright, tmp_path):
    with (
        scripted_site(flaky) as (url, site),
        browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, *FAKE_MIC_ARGS], ["microphone"]) as page,
    ):
        page.goto(f"{url}/")
        error = page.locator("#error")
        # A server `error` event is shown as such.
        page.wait_for_function(
            "document.getElementById('error').textContent.includes('odd byte count')", timeout=10_000
        )
        assert "bad_audio" in error.inner_text()
        # The drop is noticed and announced, and the page reconnects on its own.
        page.wait_for_function(
            "document.getElementById('error').textContent.includes('Lost the connection')", timeout=10_000
        )
        assert page.locator("#conn").get_attribute("data-state") == "reconnecting"
        page.wait_for_function(
            "window.parley.socketState === 'open' && window.parley.state === 'ready'", timeout=15_000
        )
        assert site.connections == 2
        assert "Lost the connection" not in error.inner_text()  # the connection problem is cleared
        assert page.locator("#conn").inner_text() == "Connected"
        assert page.locator("#log .notice").first.inner_text().startswith("Reconnected")
        assert not page.page_errors, page.page_errors


def test_a_ws_parameter_cannot_send_the_page_elsewhere(playwright, tmp_path):
    """`?ws=` once pointed the page at any server; an attacker's link must not move the microphone."""
    with (
        scripted_site(lambda ws, site, n: site.converse(ws)) as (url, site),
        scripted_site(lambda ws, site, n: site.converse(ws)) as (elsewhere, other),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        target = elsewhere.replace("http://", "ws://") + "/ws"
        page.goto(f"{url}/?ws={target}")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        assert sockets == [url.replace("http://", "ws://") + "/ws"]
        assert other.connections == 0 and site.connections == 1


def test_denied_microphone_shows_a_clear_message(playwright, live_server, tmp_path):
    # No fake-UI flag and no granted permission: chromium denies getUserMedia itself.
    args = [*BASE_ARGS, "--use-fake-device-for-media-stream"]
    with browser_page(playwright, tmp_path / "profile", args, []) as page:
        page.goto(f"{live_server}/")
        page.wait_for_function("window.parley && window.parley.socketState === 'open'", timeout=30_000)
        page.click("#start")
        error = page.locator("#error")
        error.wait_for(state="visible", timeout=10_000)
        text = error.inner_text().lower()
        assert "microphone" in text and "denied" in text, text
        assert page.evaluate("window.parley.micOn") is False
        assert page.locator("#start").get_attribute("aria-pressed") == "false"
        # The typed-question fallback stays usable.
        assert page.locator("#text").is_enabled()
        assert not page.page_errors, page.page_errors


# ---------------------------------------------------------------- audio building blocks
WORKLET_PROBE = """async ([freq, rate]) => {
  // Render one second of a tone at `rate` through the page's capture worklet, offline.
  const ctx = new OfflineAudioContext(1, rate, rate);
  await ctx.audioWorklet.addModule('/static/mic-worklet.js');
  const osc = new OscillatorNode(ctx, {frequency: freq});
  const gain = new GainNode(ctx, {gain: 0.5});
  const node = new AudioWorkletNode(ctx, 'parley-mic', {numberOfInputs: 1, numberOfOutputs: 0,
      channelCount: 1, channelCountMode: 'explicit', processorOptions: {targetRate: 16000, frameMs: 20}});
  const frames = [];
  node.port.onmessage = (e) => frames.push(new Int16Array(e.data.pcm));
  osc.connect(gain).connect(node);
  osc.start();
  await ctx.startRendering();
  await new Promise((r) => setTimeout(r, 300));  // let the last port messages land
  const all = [];
  frames.forEach((f) => all.push(...f));
  const x = all.slice(1600).map((v) => v / 32768);  // skip the filter's warm-up
  const rms = Math.sqrt(x.reduce((a, v) => a + v * v, 0) / x.length);
  let crossings = 0;
  for (let i = 1; i < x.length; i++) if ((x[i - 1] < 0) !== (x[i] < 0)) crossings++;
  return {sizes: [...new Set(frames.map((f) => f.length))], total: all.length, rms,
          freq: crossings / 2 / (x.length / 16000)};
}"""


@pytest.mark.parametrize("rate", [16_000, 44_100, 48_000])
def test_mic_worklet_emits_20ms_pcm16_frames_at_16k(playwright, page_only_server, tmp_path, rate):
    with browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page:
        page.goto(f"{page_only_server}/")
        tone = page.evaluate(WORKLET_PROBE, [1000, rate])
        assert tone["sizes"] == [320]  # 20 ms at 16 kHz
        assert abs(tone["total"] - 16_000) <= 320  # one second in, one second out
        assert tone["rms"] == pytest.approx(0.5 / 2**0.5, rel=0.02)  # a 0.5 sine, undistorted
        assert tone["freq"] == pytest.approx(1000, rel=0.02)  # same pitch after resampling
        if rate > 16_000:
            # 12 kHz cannot exist at 16 kHz: it must be filtered out, not folded to 4 kHz.
            alias = page.evaluate(WORKLET_PROBE, [12_000, rate])
            assert alias["rms"] < 0.01


PLAYER_PROBE = """async () => {
  const {Player} = await import('/static/player.js');
  const p = new Player();
  p.unlock();
  await p.ctx.resume();
  const chunk = (n) => new Int16Array(n).fill(1000).buffer;
  p.begin(1, 22050);
  for (let i = 0; i < 8; i++) p.push(chunk(2205));  // 8 x 100 ms
  const starts = p.chunks.map((c) => c.start), ends = p.chunks.map((c) => c.end);
  const gaps = starts.slice(1).map((s, i) => s - ends[i]);
  await new Promise((r) => setTimeout(r, 350));
  const midway = p.playedSamples, midMs = p.playedMs(1);
  const heardMs = p.interrupt(1);
  const afterStop = {playing: p.playing, played: p.playedSamples};
  p.push(chunk(2205));  // a late frame of the interrupted turn: dropped
  await new Promise((r) => setTimeout(r, 200));
  const frozen = p.playedSamples, queued = p.chunks.length;
  p.begin(2, 16000);  // the next turn plays again, at its own rate
  p.push(chunk(1600));
  await new Promise((r) => setTimeout(r, 300));
  return {gaps, midway, midMs, heardMs, afterStop, frozen, queued,
          received: p.receivedSamples, final: p.playedSamples, playing: p.playing, turnMs: p.playedMs(2)};
}"""


def test_player_is_gapless_counts_played_samples_and_stops_on_interrupt(playwright, page_only_server, tmp_path):
    args = [*BASE_ARGS, "--autoplay-policy=no-user-gesture-required"]
    with browser_page(playwright, tmp_path / "profile", args, []) as page:
        page.goto(f"{page_only_server}/")
        r = page.evaluate(PLAYER_PROBE)
    assert all(abs(g) < 1e-9 for g in r["gaps"]), r["gaps"]  # back to back: no gaps, no overlap
    assert 0 < r["midway"] < 8 * 2205  # played counter follows the clock while playing
    assert r["heardMs"] == pytest.approx(r["midMs"], abs=30)
    assert r["afterStop"]["playing"] is False  # the cut is immediate
    assert r["frozen"] == r["afterStop"]["played"]  # nothing more plays after the interrupt
    assert r["queued"] == 0  # and late frames of that turn are dropped
    assert r["received"] == 8 * 2205 + 1600
    assert r["final"] == r["frozen"] + 1600 and r["playing"] is False
    assert r["turnMs"] == pytest.approx(100, abs=1)
