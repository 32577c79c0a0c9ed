"""``parley engine ...``: run the engine as an OpenAI-compatible HTTP server (``serve``); merge a LoRA
adapter into a model's weights (``merge-lora``, engine/lora.py).

``app/cli.py`` forwards ``parley engine <args>`` here as ``main(args)``; it also runs
standalone (``python -m engine.cli serve``). The model loads before the socket opens, and
one line, ``parley engine ready on http://HOST:PORT``, is printed once requests are served.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from engine.config import INT8_METHODS

log = logging.getLogger(__name__)

BUNDLED_NAME = "SmolLM2-135M-Instruct"


def served_name(model: str) -> str:
    """The id ``/v1/models`` reports: the bundled model's name, else the directory / file stem."""
    if model == "bundled":
        return BUNDLED_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley engine", description="Parley's LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001, help="0 picks a free port (the ready line tells which)")
    serve.add_argument(
        "--model",
        default="bundled",
        help="'bundled', a Hugging Face model directory, or a GGUF file (llama.cpp, Ollama, LM Studio: converted once)",
    )
    serve.add_argument("--served-model-name", default=None, help="model id for /v1/models (default: from --model)")
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto (the voice server's choice): bfloat16 on CUDA and on CPUs that compute it, else float32",
    )
    serve.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="auto (the voice server's choice): int8 weights on the CPU; on CUDA int8 where `parley doctor --gpu` "
        "measured it faster than bf16 on this card, else none",
    )
    serve.add_argument(
        "--int8-method",
        choices=list(INT8_METHODS),
        default="auto",
        help="int8 kernel (with --quantization int8): auto = on CUDA the doctor's pick, else w8a8, else bitsandbytes "
        "LLM.int8; int8pack on the CPU",
    )
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="cap on requests in the running batch")
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: 128 on a CPU that emulates bfloat16, 256 on one that computes it, 512 on CUDA)",
    )
    serve.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="memory for the paged KV cache (default: 512 on the CPU; on CUDA from --gpu-memory-fraction)",
    )
    serve.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="CUDA: the share of the GPU's memory the engine may use, weights and KV cache together (vLLM's notion)",
    )
    serve.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run decode steps eagerly")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    serve.add_argument(
        "--prefill-threads",
        type=int,
        default=None,
        help="CPU threads for prompt prefill steps (default: --num-threads)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PARLEY_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $PARLEY_API_KEY)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    merge = sub.add_parser("merge-lora", help="merge a PEFT LoRA adapter into a model's weights (offline)")
    merge.add_argument("--base", required=True, help="the base model directory ('bundled' for the bundled model)")
    merge.add_argument("--adapter", required=True, help="the adapter (adapter_config.json + adapter_model.safetensors)")
    merge.add_argument("--out", required=True, help="where to write the merged model (must not exist or be empty)")
    merge.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def engine_config(args: argparse.Namespace):
    """The served engine's configuration: ``auto`` resolves as in the voice server, on the device it will use."""
    from engine.config import EngineConfig, resolve_dtype, resolve_quantization

    device = EngineConfig(model=args.model, device=args.device).resolved_device()
    return EngineConfig(
        model=args.model,
        dtype=resolve_dtype(args.dtype, device),
        quantization=resolve_quantization(args.quantization, device),
        int8_method=args.int8_method,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_mb * 1024 * 1024 if args.kv_cache_mb else None,
        gpu_memory_fraction=args.gpu_memory_fraction,
        cuda_graphs=not args.no_cuda_graphs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        prefill_threads=args.prefill_threads,
    )


async def _serve(app, host: str, port: int, log_level: str) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # failed to bind, for instance
            await task
            return
        await asyncio.sleep(0.05)
    bound = port
    for s in server.servers:
        for sock in s.sockets:
            bound = sock.getsockname()[1]
            break
    print(f"parley engine ready on http://{host}:{bound}", flush=True)
    await task


def serve(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncLLMEngine
    from engine.openai_api.api_server import create_app
    from engine.weights import resolve_model

    try:
        config = engine_config(args)
        resolve_model(config.model)  # a GGUF converts here, once; a missing or bad file stops with its reason
    except (OSError, ValueError) as e:
        print(f"parley engine: {e}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(config)
    print(engine.engine.describe(), flush=True)  # the start-up line: which kernels are in use
    try:
        app = create_app(engine, args.served_model_name or served_name(args.model), api_key=args.api_key)
        asyncio.run(_serve(app, args.host, args.port, args.log_level))
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed why
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "merge-lora":
        return merge_lora(args)
    return 2


def merge_lora(args: argparse.Namespace) -> int:
    from engine.lora import merge_lora as merge

    try:
        out = merge(args.base, args.adapter, args.out)
    except (OSError, ValueError) as e:
        print(f"parley engine merge-lora: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.base}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
