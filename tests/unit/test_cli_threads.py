"""`parley serve` lets idle OpenMP threads sleep before the models (and their OpenMP runtimes) load."""

from __future__ import annotations

import pytest

import app.cli as cli


@pytest.fixture
def serve_without_running(monkeypatch):
    """``main(["serve"])`` up to building the app: records the wait policy the app (and its models) start under."""
    import uvicorn

    import app.server.app as server_app

    seen: dict[str, str | None] = {}

    def create_app(settings):
        import os

        seen["policy"] = os.environ.get("OMP_WAIT_POLICY")
        return object()

    monkeypatch.setattr(server_app, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    return seen


def test_serve_sets_the_passive_wait_policy_before_the_app_loads(monkeypatch, serve_without_running):
    monkeypatch.setenv("OMP_WAIT_POLICY", "recorded")  # so that monkeypatch restores it (unset) afterwards
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert cli.main(["serve"]) == 0
    assert serve_without_running["policy"] == "PASSIVE"


def test_a_policy_the_user_set_is_kept(monkeypatch, serve_without_running):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["serve"]) == 0
    assert serve_without_running["policy"] == "ACTIVE"


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
