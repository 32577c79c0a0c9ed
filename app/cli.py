"""The ``parley`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.config import load_settings
    from app.server import create_app

    settings = load_settings(host=args.host, port=args.port, llm_backend=args.llm_backend, llm_url=args.llm_url)
    print(f"starting parley on {settings.host}:{settings.port} (loading models first)", flush=True)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level, ws_max_size=1 << 20
    )
    return 0


def _config(args: argparse.Namespace) -> int:
    from app.config import load_settings

    settings = load_settings()
    for key, value in settings.model_dump().items():
        print(f"{key} = {value!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="A real-time, fully local voice assistant.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the voice server (web page at /, WebSocket at /ws)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--llm-backend", choices=["engine", "transformers", "openai"], help="where answers come from")
    serve.add_argument("--llm-url", help="OpenAI-compatible base URL for --llm-backend openai")
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)

    config = commands.add_parser("config", help="print the effective settings")
    config.set_defaults(func=_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
