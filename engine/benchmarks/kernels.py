"""``parley bench kernels``: the fused CPU kernels on the default brain's shapes, against another build of them.

Why a benchmark of its own: a kernel change moves a voice turn by a few percent, less than this kind of VM drifts
in minutes, so a before/after needs both builds in one process, the same inputs, alternated call by call
(``--against`` takes another ``fused_cpu.cpp``, e.g. ``git show HEAD~1:engine/csrc/fused_cpu.cpp > old.cpp``).
Each layer gets weights of its own (random int8), so a one-row product reads them from memory as decode does.
Besides the medians, the report gives how far each kernel's outputs are from this build's (0 = equal bit for bit).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.benchmarks.entry import bench_main

# Qwen2.5-Coder-0.5B-Instruct (the default brain): q, k, v fused; gate and up fused; 14 heads over 2 KV heads of 64
LINEARS = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16


def load_build(source: Path):
    """Another ``fused_cpu.cpp`` compiled for this CPU, under a name of its own (its hash)."""
    from engine.fused import compile_source

    return compile_source("parley_bench_kernels_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12], source)


def cases(args: argparse.Namespace) -> dict[str, Callable]:
    """name -> a call of one kernel module on fixed inputs."""
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Callable] = {}
    gate_up = torch.randn(16, 2 * LINEARS["down"][1], dtype=bf16, generator=gen)
    out["silu_mul 16 rows"] = lambda k: k.silu_mul(gate_up)
    nb = -(-args.context // BLOCK)
    for rows in (1, 8):
        cache = torch.randn(2, KV_HEADS, rows * nb + 1, BLOCK, HEAD_DIM, generator=gen).to(bf16)
        tables = torch.randperm(rows * nb + 1, generator=gen)[: rows * nb].view(rows, nb)
        lens = torch.full((rows,), args.context)
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(bf16)
        out[f"paged attention {rows} row(s), {args.context} cached, a layer"] = (
            lambda k, qkv=qkv, cache=cache, tables=tables, lens=lens: k.paged_decode_attention(
                qkv, cache, tables, lens, HEADS, HEAD_DIM, HEAD_DIM**-0.5
            )
        )
    weights = [
        {
            n: (torch.randint(-127, 128, s, dtype=torch.int8, generator=gen), torch.rand(s[0], generator=gen).to(bf16))
            for n, s in LINEARS.items()
        }
        for _ in range(args.layers)
    ]
    head = (
        torch.randint(-127, 128, (args.vocab, LINEARS["o"][1]), dtype=torch.int8, generator=gen),
        torch.rand(args.vocab, generator=gen).to(bf16) * 0.01,
    )
    for rows in args.rows:
        xs = {n: torch.randn(rows, s[1], generator=gen).to(bf16) for n, s in LINEARS.items()}
        out[f"int8 linears of {args.layers} layers, {rows} row(s)"] = lambda k, xs=xs: torch.cat(
            [k.int8_linear(xs[n], *layer[n]).flatten() for layer in weights for n in LINEARS]
        )
        xh = torch.randn(rows, LINEARS["o"][1], generator=gen).to(bf16)
        out[f"int8 head ({args.vocab} rows), {rows} row(s)"] = lambda k, xh=xh: k.int8_linear(xh, *head)
    return out


def run(args: argparse.Namespace) -> dict:
    from engine.fused import fused_kernels

    builds = {"this build": fused_kernels()}
    if builds["this build"] is None:
        raise RuntimeError("the fused CPU kernels are not built here (no compiler, or PARLEY_FUSED_KERNELS=0)")
    if not builds["this build"].has_int8_linear():
        raise RuntimeError("int8_linear needs AVX2 and FMA, which this CPU lacks")
    if args.against:
        source = Path(args.against)
        if not source.is_file():
            raise FileNotFoundError(f"no kernel source at {source}")
        print(f"building {source} for this CPU (about a minute the first time) ...", flush=True)
        builds[str(source)] = load_build(source)
    torch.set_num_threads(args.threads)
    results = []
    for name, call in cases(args).items():
        outputs = {label: call(kernels) for label, kernels in builds.items()}  # warm-up, and what they give
        reference = outputs["this build"].float()
        times: dict[str, list[float]] = {label: [] for label in builds}
        for _ in range(args.repeats):
            for label, kernels in builds.items():  # alternated: the VM's drift reaches every build alike
                start = time.perf_counter()
                call(kernels)
                times[label].append(time.perf_counter() - start)
        row = {"case": name, "ms": {label: 1000 * statistics.median(t) for label, t in times.items()}}
        scale = reference.abs().max().item() or 1.0
        row["differs"] = {label: (out.float() - reference).abs().max().item() / scale for label, out in outputs.items()}
        results.append(row)
    return {"threads": args.threads, "repeats": args.repeats, "builds": list(builds), "cases": results}


def report(result: dict) -> str:
    builds = result["builds"]
    lines = [f"{result['threads']} threads, medians of {result['repeats']}, alternated (ms)"]
    lines.append(f"{'kernel call':58s}" + "".join(f"{b[-26:]:>28s}" for b in builds))
    for row in result["cases"]:
        cells = []
        for b in builds:
            cell = f"{row['ms'][b]:.3f}"
            if b != "this build":
                differs = row["differs"][b]
                cell += (
                    f" ({row['ms'][b] / row['ms']['this build']:.2f}x, {'same' if differs == 0 else f'{differs:.1e}'})"
                )
            cells.append(f"{cell:>28s}")
        lines.append(f"{row['case']:58s}" + "".join(cells))
    if len(builds) > 1:
        lines.append("(x: the other build's time over this build's; then how far its outputs are, of their scale)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another fused_cpu.cpp to build and time beside this checkout's")
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 16, 32])
    parser.add_argument("--layers", type=int, default=24, help="layers of weights (24: the default brain)")
    parser.add_argument("--vocab", type=int, default=151936, help="rows of the head (151936: the default brain)")
    parser.add_argument("--context", type=int, default=990, help="cached tokens the attention reads")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the figures here too")
    return bench_main("bench kernels", parser, argv, run, report)
