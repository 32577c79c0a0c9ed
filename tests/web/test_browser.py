"""The web page in a real browser: Debian chromium driven by Playwright.

The fake microphone is fed from a WAV file (chromium loops it), so the page hears a
real spoken question, the real server answers it, and the page plays the answer.
Never run `playwright install` here (it downloads a browser): we drive the system chromium.
"""

from __future__ import annotations

import array
import contextlib
import functools
import http.server
import json
import math
import re
import shutil
import threading
import time
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
WEB_DIR = Path(__file__).resolve().parents[2] / "web"
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
        # `config` goes out on connecting (the settings); `start` comes before any audio.
        kinds = [m["type"] for m in sent["text"]]
        assert sent["text"][kinds.index("start")] == {"type": "start", "sample_rate": 16000}
        assert set(kinds[: kinds.index("start")]) <= {"config"}
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
        self.refused = 0
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
def scripted_site(handler, health: dict | None = None, admit=None):
    """Serve the page (``/``, ``/static/*``, ``/healthz``) and a scripted ``/ws`` from one origin.

    ``handler(ws, site, n)`` runs for the n-th WebSocket connection (1-based); ``admit(request)``,
    if given, may refuse an upgrade (HTTP 403, as the real server refuses an origin or a key). The page only
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
            if admit is not None and not admit(request):
                with site.lock:
                    site.refused += 1
                return respond(403, b"refused", "text/plain")
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


def test_a_refused_upgrade_is_told_apart_from_a_down_server(playwright, tmp_path):
    with (
        scripted_site(lambda ws, site, n: site.converse(ws), admit=lambda request: False) as (url, site),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#error", has_text="answers but refused the voice connection").wait_for(timeout=15_000)
        assert site.refused >= 1 and site.connections == 0
        assert not page.locator("#key-dialog").is_visible()  # /healthz says no key is needed


def test_key_form_with_a_scripted_server(playwright, tmp_path):
    """The key goes as the `parley.key.<KEY>` subprotocol next to `parley`; a refused one is asked again."""
    offered: list[str] = []

    def admit(request):
        offered.append(request.headers.get("Sec-WebSocket-Protocol", ""))
        return "parley.key.s3cret-key" in offered[-1]

    health = {"status": "ok", "auth_required": True, "accepting_sessions": True}
    with (
        scripted_site(lambda ws, site, n: site.converse(ws), health=health, admit=admit) as (url, site),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        page.goto(f"{url}/")
        dialog = page.get_by_role("dialog", name="API key needed")
        dialog.wait_for(timeout=15_000)
        assert offered == []  # asked before dialing
        page.locator("#key-input").focus()
        assert page.evaluate("document.activeElement.id") == "key-input"
        page.fill("#key-input", "wrong")
        page.keyboard.press("Enter")
        page.locator("#key-error", has_text="did not accept").wait_for(timeout=15_000)
        assert page.get_attribute("#key-input", "aria-invalid") == "true"
        assert offered == ["parley, parley.key.wrong"]
        page.fill("#key-input", "s3cret-key")
        page.keyboard.press("Enter")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        assert offered[-1] == "parley, parley.key.s3cret-key" and site.connections == 1
        assert not page.page_errors, page.page_errors


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
        # the page sees its socket open when the handshake's answer arrives; the site's thread counts the connection
        # when it takes it, which may be a moment later (a fresh-clone run once asserted in between)
        deadline = time.monotonic() + 15
        while site.connections == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.connections == 0 and site.connections == 1


def tone(ms: int, rate: int = 16_000, freq: float = 440.0) -> bytes:
    """``ms`` of a quiet sine as PCM16 LE: reply audio for a scripted server."""
    n = rate * ms // 1000
    return array.array("h", (int(6000 * math.sin(2 * math.pi * freq * i / rate)) for i in range(n))).tobytes()


STORY_METRICS = {
    "endpoint_ms": 412.0,
    "asr_final_ms": 95.5,
    "llm_ttft_ms": 310.2,
    "tts_first_audio_ms": 205.9,
    "voice_to_voice_ms": 1023.6,
    "reply_audio_s": 1.3,
    "rtf": 0.42,
    "underruns": 0,
}


class Storyteller:
    """Answers each typed question like the server: its transcript, a streamed reply, a notice and 10 s
    of audio; then holds the turn open until the page sends `cancel` (interrupt + turn_done
    interrupted, as the server does) or the test sets ``finish`` (the rest of the reply)."""

    def __init__(self) -> None:
        self.finish = threading.Event()
        self.turns = 0
        self.cancels: list[threading.Event] = []

    def __call__(self, ws, site, n):
        def on_message(ws, message):
            if message["type"] == "text":
                self.turns += 1
                cancelled = threading.Event()
                self.cancels.append(cancelled)
                threading.Thread(
                    target=self.tell, args=(ws, self.turns, message["text"], cancelled), daemon=True
                ).start()
            elif message["type"] == "cancel" and self.cancels:
                self.cancels[-1].set()

        site.converse(ws, on_message)

    def tell(self, ws, turn, text, cancelled):
        def send(**event):
            ws.send(json.dumps(event))

        with contextlib.suppress(Exception):
            send(type="transcript", turn_id=turn, text=text, final=True)
            for word in ("Once ", "upon ", "a ", "time"):
                send(type="assistant_text", turn_id=turn, delta=word)
            send(type="notice", turn_id=turn, code="truncated", message="Your message was too long and was cut to fit.")
            send(type="audio_start", turn_id=turn, sample_rate=16000)
            chunk = tone(100)
            for _ in range(100):  # 10 s, sent at once: the page queues it
                ws.send(chunk)
            while not (cancelled.is_set() or self.finish.wait(0.05)):
                pass
            if cancelled.is_set():
                send(type="interrupt", turn_id=turn)
                metrics = {k: v for k, v in STORY_METRICS.items() if k != "rtf"} | {"barge_in": False}
                send(type="turn_done", turn_id=turn, text="Once upon", interrupted=True, metrics=metrics)
            else:
                send(type="assistant_text", turn_id=turn, delta=", the end.")
                send(type="turn_done", turn_id=turn, text="Once upon a time, the end.", metrics=STORY_METRICS)


def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition"):
    """Poll a Python-side condition (what a scripted server saw)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


AUTOPLAY = "--autoplay-policy=no-user-gesture-required"


def test_stop_and_esc_silence_the_reply_at_once_and_keep_the_conversation(playwright, tmp_path):
    story = Storyteller()
    with (
        scripted_site(story) as (url, site),
        browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, AUTOPLAY], []) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        stop = page.locator("#stop")
        assert stop.get_attribute("aria-disabled") == "true"  # nothing to stop yet

        page.fill("#text", "Tell me a story")
        page.press("#text", "Enter")
        # The reply streams: marked busy for screen readers until it is done.
        reply = page.locator('#log .msg.assistant[data-turn="1"]')
        page.locator('#log .msg.assistant[data-turn="1"][aria-busy="true"]').wait_for(timeout=15_000)
        # the deltas arrive one by one: wait for the last (asserting at once raced them on a quiet CI run)
        reply.locator(".text", has_text="Once upon a time").wait_for(timeout=15_000)
        # The server's notice is shown in the conversation.
        notice = page.locator("#log .notice.server")
        notice.wait_for(timeout=15_000)
        assert "too long" in notice.inner_text()
        page.wait_for_function("window.parley.playing === true", timeout=15_000)
        page.wait_for_function("document.getElementById('stop').getAttribute('aria-disabled') === 'false'")

        # Esc (focus is still in the text box): silent at once, before the server even answers.
        page.keyboard.press("Escape")
        assert page.evaluate("window.parley.playing") is False
        frozen = page.evaluate("window.parley.playedSamples")
        assert 0 < frozen < page.evaluate("window.parley.receivedSamples")
        wait_until(lambda: site.messages("cancel"), what="the cancel message")
        sent = [m["type"] for m in site.received]
        assert sent.index("playback") < sent.index("cancel")  # what was heard, then the cancel
        heard = [m for m in site.messages("playback") if m["turn_id"] == 1]
        assert heard and heard[-1]["played_ms"] > 0

        # The server's interrupt + turn_done settle the bubble; the question and the reply stay.
        page.locator('#log .msg.assistant.interrupted[data-turn="1"]:not([aria-busy])').wait_for(timeout=15_000)
        page.wait_for_function("window.parley.events.some(e => e.type === 'turn_done' && e.turn_id === 1)")
        assert page.locator('#log .msg.user[data-turn="1"] .text').inner_text() == "Tell me a story"
        assert reply.locator(".text").inner_text() == "Once upon"
        assert reply.locator(".meta .flag").inner_text() == "interrupted"
        page.wait_for_timeout(500)
        assert page.evaluate("window.parley.playedSamples") == frozen  # nothing more played
        page.wait_for_function("window.parley.state === 'ready'", timeout=10_000)

        # The stage breakdown is a disclosure: reachable by keyboard, read as a list.
        summary = reply.locator("details.stages summary")
        assert summary.inner_text() == "reply in 1024 ms"
        summary.focus()
        page.keyboard.press("Enter")
        figures = reply.locator("details.stages[open] dl")
        figures.wait_for()
        text = figures.inner_text()
        assert "LLM first token (ms)" in text and "310" in text and "endpoint (ms)" in text

        # The Stop button does the same for the next reply.
        page.fill("#text", "Another one")
        page.press("#text", "Enter")
        page.locator('#log .msg.assistant[data-turn="2"]').wait_for(timeout=15_000)
        page.wait_for_function("window.parley.playing === true", timeout=15_000)
        page.wait_for_function("document.getElementById('stop').getAttribute('aria-disabled') === 'false'")
        stop.click()
        assert page.evaluate("window.parley.playing") is False
        wait_until(lambda: len(site.messages("cancel")) == 2, what="the second cancel")
        page.locator('#log .msg.assistant.interrupted[data-turn="2"]').wait_for(timeout=15_000)
        assert page.locator("#log .msg").count() == 4  # both questions, both (cut) replies
        page.wait_for_function("document.getElementById('stop').getAttribute('aria-disabled') === 'true'")
        assert not page.page_errors, page.page_errors


def continued_turn(ws, site, n):
    """A spoken turn committed at a pause, answered, then continued (``turn_continued``) and answered whole."""

    def on_message(ws, message):
        if message["type"] != "text":
            return

        def send(**event):
            ws.send(json.dumps(event))

        send(type="transcript", turn_id=1, text="I want to visit Paris.", final=True)
        send(type="assistant_text", turn_id=1, delta="Paris is ")
        send(type="audio_start", turn_id=1, sample_rate=16000)
        for _ in range(30):  # 3 s of the first half's answer, queued by the page
            ws.send(tone(100))
        time.sleep(0.3)
        send(type="speech_started")
        send(type="turn_continued", turn_id=1)
        send(type="transcript", turn_id=1, text="I want to visit Paris. and London", final=False)
        time.sleep(0.3)
        send(type="transcript", turn_id=1, text="I want to visit Paris. and London next summer.", final=True)
        send(type="assistant_text", turn_id=1, delta="Both are lovely in summer.")
        send(type="audio_start", turn_id=1, sample_rate=16000)
        for _ in range(5):
            ws.send(tone(100))
        send(type="turn_done", turn_id=1, text="Both are lovely in summer.", metrics=STORY_METRICS)

    site.converse(ws, on_message)


def test_a_continued_turn_replaces_the_withdrawn_reply(playwright, tmp_path):
    with (
        scripted_site(continued_turn) as (url, _site),
        browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, AUTOPLAY], []) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        page.fill("#text", "go")  # the scripted server plays a spoken turn whatever is typed
        page.press("#text", "Enter")
        page.wait_for_function("window.parley.events.some(e => e.type === 'turn_done')", timeout=15_000)
        user = page.locator('#log .msg.user[data-turn="1"]')
        user.locator(".text", has_text="next summer.").wait_for(timeout=15_000)
        assert user.count() == 1 and "partial" not in (user.get_attribute("class") or "")
        replies = page.locator('#log .msg.assistant[data-turn="1"]')
        replies.locator(".text", has_text="Both are lovely").wait_for(timeout=15_000)
        assert replies.count() == 1 and replies.locator(".text").inner_text() == "Both are lovely in summer."
        # the withdrawn 3 s were cut: what plays now is the whole turn's 0.5 s answer at most
        page.wait_for_timeout(1500)
        assert page.evaluate("window.parley.playing") is False
        assert not page.page_errors, page.page_errors


def dropped_speech(ws, site, n):
    """Speech the server hears as a filler and drops (``speech_dropped``) after its partial was shown."""

    def on_message(ws, message):
        if message["type"] != "text":
            return

        def send(**event):
            ws.send(json.dumps(event))

        send(type="speech_started")
        send(type="transcript", turn_id=1, text="Um, so", final=False)
        send(type="speech_stopped")
        time.sleep(1.0)  # the page thinks a reply may come (it would for 4 s without the drop)
        send(type="speech_dropped", turn_id=1, reason="filler", heard="Um, so")

    site.converse(ws, on_message)


def test_dropped_speech_takes_its_partial_away_and_the_page_stops_thinking(playwright, tmp_path):
    with (
        scripted_site(dropped_speech) as (url, _site),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        page.fill("#text", "go")  # the scripted server plays the speech whatever is typed
        page.press("#text", "Enter")
        page.locator('#log .msg.user.partial[data-turn="1"]').wait_for(timeout=15_000)
        page.wait_for_function("window.parley.events.some(e => e.type === 'speech_dropped')", timeout=15_000)
        assert page.evaluate("window.parley.thinking") is False
        assert page.locator('#log .msg.user[data-turn="1"]').count() == 0
        assert not page.page_errors, page.page_errors


def tool_turn(ws, site, n):
    """A typed question answered after a call of a server tool, as the server sends it."""

    def on_message(ws, message):
        if message["type"] != "text":
            return

        def send(**event):
            ws.send(json.dumps(event))

        call = {"turn_id": 1, "call_id": "call_1", "name": "get_weather"}
        send(type="transcript", turn_id=1, text=message["text"], final=True)
        send(type="assistant_text", turn_id=1, delta="Let me check.")
        send(type="tool_call", **call, arguments='{"city": "Paris"}', runs_on="server")
        time.sleep(0.3)  # the tool runs
        send(type="tool_done", **call, status="completed", output='{"celsius": 21}')
        send(type="assistant_text", turn_id=1, delta=" It is 21 degrees.")
        send(type="turn_done", turn_id=1, text="Let me check. It is 21 degrees.", metrics={"tool_calls": 1})

    site.converse(ws, on_message)


def test_a_tool_call_and_its_result_show_in_the_reply_and_stay_after_a_reload(playwright, tmp_path):
    with (
        scripted_site(tool_turn) as (url, _site),
        browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, AUTOPLAY], []) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        page.fill("#text", "What is the weather in Paris?")
        page.press("#text", "Enter")
        page.wait_for_function("window.parley.events.some(e => e.type === 'turn_done')", timeout=15_000)
        reply = page.locator('#log .msg.assistant[data-turn="1"]')
        tool = reply.locator(".tool")
        assert tool.count() == 1 and tool.get_attribute("data-status") == "completed"
        assert tool.locator(".call").inner_text() == 'get_weather({"city": "Paris"})'
        assert tool.locator(".result").inner_text() == '→ {"celsius": 21}'
        assert reply.locator(".text").inner_text() == "Let me check. It is 21 degrees."
        page.wait_for_timeout(500)  # the transcript is saved (debounced)
        page.reload()
        page.locator("#log .notice.divider").wait_for(timeout=10_000)
        restored = page.locator("#log .msg.assistant .tool .call")
        assert restored.all_inner_texts() == ['get_weather({"city": "Paris"})']
        assert not page.page_errors, page.page_errors


def busy_then_open(ws, site, n):
    if n == 1:  # what the server does when admission refuses a session
        ws.send(
            json.dumps(
                {
                    "type": "error",
                    "code": "overloaded",
                    "message": "all 1 sessions are in use; try again later",
                    "fatal": True,
                    "retry_after_s": 4,
                }
            )
        )
        ws.close(1013, "overloaded")
        return
    site.converse(ws)


def test_overloaded_server_is_counted_down_then_joined(playwright, tmp_path):
    with (
        scripted_site(busy_then_open) as (url, site),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        page.goto(f"{url}/")
        error = page.locator("#error")
        page.wait_for_function("/Server busy, retrying in [34] s/.test(document.getElementById('error').textContent)")
        assert page.locator("#status").inner_text() == "Server busy"
        assert "overloaded" not in error.inner_text()  # the countdown, not a raw error
        # A live countdown, not a silent wait.
        page.wait_for_function("/Server busy, retrying in [12] s/.test(document.getElementById('error').textContent)")
        assert site.connections == 1  # it waits as told instead of hammering the server
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        assert site.connections == 2
        assert "Server busy" not in error.inner_text()
        assert not page.page_errors, page.page_errors


def idle_then_open(ws, site, n):
    if n == 1:
        ws.send(json.dumps(READY))
        time.sleep(1.0)
        ws.close(4000, "idle for 1 s")
        return
    site.converse(ws)


def test_idle_close_is_not_retried_until_the_user_asks(playwright, tmp_path):
    with (
        scripted_site(idle_then_open) as (url, site),
        browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page,
    ):
        page.goto(f"{url}/")
        error = page.locator("#error")
        page.wait_for_function("document.getElementById('error').textContent.includes('Closed after being idle')")
        assert page.locator("#conn").inner_text() == "Disconnected"
        reconnect = error.get_by_role("button", name="Reconnect")
        assert reconnect.is_visible()
        # A dropped connection is retried after 0.5 s; an idle one is not retried at all.
        page.wait_for_timeout(3000)
        assert site.connections == 1
        assert page.evaluate("window.parley.socketState") == "idle_closed"
        reconnect.click()
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        assert site.connections == 2
        assert "idle" not in error.inner_text()
        assert not page.page_errors, page.page_errors


FAKE_WAKE_LOCK = """
// Headless chromium has no screen to keep on: count what the page asks of navigator.wakeLock.
window.__wake = {requests: 0, releases: 0, held: false};
Object.defineProperty(navigator, 'wakeLock', {configurable: true, value: {request: async () => {
  window.__wake.requests++;
  window.__wake.held = true;
  const sentinel = new EventTarget();
  sentinel.released = false;
  sentinel.release = async () => { window.__wake.releases++; window.__wake.held = false; sentinel.released = true; };
  return sentinel;
}}});
"""


def test_half_duplex_keeps_the_mic_quiet_while_a_reply_plays(playwright, tmp_path):
    story = Storyteller()
    args = [*BASE_ARGS, *FAKE_MIC_ARGS, AUTOPLAY]
    with (
        scripted_site(story) as (url, site),
        browser_page(playwright, tmp_path / "profile", args, ["microphone"]) as page,
    ):
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        page.click("#duplex")
        page.locator('#duplex[aria-checked="true"]').wait_for()
        page.fill("#text", "Tell me a story")
        page.press("#text", "Enter")
        page.wait_for_function("window.parley.playing === true", timeout=15_000)

        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.keyboard.down("Space")
        page.wait_for_function("window.parley.micOn === true", timeout=15_000)
        wait_until(lambda: site.messages("start"), what="start")
        page.wait_for_timeout(1000)  # 50 mic frames' worth, all held back: the reply is still playing
        assert page.evaluate("window.parley.playing") is True
        assert site.audio_bytes == 0
        page.keyboard.press("Escape")  # the reply stops: the mic is heard again
        wait_until(lambda: site.audio_bytes > 0, what="mic audio after the reply")
        page.keyboard.up("Space")
        page.wait_for_function("window.parley.micOn === false", timeout=15_000)
        assert not page.page_errors, page.page_errors


def test_push_to_talk_duplex_switch_mic_picker_and_settings(playwright, tmp_path):
    args = [*BASE_ARGS, *FAKE_MIC_ARGS]
    with (
        scripted_site(lambda ws, site, n: site.converse(ws)) as (url, site),
        browser_page(playwright, tmp_path / "profile", args, ["microphone"]) as page,
    ):
        page.add_init_script(FAKE_WAKE_LOCK)
        page.goto(f"{url}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        wait_until(lambda: site.messages("config"), what="the first config")
        assert site.messages("config")[0] == {"type": "config"}  # learns the defaults, changes nothing

        # Hold Space: the mic runs while the key is down.
        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.keyboard.down("Space")
        page.wait_for_function("window.parley.micOn === true", timeout=15_000)
        wait_until(lambda: site.messages("start") and site.audio_bytes > 0, what="mic audio")
        page.wait_for_function("window.__wake.held === true")  # the screen stays on while talking
        page.keyboard.up("Space")
        page.wait_for_function("window.parley.micOn === false", timeout=15_000)
        page.wait_for_function("window.__wake.held === false && window.__wake.releases === 1")
        # ...but not while typing: Space is a space there.
        page.click("#text")
        page.keyboard.down("Space")
        page.keyboard.up("Space")
        assert page.input_value("#text") == " "
        assert page.evaluate("window.parley.micOn") is False

        # The half-duplex switch asks the server, and shows what it applied.
        duplex = page.locator("#duplex")
        assert duplex.get_attribute("aria-checked") == "false"
        duplex.click()
        page.locator('#duplex[aria-checked="true"]').wait_for()
        assert site.messages("config")[-1] == {"type": "config", "half_duplex": True}

        # Settings: voice and language from `ready`, the microphone from the browser's list.
        page.click("#settings-open")
        page.locator("#settings-dialog").wait_for()
        assert page.locator("#set-voice option").all_inner_texts() == ["joe", "amy"]
        assert page.locator("#set-language option").all_inner_texts() == ["en", "Detect automatically"]
        assert page.is_checked("#set-half-duplex")
        mics = page.locator("#set-mic option")
        page.wait_for_function("document.querySelectorAll('#set-mic option').length > 1", timeout=10_000)
        chosen = mics.nth(1).get_attribute("value")
        page.select_option("#set-mic", chosen)
        page.select_option("#set-voice", "amy")
        page.select_option("#set-language", "")
        page.uncheck("#set-barge-in")
        page.click("#settings-apply")
        page.locator("#settings-status", has_text="Applied by the server.").wait_for()
        applied = site.messages("config")[-1]
        assert applied["voice"] == "amy" and applied["language"] == "" and applied["barge_in"] is False
        assert applied["half_duplex"] is True and applied["system_prompt"] == DEFAULT_PREFS["system_prompt"]
        page.keyboard.press("Escape")  # closes the dialog
        page.locator("#settings-dialog").wait_for(state="hidden")
        assert "Settings applied" in page.locator("#log .notice").last.inner_text()

        # The picked microphone is the one used.
        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.keyboard.down("Space")
        page.wait_for_function("window.parley.micOn === true", timeout=15_000)
        assert page.evaluate("window.parley.micDevice") == chosen
        page.keyboard.up("Space")
        page.wait_for_function("window.parley.micOn === false", timeout=15_000)

        # A reload keeps the choices: they go to the server on the new connection.
        before = len(site.messages("config"))
        page.reload()
        page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
        wait_until(lambda: len(site.messages("config")) >= before + 2, what="the settings after a reload")
        resent = site.messages("config")[-1]
        assert resent["voice"] == "amy" and resent["half_duplex"] is True and resent["barge_in"] is False
        assert "system_prompt" not in resent  # the default prompt is not pinned
        page.locator('#duplex[aria-checked="true"]').wait_for()
        assert not page.page_errors, page.page_errors


def test_page_screenshots_desktop_and_phone(playwright, output_dir, tmp_path):
    """The finished page, with a reply and its stage breakdown, at desktop and phone size."""
    story = Storyteller()
    story.finish.set()
    profile = tmp_path / "profile"
    with scripted_site(story) as (url, site):
        with browser_page(playwright, profile, [*BASE_ARGS, AUTOPLAY], []) as page:
            page.goto(f"{url}/")
            page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
            page.fill("#text", "Tell me a story about a lighthouse keeper")
            page.press("#text", "Enter")
            page.locator("#log .msg.assistant details.stages summary").wait_for(timeout=15_000)
            page.click("#log .msg.assistant details.stages summary")
            page.evaluate("window.parley.sendText('And then?')")
            page.locator('#log .msg.assistant[data-turn="2"] details.stages').wait_for(timeout=15_000)
            page.click("body", position={"x": 5, "y": 5})
            page.screenshot(path=str(output_dir / "browser-desktop.png"))
            page.click("#settings-open")
            page.locator("#settings-dialog").wait_for()
            page.screenshot(path=str(output_dir / "browser-settings.png"))
            assert not page.page_errors, page.page_errors
        phone = {
            "viewport": {"width": 390, "height": 844},
            "device_scale_factor": 2,
            "is_mobile": True,
            "has_touch": True,
        }
        with browser_page(playwright, profile, BASE_ARGS, [], **phone) as page:
            page.goto(f"{url}/")  # the same profile: the conversation comes back from localStorage
            page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
            page.locator("#log .notice.divider").wait_for()
            page.screenshot(path=str(output_dir / "browser-phone.png"))
            assert not page.page_errors, page.page_errors
        with browser_page(playwright, profile, BASE_ARGS, [], color_scheme="dark") as page:
            page.goto(f"{url}/")
            page.locator("#conn[data-state=open]").wait_for(timeout=15_000)
            page.click("#log .msg.assistant details.stages summary")
            page.click("#export-menu summary")
            page.screenshot(path=str(output_dir / "browser-dark.png"))
            assert not page.page_errors, page.page_errors


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


# ---------------------------------------------------------------- the page against the real server
CSP_MARKERS = ("Content Security Policy", "Refused to")


@pytest.fixture(scope="module")
def silence_wav(tmp_path_factory) -> Path:
    """Ten seconds of silence for the fake microphone: audio flows, nobody speaks."""
    path = tmp_path_factory.mktemp("browser-audio") / "silence.wav"
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(b"\0\0" * 16000 * 10)
    return path


def ask(page, text: str) -> int:
    """Type a question; returns its turn id once the server has numbered it."""
    count = len(page.evaluate("window.parley.events"))
    page.fill("#text", text)
    page.press("#text", "Enter")
    return page.wait_for_function(
        f"""() => {{
            const e = window.parley.events.slice({count}).find(e => e.type === 'transcript' || e.type === 'assistant_text');
            return e && e.turn_id;
        }}""",
        timeout=TURN_TIMEOUT_MS,
    ).json_value()


def turn_done(page, turn: int) -> dict:
    return page.wait_for_function(
        f"window.parley.events.find(e => e.type === 'turn_done' && e.turn_id === {turn})", timeout=TURN_TIMEOUT_MS
    ).json_value()


def test_page_runs_under_the_servers_csp(playwright, live_server, silence_wav, tmp_path):
    """The real page from the real server, CSP enforced: it connects, applies settings, answers,
    exports and runs the microphone without one policy violation. Only locators drive it here
    (a string `wait_for_function` is eval, which this very policy forbids)."""
    args = [*BASE_ARGS, *FAKE_MIC_ARGS, f"--use-file-for-fake-audio-capture={silence_wav}"]
    with browser_page(playwright, tmp_path / "profile", args, ["microphone"], bypass_csp=False) as page:
        response = page.goto(f"{live_server}/")
        assert "script-src 'self'" in response.headers["content-security-policy"]
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        page.locator("#status", has_text="Ready").wait_for(timeout=10_000)

        page.click("#settings-open")
        page.locator("#settings-dialog").wait_for()
        page.fill("#set-prompt", "You are Parley. Answer in one short sentence.")
        page.click("#settings-apply")
        page.locator("#settings-status", has_text="Applied by the server.").wait_for(timeout=30_000)
        page.click("#settings-close")

        page.fill("#text", "Say hello.")
        page.press("#text", "Enter")
        summary = page.locator("#log .msg.assistant details.stages summary")
        summary.wait_for(timeout=TURN_TIMEOUT_MS)
        summary.click()
        page.locator("#log .msg.assistant details.stages[open] dl").wait_for()

        page.click("#export-menu summary")
        with page.expect_download() as download:
            page.click("#export-txt")
        assert "You: Say hello." in Path(download.value.path()).read_text()

        page.click("#start")  # the capture worklet is a script too
        page.locator('#start[aria-pressed="true"]').wait_for(timeout=15_000)
        page.click("#start")
        page.locator('#start[aria-pressed="false"]').wait_for(timeout=15_000)

        violations = [line for line in page.console if any(marker in line for marker in CSP_MARKERS)]
        assert not violations, violations
        assert not page.page_errors, page.page_errors


def test_settings_change_reaches_the_next_turn(playwright, live_server, tmp_path):
    prompt = "You are Parley. Answer every question with one short sentence."
    with browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page:
        page.add_init_script(RECORD_SENT)
        page.goto(f"{live_server}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        page.wait_for_function("window.parley.applied !== null", timeout=30_000)  # the server's defaults
        default_prompt = page.evaluate("window.parley.applied.system_prompt")
        assert default_prompt and default_prompt != prompt

        page.click("#settings-open")
        page.locator("#settings-dialog").wait_for()
        assert page.get_attribute("#set-prompt", "placeholder") == default_prompt
        page.fill("#set-prompt", prompt)
        page.click("#settings-apply")
        page.locator("#settings-status", has_text="Applied by the server.").wait_for(timeout=30_000)
        page.click("#settings-close")
        notice = page.locator("#log .notice", has_text="Settings applied")
        assert "your system prompt" in notice.inner_text()
        applied = [e for e in page.evaluate("window.parley.events") if e["type"] == "config_applied"][-1]
        assert applied["system_prompt"] == prompt

        turn = ask(page, "What is two plus two?")
        done = turn_done(page, turn)
        assert done["text"].strip()
        sent = page.evaluate("window.__sent.text")
        config_at = next(i for i, m in enumerate(sent) if m["type"] == "config" and m.get("system_prompt") == prompt)
        text_at = next(i for i, m in enumerate(sent) if m["type"] == "text")
        assert config_at < text_at  # the turn was asked under the new prompt

        # The choice is remembered: the next connection gets it again.
        page.reload()
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        page.wait_for_function(
            f"window.parley.events.some(e => e.type === 'config_applied' && e.system_prompt === {json.dumps(prompt)})",
            timeout=30_000,
        )
        page.click("#settings-open")
        assert page.input_value("#set-prompt") == prompt
        assert not page.page_errors, page.page_errors


def test_stop_keeps_the_history_and_silences_playback(playwright, live_server, tmp_path):
    with browser_page(playwright, tmp_path / "profile", [*BASE_ARGS, AUTOPLAY], []) as page:
        page.add_init_script(RECORD_SENT)
        page.goto(f"{live_server}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        question = "Tell me a long story about a brave knight and a dragon."
        turn = ask(page, question)
        page.wait_for_function("window.parley.playedSamples > 0 && window.parley.playing", timeout=TURN_TIMEOUT_MS)

        page.click("#stop")
        assert page.evaluate("window.parley.playing") is False  # silent at once, not after a round trip
        frozen = page.evaluate("window.parley.playedSamples")
        sent = page.evaluate("window.__sent.text")
        cancel_at = sent.index({"type": "cancel"})
        before = sent[cancel_at - 1]
        assert before["type"] == "playback" and before["turn_id"] == turn  # what was heard came first

        done = turn_done(page, turn)
        assert done["interrupted"] is True
        page.wait_for_function("window.parley.state === 'ready'", timeout=30_000)
        assert page.evaluate("window.parley.playedSamples") == frozen  # no late audio got through
        # The conversation stays: the question, and the reply as far as it went.
        assert page.locator(f'#log .msg.user[data-turn="{turn}"] .text').inner_text() == question
        reply = page.locator(f'#log .msg.assistant[data-turn="{turn}"]')
        assert "interrupted" in reply.get_attribute("class")
        assert reply.locator(".text").inner_text().strip()
        assert page.locator("#stop").get_attribute("aria-disabled") == "true"
        assert not page.page_errors, page.page_errors


def test_transcript_survives_reload_and_exports(playwright, live_server, tmp_path):
    question = "What is the capital of France?"
    with browser_page(playwright, tmp_path / "profile", BASE_ARGS, []) as page:
        page.goto(f"{live_server}/")
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        turn = ask(page, question)
        done = turn_done(page, turn)
        answer = page.locator(f'#log .msg.assistant[data-turn="{turn}"] .text').inner_text().strip()
        assert answer

        page.click("#export-menu summary")
        with page.expect_download() as text_file:
            page.click("#export-txt")
        assert text_file.value.suggested_filename.endswith(".txt")
        text = Path(text_file.value.path()).read_text()
        assert f"You: {question}" in text and f"Parley: {answer}" in text

        page.click("#export-menu summary")
        with page.expect_download() as json_file:
            page.click("#export-json")
        assert json_file.value.suggested_filename.endswith(".json")
        exported = json.loads(Path(json_file.value.path()).read_text())
        entries = [e for e in exported["entries"] if e["role"] != "notice"]
        assert [(e["role"], e["text"]) for e in entries] == [("user", question), ("assistant", answer)]
        if done.get("metrics", {}).get("llm_ttft_ms") is not None:
            assert entries[1]["metrics"]["llm_ttft_ms"] == done["metrics"]["llm_ttft_ms"]

        page.reload()
        page.locator("#log .notice.divider").wait_for(timeout=10_000)
        assert page.locator("#log .msg.user .text").all_inner_texts() == [question]
        assert [t.strip() for t in page.locator("#log .msg.assistant .text").all_inner_texts()] == [answer]
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)

        page.click("#reset")  # a new conversation forgets the saved one too
        page.reload()
        page.locator("#conn[data-state=open]").wait_for(timeout=60_000)
        assert page.locator("#log .msg").count() == 0
        assert page.locator("#empty").is_visible()
        assert not page.page_errors, page.page_errors


API_KEY = "browser-test-key-0123456789"
IDLE_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def keyed_server(output_dir):
    """A real server that wants an API key, takes one session at a time and closes idle ones."""
    from harness import start_server, stop_server

    args = ["serve", "--api-key", API_KEY, "--max-sessions", "1", "--idle-timeout-s", str(IDLE_TIMEOUT_S)]
    server, base_url = start_server(args, output_dir / "server-browser-key.log")
    yield base_url
    stop_server(server)


def enter_key(page, key: str) -> None:
    page.locator("#key-dialog").wait_for(timeout=30_000)
    page.fill("#key-input", key)
    page.click("#key-submit")


@pytest.mark.models  # keyed_server is a real `parley serve`
def test_api_key_form_busy_countdown_and_idle_close_on_a_real_server(playwright, keyed_server, silence_wav, tmp_path):
    args = [*BASE_ARGS, *FAKE_MIC_ARGS, f"--use-file-for-fake-audio-capture={silence_wav}"]
    with contextlib.ExitStack() as first_tab:
        a = first_tab.enter_context(browser_page(playwright, tmp_path / "a", args, ["microphone"]))
        sockets: list[str] = []
        a.on("websocket", lambda ws: sockets.append(ws.url))
        a.goto(f"{keyed_server}/")
        # /healthz says a key is needed and none is stored: the page asks before dialing.
        a.locator("#key-dialog").wait_for(timeout=30_000)
        a.keyboard.press("Escape")  # dismissed: the page says why it is not connected, and offers the form again
        a.locator("#error", has_text="needs an API key").wait_for()
        a.locator("#error").get_by_role("button", name="Enter key").click()
        enter_key(a, "not-the-right-key-000000")
        a.locator("#key-error", has_text="did not accept").wait_for(timeout=30_000)
        assert a.locator("#key-dialog").is_visible()
        assert a.locator("#conn").inner_text() == "Key needed"
        enter_key(a, API_KEY)
        a.locator("#conn[data-state=open]").wait_for(timeout=30_000)
        assert a.evaluate("sessionStorage.getItem('parley.apiKey')") == API_KEY
        # A reload in the same tab keeps the key: no question this time.
        a.reload()
        a.locator("#conn[data-state=open]").wait_for(timeout=30_000)
        assert not a.locator("#key-dialog").is_visible()
        assert sockets and all(url.endswith("/ws") for url in sockets)  # the key went as a subprotocol
        # Keep this session busy (silence streams in), so it holds the only slot.
        a.click("#start")
        a.locator('#start[aria-pressed="true"]').wait_for(timeout=15_000)

        with browser_page(playwright, tmp_path / "b", BASE_ARGS, []) as b:
            b.goto(f"{keyed_server}/")
            enter_key(b, API_KEY)
            # Refused for capacity: a countdown from retry_after_s, not silent reconnects.
            b.locator("#error", has_text="Server busy, retrying in").wait_for(timeout=30_000)
            b.locator("#status", has_text="Server busy").wait_for(timeout=10_000)
            first_tab.close()  # the first tab goes: its slot frees up
            b.locator("#conn[data-state=open]").wait_for(timeout=60_000)
            assert "Server busy" not in b.locator("#error").inner_text()

            # Left alone, the session is closed as idle; the page waits for the user.
            b.locator("#error", has_text="Closed after being idle").wait_for(timeout=(IDLE_TIMEOUT_S + 30) * 1000)
            assert b.locator("#conn").inner_text() == "Disconnected"
            b.wait_for_timeout(3000)
            assert b.evaluate("window.parley.socketState") == "idle_closed"
            b.locator("#error").get_by_role("button", name="Reconnect").click()
            b.locator("#conn[data-state=open]").wait_for(timeout=30_000)
            assert not b.page_errors, b.page_errors


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
