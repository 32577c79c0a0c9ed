"""`parley bench engine --peer llama-cpp`: our engine against llama.cpp on the same GGUF, in one run.

Why: on a CPU the tool people reach for is llama.cpp (directly or through Ollama), so the
figures that matter are ours next to its, same machine, same model file, same threads,
same token ids, measured in the same run (this machine is shared and noisy: every figure
is repeated and reported as min/median/max, and the two sides alternate repetition by
repetition so both see the same load).

The peer is either ``llama-cpp-python`` in this process (the optional ``bench`` extra; it
is never a dependency of the product or CI) or a llama-server URL (``--peer-url``). The
workload, for both sides:

1. decode at batch 1: tokens/s after the first token of one ~100-token chat prompt
   (ours in fp32, bf16 and int8; the ratio uses our fastest);
2. 8 concurrent chat requests of mixed lengths: total tokens/s and TTFT p50. With a URL
   the 8 requests go to llama-server at once (its slots serve them in parallel); with
   llama-cpp-python alone the peer serves them one after another (one context), which
   the report says;
3. prefill of a 500-token prompt: time to the first token (ours) / to evaluate the prompt
   (llama.cpp), prefix caches cleared.

A peer that dies (llama.cpp built for instructions this CPU lacks dies on its first token with
SIGILL) stops the run with its reason, never a wait on a dead worker. ``make bench-deps`` builds
llama-cpp-python for AVX2, and AVX-512 where this CPU lists it (explicit instruction sets, not the native build);
the report names the sets the peer was built for.

Ratios (``--json``): ``peer_decode_bs1_ratio`` (ours/peer tokens/s, target >= 1),
``peer_concurrent8_throughput_ratio`` (ours/peer, target >= 2),
``peer_concurrent8_ttft_ratio`` (ours/peer TTFT p50, target <= 0.25) and
``peer_prefill_ratio`` (ours/peer time, target <= 0.3), all from medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from engine.benchmarks.entry import bench_main

log = logging.getLogger(__name__)

DATA_PATH = Path(__file__).with_name("data.txt")
SYSTEM = "You are a helpful assistant."
PREFILL_TOKENS = 500
DEATHS = {
    4: "SIGILL, an illegal instruction: llama.cpp was built for a CPU with more instruction sets than this "
    "one; build it portable with `make bench-deps`",
    9: "SIGKILL (out of memory?)",
    11: "SIGSEGV",
}
TARGETS = {
    "peer_decode_bs1_ratio": (1.0, True),
    "peer_concurrent8_throughput_ratio": (2.0, True),
    "peer_concurrent8_ttft_ratio": (0.25, False),
    "peer_prefill_ratio": (0.3, False),
}
# int8 and int4 are configured as the app configures them (``engine.config.resolve_dtype("auto")``); ``ModelRunner``
# then runs every quantized model on bfloat16 activations (its int8 x int8 kernel quantizes them per block of 32)
PRECISIONS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("auto", "int8"),
    "int4": ("auto", "int4"),
}


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "values": list(xs)}


def fmt(s: dict | None, spec: str = ".1f") -> str:
    if not s:
        return "n/a"
    return f"{s['min']:{spec}} / {s['median']:{spec}} / {s['max']:{spec}}"


# --- workload ----------------------------------------------------------------------------------


def chat_prompt(tokenizer, text_ids: list[int], n_tokens: int, offset: int) -> list[int]:
    """A one-turn chat prompt (system + user + assistant cue) of exactly ``n_tokens`` tokens."""
    mark = "\u2063MARK\u2063"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    before, after = text.split(mark)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    head, tail = enc(before), enc(after)
    k = max(1, n_tokens - len(head) - len(tail))
    body = [text_ids[(offset + j) % len(text_ids)] for j in range(k)]
    return head + body + tail


def workload(tokenizer, quick: bool, seed: int) -> dict:
    text_ids = list(tokenizer(DATA_PATH.read_text(), add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)
    plo, phi = (30, 150) if quick else (40, 400)
    olo, ohi = (8, 24) if quick else (16, 128)
    conc = [
        Req(
            chat_prompt(tokenizer, text_ids, rng.randint(plo, phi), rng.randrange(len(text_ids))), rng.randint(olo, ohi)
        )
        for _ in range(8)
    ]
    return {
        "decode_prompt": chat_prompt(tokenizer, text_ids, 100, 0),
        "decode_tokens": 24 if quick else 64,
        "concurrent": conc,
        # a fresh 500-token prompt per repetition, so no prefix cache can help either side
        "prefill": [chat_prompt(tokenizer, text_ids, PREFILL_TOKENS, 1000 + 331 * i) for i in range(16)],
    }


# --- our engine ----------------------------------------------------------------------------------


class Ours:
    def __init__(self, model: str, threads: int) -> None:
        self.model = model
        self.threads = threads
        self.engines: dict[str, object] = {}

    def engine(self, precision: str):
        if precision not in self.engines:
            from engine.config import EngineConfig, resolve_dtype
            from engine.llm_engine import LLMEngine

            dtype, quant = PRECISIONS[precision]
            dtype = resolve_dtype(dtype, "cpu")
            cfg = EngineConfig(
                model=self.model,
                dtype=dtype,
                quantization=quant,
                device="cpu",
                num_threads=self.threads,
                kv_cache_bytes=128 * 1024 * 1024,
                max_num_seqs=16,
            )
            eng = LLMEngine(cfg)
            self._run(eng, [Req(list(range(1000, 1040)), 4), Req(list(range(2000, 2030)), 4)])  # warm-up
            self.engines[precision] = eng
        return self.engines[precision]

    @staticmethod
    def _run(eng, reqs: list[Req]) -> tuple[float, list[float], int, list[float]]:
        """All requests added at once; returns wall s, TTFTs s, tokens, and each token's time."""
        from engine.sampling import SamplingParams

        eng.reset_prefix_cache()
        t0 = time.monotonic()
        ids = [eng.add_request(None, r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)) for r in reqs]
        first: dict[str, float] = {}
        times: list[float] = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.finish_reason == "error":
                    raise RuntimeError(f"engine request failed: {o.error}")
                if o.token_ids_delta:
                    now = time.monotonic()
                    times.extend([now] * len(o.token_ids_delta))
                    first.setdefault(o.request_id, (o.first_token_time or now) - t0)
        wall = time.monotonic() - t0
        return wall, [first[i] for i in ids], len(times), times

    def decode_bs1(self, precision: str, prompt: list[int], n: int) -> float:
        _, _, k, times = self._run(self.engine(precision), [Req(prompt, n + 1)])
        return (k - 1) / (times[-1] - times[0])

    def concurrent(self, precision: str, reqs: list[Req]) -> tuple[float, float]:
        wall, ttfts, k, _ = self._run(self.engine(precision), reqs)
        return k / wall, statistics.median(ttfts)

    def prefill_ms(self, precision: str, prompt: list[int]) -> float:
        _, ttfts, _, _ = self._run(self.engine(precision), [Req(prompt, 1)])
        return 1000 * ttfts[0]


# --- the peer: llama-cpp-python in process ------------------------------------------------------------


class _LlamaCppWorker:
    """llama-cpp-python itself; lives in a child process (see LlamaCppPeer)."""

    def __init__(self, gguf: str, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(gguf, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        self._gen([1, 2, 3, 4], 4)  # warm-up

    def _gen(self, prompt: list[int], n: int) -> tuple[float, float]:
        """Greedy-generate ``n`` tokens (end of text ignored); returns (time to first token, time of the rest)."""
        self.llm.reset()
        t0 = time.perf_counter()
        t1 = t0
        k = 0
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            k += 1
            if k == 1:
                t1 = time.perf_counter()
            if k >= n:
                break
        return t1 - t0, time.perf_counter() - t1

    def decode_bs1(self, prompt: list[int], n: int) -> float:
        _, rest = self._gen(prompt, n + 1)
        return n / rest

    def concurrent(self, reqs: list[tuple[list[int], int]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        ttfts = []
        for prompt, n in reqs:
            start = time.perf_counter() - t0
            first, _ = self._gen(prompt, n)
            ttfts.append(start + first)
        wall = time.perf_counter() - t0
        return sum(n for _, n in reqs) / wall, statistics.median(ttfts)

    def prefill_ms(self, prompt: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return 1000 * (time.perf_counter() - t0)


def _worker_main(conn, gguf: str, threads: int) -> None:
    try:
        worker = _LlamaCppWorker(gguf, threads)
        conn.send(("ok", _instruction_sets()))
    except BaseException as e:  # report and exit
        conn.send(("error", repr(e)))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, args = msg
        try:
            conn.send(("ok", getattr(worker, name)(*args)))
        except BaseException as e:
            conn.send(("error", repr(e)))


def _instruction_sets() -> str:
    """What this llama.cpp was built to use ("AVX2 FMA ..."): a build for AVX2 alone, `make bench-deps`'s, leaves an
    AVX-512 CPU's wider instructions unused, and the comparison should say so."""
    import re

    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return " ".join(name for name, on in re.findall(r"(\w+) = (\d)", info) if on == "1")


def died_of(exitcode: int | None) -> str:
    """A dead child's exit code in words (multiprocessing gives a signal as its negative)."""
    if exitcode is None:
        return "it closed its pipe and did not exit"
    if exitcode < 0:
        return f"killed by signal {-exitcode}" + (f" ({DEATHS[-exitcode]})" if -exitcode in DEATHS else "")
    return f"exit code {exitcode}"


class LlamaCppPeer:
    """llama-cpp-python in a child process, driven over a pipe.

    Why a child: two thread pools in one process (torch's OpenMP team and ggml's) share
    the runtime and its spin-waits, which slowed both sides many times over.
    The child sleeps on the pipe while we measure, and we sleep while it does.
    """

    mode_concurrent = "llama-cpp-python, the 8 requests one after another (one context)"

    def __init__(self, gguf: Path, threads: int, worker=None) -> None:
        """``worker`` (tests): the child's main function in place of llama-cpp-python's."""
        import importlib.util
        import multiprocessing as mp

        self.name = f"a stand-in worker, {gguf.name}"
        if worker is None:
            if importlib.util.find_spec("llama_cpp") is None:
                raise RuntimeError(
                    "llama-cpp-python is not installed: `make bench-deps` (it builds llama.cpp from source for this "
                    "CPU's AVX2 or AVX-512 sets, ~6 minutes on 2 cores), or give a llama-server URL with --peer-url"
                )
            from importlib.metadata import version

            self.name = f"llama.cpp via llama-cpp-python {version('llama-cpp-python')}, {gguf.name}"
            worker = _worker_main
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker, args=(child, str(gguf), threads), daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child alone: its death is then an end of file here
        built_for = self._recv()
        if built_for:
            self.name += f" (built for {built_for})"

    def _recv(self):
        """The worker's answer; its death (a signal, an exit) is an error with its cause, never a wait."""
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                break
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"llama-cpp-python's worker died: {died_of(self._proc.exitcode)}") from None
        if status != "ok":
            raise RuntimeError(f"llama-cpp-python: {value}")
        return value

    def _call(self, name: str, *args):
        self._conn.send((name, args))
        return self._recv()

    def decode_bs1(self, prompt: list[int], n: int) -> float:
        return self._call("decode_bs1", prompt, n)

    def concurrent(self, reqs: list[Req]) -> tuple[float, float]:
        return self._call("concurrent", [(r.prompt, r.max_tokens) for r in reqs])

    def prefill_ms(self, prompt: list[int]) -> float:
        return self._call("prefill_ms", prompt)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()


# --- the peer: a llama-server URL -------------------------------------------------------------------


class ServerPeer:
    mode_concurrent = "llama-server, the 8 requests at once (its parallel slots)"

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.name = f"llama-server at {self.url}"
        try:
            with urllib.request.urlopen(self.url + "/props", timeout=10) as r:
                props = json.loads(r.read())
            self.name += f" ({props.get('total_slots', '?')} slots)"
        except (OSError, ValueError):
            pass
        self._post([1, 2, 3, 4], 2)

    def _post(self, prompt: list[int], n: int, stream: bool = False):
        body = {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": stream,
        }
        req = urllib.request.Request(
            self.url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return urllib.request.urlopen(req, timeout=600)

    def _timings(self, prompt: list[int], n: int) -> dict:
        with self._post(prompt, n) as r:
            return json.loads(r.read())["timings"]

    def decode_bs1(self, prompt: list[int], n: int) -> float:
        return float(self._timings(prompt, n + 1)["predicted_per_second"])

    def prefill_ms(self, prompt: list[int]) -> float:
        return float(self._timings(prompt, 1)["prompt_ms"])

    def close(self) -> None:
        pass

    def concurrent(self, reqs: list[Req]) -> tuple[float, float]:
        ttfts: list[float] = [0.0] * len(reqs)
        counts: list[int] = [0] * len(reqs)
        errors: list[BaseException] = []
        t0 = time.perf_counter()

        def one(i: int, r: Req) -> None:
            try:
                with self._post(r.prompt, r.max_tokens, stream=True) as resp:
                    for line in resp:
                        if not line.startswith(b"data:"):
                            continue
                        msg = json.loads(line[5:])
                        if msg.get("content") or msg.get("tokens"):
                            if counts[i] == 0:
                                ttfts[i] = time.perf_counter() - t0
                            counts[i] += max(1, len(msg.get("tokens") or []))
                        if msg.get("stop"):
                            counts[i] = max(counts[i], int(msg.get("tokens_predicted", counts[i])))
                            break
            except BaseException as e:  # reported after join
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"llama-server request failed: {errors[0]!r}")
        wall = time.perf_counter() - t0
        return sum(counts) / wall, statistics.median(ttfts)


# --- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parley bench engine --peer llama-cpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", choices=["llama-cpp"], default="llama-cpp")
    p.add_argument("--peer-url", help="a llama-server URL (e.g. http://127.0.0.1:8080) instead of llama-cpp-python")
    p.add_argument("--gguf", help="GGUF file for both sides (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads, both sides")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every figure (at least 3)")
    p.add_argument(
        "--precisions",
        default="fp32,bf16,int8",
        help="our precisions for batch-1 decode (comma list of fp32,bf16,int8)",
    )
    p.add_argument(
        "--dtype", choices=list(PRECISIONS), default="int8", help="our precision for concurrent and prefill (the app's)"
    )
    p.add_argument("--quick", action="store_true", help="shorter outputs (still >= 3 repetitions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as one JSON object")
    return p


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from engine.weights import bundled_gguf_path, resolve_model

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else bundled_gguf_path()
    path = resolve_model(str(gguf))
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    w = workload(tokenizer, args.quick, args.seed)
    reps = max(3, args.reps)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions + [args.dtype]:
        if p not in PRECISIONS:
            raise ValueError(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")

    peer = ServerPeer(args.peer_url) if args.peer_url else LlamaCppPeer(gguf, args.threads)
    try:
        return _measure(args, peer, Ours(str(gguf), args.threads), w, reps, precisions, gguf)
    finally:
        peer.close()


def _measure(args, peer, ours: Ours, w: dict, reps: int, precisions: list[str], gguf: Path) -> dict:
    import torch

    r: dict = {
        "peer": peer.name,
        "gguf": str(gguf),
        "threads": args.threads,
        "reps": reps,
        "quick": bool(args.quick),
        "torch_threads": torch.get_num_threads(),
        "decode_prompt_tokens": len(w["decode_prompt"]),
        "decode_tokens": w["decode_tokens"],
        "concurrent_prompt_tokens": [len(q.prompt) for q in w["concurrent"]],
        "concurrent_output_tokens": [q.max_tokens for q in w["concurrent"]],
        "concurrent_dtype": args.dtype,
        "peer_concurrent_mode": peer.mode_concurrent,
        "prefill_prompt_tokens": len(w["prefill"][0]),
    }
    t_all = time.monotonic()

    # 1. batch-1 decode: alternate the sides every repetition
    dec: dict[str, list[float]] = {p: [] for p in precisions}
    dec_peer: list[float] = []
    for p in precisions:
        ours.engine(p)
    for _ in range(reps):
        dec_peer.append(peer.decode_bs1(w["decode_prompt"], w["decode_tokens"]))
        for p in precisions:
            dec[p].append(ours.decode_bs1(p, w["decode_prompt"], w["decode_tokens"]))
    r["peer_decode_bs1_tok_s"] = stats(dec_peer)
    for p in precisions:
        r[f"ours_{p}_decode_bs1_tok_s"] = stats(dec[p])
        r[f"peer_decode_bs1_ratio_{p}"] = _ratio(statistics.median(dec[p]), statistics.median(dec_peer))
    best = max(precisions, key=lambda p: statistics.median(dec[p])) if precisions else None
    r["ours_decode_bs1_best_precision"] = best
    r["peer_decode_bs1_ratio"] = r.get(f"peer_decode_bs1_ratio_{best}")

    # 2. 8 concurrent chat requests
    thr, ttft, thr_p, ttft_p = [], [], [], []
    for _ in range(reps):
        a, b = peer.concurrent(w["concurrent"])
        thr_p.append(a)
        ttft_p.append(b)
        a, b = ours.concurrent(args.dtype, w["concurrent"])
        thr.append(a)
        ttft.append(b)
    r["ours_concurrent8_tok_s"] = stats(thr)
    r["ours_concurrent8_ttft_p50_s"] = stats(ttft)
    r["peer_concurrent8_tok_s"] = stats(thr_p)
    r["peer_concurrent8_ttft_p50_s"] = stats(ttft_p)
    r["peer_concurrent8_throughput_ratio"] = _ratio(statistics.median(thr), statistics.median(thr_p))
    r["peer_concurrent8_ttft_ratio"] = _ratio(statistics.median(ttft), statistics.median(ttft_p))

    # 3. prefill of a 500-token prompt (a fresh prompt every repetition)
    pf, pf_p = [], []
    for i in range(reps):
        pf_p.append(peer.prefill_ms(w["prefill"][i]))
        pf.append(ours.prefill_ms(args.dtype, w["prefill"][i]))
    r["ours_prefill_ms"] = stats(pf)
    r["peer_prefill_ms"] = stats(pf_p)
    r["peer_prefill_ratio"] = _ratio(statistics.median(pf), statistics.median(pf_p))
    r["elapsed_s"] = time.monotonic() - t_all
    return r


def report(r: dict) -> str:
    lines = [
        f"peer: {r['peer']}",
        f"threads: {r['threads']} both sides; {r['reps']} repetitions; figures are min / median / max",
        "",
        f"batch-1 decode ({r['decode_prompt_tokens']}-token prompt, {r['decode_tokens']} tokens), tok/s:",
        f"  {'llama.cpp':<14}{fmt(r['peer_decode_bs1_tok_s'])}",
    ]
    for p in PRECISIONS:
        if f"ours_{p}_decode_bs1_tok_s" in r:
            ratio = r.get(f"peer_decode_bs1_ratio_{p}")
            rtxt = "n/a" if ratio is None else f"{ratio:.2f}x llama.cpp"
            lines.append(f"  {'ours ' + p:<14}{fmt(r[f'ours_{p}_decode_bs1_tok_s'])}   {rtxt}")
    lines += [
        "",
        f"8 concurrent chat requests (prompts {min(r['concurrent_prompt_tokens'])}-"
        f"{max(r['concurrent_prompt_tokens'])} tokens, outputs {min(r['concurrent_output_tokens'])}-"
        f"{max(r['concurrent_output_tokens'])}; ours in {r['concurrent_dtype']}; peer: {r['peer_concurrent_mode']}):",
        f"  total tok/s   ours {fmt(r['ours_concurrent8_tok_s'])}   peer {fmt(r['peer_concurrent8_tok_s'])}",
        f"  TTFT p50 s    ours {fmt(r['ours_concurrent8_ttft_p50_s'], '.2f')}   "
        f"peer {fmt(r['peer_concurrent8_ttft_p50_s'], '.2f')}",
        "",
        f"prefill of a {r['prefill_prompt_tokens']}-token prompt, ms (ours in {r['concurrent_dtype']}):",
        f"  ours {fmt(r['ours_prefill_ms'], '.0f')}   peer {fmt(r['peer_prefill_ms'], '.0f')}",
        "",
        "ratios (medians) and targets (ours vs llama.cpp: decode at least as fast, 8 concurrent requests",
        "at least 2x its throughput with 1/4 of its TTFT, prefill in under 0.3x its time):",
    ]
    for key, (target, higher) in TARGETS.items():
        v = r.get(key)
        if v is None:
            lines.append(f"  {key:<36} n/a")
            continue
        ok = v >= target if higher else v <= target
        lines.append(f"  {key:<36} {v:6.2f}   target {'>=' if higher else '<='} {target}   {'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return bench_main("bench engine --peer", build_parser(), argv, run, report)


if __name__ == "__main__":
    sys.exit(main())
