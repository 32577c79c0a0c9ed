"""``parley scale``'s parts without models: the nginx configuration rendered from the project's own, the
supervisor's restart of a dead child and its ordered stop, ``down`` on nothing running. Real short-lived
processes (``sleep``), no servers."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from app.scale import nginx
from app.scale.supervisor import Child, ScaleOptions, Topology, run_down, run_status
from engine.weights import chosen_model


def test_the_conf_is_the_docker_one_with_fixed_upstreams(tmp_path):
    template = nginx.TEMPLATE.read_text()
    conf = nginx.render(
        template, listen="127.0.0.1:9000", upstreams=["127.0.0.1:9001", "127.0.0.1:9002"], run_dir=tmp_path
    )
    assert "resolver" not in conf and " resolve " not in conf and "voice:8000" not in conf
    assert "listen 127.0.0.1:9000;" in conf and "listen 80;" not in conf
    assert "server 127.0.0.1:9001 max_fails=2 fail_timeout=10s;" in conf
    assert "server 127.0.0.1:9002 max_fails=2 fail_timeout=10s;" in conf
    # every location of the Docker configuration is there, with its WebSocket upgrade
    for line in (
        "location /ws {",
        "location /v1/realtime {",
        "location / {",
        "least_conn;",
        "proxy_set_header Upgrade",
    ):
        assert template.count(line) == conf.count(line) > 0, line
    assert conf.count("{") == conf.count("}")
    assert f"pid {tmp_path / 'nginx.pid'};" in conf and "daemon off;" in conf


def test_a_changed_template_fails_clearly(tmp_path):
    with pytest.raises(nginx.NginxError, match="expected one"):
        nginx.render("server { listen 80; }", listen="127.0.0.1:1", upstreams=["127.0.0.1:2"], run_dir=tmp_path)


def _sleeper(tmp_path: Path, name: str) -> Child:
    return Child(name, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / f"{name}.log")


def test_a_dead_child_is_started_again_and_stop_ends_all(tmp_path, monkeypatch):
    monkeypatch.setattr("app.scale.supervisor.RESTART_BACKOFF_S", 0.1)
    topology = Topology(ScaleOptions(run_dir=tmp_path, llm_url="http://127.0.0.1:1/v1"))
    topology.voices = [_sleeper(tmp_path, "voice-1"), _sleeper(tmp_path, "voice-2")]
    topology.balancer = _sleeper(tmp_path, "nginx")
    for child in topology.children():
        child.start()
    watcher = threading.Thread(target=lambda: setattr(topology, "code", topology.watch(poll_s=0.05)))
    watcher.start()
    first_pid = topology.voices[0].process.pid
    topology.voices[0].process.kill()
    deadline = time.monotonic() + 10
    while topology.voices[0].restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert topology.voices[0].restarts == 1 and topology.voices[0].alive()
    assert topology.voices[0].process.pid != first_pid and topology.voices[1].restarts == 0
    topology.request_stop()
    watcher.join(timeout=10)
    assert topology.code == 0
    topology.down()
    assert not any(child.alive() for child in topology.children())


def test_nginx_dying_stops_the_topology(tmp_path):
    topology = Topology(ScaleOptions(run_dir=tmp_path, llm_url="http://127.0.0.1:1/v1"))
    topology.voices = [_sleeper(tmp_path, "voice-1")]
    topology.balancer = Child("nginx", [sys.executable, "-c", "pass"], tmp_path / "nginx.log")
    for child in topology.children():
        child.start()
    assert topology.watch(poll_s=0.05) == 1
    assert not topology.voices[0].alive()


def test_down_and_status_with_nothing_running(tmp_path, capsys):
    (tmp_path / "supervisor.pid").write_text("999999999")  # stale
    assert run_down(tmp_path) == 0
    assert "nothing running" in capsys.readouterr().out
    assert not (tmp_path / "supervisor.pid").exists()
    assert run_status(tmp_path) == 1


def test_a_taken_port_is_refused_before_anything_starts(tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr("app.scale.nginx.nginx_binary", lambda: "/bin/true")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        topology = Topology(ScaleOptions(run_dir=tmp_path, port=port))
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is not free"):
            topology.up()
    assert topology.llm is None and not topology.voices


def test_voice_servers_are_told_the_model_the_started_llm_server_serves(tmp_path):
    """Their conversation policy is that model's row (SmolLM2's without tools, the default brain's with them)."""

    def voice_argv(**options) -> list[str]:
        topology = Topology(ScaleOptions(run_dir=tmp_path, **options))
        topology.llm_url = "http://127.0.0.1:9/v1"
        return topology._voice_child(1).argv

    argv = voice_argv(llm_model="bundled")
    assert argv[argv.index("--llm-model") + 1] == "bundled"
    argv = voice_argv(llm_model="auto")  # by the name of what it stands for here (``auto`` would be unknown there)
    assert argv[argv.index("--llm-model") + 1] == chosen_model("auto") != "auto"
    argv = voice_argv(llm_model="bundled", serve_args=["--llm-model", "qwen2.5-coder-0.5b"])
    assert argv.count("--llm-model") == 1 and argv[argv.index("--llm-model") + 1] == "qwen2.5-coder-0.5b"
    assert "--llm-model" not in voice_argv(llm_url="http://elsewhere:8001/v1")  # a server of the user's: theirs
