"""The scale topology on one machine, as one supervised group of processes: an LLM server, N voice servers on
the remote backend, nginx in front.

``up`` starts them in order (the LLM server, then the voice servers, each waited for, then nginx), writes the
run folder's ``state.json`` and stays in the foreground watching them: a voice server or the LLM server that
dies is started again on its port (its conversations are lost; nginx sends new ones to the others meanwhile,
and the voice servers say the LLM is down until it is back); nginx dying stops everything. SIGTERM or SIGINT
(``parley scale down``, Ctrl-C) stops nginx first (no new conversations), then the voice servers, then the
LLM server. Children get SIGTERM if the supervisor itself is killed (Linux's parent-death signal).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.scale import nginx

log = logging.getLogger(__name__)

PID_FILE = "supervisor.pid"
STATE_FILE = "state.json"
RESTART_BACKOFF_S = 2.0
STOP_TIMEOUT_S = 20.0


class StopRequested(Exception):
    """A stop signal came while the servers were starting."""


@dataclass
class ScaleOptions:
    """What ``parley scale up`` starts."""

    run_dir: Path
    voice: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    llm_url: str | None = None  # an LLM server already running (its /v1 URL); else one is started
    llm_model: str = "auto"
    vllm_python: str | None = None  # start vLLM (its OpenAI server) with this interpreter instead of Parley's engine
    engine_args: list[str] = field(default_factory=list)  # extra `parley engine serve` (or vLLM) flags
    serve_args: list[str] = field(default_factory=list)  # extra `parley serve` flags for every voice server
    ready_timeout_s: float = 600.0


@dataclass
class Child:
    """One supervised server: how to start it, where it logs, and how it is found ready."""

    name: str
    argv: list[str]
    log_path: Path
    url: str | None = None  # its own address ("http://127.0.0.1:PORT"), None for nginx
    ready_path: str = "/healthz"
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        with open(self.log_path, "a") as log_file:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor alone, which stops them in order
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "pid": self.process.pid if self.process else None,
            "url": self.url,
            "log": str(self.log_path),
            "restarts": self.restarts,
        }


class Topology:
    """The started children and the loop that keeps them running."""

    def __init__(self, options: ScaleOptions) -> None:
        self.options = options
        self.run_dir = options.run_dir.resolve()
        self.llm: Child | None = None
        self.voices: list[Child] = []
        self.balancer: Child | None = None
        self.llm_url = options.llm_url
        self._stopping = False

    # --- start -----------------------------------------------------------------------------------------
    def up(self) -> None:
        """Start everything, in order, each waited for; raises (after stopping what started) if one fails."""
        o = self.options
        self.run_dir.mkdir(parents=True, exist_ok=True)
        nginx_program = nginx.nginx_binary()  # missing nginx or a taken port fail before any model loads
        _check_free(o.host, o.port)
        try:
            if self.llm_url is None:
                self.llm = self._llm_child()
                self._start_and_wait([self.llm])
                self.llm_url = self.llm.url + "/v1"
            self.voices = [self._voice_child(i) for i in range(1, o.voice + 1)]
            self._start_and_wait(self.voices)
            conf = nginx.write_conf(
                self.run_dir,
                listen=f"[{o.host}]:{o.port}" if ":" in o.host else f"{o.host}:{o.port}",
                upstreams=[v.url.removeprefix("http://") for v in self.voices],
            )
            command = nginx.command(nginx_program, conf, self.run_dir)
            self.balancer = Child("nginx", command, self.run_dir / "nginx.log", url=self.url)
            self._start_and_wait([self.balancer])
        except BaseException:
            self.down()
            raise
        self.write_state()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "::") else self.options.host
        return f"http://{host}:{self.options.port}"

    def _llm_child(self) -> Child:
        o = self.options
        port = free_port()
        if o.vllm_python:
            from engine.weights import resolve_model

            model = str(resolve_model(o.llm_model, float32_weights=True))  # vLLM reads the folder's safetensors
            argv = [o.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
            argv += ["--served-model-name", "parley", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
            argv += ["--host", "127.0.0.1", "--port", str(port), *o.engine_args]
            return Child(
                "vllm", argv, self.run_dir / "vllm.log", url=f"http://127.0.0.1:{port}", ready_path="/v1/models"
            )
        argv = [sys.executable, "-m", "app.cli", "engine", "serve", "--model", o.llm_model, *default_engine_args()]
        argv += [*o.engine_args, "--host", "127.0.0.1", "--port", str(port)]
        return Child("llm", argv, self.run_dir / "llm.log", url=f"http://127.0.0.1:{port}", ready_path="/v1/models")

    def _voice_child(self, i: int) -> Child:
        port = free_port()
        o = self.options
        argv = [sys.executable, "-m", "app.cli", "serve", "--llm-backend", "openai", "--llm-url", self.llm_url]
        if o.llm_url is None and "--llm-model" not in o.serve_args:
            # the model the started LLM server serves, by its own name (``auto`` there means "whatever the server
            # serves"): the voice servers' conversation policy is that model's row (``app.policy.model_traits``)
            from engine.weights import chosen_model

            argv += ["--llm-model", chosen_model(o.llm_model)]
        argv += [*o.serve_args, "--host", "127.0.0.1", "--port", str(port)]
        return Child(f"voice-{i}", argv, self.run_dir / f"voice-{i}.log", url=f"http://127.0.0.1:{port}")

    def _start_and_wait(self, children: list[Child]) -> None:
        for child in children:
            child.start()
            log.warning("started %s (pid %d), log %s", child.name, child.process.pid, child.log_path)
        deadline = time.monotonic() + self.options.ready_timeout_s
        waiting = list(children)
        while waiting:
            if self._stopping:
                raise StopRequested
            for child in list(waiting):
                if not child.alive():
                    tail = child.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{child.name} exited while starting (log {child.log_path}):\n{tail}")
                if _answers(child.url + child.ready_path):
                    log.warning("%s ready at %s", child.name, child.url)
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {self.options.ready_timeout_s:.0f} s: {[c.name for c in waiting]}")
            time.sleep(0.5)

    # --- run -------------------------------------------------------------------------------------------
    def children(self) -> list[Child]:
        return [c for c in (self.balancer, *self.voices, self.llm) if c is not None]

    def watch(self, poll_s: float = 1.0) -> int:
        """Keep the servers running until a stop signal (0) or nginx's death (1)."""
        restart_at: dict[str, float] = {}
        while not self._stopping:
            if self.balancer is not None and not self.balancer.alive():
                log.error("nginx exited (code %s): stopping the topology", self.balancer.process.returncode)
                self.down()
                return 1
            for child in [*self.voices, *([self.llm] if self.llm else [])]:
                if child.alive() or self._stopping:
                    continue
                due = restart_at.setdefault(child.name, time.monotonic() + RESTART_BACKOFF_S)
                if time.monotonic() >= due:
                    log.warning("%s exited (code %s): starting it again", child.name, child.process.returncode)
                    child.start()
                    child.restarts += 1
                    restart_at.pop(child.name)
                    self.write_state()
            time.sleep(poll_s)
        return 0

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def down(self) -> None:
        """Stop nginx, then the voice servers, then the LLM server (each given STOP_TIMEOUT_S, then killed)."""
        self._stopping = True
        for child in self.children():
            child.stop()
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)

    def write_state(self) -> None:
        state = {
            "url": self.url,
            "llm_url": self.llm_url,
            "supervisor_pid": os.getpid(),
            "processes": [c.describe() for c in self.children()],
        }
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_dir / STATE_FILE)


def default_engine_args() -> list[str]:
    """The started engine server's precision: the voice server's settings (``auto`` resolves alike in both)."""
    from app.config import Settings

    settings = Settings()
    return ["--dtype", settings.llm_dtype, "--quantization", settings.llm_quantization]


def run_up(options: ScaleOptions) -> int:
    """``parley scale up``: start, print where, watch until stopped."""
    run_dir = options.run_dir.resolve()
    running = running_supervisor(run_dir)
    if running is not None:
        print(f"already running (pid {running}) from {run_dir}: `parley scale down --run-dir {run_dir}` first")
        return 1
    topology = Topology(options)
    signal.signal(signal.SIGTERM, topology.request_stop)
    signal.signal(signal.SIGINT, topology.request_stop)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PID_FILE).write_text(str(os.getpid()))
    try:
        topology.up()
        voices = ", ".join(v.url for v in topology.voices)
        print(f"ready: {topology.url} (nginx) -> {voices}; LLM at {topology.llm_url}; state in {run_dir}", flush=True)
        code = topology.watch()
        topology.down()
        print("stopped", flush=True)
        return code
    except StopRequested:
        print("stopped while starting", flush=True)
        return 0
    except Exception as e:
        print(f"parley scale up failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        (run_dir / PID_FILE).unlink(missing_ok=True)


def running_supervisor(run_dir: Path) -> int | None:
    """The pid of the supervisor running from ``run_dir``, or None (a stale pid file is removed)."""
    pid_file = run_dir / PID_FILE
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        pid_file.unlink(missing_ok=True)
        return None
    return pid


def run_down(run_dir: Path, timeout_s: float = 90.0) -> int:
    """``parley scale down``: ask the supervisor to stop everything and wait until it has."""
    run_dir = run_dir.resolve()
    pid = running_supervisor(run_dir)
    if pid is None:
        print(f"nothing running from {run_dir}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running_supervisor(run_dir) is None:
            print(f"stopped (supervisor pid {pid})")
            return 0
        time.sleep(0.3)
    print(f"the supervisor (pid {pid}) has not stopped in {timeout_s:.0f} s", file=sys.stderr)
    return 1


def run_status(run_dir: Path) -> int:
    """``parley scale status``: each server, alive or not, and the topology's /healthz through nginx."""
    run_dir = run_dir.resolve()
    if running_supervisor(run_dir) is None:
        print(f"nothing running from {run_dir}")
        return 1
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        print("starting (no state yet)")
        return 1
    for p in state["processes"]:
        alive = p["pid"] is not None and pid_alive(p["pid"])
        print(f"{p['name']:8} pid {p['pid']} {'up' if alive else 'DOWN'} {p['url'] or ''} restarts {p['restarts']}")
    try:
        r = httpx.get(state["url"] + "/healthz", timeout=3)
        print(f"{state['url']}/healthz: {r.status_code} {r.text}")
        return 0 if r.status_code == 200 else 1
    except httpx.HTTPError as e:
        print(f"{state['url']}/healthz: {type(e).__name__}")
        return 1


def stop_process(process: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Ask a child server to stop (SIGTERM), and kill it if it has not within ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    """A loopback port free now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nginx binds it
        try:
            sock.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"{host}:{port} is not free ({e.strerror}): choose another --port") from None


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited, unreaped zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the supervisor dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
