"""`parley serve` bounds how long idle OpenMP threads spin before the models (and their OpenMP runtimes) load."""

from __future__ import annotations

import pytest

import app.cli as cli


@pytest.fixture
def serve_without_running(monkeypatch):
    """``main(["serve"])`` up to building the app: records the wait policy and spin count the app (and its models)
    start under."""
    import uvicorn

    import app.server.app as server_app

    seen: dict[str, str | None] = {}

    def create_app(settings):
        import os

        seen["policy"] = os.environ.get("OMP_WAIT_POLICY")
        seen["spins"] = os.environ.get("GOMP_SPINCOUNT")
        return object()

    monkeypatch.setattr(server_app, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    return seen


def unset(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores it (unset) afterwards
        monkeypatch.delenv(name)


def test_serve_bounds_the_spinning_before_the_app_loads(monkeypatch, serve_without_running):
    unset(monkeypatch, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    assert cli.main(["serve"]) == 0
    assert serve_without_running == {"policy": None, "spins": str(cli.OPENMP_SPINS)}


def test_a_policy_the_user_set_is_kept_without_a_count(monkeypatch, serve_without_running):
    """A policy alone says how long to spin (PASSIVE: not at all); a count set beside it would override it."""
    unset(monkeypatch, "GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cli.main(["serve"]) == 0
    assert serve_without_running == {"policy": "PASSIVE", "spins": None}


def test_a_count_the_user_set_is_kept(monkeypatch, serve_without_running):
    unset(monkeypatch, "OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert cli.main(["serve"]) == 0
    assert serve_without_running == {"policy": None, "spins": "0"}


def test_nothing_with_an_openmp_runtime_loads_before_serve_sets_the_policy():
    """The policy is read once, when the runtime loads: ``main`` must get to ``_serve`` with none loaded."""
    import subprocess
    import sys

    check = (
        "import sys, app.cli as cli; cli.build_parser().parse_args(['serve']); "
        "loaded = {'torch', 'ctranslate2', 'onnxruntime', 'numpy'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_debug_log_names_loggers_at_debug_under_a_quieter_level(monkeypatch, serve_without_running):
    """``--debug-log engine.llm_engine``: the engine's steps at debug, the rest (every WebSocket frame) at warning."""
    import logging

    for name in ("", "engine.llm_engine", "engine", "app.server"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)  # restored after
    assert cli.main(["serve", "--debug-log", "engine.llm_engine"]) == 0
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("engine.llm_engine").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("engine").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("app.server").isEnabledFor(logging.DEBUG)
